"""What compression="auto" measures at build, bounded whatever the model, and agrees on.

- `from_replica_0`: replica 0's numbers on every replica and worker (one small all-reduce).
- `planned`: a candidate's build (plan and refusals) without making its state.
- `run_ratio`: a candidate's link bytes over a run, each phase for its share, / float32's.
- `link_seconds`: a float32 all-reduce of the gradient, from timings of at most 4 MB.
- `compute_seconds`: forward + backward, from a proxy of at most 4M weights and 2 GFLOP.

Example:
    >>> link_s, latency_s = link_seconds(strategy, size=25_000_000)
    >>> compute_s = compute_seconds(model.trainable_variables, tokens=4096)
"""

from __future__ import annotations

import time
import types
from typing import Callable, Sequence

import tensorflow as tf

from tfpar.compression import accounting
from tfpar.compression.compressed_aggregator import Compression

LINK_PROBE_FLOATS = 1 << 20      # the largest all-reduce timed at build: 4 MB
PROXY_WEIGHTS = 4 << 20          # the compute proxy's weights, at most (16 MB)
PROXY_FLOPS = 2e9                # its work per call
PROXY_MATRICES = 32              # and its matrices


def communicates(strategy) -> bool:
    return strategy.num_replicas_in_sync > 1 or getattr(strategy.extended, "_num_workers", 1) > 1


def from_replica_0(strategy, values: Callable[[int], list]) -> list[float]:
    """`values(replica_id)` as replica 0 has them, the same on every replica and worker: one
    float32 SUM all-reduce of a few numbers to which only replica 0 contributes."""
    if not communicates(strategy):
        return [float(v) for v in values(0)]
    local = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(values(context.replica_id_in_sync_group), tf.float32))

    def first(value):
        context = tf.distribute.get_replica_context()
        mine = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value * mine)

    agreed = [t.numpy().tolist() for t in strategy.experimental_local_results(
        tf.function(lambda v: strategy.run(first, args=(v,)))(local))]
    assert all(a == agreed[0] for a in agreed), agreed  # an all-reduce gives every replica the sum
    return agreed[0]


def planned(compression: Compression, variables) -> None:
    """Runs `compression`'s build, plan and refusals included, without making its state:
    each variable it creates is only its shape (no memory kept, no collective)."""
    def shape_only(next_creator, **kwargs):
        del next_creator
        initial = kwargs["initial_value"]
        initial = initial() if callable(initial) else initial
        return types.SimpleNamespace(shape=tf.TensorShape(initial.shape), dtype=initial.dtype)

    with tf.variable_creator_scope(shape_only):
        compression._build_state(variables)  # pylint: disable=protected-access


def _link_bytes(report: dict, replicas: int) -> float:
    """Bytes a worker transmits for `payload_bytes`' report: gathers send theirs R - 1 times,
    an all-to-all (R - 1) / R, an all-reduce 2 (R - 1) / R (accounting.LINK_FACTORS)."""
    def kind(key: str) -> str:
        return ("gather" if key in ("all_gather", "(size exchange)")
                else "all_to_all" if key == "all_to_all" else "reduce")
    return sum(accounting.LINK_FACTORS[kind(k)](replicas) * b for k, b in report.items())


def run_ratio(compression: Compression, variables, steps: int, replicas: int) -> float:
    """Link bytes over `steps` steps, each phase for its share, / float32's (at 2 replicas
    where fewer run: a given link time)."""
    replicas = max(replicas, 2)
    cuts = [0, *(b for b in compression.boundaries() if 0 < b < steps), steps]
    sent = sum((end - start) * _link_bytes(compression.payload_bytes(variables, compression.phase(start)), replicas)
               for start, end in zip(cuts, cuts[1:]))
    fp32 = 4 * sum(int(v.shape.num_elements()) for v in variables)
    return sent / (steps * _link_bytes({"all_reduce": fp32}, replicas))


def _median_seconds(run, repeats: int = 3) -> float:
    """Median wall seconds of `repeats` calls of `run`, after one untimed call (the trace)."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _time_all_reduce(strategy, size: int) -> float:
    """Seconds of one SUM all-reduce of `size` float32 (median of 3: a single one varied
    1.5x on a shaped link)."""
    @tf.function
    def reduce():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.ones([size]))[:1])

    return _median_seconds(lambda: [t.numpy() for t in strategy.experimental_local_results(reduce())])


def link_seconds(strategy, size: int) -> tuple[float, float]:
    """(seconds of a float32 all-reduce of `size` entries, the latency part of them): a
    latency + seconds per entry fitted through timings at min(size, LINK_PROBE_FLOATS) and
    1/16 of that."""
    large = min(size, LINK_PROBE_FLOATS)
    small = max(1, large // 16)
    t_small, t_large = _time_all_reduce(strategy, small), _time_all_reduce(strategy, large)
    per_entry = max(t_large - t_small, 0.0) / max(large - small, 1)
    latency = max(t_small - per_entry * small, 0.0)
    return latency + per_entry * size, latency


def proxy_plan(shapes: Sequence[tuple[int, int]], tokens: int) -> tuple[list, int, float]:
    """(the [n, m] matrices the compute proxy multiplies, its rows, the factor that scales
    its time to the model's `shapes` at `tokens` rows): the first matrices, a first one too
    large cut to a piece, at most PROXY_MATRICES of them, PROXY_WEIGHTS weights and PROXY_FLOPS
    of work.

    Example:
        >>> proxy_plan([(8192, 8192)] * 96, tokens=4096)   # 6.4B weights: one 2048 x 2048 piece
        ([(2048, 2048)], 79, 79638.7...)
    """
    sampled, weights = [], 0
    for n, m in shapes[:PROXY_MATRICES]:
        if n * m > PROXY_WEIGHTS - weights:
            if sampled:
                break
            n = min(n, 2048)  # the first matrix alone is too large: a piece of it
            m = min(m, PROXY_WEIGHTS // n)
        sampled.append((n, m))
        weights += n * m
    rows = int(max(1, min(tokens, PROXY_FLOPS // (6 * weights))))
    return sampled, rows, (tokens / rows) * sum(n * m for n, m in shapes) / weights


def compute_seconds(variables: Sequence[tf.Variable], tokens: int) -> float:
    """Seconds of a forward + backward proxy: a [rows, n] x [n, m] product and its two
    backward products per matrix, on `proxy_plan`'s share of the model, scaled up."""
    shapes = [(int(v.shape[0]), int(v.shape.num_elements()) // int(v.shape[0]))
              for v in variables if v.shape.rank and v.shape.rank >= 2]
    if not shapes:
        return 0.0
    sampled, rows, scale = proxy_plan(shapes, tokens)
    # inputs are arguments: products of constants inside the function are folded by grappler
    # at trace time, which timed 1 ms for gpt_wide's 95 ms step
    inputs = [(tf.random.normal([rows, n]), tf.random.normal([n, m])) for n, m in sampled]

    @tf.function
    def proxy(inputs):
        total = tf.constant(0.0)
        for x, w in inputs:
            y = tf.matmul(x, w)
            total += tf.reduce_sum(tf.matmul(y, w, transpose_b=True)) + tf.reduce_sum(tf.matmul(x, y, transpose_a=True))
        return total

    return _median_seconds(lambda: float(proxy(inputs))) * scale
