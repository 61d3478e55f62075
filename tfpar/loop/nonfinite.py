"""What a step with NaN or Inf gradients does: stop naming it, skip its update, or nothing.

The check reads the global norm of the aggregated gradients, identical on every replica,
so every replica takes the same branch. Per `steps_per_loop` call the guard counts the bad
steps and remembers the first (per-replica ON_READ copies, replica 0's read); the host
then raises or counts.

Example:
    >>> guard = NonFiniteGuard("skip")          # built under strategy.scope()
    >>> guard.apply(optimizer, grads, variables, index)   # in the replica step
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfpar.compression import accounting
from tfpar.errors import NonFiniteError
from tfpar.aggregation import communicates

POLICIES = ("stop", "skip", "ignore")


class NonFiniteGuard:
    """`policy`: stop | skip | ignore (see tfpar.loop.Trainer)."""

    def __init__(self, policy: str):
        self.policy, self.skipped_steps = policy, 0
        self._bad_steps, self._first_bad = (tf.Variable(
            0.0, trainable=False, name=name, synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) for name in ("bad_steps", "first_bad"))

    @property
    def variables(self) -> tuple:
        """Per-call state, reset to 0 on every replica at the start of a call."""
        return self._bad_steps, self._first_bad

    def apply(self, optimizer, grads, variables, index, norm=None) -> None:
        """Replica context: notes whether `grads` are finite (by their global `norm`, computed
        here unless given), then applies the update unless the policy skips a bad one."""
        if self.policy == "ignore":
            optimizer.apply(grads, variables)
            return
        finite = tf.math.is_finite(tf.linalg.global_norm(grads) if norm is None else norm)
        self.note(finite, index)
        if self.policy == "skip":
            _apply_if(optimizer, finite, grads, variables)
        else:
            optimizer.apply(grads, variables)

    def note(self, finite, index) -> None:
        """Replica context: counts step `index` (of this call) as bad unless `finite`, a
        flag every replica agrees on (the sharded update applies the policy itself)."""
        bad = 1.0 - tf.cast(finite, tf.float32)
        first = tf.where((self._first_bad == 0.0) & (bad > 0), tf.cast(index, tf.float32) + 1.0,
                         self._first_bad)
        self._first_bad.assign(first)
        self._bad_steps.assign_add(bad)

    def read(self):
        """Cross-replica context: (bad steps, first bad step from 1) of this call."""
        return self._bad_steps.read_value(), self._first_bad.read_value()

    def after_call(self, bad, first, step: int) -> None:
        """Host side, after a call that started at optimizer step `step`."""
        bad = int(bad)
        if bad and self.policy == "stop":
            raise NonFiniteError.at(str(step + int(first)),
                                    "the gradients (or the loss) are NaN or Inf",
                                    "optimizer.clip_norm / global_clipnorm", "use nonfinite='skip'")
        self.skipped_steps += bad


def _apply_if(optimizer, finite, grads, variables) -> None:
    """optimizer.apply only when `finite` (the same on every replica). Keras's optimizer
    merge_calls to the cross-replica context, which cannot happen inside a tf.cond branch
    built in a replica context; so, as Keras's LossScaleOptimizer does, the cond runs in the
    cross-replica context and calls back into every replica."""
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(finite, lambda: (optimizer.apply(grads, variables), tf.constant(True))[1],
                lambda: tf.constant(False))
        return

    def cross_replica(strategy, finite, grads):
        def update():
            strategy.extended.call_for_each_replica(lambda g: optimizer.apply(g, variables), args=(grads,))
            return tf.constant(True)
        tf.cond(strategy.experimental_local_results(finite)[0], update, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite, grads))


class SkippedStepState:
    """Keeps a stateful aggregator's state (error feedback, a compressor's moments) as it was
    before a step that is then skipped (`nonfinite="skip"`, or fp16's loss scale). Otherwise
    one NaN gradient enters the error feedback, every later sum is NaN and every later step
    is skipped.

    Whether every replica's own gradients are finite is agreed by one scalar all-reduce: a
    compressed sum can be finite with a NaN left behind in one replica's residual (a top-k
    that does not send it, a 1-bit Adam step that exchanges nothing). Where they are not, or
    the sum is not, every replica puts its state back to what it read before the aggregator
    ran and returns a NaN sum, so the step is skipped everywhere: it never happened.

    With no variables it only agrees (nonfinite="stop": the run ends at that step, so there
    is nothing to put back).

    Example:
        >>> keep = SkippedStepState(compression.state_variables())
        >>> saved = keep.save(grads)                          # replica context
        >>> summed = keep.restore_if_skipped(compression(grads, variables), saved)
    """

    def __init__(self, variables: Sequence[tf.Variable]):
        self.variables = tuple(variables)

    def save(self, grads: Sequence) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """(whether every replica's gradients are finite, the state's values now)."""
        context = tf.distribute.get_replica_context()
        bad = 1.0 - tf.cast(_finite(grads), tf.float32)
        if communicates(context):
            with tf.name_scope(accounting.CHECK_SCOPE):  # wire_bytes names its bytes apart
                bad = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)
        return tf.equal(bad, 0.0), [tf.identity(v.read_value()) for v in self.variables]

    def restore_if_skipped(self, summed: Sequence, saved: tuple) -> list:
        """`summed`, or NaN where the step is skipped (the state then put back as saved)."""
        all_finite, before = saved
        keep = tf.logical_and(all_finite, _finite(summed))

        def restore():
            for variable, old in zip(self.variables, before):
                variable.assign(old)
            return tf.constant(False)

        tf.cond(keep, lambda: tf.constant(True), restore)
        return [None if g is None else _nan_unless(keep, g) for g in summed]


def _finite(tensors: Sequence) -> tf.Tensor:
    return tf.math.is_finite(tf.linalg.global_norm([t for t in tensors if t is not None]))


def _nan_unless(finite, gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_nan_unless(finite, gradient.values), gradient.indices, gradient.dense_shape)
    return tf.where(finite, gradient, tf.constant(float("nan"), gradient.dtype))
