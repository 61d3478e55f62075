"""Asynchronous parameter-server training: the ClusterCoordinator side of tfpar.Trainer.

Under `parameter_server` the chief runs no training step itself. It schedules train
functions onto the workers with `tf.distribute.coordinator.ClusterCoordinator`; each
worker reads the variables from the parameter servers, computes its gradients and applies
them there, without waiting for the other workers (a variable split over several
parameter servers is updated through `tfpar.strategy.private_api.trainer_step`). A
worker that dies has its scheduled function run again elsewhere; when it comes back, the
coordinator rebuilds its dataset iterator and gives it work again.

Example:
    >>> steps = AsyncSteps(strategy)
    >>> iterator = iter(steps.per_worker_dataset(lambda: make_dataset()))
    >>> steps.run(train_fn, iterator, chunks=[10] * 60, on_done=lambda n, loss: print(n, loss))
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable

import tensorflow as tf

from tfpar.strategy import private_api
from tfpar.strategy.describe import describe

#: How long `fetch` waits for a function whose worker died before its result reached the
#: chief to have run again on another worker.
REFETCH_PATIENCE_S = 300.0


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


class AsyncSteps:
    """Schedules train functions on the workers and reports each one as it finishes.

    At most `in_flight` functions are scheduled at once (default: two per worker), so the
    workers never wait for the chief and the chief reports progress in order.
    """

    def __init__(self, strategy: tf.distribute.Strategy, in_flight: int | None = None):
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self.in_flight = in_flight or 2 * describe(strategy).num_workers

    def per_worker_dataset(self, dataset_fn: Callable[[], tf.data.Dataset]):
        """One copy of `dataset_fn()`'s dataset on every worker (rebuilt after a failure)."""
        return self.coordinator.create_per_worker_dataset(dataset_fn)

    def run(self, function, iterator, chunks: Iterable[int],
            on_done: Callable[[int, float], None]) -> None:
        """Schedules `function(iterator, n)` for each n in `chunks`; calls `on_done(n, result)`
        in scheduling order as results arrive. Returns when every function has finished."""
        pending: collections.deque = collections.deque()
        for n in chunks:
            pending.append((n, self.coordinator.schedule(function, args=(iterator, tf.constant(n)))))
            while len(pending) >= self.in_flight:
                done, value = pending.popleft()
                on_done(done, float(fetch(value)))
        while pending:
            done, value = pending.popleft()
            on_done(done, float(fetch(value)))


def fetch(value, patience_s: float = REFETCH_PATIENCE_S):
    """`value.fetch()`, surviving a worker that dies between finishing the function and
    handing its result to the chief.

    The coordinator marks a result ready before it copies it to the chief; when the worker
    dies in between, the copy fails on the chief (UnavailableError) while the coordinator
    puts the function back and runs it on a live worker. This waits for that result. A
    function that failed for good (a parameter server lost, an error in the step) raises
    at once, as `fetch()` does.

    Example:
        >>> loss = fetch(coordinator.schedule(train_fn, args=(iterator,)))
    """
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return value.fetch()
        except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError):
            if private_api.remote_value_failed(value) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the coordinator is putting the function back on a live worker
