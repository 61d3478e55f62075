"""The user's Keras optimizer, run on this replica's shard of the parameters.

A copy of the optimizer (`from_config`, with the caller's learning rate or schedule and
step counter themselves) is built on one piece per variable (tfpar.zero.partitions):
Keras creates its slots (Adam's m and v, momentum, EMA averages) from those pieces, so each
replica holds 1/R of them, as per-replica (ON_READ) variables. Each step then does what
Keras's `apply` does, in the same order and with Keras's own arithmetic, on the pieces:
clip (with norms summed over the shards), decoupled weight decay (the variables the caller
excluded stay excluded: by variable, or by name matched against the variable's path, as
Keras's TensorFlow backend matches it), `update_step` per piece, the moving average, the
step counter.

Which optimizers: those whose update is elementwise (SGD, Adam, AdamW, Adamax, Nadam,
RMSprop, Adagrad, Adadelta, Lion, Ftrl: the update of an element reads only that element
and a few scalars), and LAMB, whose trust ratio ||w|| / ||update|| is per variable: each
replica sums the squares of its pieces and one all-reduce of 2 floats per variable gives
every replica the exact norms (up to the order of the sum). Refused, by name: Adafactor
(its second moment is factored over a matrix's rows and columns), Muon (orthogonalises each
whole matrix), ScheduleFreeAdamW (swaps the model's weights for evaluation), MultiOptimizer
and custom optimizers (their update may read the whole variable).

Example:
    >>> shard = PartitionedOptimizer(keras.optimizers.AdamW(1e-3, global_clipnorm=1.0))
    >>> shard.build(layout, model.trainable_variables)   # under strategy.scope()
    >>> shard.apply(grads, all_reduce)                   # replica context: the pieces move
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfpar.compression import clipping
from tfpar.errors import ShardingError
from tfpar.strategy import private_api

O = keras.optimizers
ELEMENTWISE = (O.SGD, O.Adam, O.AdamW, O.Adamax, O.Nadam, O.RMSprop, O.Adagrad, O.Adadelta,
               O.Lion, O.Ftrl)
LAYERWISE = (O.Lamb,)
WHY_NOT = {
    "Adafactor": "factors its second moment over each matrix's rows and columns, which a flat "
                 "shard does not have",
    "Muon": "orthogonalises each whole matrix (Newton-Schulz), which a shard is not",
    "ScheduleFreeAdamW": "swaps the model's weights for evaluation, which the shards cannot follow",
    "MultiOptimizer": "routes variables to several optimizers; shard each one's model apart",
    "OptimizerMap": "routes variables to several optimizers; shard each one's model apart",
}
SUPPORTED = ", ".join(c.__name__ for c in (*ELEMENTWISE, *LAYERWISE))


def check_optimizer(optimizer) -> None:
    """Raises ShardingError, naming why and what to do, for an optimizer the sharded update
    cannot run on its shard."""
    base = private_api.base_optimizer(optimizer)
    name = type(base).__name__
    if type(base) not in (*ELEMENTWISE, *LAYERWISE):
        why = WHY_NOT.get(name, "is not one tfpar knows to update element by element (a custom "
                                "update_step may read the whole variable)")
        raise ShardingError(f"shard cannot run {name} on a shard of the parameters: it {why}. "
                            f"Sharded optimizers: {SUPPORTED}; or train with shard='none'.")
    if base.gradient_accumulation_steps:
        raise ShardingError(
            f"shard with {name}(gradient_accumulation_steps={base.gradient_accumulation_steps}): "
            "the sharded update accumulates micro-batches itself, in the shard; use "
            "tfpar.Trainer(accumulate=K) (--config.train.accumulate=K), the same mean of K "
            "micro-batches, and leave gradient_accumulation_steps unset.")
    if base.loss_scale_factor is not None:
        raise ShardingError(f"shard with {name}(loss_scale_factor=...): use mixed_float16's "
                            "LossScaleOptimizer (dynamic loss scaling) or no loss scale.")


@contextlib.contextmanager
def _per_replica_variables():
    """Every variable made within is per replica (ON_READ): each replica its own value."""
    def creator(next_creator, **kwargs):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


class PartitionedOptimizer:
    """The user's optimizer (a LossScaleOptimizer's inner one under fp16) on the pieces.

    Attributes (after `build`): `pieces` (this replica's chunk of each variable: the working
    copy the update writes), `clone` (the optimizer built on them), `slot_of` (index in
    `clone.variables` -> variable index, for the slots made from a piece), `decays` (whether
    weight decay applies to each variable), `scale`/`growth` (fp16's dynamic loss scale).
    """

    def __init__(self, optimizer):
        check_optimizer(optimizer)
        self.optimizer, self.base = optimizer, private_api.base_optimizer(optimizer)
        self.loss_scaled = private_api.is_loss_scaled(optimizer)
        self.pieces, self.slot_of, self.decays, self.clone, self.variables = [], {}, [], None, []
        self.scale = self.counter = None
        self.own_variables = 0

    def build(self, layout, variables) -> None:
        """Under `strategy.scope()`: the pieces, the optimizer on them, fp16's scale."""
        self.clone = _copy(self.base)
        self.variables = list(variables)  # the model's: a checkpoint names them as Keras does
        self.own_variables = len(self.clone.variables)  # its counter (and rate): not the caller's
        # Keras's own decision, asked as its TensorFlow backend asks it: with the tf.Variable,
        # whose name is the variable's path (an exclusion by layer name matches there)
        self.decays = [private_api.uses_weight_decay(self.base, v) for v in variables]
        with _per_replica_variables():
            self.pieces = [tf.Variable(tf.zeros([c], d), trainable=False, name=f"shard_{i}")
                           for i, (c, d) in enumerate(zip(layout.chunks, layout.dtypes))]
            made = []
            original = self.clone.add_variable_from_reference

            def recording(reference, name=None, initializer="zeros"):
                variable = original(reference, name=name, initializer=initializer)
                made.append((variable, next(i for i, p in enumerate(self.pieces) if p is reference)))
                return variable

            object.__setattr__(self.clone, "add_variable_from_reference", recording)
            try:
                self.clone.build(self.pieces)
            finally:
                object.__delattr__(self.clone, "add_variable_from_reference")
            if self.loss_scaled:
                self.scale = tf.Variable(float(self.optimizer.initial_scale), trainable=False,
                                         name="dynamic_scale")
                self.counter = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="step_counter")
        index = {id(v): k for k, v in enumerate(self.clone.variables)}
        self.slot_of = {index[id(v)]: i for v, i in made}

    # -- the step (replica context) ----------------------------------------------------

    @property
    def iterations(self):
        return self.base.iterations

    def learning_rate(self) -> tf.Tensor:
        """The learning rate of this step (the schedule at the caller's step counter)."""
        return self.clone.learning_rate

    def clip(self, grads: list, norms: dict) -> list:
        """Keras's clipping with the norms of the whole gradient (`norms`: 'total' its squared
        global norm, 'each' each variable's squared norm, summed over the shards)."""
        base = self.base
        if base.clipnorm and base.clipnorm > 0:  # tf.clip_by_norm, with the whole variable's norm
            out = []
            for g, square in zip(grads, tf.unstack(norms["each"])):
                norm = tf.where(square > 0, tf.sqrt(tf.where(square > 0, square, 1.0)), square)
                out.append(tf.identity(g * base.clipnorm / tf.maximum(norm, base.clipnorm)))
            return out
        if base.global_clipnorm and base.global_clipnorm > 0:
            scale = clipping.factor(base.global_clipnorm, tf.sqrt(norms["total"]))
            return [g * scale for g in grads]
        if base.clipvalue and base.clipvalue > 0:
            return [tf.clip_by_value(g, -base.clipvalue, base.clipvalue) for g in grads]
        return list(grads)

    def apply(self, grads: list, updated: list, all_reduce) -> None:
        """Weight decay and the update on the pieces (they hold this replica's chunks);
        `updated[i]`: whether variable i has a gradient (Keras leaves the others alone)."""
        lr = self.learning_rate()
        for piece, decays, has in zip(self.pieces, self.decays, updated):
            if decays and has:  # Keras: variable.assign_sub(variable * wd * lr)
                piece.assign_sub(piece * tf.cast(self.base.weight_decay, piece.dtype) * tf.cast(lr, piece.dtype))
        if isinstance(self.clone, O.Nadam):
            self._nadam_product()
        pairs = [(g, p) for g, p, has in zip(grads, self.pieces, updated) if has]
        if isinstance(self.clone, O.Lamb):
            _lamb(self.clone, pairs, lr, all_reduce)
        else:
            for grad, piece in pairs:
                self.clone.update_step(grad, piece, lr)
        if self.base.use_ema:
            self._moving_average()

    def _nadam_product(self) -> None:
        """Nadam's once-a-step product (Keras's `Nadam._backend_update_step`)."""
        clone = self.clone
        dtype = clone._u_product.dtype  # pylint: disable=protected-access
        clone.assign(clone._u_product, clone._u_product * clone.beta_1 * (  # pylint: disable=protected-access
            1.0 - 0.5 * keras.ops.power(0.96, keras.ops.cast(clone.iterations + 1, dtype))))

    def _moving_average(self) -> None:
        """Keras's EMA on the pieces (1/R of the averages per replica), and its overwrite."""
        clone = self.clone
        clone._update_model_variables_moving_average(self.pieces)  # pylint: disable=protected-access
        if not clone.ema_overwrite_frequency:
            return

        def overwrite():
            for piece, average in zip(self.pieces, self.averages()):
                piece.assign(average)
            return tf.constant(True)

        due = tf.equal((clone.iterations + 1) % clone.ema_overwrite_frequency, 0)
        tf.cond(due, overwrite, lambda: tf.constant(False))

    def averages(self) -> list:
        """The EMA slots, one per piece (use_ema)."""
        return list(self.clone._model_variables_moving_average)  # pylint: disable=protected-access

    def update_scale(self, finite) -> None:
        """fp16: Keras's LossScaleOptimizer rule on an agreed `finite` (every replica the same)."""
        growth = self.optimizer.dynamic_growth_steps
        grow = tf.logical_and(finite, tf.equal(self.counter, growth - 1))
        counter = tf.where(tf.logical_and(finite, tf.logical_not(grow)), self.counter + 1,
                           tf.zeros_like(self.counter))
        scale = tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale), self.scale * 0.5)
        self.counter.assign(counter)
        self.scale.assign(scale)


