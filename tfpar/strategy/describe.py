"""What a strategy is, in one small record.

Example:
    >>> tfpar.describe(tfpar.create_strategy("mirrored", virtual_devices=2))
    StrategyInfo(kind='mirrored', replicas=2, num_workers=1, task_type=None, task_index=None,
                 is_chief=True, devices=('/job:localhost/replica:0/task:0/device:CPU:0', ...))
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpar.strategy import runtime
from tfpar.strategy.cluster import is_chief


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """kind: the tfpar name; replicas: replicas in sync; devices: this worker's devices."""

    kind: str
    replicas: int
    num_workers: int
    task_type: str | None
    task_index: int | None
    is_chief: bool
    devices: tuple[str, ...]


def strategy_kind(strategy: tf.distribute.Strategy) -> str:
    """The tfpar name of a strategy object."""
    kinds = [
        (tf.distribute.TPUStrategy, "tpu"),
        (tf.distribute.MultiWorkerMirroredStrategy, "multi_worker_mirrored"),
        (tf.distribute.MirroredStrategy, "mirrored"),
        (tf.distribute.OneDeviceStrategy, "one_device"),
        (tf.distribute.experimental.ParameterServerStrategy, "parameter_server"),
    ]
    for cls, kind in kinds:
        if isinstance(strategy, cls):
            return kind
    return "default"


def describe(strategy: tf.distribute.Strategy | None = None) -> StrategyInfo:
    """Describes `strategy` (default: the current one)."""
    strategy = strategy or tf.distribute.get_strategy()
    kind = strategy_kind(strategy)
    resolver = (getattr(strategy, "cluster_resolver", None)  # PS keeps its own privately
                or getattr(strategy, "_cluster_resolver", None))
    task_type = getattr(resolver, "task_type", None) if resolver else None
    task_index = getattr(resolver, "task_id", None) if resolver else None
    jobs = resolver.cluster_spec().as_dict() if resolver is not None and task_type else {}
    num_workers = 1
    if kind == "multi_worker_mirrored" and jobs:
        num_workers = max(1, len(jobs.get("worker", [])) + len(jobs.get("chief", [])))
    elif kind == "parameter_server" and jobs:  # the chief coordinates, workers train
        num_workers = len(jobs.get("worker", []))
    elif kind == "tpu":
        num_workers = strategy.extended.num_hosts
    chief = is_chief(jobs, task_type, task_index)
    if kind == "default":  # where TensorFlow places ops: the first GPU if there is one
        devices = (runtime.local_compute_devices()[0],)
    elif kind == "parameter_server":
        devices = tuple(strategy.extended.parameter_devices)
    else:
        devices = tuple(strategy.extended.worker_devices)
    return StrategyInfo(
        kind=kind,
        replicas=strategy.num_replicas_in_sync,
        num_workers=num_workers,
        task_type=task_type,
        task_index=task_index,
        is_chief=chief,
        devices=devices,
    )
