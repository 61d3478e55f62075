"""Per-stage costs to balance a plan by: FLOPs (counted) or seconds (measured).

Both take a sample batch, push it through the stages in order to get each stage's input,
and return {stage name: cost}, which `balanced(model, devices, cost=...)` accepts.

Example:
    >>> plan = balanced(model, ["/gpu:0", "/gpu:1"], cost=costs.seconds(model, x))
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

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
    """Forward + backward floating-point operations of each stage, counted by TensorFlow's
    profiler on the traced graph of `x`'s shapes (ops without a registered count, like
    element-wise ones, add nothing: matrix products dominate)."""
    from tensorflow.python.profiler import model_analyzer, option_builder

    options = option_builder.ProfileOptionBuilder(
        option_builder.ProfileOptionBuilder.float_operation()).with_empty_output().build()
    costs = {}
    for name, layer, h in stage_inputs(model, x):
        graph = _forward_backward(layer).get_concrete_function(
            tf.TensorSpec(h.shape, h.dtype)).graph
        costs[name] = float(model_analyzer.profile(graph, options=options).total_float_ops)
    return costs
