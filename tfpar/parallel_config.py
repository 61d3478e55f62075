"""The `config.parallel` block: every kind of parallelism tfpar has, from one place, and the
checks that refuse a combination at start, naming the key and the fix.

    parallel.stages        pipeline stages (1: no pipeline)
    parallel.balance       how the stages are cut: params | flops | seconds
    parallel.schedule      gpipe | 1f1b | interleaved | zb-h1 | zb-v
    parallel.microbatches  micro-batches per step through the pipeline
    parallel.chunks        stage groups per device (interleaved: >= 2; zb-v: 2)
    parallel.remat         none | full | attention (recompute in the backward)
    parallel.tensor        tensor-parallel degree T (1: none)
    parallel.shard         none | optimizer | gradients (sharded optimizer state)
    parallel.sync          none | diloco (local steps, then an outer step: tfpar.sync)
    parallel.inner_steps   diloco: H, the local steps between two outer steps
    parallel.outer_learning_rate, parallel.outer_momentum
                           diloco: the outer Nesterov SGD (the paper's 0.7 and 0.9)
    parallel.outer_compression
                           diloco: none | fp16 | int8 | int4, how the outer gradients travel
                           (with error feedback; tfpar.sync.outer_compression)
    parallel.overlap_steps diloco: tau, the steps a round's exchange overlaps (0: none)
    parallel.fragments     diloco: F, blocks of layers exchanged on steps of their own
                           (Streaming DiLoCo; 1: the whole model at once)

Data parallelism is the strategy's: the replicas left after the pipeline's stages or the
tensor-parallel groups train on different batches; across workers (multi_worker_mirrored)
the same block gives the hybrid.

Example:
    >>> config = base_config(); config.mode = "loop"
    >>> config.parallel.update(stages=2, schedule="1f1b", microbatches=4)
    >>> validate_parallel(config)
"""

from __future__ import annotations

import ml_collections

from tfpar.errors import ConfigError

BALANCES = ("params", "flops", "seconds")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
REMATS = ("none", "full", "attention")
SHARDS = ("none", "optimizer", "gradients")
SYNCS = ("none", "diloco")
DILOCO_KEYS = ("inner_steps", "outer_learning_rate", "outer_momentum", "outer_compression", "overlap_steps",
               "fragments")
OUTER_CODES = ("none", "fp16", "int8", "int4")  # tfpar.sync.outer_compression.CODES
SPLITTABLE_MODELS = ("gpt", "keras_hub")
PIPELINE_KEYS = ("balance", "schedule", "microbatches", "chunks", "remat")


def parallel_block() -> ml_collections.ConfigDict:
    """The defaults: no pipeline, no tensor parallelism, no sharding (data parallel only)."""
    return ml_collections.ConfigDict(dict(
        stages=1, balance="flops", schedule="gpipe", microbatches=1, chunks=1, remat="none",
        tensor=1, shard="none", sync="none", inner_steps=1, outer_learning_rate=0.7, outer_momentum=0.9,
        outer_compression="none", overlap_steps=0, fragments=1))


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.parallel.{key}: {message}")


def validate_parallel(config) -> None:
    """Raises ConfigError naming the first parallel key (or combination) that cannot work."""
    p = config.parallel
    for key in ("stages", "microbatches", "chunks", "tensor"):
        _require(isinstance(p[key], int) and not isinstance(p[key], bool) and p[key] >= 1, key,
                 f"must be a positive integer (1: none), got {p[key]!r}.")
    for key, allowed in (("balance", BALANCES), ("schedule", SCHEDULES), ("remat", REMATS), ("shard", SHARDS),
                         ("sync", SYNCS)):
        _require(p[key] in allowed, key, f"{p[key]!r} is not one of {', '.join(allowed)}.")
    _require(config.mode == "loop" or (p.stages == 1 and p.tensor == 1 and p.shard == "none"),
             _first_set(p), "pipelines, tensor parallelism and sharding run in tfpar's loop: add "
             "--config.mode=loop (Keras fit runs data parallelism only).")
    _validate_pipeline(config)
    _validate_tensor(config)
    _validate_shard(config)
    _validate_sync(config)


