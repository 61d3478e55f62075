"""`config.parallel` in a run: the devices a pipeline uses, the strategy it trains under, the
model built split or placed, and what the Trainer gets (tfpar.run calls these).

- Pipeline (`parallel.stages` = S): this worker's compute devices hold R = devices / S copies
  of an S-device pipeline (`tfpar.placement.balanced(...).replicate(...)`), trained under
  the plan's strategy (one replica per pipeline; R = 1: the default strategy). Under
  multi_worker_mirrored every worker runs one pipeline per local replica on its own
  devices: data parallel over the workers, pipelined on each.
- Tensor (`parallel.tensor` = T): the strategy's replicas form groups of T consecutive
  replicas (tfpar.tensor_parallel.Layout); each group sees one batch.
- Shard (`parallel.shard`): `Trainer(shard=...)`.

Example:
    >>> info = tfpar.describe(strategy)
    >>> check_devices(config, strategy, info)     # ConfigError naming the key and the fix
    >>> data_replicas(config, info)               # replicas that see different batches
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tfpar.config import ConfigError


def _pipeline_devices(strategy) -> tuple[list[str], int]:
    """(this worker's compute devices, pipelines per worker): under mirrored the strategy's
    devices hold the pipelines; else the logical devices of this worker, one pipeline per
    local replica."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfpar.placement.plan import is_multi_worker_mirrored  # pylint: disable=import-outside-toplevel
    from tfpar.strategy import runtime  # pylint: disable=import-outside-toplevel

    local = runtime.local_compute_devices()
    if is_multi_worker_mirrored(strategy):  # a plan names each worker's own devices
        own = [tf.DeviceSpec.from_string(d) for d in local]
        return ([tf.DeviceSpec(device_type=d.device_type, device_index=d.device_index).to_string() for d in own],
                len(strategy.extended.worker_devices))
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return list(strategy.extended.worker_devices), 0  # 0: as many as fit
    return local, 1


def check_devices(config, strategy, info) -> None:
    """Refuses, by key and with the fix, a degree the strategy's devices cannot hold."""
    p = config.parallel
    if p.tensor > 1:
        _require(info.kind in ("mirrored", "multi_worker_mirrored"), "tensor",
                 f"tensor parallelism runs under mirrored or multi_worker_mirrored, not {info.kind}: "
                 f"--config.strategy=mirrored (on a CPU with --config.strategy_args.virtual_devices={p.tensor}).")
        local = info.replicas // info.num_workers
        _require(info.replicas % p.tensor == 0 and (local % p.tensor == 0 or p.tensor % local == 0),
                 "tensor", f"T={p.tensor} needs groups of {p.tensor} replicas that are each one worker's "
                 f"or whole workers', the strategy has {info.replicas} on {info.num_workers} worker(s) "
                 f"({local} each): use a T that divides {local} or a multiple of {local} that divides "
                 f"{info.replicas}, or give each worker a multiple of {p.tensor} devices "
                 f"(--config.strategy_args.virtual_devices={p.tensor} on a CPU).")
    if p.stages > 1:
        devices, pipelines = _pipeline_devices(strategy)
        _require(pipelines <= 1, "stages", f"multi_worker_mirrored runs {pipelines} replicas on each "
                 "worker; the binary runs one pipeline per worker (CPU workers, or one GPU each: "
                 "CUDA_VISIBLE_DEVICES). Several per worker: plan.replicate(...) from Python "
                 "(docs/placement.md).")
        need = p.stages * max(pipelines, 1)
        _require(len(devices) >= need and (pipelines or len(devices) % p.stages == 0), "stages",
                 f"{p.stages} stages need {need if pipelines else f'a multiple of {p.stages}'} devices "
                 f"on each worker ({'one pipeline per local replica, ' if pipelines > 1 else ''}one "
                 f"device per stage); this worker has {len(devices)}: lower parallel.stages, or add "
                 f"devices (on a CPU: --config.strategy_args.virtual_devices={need}).")


def data_replicas(config, info) -> int:
    """Replicas that see different batches: the strategy's, over T for tensor parallelism,
    over S for pipelines that replace a mirrored strategy's devices."""
    p = config.parallel
    if p.tensor > 1:
        return info.replicas // p.tensor
    if p.stages > 1 and info.kind == "mirrored":
        return info.replicas // p.stages
    return info.replicas


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.parallel.{key}: {message}")


def build_model(config, data_info: dict):
    """The configured model; with parallel.tensor = T, split over T replicas (build it in
    the strategy's scope)."""
    import ml_collections  # pylint: disable=import-outside-toplevel

    from tfpar import recipes  # pylint: disable=import-outside-toplevel

    if config.parallel.tensor == 1:
        return recipes.build_model(config, data_info)
    if config.model == "keras_hub":  # split by its layout map, where its weights are made
        return _split_by_layout_map(config, data_info)
    split = ml_collections.ConfigDict(config.to_dict())
    split.model_args.tensor_parallel = config.parallel.tensor
    return recipes.build_model(split, data_info)


def _split_by_layout_map(config, data_info: dict):
    """A keras-hub model built with its weights split by its backbone's layout map
    (tfpar.models.layout_maps) over T = parallel.tensor replicas of the strategy in scope."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfpar import recipes, tensor_parallel  # pylint: disable=import-outside-toplevel
    from tfpar.models.layout_maps import layout_map_for  # pylint: disable=import-outside-toplevel
    from tfpar.tensor_parallel.layout_map import LayoutMapSplits  # pylint: disable=import-outside-toplevel

    degree, strategy = config.parallel.tensor, tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    devices = [f"cpu:{i}" for i in range(replicas)]  # names only: the map reads the mesh's axes and shape
    mesh = keras.distribution.DeviceMesh((replicas // degree, degree), ["batch", "model"], devices)
    splits = LayoutMapSplits(layout_map_for(config.model_args.backbone, mesh), "batch", "model", degree)
    with tensor_parallel.split_weights(tensor_parallel.Layout.of(strategy, degree), splits.decide):
        model = recipes.build_model(config, data_info)
    line = splits.describe()
    if splits.on_batch and replicas > degree:  # keras-hub's maps lay kernels on "batch" too (FSDP-style)
        shard = config.parallel.shard
        line += (f"; their optimizer state partitioned (parallel.shard={shard})" if shard != "none" else
                 "; their optimizer state whole: --config.parallel.shard=gradients partitions it (ZeRO-2)")
    model.tfpar_parallel_line = line
    return model


def plan(config, strategy, data_info: dict, sample):
    """The pipeline's StagePlan over this worker's devices, balanced by parallel.balance on a
    throwaway copy of the model (`sample`: a batch of inputs for flops and seconds)."""
    from tensorflow.python.util import deprecation  # pylint: disable=import-outside-toplevel

    from tfpar import placement, recipes  # pylint: disable=import-outside-toplevel
    from tfpar.placement import costs  # pylint: disable=import-outside-toplevel

    p = config.parallel
    devices, pipelines = _pipeline_devices(strategy)
    copies = pipelines or len(devices) // p.stages
    model = recipes.build_model(config, data_info)
    cost = {"params": None, "flops": lambda: costs.flops(model, sample),
            "seconds": lambda: costs.seconds(model, sample)}[p.balance]
    try:
        with deprecation.silence():  # the FLOP counter's TF1 profiler says it is deprecated
            cost = cost and cost()
        found = placement.balanced(model, devices[:p.stages], cost=cost, chunks=p.chunks,
                                   layout="v" if p.schedule == "zb-v" else "round_robin")
    except placement.PlacementError as error:
        raise ConfigError(f"config.parallel.stages: {error}") from None
    return found.replicate(devices[:copies * p.stages]) if copies > 1 else found


@contextlib.contextmanager
def build_scope(config, strategy, stage_plan) -> Iterator:
    """Where the model is built; yields the strategy to train under (a pipeline's own)."""
    from tfpar.placement.plan import is_multi_worker_mirrored  # pylint: disable=import-outside-toplevel

    if stage_plan is None:
        with strategy.scope():
            yield strategy
        return
    with stage_plan.scope(strategy if is_multi_worker_mirrored(strategy) else None) as trains_under:
        yield trains_under


def pipeline(config, model, stage_plan):
    """The Trainer's placement (None without a pipeline)."""
    from tfpar.placement import Pipeline  # pylint: disable=import-outside-toplevel

    if stage_plan is None:
        return None
    p = config.parallel
    return Pipeline(model, stage_plan, micro_batches=p.microbatches, schedule=p.schedule,
                    remat={"none": False, "full": True, "attention": "attention"}[p.remat])


def sync(config):
    """The Trainer's sync (a tfpar.sync.DiLoCo for parallel.sync=diloco, else None); made
    under the run's strategy scope by its Trainer."""
    p = config.parallel
    if p.sync == "none":
        return None
    import keras  # pylint: disable=import-outside-toplevel

    from tfpar.sync import DiLoCo  # pylint: disable=import-outside-toplevel

    outer = keras.optimizers.SGD(p.outer_learning_rate, momentum=p.outer_momentum, nesterov=p.outer_momentum > 0)
    return DiLoCo(inner_steps=p.inner_steps, outer_optimizer=outer, compression=p.outer_compression,
                  overlap_steps=p.overlap_steps, fragments=p.fragments)


def sampling_model(config, model):
    """A model that runs from Python: a tensor-parallel model's unsplit copy."""
    if config.parallel.tensor == 1:
        return model
    from tfpar import tensor_parallel  # pylint: disable=import-outside-toplevel

    return tensor_parallel.unsplit(model)


def describe(config, stage_plan) -> str | None:
    """The line a run prints about its parallelism beside the data parallelism."""
    p = config.parallel
    parts = []
    if stage_plan is not None:
        parts.append(f"pipeline of {p.stages} stages x {stage_plan.replicas} cop(ies), schedule "
                     f"{p.schedule}, {p.microbatches} micro-batch(es), balanced by {p.balance}"
                     + (f", remat {p.remat}" if p.remat != "none" else ""))
    if p.tensor > 1:
        parts.append(f"tensor parallel T={p.tensor}")
    if p.shard != "none":
        parts.append(f"sharded {p.shard} state")
    if p.sync == "diloco":
        coded = f", outer gradients in {p.outer_compression}" if p.outer_compression != "none" else ""
        overlapped = f", each exchange beside the next {p.overlap_steps} steps" if p.overlap_steps else ""
        if p.fragments > 1:
            overlapped += f", the model in {p.fragments} fragments exchanged in turn"
        parts.append(f"DiLoCo: {p.inner_steps} local steps per round, outer Nesterov SGD "
                     f"({p.outer_learning_rate}, momentum {p.outer_momentum}){coded}{overlapped}; evaluation "
                     "reads the shared weights")
    return "parallel: " + "; ".join(parts) if parts else None
