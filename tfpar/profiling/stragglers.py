"""Every worker's own step time, gathered: the slowest worker, its lag, per-worker scalars.

In a synchronous step every worker waits for the slowest at the gradients' all-reduce, so
the wall time of a step is the same everywhere and names no one. What differs is each
worker's own part: from the start of its step (before it reads its batch) to its
gradients being ready, before any wait on the others. `StepTimer` adds that up in the
step (two `tf.timestamp` ops per step and replica, only when on); `StragglerWatch`
gathers one number per worker per log interval with one tiny all-reduce.

Example:
    >>> watch = StragglerWatch(strategy, workers=2, worker=task_id)
    >>> watch.gather(local_ms)           # [212.0, 318.5]: worker 1 is 50% slower
"""

from __future__ import annotations

import statistics

import tensorflow as tf

THRESHOLD = 0.1  # a worker this much slower than the median is named in the progress line


class StepTimer:
    """Per replica, the seconds of its own work in the steps so far (see the module
    docstring): `start()` as the step begins, `ready(started, gradients)` when its
    gradients are computed, before the all-reduce."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self.strategy = strategy
        with strategy.scope():
            self.seconds = tf.Variable(0.0, trainable=False, name="tfpar_own_step_seconds", dtype=tf.float64,
                                       synchronization=tf.VariableSynchronization.ON_READ,
                                       aggregation=tf.VariableAggregation.SUM)

    def start(self) -> tf.Tensor:
        return tf.timestamp()

    def ready(self, started: tf.Tensor, gradients) -> None:
        waits = [g for g in tf.nest.flatten(gradients, expand_composites=True) if g is not None]
        with tf.control_dependencies(waits):
            self.seconds.assign_add(tf.timestamp() - started)

    def local_seconds(self) -> float:
        """This worker's own seconds so far: the mean over its replicas."""
        values = self.strategy.experimental_local_results(self.seconds)
        return float(sum(float(v) for v in values) / len(values))


class StragglerWatch:
    """Gathers one value per worker (every worker must call `gather` at the same point)."""

    def __init__(self, strategy: tf.distribute.Strategy, workers: int, worker: int):
        self.strategy, self.workers, self.worker = strategy, workers, worker
        self._exchange = tf.function(self._sum_rows)

    def _sum_rows(self, row):
        local = len(self.strategy.extended.worker_devices)
        with tf.name_scope("tfpar_stragglers"):  # named apart from the step's collectives
            per_replica = self.strategy.run(lambda: tf.identity(row) / local)
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def gather(self, value: float) -> list[float]:
        """Every worker's `value`, in worker order."""
        if self.workers == 1:
            return [value]
        row = [0.0] * self.workers
        row[self.worker] = value
        return [float(v) for v in self._exchange(tf.constant(row, tf.float32))]


def slowest(values: list[float], threshold: float = THRESHOLD) -> tuple[int, float] | None:
    """(worker, lag over the median in the values' unit) when the slowest worker is more
    than `threshold` slower than the median; None otherwise.

    Example:
        >>> slowest([200.0, 300.0, 205.0])
        (1, 95.0)
    """
    if len(values) < 2:
        return None
    median = statistics.median(values)
    worker = max(range(len(values)), key=values.__getitem__)
    lag = values[worker] - median
    return (worker, lag) if median > 0 and lag > threshold * median else None