def _first_set(p) -> str:
    return next((k for k in ("stages", "tensor", "shard") if p[k] != parallel_block()[k]), "stages")


def _validate_pipeline(config) -> None:
    p, defaults, kind = config.parallel, parallel_block(), _strategy_kind(config)
    if p.stages == 1:
        for key in PIPELINE_KEYS:
            _require(p[key] == defaults[key], key, f"applies to a pipeline; with parallel.stages=1 "
                     f"there is none: set --config.parallel.stages=2 (or more), or drop {key}.")
        return
    _require(kind not in ("parameter_server", "tpu"), "stages",
             f"a pipeline from the binary runs under default, one_device, mirrored or "
             f"multi_worker_mirrored, not {kind} (on a TPU: tfpar.placement.tpu_cores from Python, "
             "docs/placement.md).")
    _require(p.tensor == 1, "tensor", "a pipeline of tensor-parallel stages is not built: use "
             "parallel.stages or parallel.tensor, not both.")
    _require(config.model != "keras_hub", "stages", "a pipeline of a keras-hub backbone is not built: "
             "its blocks take a padding mask beside the activations (docs/placement.md, 'Side "
             "inputs'). Use parallel.tensor, or --config.model=gpt for a pipeline.")
    if p.schedule == "interleaved":
        _require(p.chunks >= 2, "chunks", "schedule interleaved puts v >= 2 stage groups on each "
                 "device: set --config.parallel.chunks=2 (or more).")
        _require(p.microbatches % p.stages == 0, "microbatches",
                 f"schedule interleaved runs micro-batches in rounds of {p.stages} (the stages): use "
                 f"a multiple of {p.stages}, e.g. --config.parallel.microbatches={2 * p.stages}.")
    elif p.schedule == "zb-v":
        _require(p.chunks == 2, "chunks", "schedule zb-v puts 2 stage groups on each device in a "
                 "V: set --config.parallel.chunks=2.")
    else:
        _require(p.chunks == 1, "chunks", f"schedule {p.schedule} runs one stage group per device: "
                 "use --config.parallel.schedule=interleaved (or zb-v with chunks=2), or chunks=1.")
    _require(not (p.remat == "full" and p.schedule in ("zb-h1", "zb-v")), "remat",
             f"schedule {p.schedule} splits each backward in two; whole-stage remat would recompute "
             "the forward for both: use --config.parallel.remat=attention, or schedule 1f1b.")
    groups, stages = p.stages * p.chunks, _model_stages(config)
    _require(stages is None or groups <= stages, "stages",
             f"{p.stages} stages x {p.chunks} chunk(s) = {groups} stage groups, but {config.model} of "
             f"depth {config.model_args.get('depth')} has {stages} stages (embedding, attention and "
             f"MLP per block, head): use parallel.stages x parallel.chunks <= {stages}, or "
             f"--config.model_args.depth={-(-(groups - 2) // 2)} or more.")


