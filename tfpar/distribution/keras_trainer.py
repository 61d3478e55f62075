"""Keras's own `fit`, `evaluate` and `predict` for a model split under keras.distribution.

Keras's trainer gives every replica its own slice of each global batch and sums every
gradient over all replicas: right for data parallelism, wrong for a split model, whose
replicas of one tensor-parallel group must see the same examples and whose split gradients
must not be summed across the group. So, the first time one of them is called on a model
that tfpar split under a keras.distribution (tfpar.distribution.enabled), the model is
prepared (once) instead of refused:

- its optimizer is one that trains split weights (tfpar.loop.tensor_parallel's allow-list),
  built now with its slots of split weights made shards too, and its cross-replica sum is
  tfpar's `TensorParallelSum` (split gradients over their data-parallel group, replicated
  ones over every replica, clipped by the whole gradient's norm);
- each step all-gathers the replicas' slices of the batch over their tensor-parallel group
  (the group's replicas held consecutive slices of one global batch: together, the group's
  batch), so each group trains on its batch, as `tfpar.data.distribute_train(...,
  tensor_parallel=T)` deals it; losses and metrics are means, the same with each example
  counted T times;
- `predict` keeps each group's predictions once (its first rank's; the others return none).

Example:
    >>> model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=...)   # under ModelParallel
    >>> model.fit(dataset)            # prepared on this first call
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from tfpar.strategy import private_api
from tfpar.tensor_parallel import layout_of, shard_slots
from tfpar.tensor_parallel.data import gather_group_batch

PREPARED = "_tfpar_keras_trainer_prepared"
SAID = "_tfpar_start_line_said"


def prepare_or_refuse(model):
    """Fix 3's check (tfpar.strategy.trainer_fixes): a split model of a tfpar-run
    keras.distribution is prepared for Keras's trainer; anything else is not this check's.
    A model of a tfpar-run distribution gets its start line said once (the plan; what
    becomes of weights laid out on the batch axis: fit keeps their state whole)."""
    plan = getattr(model.distribute_strategy, "_tfpar_plan", None)
    if plan is not None and not getattr(model, SAID, False):
        logging.info("tfpar: %s", plan.start_line(model, None, how="model.fit"))
        object.__setattr__(model, SAID, True)
    layout = layout_of(model)
    if layout is None or getattr(layout.strategy, "_tfpar_plan", None) is None:
        return None
    prepare(model, layout)
    return None


def prepare(model, layout) -> None:
    """Makes Keras's fit/evaluate/predict run `model` split over `layout` (see module
    docstring); idempotent.

    Raises:
      TensorParallelError: an optimizer that cannot train split weights, by name.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, PREPARED, None) is not model:
        from tfpar.loop.tensor_parallel import TensorParallelSum  # pylint: disable=import-outside-toplevel

        aggregator = TensorParallelSum(layout)
        aggregator.check_optimizer(optimizer)
        if not optimizer.built:
            with layout.strategy.scope():
                shard_slots(optimizer, model.trainable_variables, layout)

        def all_reduce(grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            summed = aggregator([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])
            return list(zip(summed, [v for _, v in grads_and_vars]))

        private_api.replace_all_reduce(optimizer, all_reduce)
        object.__setattr__(optimizer, PREPARED, model)
    if getattr(model, PREPARED, False):
        return
    _gather_batches(model, layout)
    object.__setattr__(model, PREPARED, True)


def _gather_batches(model, layout) -> None:
    """The model's train, test and predict steps take their group's whole batch."""
    train_step, test_step, predict_step = model.train_step, model.test_step, model.predict_step

    def train(data):
        return train_step(gather_group_batch(data, layout))

    def test(data):
        return test_step(gather_group_batch(data, layout))

    def predict(data):
        outputs = predict_step(gather_group_batch(data, layout))
        if layout.rank(layout.here()) == 0:
            return outputs
        return tf.nest.map_structure(lambda t: t[:0] if tf.is_tensor(t) and t.shape.rank else t, outputs)

    for name, step in (("train_step", train), ("test_step", test), ("predict_step", predict)):
        object.__setattr__(model, name, step)
