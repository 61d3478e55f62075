"""A keras.distribution `Distribution`, as tfpar runs it on TensorFlow: its strategy and
its tensor-parallel layout.

- `DataParallel(mesh)`: data parallelism over the mesh's devices: `mirrored` over them in
  one process, `multi_worker_mirrored` when the process is one of a cluster (TF_CONFIG,
  SLURM): the strategy tfpar would pick.
- `ModelParallel(layout_map, batch_dim_name)` on a 2-D mesh (batch x model): the same
  strategy over every device of the mesh, ordered so that the devices of one model row are
  consecutive replicas: they form one tensor-parallel group of T = the model axis's size
  (tfpar.tensor_parallel.Layout), the rows the data-parallel groups. The layout map is
  read by tfpar.tensor_parallel.layout_map.

A plan is made once per distribution object (kept on it) and its strategy once: creating
the first variable, or calling fit, makes it. Weights the layout map lays out on the batch
axis (FSDP-style, as keras-hub's maps do) stay whole and tfpar.Trainer partitions their
optimizer state and gradients over the data-parallel replicas (ZeRO-2, `shard_for`); one
line at start says so (`start_line`), under model.fit too, which does not partition them.

Example:
    >>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices())
    >>> plan = plan_of(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    >>> plan.degree, plan.strategy.num_replicas_in_sync
    (2, 4)
"""

from __future__ import annotations

import keras
import numpy as np

from tfpar.tensor_parallel.layout import TensorParallelError
from tfpar.tensor_parallel.layout_map import LayoutMapSplits

PLAN = "_tfpar_plan"  # the attribute a distribution keeps its plan in


class Plan:
    """How tfpar runs one keras.distribution Distribution (see module docstring)."""

    def __init__(self, distribution):
        self.distribution = distribution
        mesh = distribution.device_mesh
        names, shape = list(mesh.axis_names), tuple(mesh.shape)
        self.batch_axis = getattr(distribution, "batch_dim_name", None) or names[0]
        if self.batch_axis not in names:
            raise TensorParallelError(f"batch_dim_name {self.batch_axis!r} is not an axis of the device mesh "
                                      f"{names}: name one of them.")
        others = [n for n in names if n != self.batch_axis]
        if len(others) > 1:
            raise TensorParallelError(f"The device mesh has {len(names)} axes ({names}): tfpar runs a batch axis "
                                      "and at most one model axis (a 2-D mesh). Fold the others into one.")
        self.model_axis = others[0] if others and isinstance(distribution, keras.distribution.ModelParallel) else None
        self.degree = shape[names.index(self.model_axis)] if self.model_axis else 1
        devices = np.asarray(mesh.devices)
        if self.model_axis and names.index(self.model_axis) < names.index(self.batch_axis):
            devices = devices.T  # a model row: consecutive replicas
        self.devices = [_tf_device(d) for d in devices.reshape(-1)]
        layout_map = getattr(distribution, "_layout_map", None)
        self.splits = LayoutMapSplits(layout_map, self.batch_axis, self.model_axis, self.degree) \
            if layout_map is not None else None
        if self.splits is not None:
            for key, layout in layout_map.items():  # an activation layout (Keras: "<layer>/output")
                if str(key).rstrip("$").endswith("output"):
                    self.splits.check_activation(key, tuple(getattr(layout, "axes", layout)))
        self._strategy = self._layout = None

    @property
    def strategy(self):
        """The tf.distribute strategy (made on first use)."""
        if self._strategy is None:
            self._strategy = _strategy_over(self.devices)
            setattr(self._strategy, PLAN, self)
        return self._strategy

    @property
    def layout(self):
        """The tensor-parallel Layout (None on a data-parallel mesh)."""
        if self.degree > 1 and self._layout is None:
            from tfpar.tensor_parallel import Layout  # pylint: disable=import-outside-toplevel

            self._layout = Layout.of(self.strategy, self.degree)
        return self._layout

    @property
    def data_parallel(self) -> int:
        """R: the size of the batch axis (the replicas that share each shard)."""
        return len(self.devices) // self.degree

    def batch_weights(self, model) -> list:
        """`model`'s trainable weights the layout map lays out on the batch axis."""
        paths = set(self.splits.on_batch) if self.splits is not None else set()
        return [v for v in model.trainable_variables if v.path in paths]

    def shard_for(self, model, asked=None):
        """The Trainer's `shard` for `model`: `asked` if given; else, where the layout map
        lays weights on the batch axis over R > 1 replicas (keras-hub's maps, FSDP-style),
        "gradients": ZeRO-2 partitions of their optimizer state and gradients over the
        data-parallel group, the weights whole (the same numbers); else "none". tfpar's
        ZeRO partitions every trainable weight of the model, which the map's batch-axis
        ones are among: a partitioned weight costs the wire what an all-reduced one does
        (a reduce-scatter and an all-gather), so partitioning the others too saves their
        memory for nothing."""
        if asked is not None:
            return asked
        return "gradients" if self.batch_weights(model) and self.data_parallel > 1 else "none"

    def start_line(self, model, shard: str | None, how: str = "tfpar.Trainer") -> str:
        """The one line said at start: the plan, and what becomes of the weights the map
        lays out on the batch axis under `how` with `shard` (None: not partitioned)."""
        line = self.describe()
        on_batch = self.batch_weights(model)
        if not on_batch:
            return line
        count = f"{len(on_batch)} weight(s) laid out on {self.batch_axis!r}"
        mode = str(getattr(shard, "mode", shard))
        if mode in ("optimizer", "gradients"):
            what = {"optimizer": "their optimizer state (ZeRO-1)",
                    "gradients": "their optimizer state and gradients (ZeRO-2)"}[mode]
            return (f"{line}; {count}: whole weights, {what} partitioned over the "
                    f"{self.data_parallel} replicas of {self.batch_axis!r} (as every trainable weight's)")
        if self.data_parallel == 1:
            return f"{line}; {count}: whole (one replica on {self.batch_axis!r}: nothing to partition)"
        fix = ("tfpar.Trainer partitions them (ZeRO-2)" if how != "tfpar.Trainer"
               else "leave shard at its default or pass 'gradients' to partition them")
        return (f"{line}; {count}: whole weights and whole optimizer state on every replica under "
                f"{how} (the same numbers, not partitioned): {fix}")

    def describe(self) -> str:
        kind = type(self.distribution).__name__
        line = f"keras.distribution.{kind} on {len(self.devices)} device(s)"
        if self.degree > 1:
            line += f", {self.batch_axis} x {self.model_axis} = {self.data_parallel} x {self.degree}"
        return line + (f"; {self.splits.describe()}" if self.splits is not None and self.degree > 1 else "")


