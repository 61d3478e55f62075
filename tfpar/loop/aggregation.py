"""The gradient-aggregation seam of tfpar's loop.

An aggregator receives this replica's gradients in the replica context and returns the
gradients summed over all replicas. The Trainer calls it exactly once per step and then
applies the optimizer in the cross-replica context, where Keras does not all-reduce again.
Gradient compression (tfpar.compression) plugs in here.

Example:
    >>> class Mine(GradientAggregator):
    ...     def __call__(self, gradients, variables):
    ...         ctx = tf.distribute.get_replica_context()
    ...         return ctx.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
"""

from __future__ import annotations

import abc
from typing import Sequence

import tensorflow as tf

from tfpar.compression.aggregation import densify_if_smaller


class GradientAggregator(abc.ABC):
    """Base class: per-replica gradients in, summed gradients out (replica context)."""

    @abc.abstractmethod
    def __call__(self, gradients: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
        """Returns the gradients summed over all replicas, in the same order."""


class AllReduce(GradientAggregator):
    """One batched SUM all-reduce of every gradient: what tf.distribute itself does, except
    that a sparse gradient with as many rows as its variable is sent dense (smaller)."""

    def __call__(self, gradients, variables):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1 and not _multi_worker(context):
            return list(gradients)
        gradients = [densify_if_smaller(g, v) for g, v in zip(gradients, variables)]
        return context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)


class NoReduce(GradientAggregator):
    """No collective: each worker applies its own gradients (parameter-server training)."""

    def __call__(self, gradients, variables):
        return list(gradients)


def _multi_worker(context) -> bool:
    return getattr(context.strategy.extended, "_num_workers", 1) > 1
