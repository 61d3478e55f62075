"""Keras 3's optimizer update under a tf.distribute strategy, made the one-device update.

Keras's `BaseOptimizer._backend_apply_gradients` clips, decays and updates, and only then,
inside `_backend_update_step`, sums the gradients across replicas. Three things go wrong
with more than one replica, and a fourth on any:

1. Clipping (`global_clipnorm`, `clipnorm`, `clipvalue`) sees each replica's share of the
   gradient, not the sum: on 2 replicas fit ended 1.5e-2 to 8e-2 away from one device.
2. `gradient_accumulation_steps` puts the update inside a `cond`, and `use_ema` its
   overwrite: a strategy that synchronises through `merge_call` (MirroredStrategy,
   MultiWorkerMirroredStrategy on CPUs) cannot reach it from there ("`merge_call` called
   while defining a new graph").
3. A sparse (embedding) gradient reaches the clip with one row per token occurrence, so the
   clip's norm counts a repeated row's parts apart (measured 7.49 for a true 10.20), on one
   device too.
4. Adam-family optimizers square such rows before they are summed (see docs/keras_fixes.md).

`apply_gradients` below, installed by tfpar.strategy.keras_fixes, sums first: one
all-reduce of the replicas' gradients (the optimizer's own `_all_reduce_sum_gradients`, so a
`compress_fit` compression still takes its place), then a sparse gradient's repeated rows
summed, then Keras's own clip, weight decay and update with its all-reduce off. Where
accumulation or EMA needs a `cond` under a merge-call strategy, the `cond` runs in the
cross-replica context and calls back into every replica (what Keras's own
LossScaleOptimizer does for its finiteness check); the arithmetic is Keras's.

Example:
    >>> keras_fixes.apply()      # installs apply_gradients on Keras's TFOptimizer
    >>> model.compile(optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0,
    ...                                                gradient_accumulation_steps=4))
    >>> model.fit(...)           # under mirrored: one device's numbers
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from tfpar.strategy.replicas import communicates

SUM_SPARSE_ROWS = [True]  # keras_fixes.set_sum_sparse_rows switches it

#: What `apply_gradients` relies on inside Keras's optimizer (checked before it is installed).
KERAS_NAMES = ("_all_reduce_sum_gradients", "_clip_gradients", "_apply_weight_decay",
               "_backend_update_step", "_backend_increment_gradient_accumulators",
               "_accumulated_gradients", "_get_variable_index", "_iterations",
               "_model_variables_moving_average", "ema_momentum", "ema_overwrite_frequency")


def sum_repeated_rows(gradient):
    """A sparse gradient with one row per index (repeated rows summed); others unchanged.

    Example:
        >>> g = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([0, 0, 2]), tf.constant([4, 2]))
        >>> sum_repeated_rows(g).indices      # [0, 2], values [[2, 2], [1, 1]]
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)


@contextlib.contextmanager
def sparse_rows_summed(enabled: bool):
    """Within the block (while a step is traced), repeated rows are summed or not."""
    saved = SUM_SPARSE_ROWS[0]
    SUM_SPARSE_ROWS[0] = bool(enabled)
    try:
        yield
    finally:
        SUM_SPARSE_ROWS[0] = saved


def _summed_already(optimizer):
    """Keras's all-reduce is an identity within the block, for this instance, in this
    replica's thread only (`make_all_reduce`; an instance attribute swapped here would be
    read by a replica thread that has not summed yet)."""
    from tfpar.strategy import private_api  # pylint: disable=import-outside-toplevel

    return private_api.summed_in_this_thread(optimizer)


def make_all_reduce(original):
    """`_all_reduce_sum_gradients` that is an identity where `_backend_apply_gradients`
    summed already (in this replica's thread)."""
    from tfpar.strategy import private_api  # pylint: disable=import-outside-toplevel

    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        if private_api.is_summed_in_this_thread(self):
            return list(grads_and_vars)
        return original(self, grads_and_vars)

    return _all_reduce_sum_gradients


def _is_parameter_server(strategy) -> bool:
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def _synchronises_by_merge_call(context) -> bool:
    return (communicates(context) and not _is_parameter_server(context.strategy)
            and not tf.__internal__.distribute.strategy_supports_no_merge_call())


