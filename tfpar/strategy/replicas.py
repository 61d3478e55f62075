"""Questions about the replica context a step runs in.

Example:
    >>> context = tf.distribute.get_replica_context()
    >>> communicates(context)      # True: a collective here reaches another replica
"""

from __future__ import annotations


def multi_worker(context) -> bool:
    """Whether the replica context's strategy spans several workers."""
    return spans_workers(context.strategy)


def spans_workers(strategy) -> bool:
    """Whether the strategy's replicas live in several worker processes."""
    return getattr(strategy.extended, "_num_workers", 1) > 1


def communicates(context) -> bool:
    """Whether a collective in this replica context reaches another replica."""
    return context.num_replicas_in_sync > 1 or multi_worker(context)


def count_failed_workers(strategy, failed: bool) -> int:
    """A barrier every worker reaches (one small all-reduce): how many workers said
    `failed` (a checkpoint file of its own it could not write, say)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    share = (1.0 if failed else 0.0) / len(strategy.extended.worker_devices)  # per local replica
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(share)), axis=None)
    return int(round(float(total)))
