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
from tfpar.strategy import private_api
from tfpar.placement.plan import PlacementError, StagePlan, is_multi_worker_mirrored
from tfpar.placement.schedules import SCHEDULES

REMAT = {False: None, None: None, "none": None, True: "full", "full": "full", "attention": "attention"}
KIND = {"F": 0, "B": 1, "W": 2}


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
        data of `deps` (see `_landed`), not for their kernels to be queued."""
        if _on_gpu(device):
            deps = _landed(deps)
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
        step = _Step(self, x, y, w, loss_fn, self.plan.replica_devices[replica])
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


class _Step:
    """One traced step's state: what each unit produced, per-device chains, op regions."""

    def __init__(self, pipe: Pipeline, x, y, w, loss_fn, devices):
        m_count = pipe.micro_batches
        self.pipe, self.loss_fn, self.devices = pipe, loss_fn, devices
        self.xs, self.ys = tf.split(x, m_count), tf.split(y, m_count)
        self.ws = tf.split(w, m_count) if w is not None else [None] * m_count
        self.tapes, self.inputs, self.outputs, self.grads_in, self.weights = {}, {}, {}, {}, {}
        self.losses = [None] * m_count
        self.var_grads = [[None] * len(pipe.group_variables(s)) for s in range(len(pipe.groups))]
        self.last = [None] * pipe.devices  # each device's control chain
        self.ends = {}  # (kind, group, micro-batch) -> end stamp, when recording
        self.stamps = []
        self.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self.regions = activations.Regions()

    def _count(self) -> int:
        return len(self.graph.get_operations()) if self.graph is not None else 0

    def run(self, unit) -> None:
        """Runs one unit on its device after the device's previous unit; times it if asked."""
        kind, g, m = unit
        d, device = self.pipe.plan.device_index(g), self.devices[g]
        first = self._count()
        with self.pipe._on(device):
            arriving = {"F": lambda: self.xs[m] if g == 0 else self.outputs[(g - 1, m)],
                        "B": lambda: self.grads_in.get((g + 1, m)), "W": lambda: None}[kind]()
            arriving = self.pipe._hand_to(device, arriving)
            # recorded: a unit also starts after the end stamp of the unit that made its
            # input, so a drawn consumer never seems to end before its producer
            producer = {"F": ("F", g - 1, m), "B": ("B", g + 1, m), "W": None}[kind]
            deps = [t for t in (arriving, self.last[d], self.ends.get(producer)) if t is not None]
            start = self.pipe._stamp(deps, device) if self.pipe.record else None
            deps = [start] if start is not None else deps
            done = {"F": self._forward, "B": self._backward, "W": self._weights}[kind](g, m, arriving, deps)
            done = done or deps  # a unit with nothing to do (B of the first group) keeps the chain
            if self.pipe.record:  # the device's next unit starts after this one's end
                self.last[d] = self.ends[(kind, g, m)] = self.pipe._stamp(done, device)
                self.stamps.append(tf.stack([tf.constant(v, tf.float64) for v in (d, m, KIND[kind])]
                                            + [start, self.last[d], tf.constant(g, tf.float64)]))
            else:
                self.last[d] = tf.group(*done)  # a token, not a stateful op (see _stamp)
        self.regions.add(unit, first, self._count())

    def _forward(self, g, m, h_in, deps):
        with tf.control_dependencies(deps):
            h_in = tf.identity(h_in)  # the stage's work starts here
        if self.graph is not None:
            self.regions.seeds[("F", g, m)] = h_in.op
        tape = tf.GradientTape(persistent=False)
        first_out = []  # the first group's B target: its first layer's output (see _backward)

        def note_first(h):
            if h.dtype.is_floating:  # an integer output has no gradient: B stays empty then
                tape.watch(h)
                first_out.append(h)

        after_first = note_first if g == 0 and self.pipe.split and len(self.pipe.groups[0]) > 1 else None
        with tape:
            if g > 0:
                tape.watch(h_in)
            out = self.pipe._apply(g, h_in, after_first=after_first)
            if g == len(self.pipe.groups) - 1:
                out = self.losses[m] = self.loss_fn(self.ys[m], out, self.ws[m])
        self.tapes[(g, m)], self.outputs[(g, m)] = tape, out
        self.inputs[(g, m)] = h_in if g > 0 else (first_out[0] if first_out else None)
        return [out]

    def _backward(self, g, m, upstream, deps):
        """The stage's backward (zb-h1, zb-v: all of it is built here, the W part set aside).

        B is the gradient of the group's input; in the first group, whose input (token ids,
        say) has none, it is the gradient of its first layer's output: the activation chain
        through the group, as in the zero-bubble paper, so the first device's B is not empty
        with all of its backward left to W. (A first group of one layer has no such chain:
        its B stays empty.)"""
        variables = self.pipe.group_variables(g)
        target = self.inputs[(g, m)]  # the group's input, or (first group, split) its first layer's output
        sources = variables + ([target] if target is not None else [])
        first = len(self.graph.get_operations()) if self.pipe.split else 0
        with tf.control_dependencies(deps):
            result = self.tapes.pop((g, m)).gradient(self.outputs[(g, m)], sources,
                                                     output_gradients=upstream)
            weight_grads = [tf.convert_to_tensor(r) if r is not None else None
                            for r in result[:len(variables)]]
        input_grad = result[-1] if target is not None else None
        if g > 0:
            self.grads_in[(g, m)] = input_grad
        if not self.pipe.split:
            self._accumulate(g, weight_grads)
            return [t for t in weight_grads + [input_grad] if t is not None]
        self.weights[(g, m)] = (_weight_only_frontier(self.graph, first, weight_grads, input_grad,
                                                      self.regions, ("W", g, m)), weight_grads)
        return [input_grad] if input_grad is not None else []

    def _weights(self, g, m, _, deps):
        frontier, weight_grads = self.weights.pop((g, m))
        for op in frontier:  # W's first ops wait for the device's previous unit; TF has no
            for dep in deps:  # public API that adds a control input to an op already built
                private_api.add_control_input(op, dep if isinstance(dep, tf.Operation) else dep.op)
        self._accumulate(g, weight_grads)
        return [t for t in weight_grads if t is not None]

    def _accumulate(self, g, weight_grads) -> None:
        for i, grad in enumerate(weight_grads):
            total = self.var_grads[g][i]
            self.var_grads[g][i] = grad if total is None or grad is None else total + grad