def _copy(base):
    """A fresh optimizer with `base`'s configuration, its learning rate (or schedule) and
    its step counter themselves (so the schedule and the caller see one count)."""
    config = base.get_config()
    rate = base._learning_rate  # pylint: disable=protected-access
    if not isinstance(rate, tf.Variable) and not isinstance(rate, keras.Variable):
        # a schedule (or callable): a stand-in keeps from_config simple and makes no variable
        config["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 1.0)
    clone = type(base).from_config(config)
    object.__setattr__(clone, "_iterations", base._iterations)  # pylint: disable=protected-access
    object.__setattr__(clone, "_learning_rate", rate)
    return clone  # weight decay: its flags are read from `base` (PartitionedOptimizer.decays)


def _lamb(clone, pairs, lr, all_reduce) -> None:
    """Keras's `Lamb.update_step` for every piece, the two norms of each variable summed over
    its shards by one all-reduce of 2 floats per variable."""
    updates, squares = [], []
    step = keras.ops.cast(clone.iterations + 1, "float32")
    for grad, piece in pairs:
        dtype = piece.dtype
        beta_1_power = keras.ops.power(keras.ops.cast(clone.beta_1, dtype), step)
        beta_2_power = keras.ops.power(keras.ops.cast(clone.beta_2, dtype), step)
        m = clone._momentums[clone._get_variable_index(piece)]  # pylint: disable=protected-access
        v = clone._velocities[clone._get_variable_index(piece)]  # pylint: disable=protected-access
        grad = keras.ops.cast(grad, dtype)
        clone.assign_add(m, keras.ops.multiply(keras.ops.subtract(grad, m), 1 - clone.beta_1))
        clone.assign_add(v, keras.ops.multiply(keras.ops.subtract(keras.ops.square(grad), v), 1 - clone.beta_2))
        m_hat = keras.ops.divide(m, (1.0 - beta_1_power))
        v_sqrt = keras.ops.add(keras.ops.sqrt(keras.ops.divide(v, (1.0 - beta_2_power))), clone.epsilon)
        update = keras.ops.divide(m_hat, v_sqrt)
        updates.append(update)
        squares += [keras.ops.sum(keras.ops.power(piece, 2)), keras.ops.sum(keras.ops.power(update, 2))]
    if not pairs:
        return
    totals = tf.unstack(all_reduce(tf.stack(squares)))
    for k, ((_, piece), update) in enumerate(zip(pairs, updates)):
        w_norm, g_norm = keras.ops.sqrt(totals[2 * k]), keras.ops.sqrt(totals[2 * k + 1])
        ratio = keras.ops.where(keras.ops.greater(w_norm, 0),
                                keras.ops.where(keras.ops.greater(g_norm, 0), (w_norm / g_norm), 1.0), 1.0)
        clone.assign_sub(piece, ratio * keras.ops.cast(lr, piece.dtype) * update)