def plan_of(distribution) -> Plan:
    """The Plan of a keras.distribution Distribution (made once, kept on it)."""
    plan = getattr(distribution, PLAN, None)
    if plan is None:
        plan = Plan(distribution)
        setattr(distribution, PLAN, plan)
    return plan


def current_plan() -> Plan | None:
    """The Plan of the distribution in effect (`set_distribution`, `with distribution.scope()`)."""
    distribution = keras.distribution.distribution()
    return None if distribution is None else plan_of(distribution)


def _tf_device(name) -> str:
    """Keras's device names ('cpu:0', 'gpu:1') as TensorFlow's ('/device:CPU:0')."""
    kind, _, index = str(name).rpartition(":")
    return f"/device:{kind.rsplit('/', 1)[-1].upper()}:{index}"


_CLUSTER: dict = {}  # "strategy": this cluster process's multi-worker strategy (one per process)


def start_cluster_strategy() -> None:
    """In a process of a cluster (TF_CONFIG, SLURM), makes its multi_worker_mirrored strategy
    now: it must exist before TensorFlow starts, and keras.distribution's own constructors
    (`DataParallel()` lists the devices) start it. `enable()` calls this."""
    import tfpar  # pylint: disable=import-outside-toplevel
    from tfpar.errors import RuntimeAlreadyStartedError  # pylint: disable=import-outside-toplevel
    from tfpar.strategy import cluster, runtime  # pylint: disable=import-outside-toplevel

    if _CLUSTER or cluster.find_cluster() is None:
        return
    if runtime.runtime_started():  # before create_strategy's wait for the peers
        raise RuntimeAlreadyStartedError(
            "This process is one of a cluster (TF_CONFIG or SLURM), and its multi-worker strategy "
            "must be made before TensorFlow starts, but TensorFlow already ran an op: call "
            "tfpar.distribution.enable() first thing in your program, before keras.distribution's "
            "DeviceMesh / DataParallel (they list the devices), models or data.")
    _CLUSTER["strategy"] = tfpar.create_strategy("multi_worker_mirrored")


def _strategy_over(devices: list[str]):
    """The strategy tfpar would pick over `devices`: this process's multi_worker_mirrored
    when it is one of a cluster (made by `start_cluster_strategy`), mirrored otherwise."""
    import tfpar  # pylint: disable=import-outside-toplevel
    from tfpar.strategy import cluster  # pylint: disable=import-outside-toplevel

    if cluster.find_cluster() is not None:
        start_cluster_strategy()
        return _CLUSTER["strategy"]
    return tfpar.create_strategy("mirrored", devices=devices)