def make_apply_gradients(original):
    """`_backend_apply_gradients` that sums across replicas and per row first (see module)."""

    @functools.wraps(original)
    def _backend_apply_gradients(self, grads, trainable_variables):
        context = tf.distribute.get_replica_context()
        if context is None:  # cross-replica (Keras's stateless paths): nothing to mend
            return original(self, grads, trainable_variables)
        grads_and_vars = list(zip(grads, trainable_variables))
        if not _is_parameter_server(context.strategy):  # one replica too: compress_fit's hook
            grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        if SUM_SPARSE_ROWS[0]:
            grads = [sum_repeated_rows(g) for g in grads]
        with _summed_already(self):
            if (self.gradient_accumulation_steps or self.use_ema) and _synchronises_by_merge_call(context):
                return _apply_with_conds_across_replicas(self, context, grads, trainable_variables)
            return original(self, grads, trainable_variables)

    return _backend_apply_gradients


def _apply_with_conds_across_replicas(optimizer, context, grads, variables) -> None:
    """Keras's `_backend_apply_gradients` for accumulation and EMA, each `cond` built in the
    cross-replica context (the gradients are summed already: every replica holds the same)."""
    if optimizer.gradient_accumulation_steps:
        _accumulate(optimizer, context, grads, variables)
    else:
        _update(optimizer, grads, variables)
    if optimizer.use_ema:
        context.merge_call(lambda strategy: _moving_average(strategy, optimizer))


def _update(optimizer, grads, variables) -> None:
    grads = optimizer._clip_gradients(grads)  # pylint: disable=protected-access
    optimizer._apply_weight_decay(variables)  # pylint: disable=protected-access
    optimizer._backend_update_step(grads, variables, optimizer.learning_rate)  # pylint: disable=protected-access


def _accumulate(optimizer, context, grads, variables) -> None:
    """Every `steps`-th call updates with the mean of the last `steps` gradients (Keras's math);
    the others add to the accumulators."""
    # pylint: disable=protected-access
    steps = optimizer.gradient_accumulation_steps
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]
    is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)

    def update(grads):  # a replica thread of its own (call_for_each_replica): summed already there too
        with _summed_already(optimizer):
            _update(optimizer, [(g + a) / steps for g, a in zip(grads, accumulators)], variables)

    def add(grads):
        optimizer._backend_increment_gradient_accumulators(grads, accumulators)

    def across_replicas(strategy, is_update_step, grads):
        def update_and_reset():
            strategy.extended.call_for_each_replica(update, args=(grads,))
            for accumulator in accumulators:  # cross-replica: every copy, once
                _per_copy(strategy, accumulator, lambda copy: copy.assign(tf.zeros_like(copy)))
            return tf.constant(True)

        def accumulate():
            strategy.extended.call_for_each_replica(add, args=(grads,))
            return tf.constant(False)

        tf.cond(strategy.experimental_local_results(is_update_step)[0], update_and_reset, accumulate)

    context.merge_call(across_replicas, args=(is_update_step, grads))


def _per_copy(strategy, variable, fn, *args) -> None:
    """`fn(copy, *arg copies)` on each replica's copy of `variable` (cross-replica context),
    each reading its own replica's copies of `args`: right where the copies differ (a
    tensor-parallel model's split weights and their slots, each copy a shard), the same as
    one write to every copy where they do not."""
    unwrap = lambda v: getattr(v, "value", v)  # noqa: E731  (a Keras variable's tf.Variable)
    strategy.extended.update(unwrap(variable), fn, args=tuple(unwrap(a) for a in args), group=False)


def _moving_average(strategy, optimizer) -> None:
    """Keras's EMA update and its periodic overwrite, in the cross-replica context, each
    replica's copy from its own copies (`_per_copy`)."""
    # pylint: disable=protected-access
    step = optimizer.iterations  # before apply's increment, as Keras reads it
    momentum = tf.cast(tf.not_equal(step, 0), tf.float32) * optimizer.ema_momentum
    pairs = list(zip(optimizer._trainable_variables, optimizer._model_variables_moving_average))
    for variable, average in pairs:
        if average is not None:
            decay = tf.cast(momentum, average.dtype)
            _per_copy(strategy, average, lambda copy, weight, decay=decay: copy.assign(
                decay * copy + (1 - decay) * tf.cast(weight, copy.dtype)), variable)
    if not optimizer.ema_overwrite_frequency:
        return

    def overwrite():
        for variable, average in pairs:
            if average is not None:
                _per_copy(strategy, variable, lambda copy, mean: copy.assign(tf.cast(mean, copy.dtype)), average)
        return tf.constant(True)

    due = tf.equal((step + 1) % optimizer.ema_overwrite_frequency, 0)
    tf.cond(due, overwrite, lambda: tf.constant(False))
