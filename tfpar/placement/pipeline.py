"""Pipeline parallelism: a StagedModel cut by a StagePlan, run micro-batch by micro-batch.

Each stage group runs on its device: its forward under `tf.device`, its backward with its
own tape (`tape.gradient(..., output_gradients=dh)` under the same device scope: with one
tape for the whole model TensorFlow would put later stages' backward ops on device 0).
Activations go forward and their gradients back between devices. The batch is split into
M micro-batches; gradients are summed over them, so loss and gradients equal the unsplit
model's. Each device's units run in its schedule's order (tfpar.placement.schedules),
forced with control dependencies: `naive`, `gpipe`, `1f1b`, `interleaved` (a plan from
`balanced(model, devices, chunks=v)`: v groups per device), `zb-h1` and `zb-v` (a plan
from `balanced(model, devices, chunks=2, layout="v")`: groups g and 2S-1-g on device g).

zb-h1 and zb-v split each backward in two units without computing anything twice: one
`tape.gradient` call builds the stage's whole backward graph; the ops that only feed the
weight gradients (X^T dY products, bias and norm sums) form the W unit, the rest (the
input-gradient chain dY W^T ...) the B unit, and W's first ops get a control input from
the unit that precedes W on the device. So B frees the next stage's wait early and W fills
the bubbles; W keeps its inputs (the saved activations and dY) alive until it runs. It needs
a traced step (tf.function; the Trainer traces one).

`remat=True` recomputes each stage's forward in its backward (tf.recompute_grad);
`remat="attention"` recomputes only the attention core (softmax and the two products
around it) and keeps the linear layers' activations (Megatron's selective recompute).
`pipe.activation_bytes` is the peak bytes of saved activations per device of the last
traced step (tfpar.placement.activations).

Under a hybrid plan (`plan.replicate(...)`, trained under `plan.strategy`) each replica
runs its own pipeline on its own devices. On a TPU (`tpu_cores.logical(plan)`) a stage runs
under `strategy.extended.experimental_logical_device(core)` and its inputs are annotated
with that core. `record=True` times every unit with `tf.timestamp()` inside the graph (see
tfpar.placement.timeline); not on TPU.

Example:
    >>> pipe = Pipeline(model, plan, micro_batches=8, schedule="1f1b")
    >>> loss, grads = pipe.forward_backward(x, y, w, loss_fn)
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfpar.models.blocks import recompute_attention_core
from tfpar.placement import activations, schedules, tpu_cores
from tfpar.placement.plan import PlacementError, StagePlan, is_multi_worker_mirrored
from tfpar.placement.pipeline_step import KIND, PipelineStep, landed, on_gpu  # noqa: F401  (KIND: re-exported)
from tfpar.placement.schedules import SCHEDULES

REMAT = {False: None, None: None, "none": None, True: "full", "full": "full", "attention": "attention"}


def schedule_order(schedule: str, stages: int, micro_batches: int, chunks: int = 1):
    """Per device, the order of its units (kind, group, micro-batch); see schedules.order."""
    return schedules.order(schedule, stages, stages * chunks, micro_batches)


def check(plan: StagePlan, micro_batches: int, schedule: str, remat, record: bool) -> None:
    """Refuses a combination that cannot run, saying what would."""
    if schedule not in SCHEDULES:
        raise PlacementError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if remat not in REMAT:
        raise PlacementError(f"remat={remat!r}: use False, True (whole stage) or 'attention' (selective).")
    if micro_batches < 1 or (schedule == "naive" and micro_batches != 1):
        raise PlacementError("micro_batches must be >= 1 (and 1 for the naive schedule).")
    _check_layout(plan, micro_batches, schedule)
    if schedule in schedules.SPLIT_BACKWARD and REMAT[remat] == "full":
        raise PlacementError(f"schedule={schedule!r} splits each backward into B and W; whole-stage "
                             "remat would recompute the forward for both: use remat='attention' "
                             "(selective), or remat=True with schedule='1f1b'.")
    if record and any(tpu_cores.is_logical(d) for d in plan.devices):
        raise PlacementError("record=True times units with tf.timestamp inside the step, which XLA "
                             "cannot compile into a TPU program: use record=False on TPU (and "
                             "tf.profiler for a trace), or record on CPU/GPU devices.")


def _check_layout(plan: StagePlan, micro_batches: int, schedule: str) -> None:
    """The plan's group -> device map must be the one the schedule's order is built for."""
    S, groups = len(plan.stage_devices), len(plan.groups)
    placed = [plan.device_index(g) for g in range(groups)]
    round_robin = groups % S == 0 and placed == [g % S for g in range(groups)]
    v_shape = groups == 2 * S and placed == [schedules.v_device(g, S) for g in range(groups)]
    if schedule == "interleaved":
        if not round_robin or groups < 2 * S:
            raise PlacementError("schedule='interleaved' needs v >= 2 stage groups per device, round "
                                 "robin: plan = balanced(model, devices, chunks=2).")
        if micro_batches % S:
            raise PlacementError(f"schedule='interleaved' runs micro-batches in rounds of S = {S}: "
                                 f"micro_batches must be a multiple of {S} (got {micro_batches}).")
    elif schedule == "zb-v":
        if not v_shape:
            raise PlacementError(f"schedule='zb-v' needs 2 stage groups per device in a V (group g and "
                                 f"2S-1-g on device g); this plan puts {groups} groups on {S} devices "
                                 "otherwise: plan = balanced(model, devices, chunks=2, layout='v').")
    elif groups != S and v_shape:
        raise PlacementError(f"This plan puts {groups} groups on {S} devices in a V (layout='v'): "
                             f"only schedule='zb-v' runs it; schedule={schedule!r} needs one group "
                             "per device: plan = balanced(model, devices).")
    elif groups != S:
        raise PlacementError(f"This plan puts {groups} groups on {S} devices; schedule={schedule!r} "
                             "needs one group per device (balanced(model, devices)): use "
                             "schedule='interleaved' for a plan with chunks.")


class Pipeline:
    """Runs a StagedModel's stage groups on their devices (see module docstring)."""

    def __init__(self, model, plan: StagePlan, micro_batches: int = 1, schedule: str = "gpipe",
                 remat: bool | str = False, record: bool = False, unit_times=None):
        """`unit_times`: seconds per unit kind, or per (kind, device), from a recorded step
        (`timeline.unit_times(pipe.timings)`): zb-h1 and zb-v then order their units for
        those times (profile-guided) instead of for F = B = W."""
        check(plan, micro_batches, schedule, remat, record)
        if unit_times is not None and schedule not in schedules.SPLIT_BACKWARD:
            raise PlacementError(f"unit_times shape only the zb-h1 and zb-v orders; schedule={schedule!r} "
                                 "has a fixed order: leave unit_times out.")
        self.model, self.plan, self.micro_batches = model, plan, micro_batches
        self.schedule, self.remat, self.record = schedule, REMAT[remat], record
        layers = dict(model.stages())
        self.groups = [[layers[n] for n in g.names] for g in plan.groups]
        self.devices = len(plan.stage_devices)
        self.unit_times = dict(unit_times or schedules.NOMINAL)
        self.order = schedules.order(schedule, self.devices, len(self.groups), micro_batches,
                                     self.unit_times)
        self.split = schedule in schedules.SPLIT_BACKWARD
        self._sequence = self._data_order()
        self.timings_by_replica: dict[int, tf.Tensor] = {}
        self.activation_bytes: dict[int, int] = {}
        self._traced = None  # replica 0's last traced graph and its units' op regions

    @property
    def timings(self):
        """Replica 0's recorded units of the last traced step, [units, 6]: device, micro-batch,
        kind (0 forward, 1 backward or B, 2 W), start and end (s, tf.timestamp), group."""
        return self.timings_by_replica.get(0)

    def bubble_theory(self) -> float:
        """This schedule's bubble at equal unit durations (tfpar.placement.schedules)."""
        return schedules.bubble_theory(self.schedule, self.devices, len(self.groups), self.micro_batches)

    def bubble_replayed(self, unit_times) -> float:
        """This order's bubble when every unit lasts its `unit_times` (by kind or (kind,
        device); a full backward is B + W): what the order alone costs at those times."""
        span = schedules.simulate(self.order, len(self.groups), unit_times, split_backward=True)
        return schedules.bubble(span, self.devices)

    def unit_op_types(self) -> dict[tuple, list[str]]:
        """Per unit (kind, group, micro-batch), the types of the ops it ran in the last
        traced step (replica 0): what each unit does, read from the graph.

        Example:
            >>> pipe.unit_op_types()[("W", 0, 0)]     # ['MatMul', ..., 'UnsortedSegmentSum']
        """
        if self._traced is None:
            raise PlacementError("No step traced yet: call forward_backward inside tf.function first.")
        graph, regions = self._traced
        ops: dict[tuple, list[str]] = {}
        for position, op in enumerate(graph.get_operations()):
            unit = regions.unit_of(position, op.name)
            if unit is not None:
                ops.setdefault(unit, []).append(op.type)
        return ops

    def _data_order(self) -> list[tuple]:
        """All units, each after its inputs' units and its device's previous unit."""
        pending, done, sequence = [list(o) for o in self.order], set(), []
        groups = len(self.groups)
        while any(pending):
            ready = [p.pop(0) for p in pending
                     if p and all(n in done for n in schedules.inputs(p[0], groups))]
            if not ready:
                raise PlacementError(f"Schedule {self.schedule} deadlocked (a bug in its order).")
            sequence.extend(ready)
            done.update(ready)
        return sequence

    def _replica(self) -> int:
        """This replica's index (its row of the plan); 0 outside a hybrid plan."""
        if self.plan.replicas == 1:
            return 0
        context = tf.distribute.get_replica_context()
        replica = None if context is None else tf.get_static_value(context.replica_id_in_sync_group)
        strategy = tf.distribute.get_strategy()
        local = (len(strategy.extended.worker_devices) if is_multi_worker_mirrored(strategy)
                 else strategy.num_replicas_in_sync)  # across workers: this worker's replicas
        if replica is None or local != self.plan.replicas:
            raise PlacementError(f"A hybrid plan of {self.plan.replicas} replicas runs inside "
                                 "plan.strategy.run, or under multi_worker_mirrored with as many "
                                 "replicas per worker (tfpar.Trainer does this).")
        return int(replica) % local  # worker i's replicas follow those of workers 0..i-1

    def group_variables(self, s: int) -> list:
        return [v for layer in self.groups[s] for v in layer.trainable_variables]

    @staticmethod
    def _on(device: str):
        """Where a stage's ops (and variables) go: its device, or its TPU logical core."""
        if tpu_cores.is_logical(device):
            extended = tf.distribute.get_strategy().extended
            return extended.experimental_logical_device(tpu_cores.logical_core(device))
        return tf.device(device)

    @staticmethod
    def _hand_to(device: str, tensor):
        """`tensor` arriving at a stage: copied to its device or annotated with its core."""
        if tensor is None:
            return None
        if tpu_cores.is_logical(device):
            return tf.distribute.get_strategy().experimental_assign_to_logical_device(
                tensor, tpu_cores.logical_core(device))
        return tf.identity(tensor)

    @staticmethod
    def _stamp(deps, device: str = "") -> tf.Tensor:
        """tf.timestamp() after `deps`. Inside tf.function, automatic control dependencies
        chain every stateful op without a resource input (tf.timestamp is one) in creation
        order, which would serialise the stages; marked independent it only runs after
        `deps` and before the function returns. On a GPU `device` the stamp waits for the
        data of `deps` (see `landed`), not for their kernels to be queued."""
        if on_gpu(device):
            deps = landed(deps)
        with tf.control_dependencies(deps):
            stamp = tf.timestamp()
        manager = getattr(stamp.graph, "experimental_acd_manager", None)
        if manager is not None:
            manager.run_independently(stamp.op)
        return stamp

    def _apply(self, s: int, h, training=True, after_first=None):
        """The group's layers on `h`; `after_first(h)` sees the first layer's output."""
        def run(h):
            for i, layer in enumerate(self.groups[s]):
                h = layer(h, training=training)
                if i == 0 and after_first is not None:
                    after_first(h)
            return h
        if self.remat == "full":
            return tf.recompute_grad(run)(h)
        with recompute_attention_core(self.remat == "attention"):
            return run(h)

    @tf.autograph.experimental.do_not_convert  # Python control flow only: trace it as is
    def forward_backward(self, x, y, w, loss_fn: Callable):
        """Loss and gradients (aligned with model.trainable_variables) of the whole batch.

        `loss_fn(y, logits, w)` returns the micro-batch's share of the batch loss (a sum
        over its examples divided by the whole batch's denominator), so shares add up.

        Raises:
            PlacementError: zb-h1 or zb-v run eagerly (they need a traced step).
        """
        if self.split and tf.executing_eagerly():
            raise PlacementError(f"schedule={self.schedule!r} splits the backward graph: run "
                                 "forward_backward inside tf.function (tfpar.Trainer does).")
        replica = self._replica()
        step = PipelineStep(self, x, y, w, loss_fn, self.plan.replica_devices[replica])
        for unit in self._sequence:
            step.run(unit)
        if self.record:
            self.timings_by_replica[replica] = tf.stack(step.stamps)
        if replica == 0 and step.graph is not None:
            self._traced = (step.graph, step.regions)
            self.activation_bytes, unknown = activations.peak_bytes(
                step.graph, step.regions, self.order, self.plan.device_index)
            if unknown:
                self.activation_bytes["unknown_tensors"] = unknown
        grads = {id(v): g for s, gs in enumerate(step.var_grads)
                 for v, g in zip(self.group_variables(s), gs)}
        return tf.add_n(step.losses), [grads.get(id(v)) for v in self.model.trainable_variables]
