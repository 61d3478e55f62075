"""One name -> a tf.distribute strategy, with the cluster found and checked first.

Keras must run on its TensorFlow backend: `create_strategy` checks that first
(tfpar.strategy.keras_backend; this module imports Keras only after the check).

Example:
    >>> strategy = tfpar.create_strategy("mirrored", virtual_devices=2)   # 2 replicas on a CPU
    >>> strategy = tfpar.create_strategy("auto")       # TPU > cluster > GPUs > one device
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
from typing import Any, Sequence

from tfpar.errors import StrategyOptionError, TPUNotFoundError, UnknownStrategyError
from tfpar.strategy import cluster as cluster_lib
from tfpar.strategy.keras_backend import check_keras_backend
from tfpar.strategy import preflight, runtime, tpu as tpu_lib  # not keras_fixes: it imports Keras

STRATEGY_NAMES = (
    "auto", "default", "one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu",
)
ALIASES = {"off": "default", "mwms": "multi_worker_mirrored", "ps": "parameter_server"}
ALL_REDUCE = ("auto", "nccl", "ring", "hierarchical_copy", "one_device")


def normalize_name(name: str) -> str:
    """Canonical strategy name; raises UnknownStrategyError with the closest match."""
    if not isinstance(name, str):
        raise UnknownStrategyError(f"Strategy name must be a string, got {name!r}.")
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key in STRATEGY_NAMES:
        return key
    choices = STRATEGY_NAMES + tuple(ALIASES)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    hint = f" Did you mean {ALIASES.get(close[0], close[0])!r}?" if close else ""
    raise UnknownStrategyError(
        f"Unknown strategy {name!r}.{hint} Known strategies: {', '.join(STRATEGY_NAMES)} "
        f"(aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})."
    )


def create_strategy(
    name: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    virtual_devices: int | None = None,
    all_reduce: str = "auto",
    num_packs: int = 1,
    tpu: str | None = None,
    cluster: Any = None,
    timeout_s: float | None = None,
    connect_timeout_s: float = 60.0,
    variable_partitioner: Any = None,
):
    """Returns the tf.distribute strategy named `name`, ready to use.

    Args:
      name: auto, default (off), one_device, mirrored, multi_worker_mirrored (mwms),
        parameter_server (ps) or tpu; case-insensitive.
      devices: explicit devices for one_device / mirrored.
      virtual_devices: split the CPU (or each GPU) into this many logical devices first,
        so multi-replica code runs on a laptop. Must come before TensorFlow starts.
      all_reduce: auto, nccl, ring, hierarchical_copy or one_device.
      num_packs: gradient packing for nccl / hierarchical_copy (mirrored).
      tpu: a TPU name, 'local' (TPU VM) or grpc address.
      cluster: 'tf_config', 'slurm', a TF_CONFIG-shaped dict or a ClusterResolver;
        None looks for TF_CONFIG, then SLURM.
      timeout_s: collective timeout (multi_worker_mirrored): a lost peer fails a step
        after this many seconds instead of hanging.
      connect_timeout_s: how long the pre-flight check waits for every peer to answer.
      variable_partitioner: parameter_server only, e.g.
        tf.distribute.experimental.partitioners.MinSizePartitioner().

    On a parameter_server cluster, worker and ps tasks start their TensorFlow server
    and serve until killed: this call does not return there. Only the chief gets a
    strategy back.

    Raises:
      KerasBackendError: Keras is set to another backend than TensorFlow (KERAS_BACKEND).
    """
    check_keras_backend()
    kind = normalize_name(name)
    _check_all_reduce(all_reduce, num_packs)
    if virtual_devices is not None:
        runtime.split_devices(virtual_devices)
    kind, cluster, tpu_resolver = _resolve_auto(kind, tpu, cluster)
    if variable_partitioner is not None and kind != "parameter_server":
        raise StrategyOptionError(
            f"variable_partitioner splits variables over parameter servers; {kind!r} has none. "
            "Drop it, or use 'parameter_server'.")
    builder = _BUILDERS[kind]
    strategy = builder(
        devices=devices, all_reduce=all_reduce, num_packs=num_packs, tpu=tpu,
        cluster=cluster, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
        variable_partitioner=variable_partitioner, tpu_resolver=tpu_resolver,
    )
    from tfpar.strategy import keras_fixes  # pylint: disable=import-outside-toplevel

    keras_fixes.apply_and_report()  # all or nothing; says once if they cannot apply
    return strategy


def _resolve_auto(kind: str, tpu, cluster) -> tuple[str, Any, Any]:
    """(kind, cluster, TPU resolver): what 'auto' chooses, said in one line; others as given."""
    if kind != "auto":
        return kind, cluster, None
    kind, cluster, reason, tpu_resolver = _auto(tpu, cluster)
    print(f"tfpar: strategy 'auto' chose {kind!r}: {reason}.", flush=True)
    return kind, cluster, tpu_resolver


def partitioner(shards: int = 0, min_shard_bytes: int = 0, max_shards: int | None = None):
    """A variable partitioner for parameter_server, or None when both are 0.

    `shards` > 0: FixedShardsPartitioner (every variable in `shards` pieces along axis 0);
    `min_shard_bytes` > 0: MinSizePartitioner (only variables large enough are split, in
    pieces of at least that many bytes, at most `max_shards`; default: one per ps task).

    Example:
        >>> create_strategy("parameter_server", variable_partitioner=partitioner(shards=2))
    """
    import tensorflow as tf

    partitioners = tf.distribute.experimental.partitioners
    if shards and min_shard_bytes:
        raise StrategyOptionError("Give shards or min_shard_bytes, not both.")
    if shards:
        return partitioners.FixedShardsPartitioner(shards)
    if min_shard_bytes:
        if max_shards is None:
            found = cluster_lib.find_cluster()
            max_shards = len(found.jobs.get("ps", ())) if found and found.has_ps else 1
        return partitioners.MinSizePartitioner(min_shard_bytes, max_shards=max_shards)
    return None


def _auto(tpu: str | None, cluster: Any, root: str = "/") -> tuple[str, Any, str, Any]:
    """What `auto` picks, why (one line), and the TPU resolver when it picked a TPU.

    Signs of a TPU that then does not answer (no TPU build installed, a busy TPU) fall
    back to the next choice with one line saying why; a multi-host slice reached as
    'local' is refused instead (falling back there would train N unsynchronised copies).
    """
    kind, cluster, reason = _decide(tpu, cluster, root)
    if kind != "tpu":
        return kind, cluster, reason, None
    try:
        return kind, cluster, reason, tpu_lib.connect_tpu(tpu, root=root)
    except tpu_lib.TPUSliceError:
        raise
    except TPUNotFoundError as e:
        failed = "; ".join(line.strip(" -") for line in str(e).splitlines()[1:-1])
        print(f"tfpar: 'auto' saw a TPU ({reason}) but could not use it ({failed}); "
              "falling back.", flush=True)
    kind, cluster, reason = _decide_without_tpu(cluster)
    return kind, cluster, reason, None


def _decide(tpu: str | None, cluster: Any, root: str = "/") -> tuple[str, Any, str]:
    """What `auto` picks, and why (one line), before connecting to anything."""
    candidates = tpu_lib.tpu_candidates(tpu, root=root)
    if candidates:
        return "tpu", cluster, candidates[0][1]
    return _decide_without_tpu(cluster)


def _decide_without_tpu(cluster: Any) -> tuple[str, Any, str]:
    found = cluster_lib.find_cluster(cluster)
    if found is not None and found.num_tasks > 1:
        if found.has_ps:
            return "parameter_server", found, f"{found.source} has a 'ps' job ({found.num_tasks} tasks)"
        return "multi_worker_mirrored", found, f"{found.source} lists {found.num_workers} workers"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) > 1:
        return "mirrored", cluster, f"{len(gpus)} GPUs found"
    # One device: TensorFlow's default strategy, not OneDeviceStrategy, which measured
    # 2x slower under Keras fit on CPU, and Keras resolves jit_compile="auto" to off under it.
    where = "1 GPU" if gpus else "no TPU, cluster or GPU found: the CPU"
    return "default", cluster, f"{where}, no distribution needed"


def _check_all_reduce(all_reduce: str, num_packs: int) -> None:
    if all_reduce not in ALL_REDUCE:
        close = difflib.get_close_matches(str(all_reduce), ALL_REDUCE, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise StrategyOptionError(
            f"Unknown all_reduce {all_reduce!r}.{hint} Choose one of {', '.join(ALL_REDUCE)}."
        )
    if not isinstance(num_packs, int) or num_packs < 0:
        raise StrategyOptionError(f"num_packs must be an integer >= 0, got {num_packs!r}.")


def _refuse_options(kind: str, **options: Any) -> None:
    given = [key for key, value in options.items() if value not in (None, "auto", 1)]
    if given:
        raise StrategyOptionError(
            f"Option(s) {', '.join(given)} do not apply to the {kind!r} strategy. Remove them, "
            "or choose a strategy that uses them (all_reduce/num_packs: mirrored or "
            "multi_worker_mirrored; timeout_s: multi_worker_mirrored)."
        )


def _build_default(*, devices, all_reduce, num_packs, timeout_s, **_):
    import tensorflow as tf

    _refuse_options("default", devices=devices, all_reduce=all_reduce, num_packs=num_packs,
                    timeout_s=timeout_s)
    return tf.distribute.get_strategy()


def _build_one_device(*, devices, all_reduce, num_packs, timeout_s, **_):
    import tensorflow as tf

    _refuse_options("one_device", all_reduce=all_reduce, num_packs=num_packs, timeout_s=timeout_s)
    if devices and len(devices) != 1:
        raise StrategyOptionError(
            f"one_device takes exactly one device, got {list(devices)}. Use 'mirrored' for several."
        )
    device = devices[0] if devices else runtime.local_compute_devices()[0]
    return tf.distribute.OneDeviceStrategy(device)


def _build_mirrored(*, devices, all_reduce, num_packs, timeout_s, **_):
    import tensorflow as tf

    _refuse_options("mirrored", timeout_s=timeout_s)
    devices = list(devices) if devices else runtime.local_compute_devices()
    on_gpu = any("GPU" in d.upper() for d in devices)
    if all_reduce == "nccl" and not on_gpu:
        raise StrategyOptionError(
            "all_reduce='nccl' needs GPUs, but the mirrored devices are CPUs. Use "
            "'auto' or 'one_device' on CPU."
        )
    if all_reduce == "ring":
        raise StrategyOptionError(
            "all_reduce='ring' is the collective ring of multi_worker_mirrored. For mirrored "
            "use 'nccl', 'hierarchical_copy', 'one_device' or 'auto'."
        )
    packs = {"num_packs": num_packs}
    cross_device_ops = {
        "auto": None,
        "nccl": lambda: tf.distribute.NcclAllReduce(**packs),
        "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(**packs),
        "one_device": lambda: tf.distribute.ReductionToOneDevice(),
    }[all_reduce]
    with _own_collective_keys(tf.distribute.MirroredStrategy):
        return tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=cross_device_ops() if cross_device_ops else None
        )


_strategies_made = itertools.count(1)


@contextlib.contextmanager
def _own_collective_keys(strategy_class):
    """Gives the next strategy its own range of collective group keys.

    Every MirroredStrategy numbers its collective groups from 1, so a second one in the
    same process over another device set joins group 1 with the wrong size ("joining a
    group with size 4, but that group has size 2"). TensorFlow offers the class
    attribute `_collective_key_base` for exactly this; each strategy gets its own base.
    """
    from tfpar.strategy import private_api  # pylint: disable=import-outside-toplevel

    with private_api.collective_key_base(strategy_class, next(_strategies_made) * 10_000):
        yield


def _multi_worker_cluster(cluster: Any, connect_timeout_s: float):
    """Finds and checks the cluster; waits for every peer. Returns (Cluster, resolver)."""
    found = cluster if isinstance(cluster, cluster_lib.Cluster) else cluster_lib.find_cluster(cluster)
    if found is None:
        return None, None
    runtime.ensure_not_started("A multi-worker strategy (its collectives and server)")
    if found.num_tasks > 1:
        preflight.wait_for_peers(found, timeout_s=connect_timeout_s)
    is_resolver = hasattr(cluster, "cluster_spec") and not isinstance(cluster, cluster_lib.Cluster)
    return found, (cluster if is_resolver else found.resolver())


def _build_multi_worker_mirrored(*, devices, all_reduce, num_packs, cluster, timeout_s,
                                 connect_timeout_s, **_):
    import tensorflow as tf

    _refuse_options("multi_worker_mirrored", devices=devices, num_packs=num_packs)
    if all_reduce in ("hierarchical_copy", "one_device"):
        raise StrategyOptionError(
            f"all_reduce={all_reduce!r} is a mirrored (single-machine) option. For "
            "multi_worker_mirrored use 'auto', 'ring' or 'nccl'."
        )
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[all_reduce]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation, timeout_seconds=timeout_s
    )
    found, resolver = _multi_worker_cluster(cluster, connect_timeout_s)
    if found is not None and found.has_ps:
        raise StrategyOptionError(
            f"{found.source} has a 'ps' job, which multi_worker_mirrored does not use. Use "
            "'parameter_server' (or 'auto'), or remove the ps job."
        )
    if found is None:
        runtime.ensure_not_started("multi_worker_mirrored (its collective ops)")
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options
    )


def _build_parameter_server(*, devices, all_reduce, num_packs, cluster, timeout_s,
                            connect_timeout_s, variable_partitioner, **_):
    import tensorflow as tf

    _refuse_options("parameter_server", devices=devices, all_reduce=all_reduce,
                    num_packs=num_packs, timeout_s=timeout_s)
    found, resolver = _multi_worker_cluster(cluster, connect_timeout_s)
    if found is None or not found.has_ps:
        raise StrategyOptionError(
            "parameter_server needs a cluster with 'chief', 'worker' and 'ps' jobs (from "
            "TF_CONFIG, SLURM or cluster=...). Start one locally with "
            "`tfpar-launch --chief --workers 2 --ps 1 -- python your_script.py`."
        )
    if found.task_type in ("worker", "ps"):
        _serve_forever(found, resolver)
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=variable_partitioner
    )


def _serve_forever(found: cluster_lib.Cluster, resolver) -> None:
    """Worker and ps tasks of a parameter-server cluster only serve the chief."""
    import tensorflow as tf

    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=found.task_type, task_index=found.task_index,
        protocol=found.rpc_layer, start=True,
    )
    print(f"tfpar: {found.task_type}[{found.task_index}] serving at {found.address} (pid "
          f"{os.getpid()}); waiting for the chief.", flush=True)
    server.join()


def _build_tpu(*, devices, all_reduce, num_packs, tpu, timeout_s, tpu_resolver=None, **_):
    import tensorflow as tf

    _refuse_options("tpu", devices=devices, all_reduce=all_reduce, num_packs=num_packs,
                    timeout_s=timeout_s)
    return tf.distribute.TPUStrategy(tpu_resolver or tpu_lib.connect_tpu(tpu))


_BUILDERS = {
    "default": _build_default,
    "one_device": _build_one_device,
    "mirrored": _build_mirrored,
    "multi_worker_mirrored": _build_multi_worker_mirrored,
    "parameter_server": _build_parameter_server,
    "tpu": _build_tpu,
}
