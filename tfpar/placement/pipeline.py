"""Pipeline parallelism: a StagedModel cut by a StagePlan, run micro-batch by micro-batch.

Each stage group runs on its device: its forward under `tf.device`, its backward with its
own tape (`tape.gradient(..., output_gradients=dh)` under the same device scope: with one
tape for the whole model TensorFlow would put later stages' backward ops on device 0).
Activations go forward and their gradients back between devices. The batch is split into
M micro-batches; gradients are summed over them, so loss and gradients equal the unsplit
model's. The order of the work per stage is forced with control dependencies:

- `naive`: one micro-batch, stage after stage;
- `gpipe`: every forward of every micro-batch, then every backward (fill, then drain);
- `1f1b`: after S - s warm-up forwards, stage s alternates one backward and one forward, so
  at most S micro-batches are in flight (less activation memory than GPipe).

Under a hybrid plan (`plan.replicate(...)`, trained under `plan.strategy`) each replica
runs its own pipeline on its own devices; the Trainer's aggregator then all-reduces the
gradients across replicas, once per step, as for any data-parallel run.

On a TPU (`tpu_cores.logical(plan)`) a stage's "device" is a logical core of the replica: the
stage's input, and the gradient handed back to it, are annotated with that core instead.

With `record=True` every unit of work (stage, micro-batch, forward/backward) is timed with
`tf.timestamp()` before and after it, inside the graph: see tfpar.placement.timeline.

Example:
    >>> pipe = Pipeline(model, plan, micro_batches=8, schedule="1f1b")
    >>> loss, grads = pipe.forward_backward(x, y, w, loss_fn)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf

from tfpar.placement import tpu_cores
from tfpar.placement.plan import PlacementError, StagePlan

SCHEDULES = ("naive", "gpipe", "1f1b")


def schedule_order(schedule: str, stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """Per stage, the order of its work units: ("F", m) and ("B", m)."""
    m_all = range(micro_batches)
    if schedule in ("naive", "gpipe"):
        return [[("F", m) for m in m_all] + [("B", m) for m in reversed(m_all)]
                for _ in range(stages)]
    if schedule == "1f1b":
        orders = []
        for s in range(stages):
            warm = min(stages - s, micro_batches)
            order = [("F", m) for m in range(warm)]
            forward, backward = warm, 0
            while backward < micro_batches:
                order.append(("B", backward))
                backward += 1
                if forward < micro_batches:
                    order.append(("F", forward))
                    forward += 1
            orders.append(order)
        return orders
    raise PlacementError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")


class Pipeline:
    """Runs a StagedModel's stage groups on their devices (see module docstring)."""

    def __init__(self, model, plan: StagePlan, micro_batches: int = 1, schedule: str = "gpipe",
                 remat: bool = False, record: bool = False):
        if schedule not in SCHEDULES:
            raise PlacementError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
        if micro_batches < 1 or (schedule == "naive" and micro_batches != 1):
            raise PlacementError("micro_batches must be >= 1 (and 1 for the naive schedule).")
        self.model, self.plan, self.micro_batches = model, plan, micro_batches
        self.schedule, self.remat, self.record = schedule, remat, record
        layers = dict(model.stages())
        self.groups = [[layers[n] for n in g.names] for g in plan.groups]
        self.order = schedule_order(schedule, len(self.groups), micro_batches)
        self.timings_by_replica: dict[int, tf.Tensor] = {}

    @property
    def timings(self):
        """Replica 0's recorded units of the last traced step, [units, 5]: stage,
        micro-batch, 0 forward / 1 backward, start and end (seconds, tf.timestamp)."""
        return self.timings_by_replica.get(0)

    def _replica(self) -> int:
        """This replica's index (its row of the plan); 0 outside a hybrid plan."""
        if self.plan.replicas == 1:
            return 0
        context = tf.distribute.get_replica_context()
        replica = None if context is None else tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None or tf.distribute.get_strategy().num_replicas_in_sync != self.plan.replicas:
            raise PlacementError(f"A hybrid plan of {self.plan.replicas} replicas runs inside "
                                 "plan.strategy.run (tfpar.Trainer does this).")
        return int(replica)

    def group_variables(self, s: int) -> list:
        return [v for layer in self.groups[s] for v in layer.trainable_variables]

    @staticmethod
    def _on(device: str):
        """Where a stage's ops go: its device (a TPU core is chosen by annotation instead)."""
        return contextlib.nullcontext() if tpu_cores.is_logical(device) else tf.device(device)

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
    def _stamp(deps) -> tf.Tensor:
        """tf.timestamp() after `deps`. Inside tf.function, automatic control dependencies
        chain every stateful op without a resource input (tf.timestamp is one) in creation
        order, which would serialise the stages; marked independent it only runs after
        `deps` and before the function returns."""
        with tf.control_dependencies(deps):
            stamp = tf.timestamp()
        manager = getattr(stamp.graph, "experimental_acd_manager", None)
        if manager is not None:
            manager.run_independently(stamp.op)
        return stamp

    def _begin(self, deps):
        """(start stamp or None, what the unit's first op must wait for)."""
        if not self.record:
            return None, deps
        start = self._stamp(deps)
        return start, [start]

    def _apply(self, s: int, h, training=True):
        def run(h):
            for layer in self.groups[s]:
                h = layer(h, training=training)
            return h
        return tf.recompute_grad(run)(h) if self.remat else run(h)

    def forward_backward(self, x, y, w, loss_fn: Callable):
        """Loss and gradients (aligned with model.trainable_variables) of the whole batch.

        `loss_fn(y, logits, w)` returns the micro-batch's share of the batch loss (a sum
        over its examples divided by the whole batch's denominator), so shares add up.
        """
        m_count, s_count = self.micro_batches, len(self.groups)
        replica = self._replica()
        devices = self.plan.replica_devices[replica]
        xs = tf.split(x, m_count)
        ys = tf.split(y, m_count)
        ws = tf.split(w, m_count) if w is not None else [None] * m_count
        tapes, inputs, outputs, grads_in = {}, {}, {}, {}
        losses = [None] * m_count
        var_grads = [[None] * len(self.group_variables(s)) for s in range(s_count)]
        last_unit = [None] * s_count  # control dependency chain per stage
        stamps = []

        def after(s, tensors):
            deps = [t for t in tensors if t is not None]
            if last_unit[s] is not None:
                deps.append(last_unit[s])
            return deps

        pending = {s: list(order) for s, order in enumerate(self.order)}
        # Walk the units in an order that respects data dependencies; control deps then
        # fix each stage's own order.
        while any(pending.values()):
            progressed = False
            for s in range(s_count):
                if not pending[s]:
                    continue
                kind, m = pending[s][0]
                ready = (kind == "F" and (s == 0 or (s - 1, m) in outputs)) or \
                        (kind == "B" and (s, m) in outputs and (s == s_count - 1 or (s + 1, m) in grads_in))
                if not ready:
                    continue
                pending[s].pop(0)
                progressed = True
                with self._on(devices[s]):
                    if kind == "F":
                        h_in = self._hand_to(devices[s], xs[m] if s == 0 else outputs[(s - 1, m)])
                        start, deps = self._begin(after(s, [h_in]))
                        with tf.control_dependencies(deps):
                            h_in = tf.identity(h_in)  # the stage's work starts here
                        tape = tf.GradientTape()
                        with tape:
                            if s > 0:
                                tape.watch(h_in)
                            out = self._apply(s, h_in)
                            if s == s_count - 1:
                                out = loss_fn(ys[m], out, ws[m])
                                losses[m] = out
                        tapes[(s, m)], inputs[(s, m)], outputs[(s, m)] = tape, h_in, out
                        done = [out]
                    else:
                        upstream = self._hand_to(devices[s], grads_in.get((s + 1, m)))
                        start, deps = self._begin(after(s, [upstream]))
                        variables = self.group_variables(s)
                        sources = variables + ([inputs[(s, m)]] if s > 0 else [])
                        with tf.control_dependencies(deps):
                            result = tapes.pop((s, m)).gradient(
                                outputs[(s, m)], sources, output_gradients=upstream)
                        for i, g in enumerate(result[:len(variables)]):
                            g = tf.convert_to_tensor(g) if g is not None else None
                            var_grads[s][i] = g if var_grads[s][i] is None else var_grads[s][i] + g
                        if s > 0:
                            grads_in[(s, m)] = result[-1]
                        done = [g for g in result if g is not None]
                    if self.record:  # the next unit of this stage starts after this one's end
                        last_unit[s] = self._stamp(done)
                        stamps.append((s, m, 0 if kind == "F" else 1, start, last_unit[s]))
                    else:
                        last_unit[s] = tf.group(*done)  # a token, not a stateful op (see _stamp)
            if not progressed:
                raise PlacementError(f"Schedule {self.schedule} deadlocked (a bug in its order).")
        if self.record:
            self.timings_by_replica[replica] = tf.stack([tf.stack([tf.constant(s, tf.float64), tf.constant(m, tf.float64),
                                               tf.constant(k, tf.float64), a, b])
                                     for s, m, k, a, b in stamps])
        loss = tf.add_n(losses)
        grads_by_var = {}
        for s in range(s_count):
            for v, g in zip(self.group_variables(s), var_grads[s]):
                grads_by_var[id(v)] = g
        return loss, [grads_by_var.get(id(v)) for v in self.model.trainable_variables]