def _validate_tensor(config) -> None:
    p = config.parallel
    if p.tensor == 1:
        return
    t, kind, args = p.tensor, _strategy_kind(config), config.model_args
    _require(config.model in SPLITTABLE_MODELS, "tensor", f"tfpar knows how to split "
             f"{' and '.join(SPLITTABLE_MODELS)} (gpt's blocks; a keras-hub backbone by its layout "
             f"map), not {config.model}: use --config.model=gpt or keras_hub, or parallel.tensor=1.")
    _require(kind in (None, "mirrored", "multi_worker_mirrored"), "tensor",
             f"tensor parallelism runs under mirrored or multi_worker_mirrored, not {kind} (on a "
             "TPU, XLA's own sharding is the engine: docs/tensor_parallel.md).")
    if config.model == "gpt":  # a keras-hub backbone's layout map checks its own sizes at build
        heads, width = args.get("heads", 4), args.get("dim", 128) * args.get("mlp_ratio", 4)
        _require(heads % t == 0, "tensor", f"T={t} does not divide the {heads} attention heads (each "
                 f"device holds whole heads): use a T that divides {heads}, or a multiple of {t} heads "
                 "(--config.model_args.heads, dividing model_args.dim).")
        _require(width % t == 0, "tensor", f"T={t} does not divide the MLP width {width} (dim x "
                 f"mlp_ratio): use a T that divides {width}.")
    _require(config.compression == "none", "tensor", "a tensor-parallel model sums its gradients "
             "over data-parallel groups only; a compression would sum its split gradients: use "
             "--config.compression=none.")
    _require(config.optimizer.name != "lamb", "tensor", "LAMB scales each variable by its whole "
             "norm, which a device holds only a shard of: use --config.optimizer.name=adamw (or sgd).")
    _require(config.precision == "float32", "tensor", f"precision {config.precision} with split "
             "layers is not built (tested in float32): use --config.precision=float32.")


def _validate_shard(config) -> None:
    from tfpar.errors import ShardingError  # pylint: disable=import-outside-toplevel
    from tfpar.zero.checks import check_shard  # pylint: disable=import-outside-toplevel

    p = config.parallel
    if p.shard == "none":
        return
    try:
        check_shard(p.shard, _strategy_kind(config), config.compression, "pipeline" if p.stages > 1 else None)
    except ShardingError as error:
        _require(False, "shard", str(error))


def _validate_sync(config) -> None:
    p, defaults = config.parallel, parallel_block()
    if p.sync == "none":
        for key in DILOCO_KEYS:
            _require(p[key] == defaults[key], key, "applies to parallel.sync=diloco: set it, or drop "
                     f"{key}.")
        return
    _require(isinstance(p.inner_steps, int) and not isinstance(p.inner_steps, bool) and p.inner_steps >= 1,
             "inner_steps", f"must be a positive integer (local steps per round), got {p.inner_steps!r}.")
    _require(isinstance(p.overlap_steps, int) and not isinstance(p.overlap_steps, bool)
             and 0 <= p.overlap_steps < p.inner_steps, "overlap_steps",
             f"must be an integer from 0 to inner_steps - 1 ({p.inner_steps - 1}), got {p.overlap_steps!r}.")
    _require(isinstance(p.fragments, int) and not isinstance(p.fragments, bool)
             and 1 <= p.fragments <= p.inner_steps, "fragments",
             f"must be an integer from 1 to inner_steps ({p.inner_steps}), got {p.fragments!r}.")
    _require(p.outer_compression in OUTER_CODES, "outer_compression",
             f"must be one of {', '.join(OUTER_CODES)}, got {p.outer_compression!r}.")
    _require(config.mode == "loop", "sync", "DiLoCo runs in tfpar's loop: add --config.mode=loop.")
    others = [k for k in ("stages", "tensor") if p[k] != 1] + (["shard"] if p.shard != "none" else [])
    others += ["compression"] if config.compression not in ("none", None) else []
    _require(not others, "sync", f"diloco with {', '.join(others)} is not built: each replica trains "
             "its own copy between rounds. Use one of them.")
    _require(_strategy_kind(config) not in ("parameter_server", "tpu"), "sync",
             f"diloco under {config.strategy} is not built (its replicas train their own copies of "
             "mirrored weights): use mirrored, multi_worker_mirrored or auto.")


def _strategy_kind(config) -> str | None:
    """The strategy kind the config names (None for auto: decided at start)."""
    from tfpar.strategy.factory import normalize_name  # pylint: disable=import-outside-toplevel

    try:
        kind = normalize_name(config.strategy)
    except ValueError:
        return None  # named by the strategy's own check
    return None if kind == "auto" else kind


def _model_stages(config) -> int | None:
    """How many stages the configured model has (gpt: 2 per block + 2; others: counted at
    build, where the plan refuses too many groups)."""
    depth = config.model_args.get("depth")
    if config.model == "gpt" and depth:
        return 2 * depth + 2
    return None