def _on_gpu(device: str) -> bool:
    """Whether a stage's `device` is a GPU (not a CPU, a TPU logical core or unnamed)."""
    if not device or tpu_cores.is_logical(device):
        return False
    return tf.DeviceSpec.from_string(device).device_type == "GPU"


def _landed(deps: list) -> list:
    """`deps` with their float tensors replaced by one host-side probe of their data.

    A GPU kernel is queued, not finished, when the ops that depend on it by control run, so a
    timestamp after it would stamp the queueing. The probe reads one element of the first
    float tensor, queued on the device after all of them (one stream per device runs its
    kernels in order), and copies it to the host. Its host end is a CheckNumerics (of a value
    made finite first): Grappler's dependency optimizer turns an op whose outputs feed only
    control edges into a NoOp, back up the chain, unless it is on its do-not-rewrite list,
    and then the stamp would wait on control edges from the GPU again.
    """
    def on_device(t) -> bool:  # stamps are on the host already
        return isinstance(t, tf.Tensor) and t.dtype.is_floating and t.op.type != "Timestamp"

    floats = [t for t in deps if on_device(t)]
    if not floats:
        return deps
    with tf.control_dependencies(floats[1:]):
        first = tf.reduce_sum(tf.cast(tf.reshape(floats[0], [-1])[:1], tf.float32))
    first = tf.where(tf.math.is_finite(first), first, tf.zeros_like(first))
    with tf.device("/device:CPU:0"):
        probe = tf.debugging.check_numerics(first, "pipeline timeline probe")
    return [t for t in deps if not on_device(t)] + [probe]


def _weight_only_frontier(graph, first, weight_grads, input_grad, regions, unit) -> list:
    """The ops built since position `first` that feed only the weight gradients (they are
    moved to `unit` in `regions`); returns those without an input from another such op."""
    built = {op.name: op for op in graph.get_operations()[first:]}

    def ancestors(tensors):
        seen, stack = set(), [t.op for t in tensors if t is not None and t.op.name in built]
        while stack:
            op = stack.pop()
            if op.name not in seen:
                seen.add(op.name)
                stack.extend(t.op for t in op.inputs if t.op.name in built)
        return seen

    weight_only = ancestors(weight_grads) - ancestors([input_grad])
    for name in weight_only:
        regions.moved[name] = unit
    return [built[n] for n in weight_only
            if not any(t.op.name in weight_only for t in built[n].inputs)]
