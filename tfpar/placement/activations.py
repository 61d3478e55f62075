"""Activation memory of a pipeline schedule, counted from the traced step.

While the Pipeline traces a step it notes which graph ops each unit (forward F, backward
B, weight-gradient W of a stage group on a micro-batch) created. A forward's *saved
activations* are the tensors it computes from its micro-batch (not the weights it reads)
that a later B or W of the same group and micro-batch consumes: the graph executor keeps
each alive until its last consumer has run. Walking each device's schedule order, adding a
forward's saved bytes when it runs and dropping each tensor after its last consumer, gives
the bytes the schedule keeps alive at its peak on that device. Static shapes only: a tensor
of unknown size is left out and counted in `unknown`.

Example:
    >>> pipe = Pipeline(model, plan, micro_batches=8, schedule="1f1b")
    >>> tf.function(pipe.forward_backward).get_concrete_function(x, y, w, loss_fn)
    >>> pipe.activation_bytes      # {device index: peak bytes}
"""

from __future__ import annotations

import bisect

import tensorflow as tf


class Regions:
    """Which unit created each op: per unit, a [first, last) range of graph op positions."""

    def __init__(self):
        self.spans: list[tuple[int, int, tuple]] = []
        self.moved: dict[str, tuple] = {}  # op name -> unit, for ops moved into a W unit
        self.seeds: dict[tuple, tf.Operation] = {}  # forward unit -> its input's op

    def add(self, unit: tuple, first: int, last: int) -> None:
        self.spans.append((first, last, unit))

    def unit_of(self, position: int, name: str):
        if name in self.moved:
            return self.moved[name]
        i = bisect.bisect_right(self.spans, (position, float("inf"))) - 1
        if i >= 0 and self.spans[i][0] <= position < self.spans[i][1]:
            return self.spans[i][2]
        return None


def _saved(forward_ops, seed, consumer_unit, unit):
    """{tensor name: (bytes, units consuming it)} of a forward's saved activations."""
    derived, saved, unknown = {seed.name}, {}, 0
    for op in forward_ops:
        if op.name != seed.name and not any(t.op.name in derived for t in op.inputs):
            continue
        derived.add(op.name)
        for t in op.outputs:
            users = {consumer_unit(c) for c in t.consumers()}
            users = {u for u in users if u and u[0] != "F" and u[1:] == unit[1:]}
            if not users:
                continue
            size = t.shape.num_elements() if t.shape.is_fully_defined() else None
            if size is None:
                unknown += 1
                continue
            saved[t.name] = (size * t.dtype.size, users)
    return saved, unknown


def peak_bytes(graph, regions: Regions, orders, device_of_group) -> tuple[dict[int, int], int]:
    """({device index: peak bytes of saved activations}, count of tensors of unknown size)."""
    ops = graph.get_operations()
    position = {op.name: i for i, op in enumerate(ops)}

    def consumer_unit(op):
        return regions.unit_of(position.get(op.name, -1), op.name)

    saved, unknown = {}, 0
    for first, last, unit in regions.spans:
        if unit[0] == "F" and unit in regions.seeds:
            saved[unit], missing = _saved(ops[first:last], regions.seeds[unit], consumer_unit, unit)
            unknown += missing
    peaks = {}
    for d, order in enumerate(orders):
        live, peak, pending = 0, 0, {}
        for unit in order:
            if unit[0] == "F":
                for name, (size, users) in saved.get(unit, {}).items():
                    pending[name] = [size, set(users)]
                    live += size
                peak = max(peak, live)
                continue
            for name in list(pending):
                pending[name][1].discard(unit)
                if not pending[name][1]:
                    live -= pending.pop(name)[0]
        peaks[d] = peak
    return peaks, unknown
