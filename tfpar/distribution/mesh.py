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
the first variable, or calling fit, makes it.

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

    def describe(self) -> str:
        kind = type(self.distribution).__name__
        line = f"keras.distribution.{kind} on {len(self.devices)} device(s)"
        if self.degree > 1:
            line += f", {self.batch_axis} x {self.model_axis} = {len(self.devices) // self.degree} x {self.degree}"
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
