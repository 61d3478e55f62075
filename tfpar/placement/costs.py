"""Per-stage costs to balance a plan by: FLOPs (counted) or seconds (measured).

Both take a sample batch, push it through the stages in order to get each stage's input,
and return {stage name: cost}, which `balanced(model, devices, cost=...)` accepts.

Example:
    >>> plan = balanced(model, ["/gpu:0", "/gpu:1"], cost=costs.seconds(model, x))
"""

from __future__ import annotations

import math
import statistics
import time

import tensorflow as tf
from tensorflow.python.framework import ops

from tfpar.placement.plan import PlacementError


def stage_inputs(model, x) -> list[tuple[str, object, tf.Tensor]]:
    """(name, layer, its input) for every stage, from running `x` through the chain."""
    if not hasattr(model, "stages"):
        raise PlacementError(f"{type(model).__name__} has no stages(); costs need a StagedModel.")
    found, h = [], tf.convert_to_tensor(x)
    for name, layer in model.stages():
        found.append((name, layer, h))
        h = layer(h, training=False)
    return found


def _wait(gradients) -> None:
    """Blocks until every gradient is computed (the embedding's come as IndexedSlices)."""
    for t in tf.nest.flatten(gradients, expand_composites=True):
        t.numpy()


def _forward_backward(layer):
    @tf.function
    def run(h):
        with tf.GradientTape() as tape:
            if h.dtype.is_floating:
                tape.watch(h)
            # the sum inside the tape: outside it the gradients are None, the backward is
            # pruned and only the forward is counted (or, timed, nothing: the graph is empty)
            total = tf.reduce_sum(tf.cast(layer(h, training=True), tf.float32))
        sources = list(layer.trainable_variables) + ([h] if h.dtype.is_floating else [])
        return tape.gradient(total, sources)
    return run


def seconds(model, x, repeats: int = 5) -> dict[str, float]:
    """Median wall time of one forward + backward of each stage (traced once, then timed
    `repeats` times), on the device it is on now."""
    costs = {}
    for name, layer, h in stage_inputs(model, x):
        run = _forward_backward(layer)
        _wait(run(h))  # trace, warm
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _wait(run(h))
            times.append(time.perf_counter() - start)
        costs[name] = statistics.median(times)
    return costs


def flops(model, x) -> dict[str, float]:
    """Forward + backward floating-point operations of each stage, counted on the traced
    graph of `x`'s shapes: TensorFlow's registered count per op (ops without one add
    nothing: matrix products dominate), except batched matrix products and two-operand
    einsums (attention's scores; no count registered), counted here from their shapes.

    TensorFlow's count for BatchMatMulV2 is wrong for the einsums of Keras attention (3.3x
    at width 256, 8.7x at 768, growing with the width), which made attention stages look
    several times heavier than MLP stages.
    """
    costs = {}
    for name, layer, h in stage_inputs(model, x):
        graph = _forward_backward(layer).get_concrete_function(
            tf.TensorSpec(h.shape, h.dtype)).graph
        costs[name] = float(sum(_op_flops(graph, op) for op in graph.get_operations()))
    return costs


def _op_flops(graph, op) -> float:
    """FLOPs of one op of a traced graph (0 where its shapes or its count are unknown)."""
    if op.type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a, b = (t.shape for t in op.inputs[:2])
        if not (a.is_fully_defined() and b.is_fully_defined()):
            return 0.0
        rows, inner = (a[-1], a[-2]) if op.get_attr("adj_x") else (a[-2], a[-1])
        cols = b[-2] if op.get_attr("adj_y") else b[-1]
        batch = math.prod(op.outputs[0].shape[:-2])  # the batch dims, broadcast
        return 2.0 * batch * rows * inner * cols
    if op.type == "Einsum" and len(op.inputs) == 2:  # no count registered: 2 x every label's size
        inputs, _ = op.get_attr("equation").decode().replace(" ", "").split("->")
        sizes = {}
        for labels, tensor in zip(inputs.split(","), op.inputs):
            if "." in labels or not tensor.shape.is_fully_defined():
                return 0.0
            sizes.update(zip(labels, tensor.shape))
        return 2.0 * math.prod(sizes.values())
    try:  # an op type without a registered count gives None
        return float(ops.get_stats_for_node_def(graph, op.node_def, "flops").value or 0)
    except ValueError:  # a registered count that needs shapes the graph does not know
        return 0.0
