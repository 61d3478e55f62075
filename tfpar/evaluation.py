"""Exact evaluation under any strategy: weighted sums reduced across replicas.

Padding examples carry weight 0 (see `tfpar.data.distribute_eval`), so the result is the
same on 1 or N replicas: mean loss per weighted target, accuracy, exact-match rate (a
sequence counts when all its weighted targets are right) and the number of examples.

Example:
    >>> dataset, steps = tfpar.data.distribute_eval(strategy, splits.validation, 64)
    >>> evaluate(model, strategy, dataset, steps)
    {'loss': 1.52, 'perplexity': 4.57, 'accuracy': 0.61, 'exact': 0.02, 'examples': 5243.0}
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf


def _batch_sums(model, x, y, w):
    logits = tf.cast(model(x, training=False), tf.float32)
    y = tf.cast(y, tf.int32)
    w = tf.cast(tf.reshape(w, tf.shape(y)), tf.float32)
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.float32)
    if y.shape.rank > 1:
        axes = list(range(1, y.shape.rank))
        counted = tf.reduce_sum(w, axes) > 0
        exact = tf.reduce_all(tf.logical_or(correct > 0, w == 0), axes)
    else:
        counted, exact = w > 0, correct > 0
    counted_f = tf.cast(counted, tf.float32)
    return tf.stack([
        tf.reduce_sum(loss * w), tf.reduce_sum(correct * w), tf.reduce_sum(w),
        tf.reduce_sum(tf.cast(exact, tf.float32) * counted_f), tf.reduce_sum(counted_f),
    ])


_STEPS: dict = {}  # (model, strategy, jit, check) -> traced eval step: evaluating again does not retrace


def _eval_step(model, strategy, jit: bool, batch_check=None, prepare=None):
    key = (id(model), id(strategy), jit, id(batch_check), id(prepare))
    if key not in _STEPS:
        sums = tf.function(lambda batch: _batch_sums(model, *batch), jit_compile=jit)

        def replica(batch):
            batch = batch if prepare is None else prepare(batch)
            found = sums(batch)
            if batch_check is None:
                return found
            return tf.concat([found, batch_check(batch)[None]], 0)

        @tf.function
        def step(iterator):
            per_replica = strategy.run(replica, args=(next(iterator),))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        if len(_STEPS) > 16:
            _STEPS.clear()
        _STEPS[key] = (model, strategy, step)  # holding both keeps their ids from being reused
    return _STEPS[key][2]


def evaluate(model, strategy: tf.distribute.Strategy, dataset, steps: int, xla: bool = False,
             batch_check=None, prepare=None) -> dict:
    """Runs `steps` global batches of `dataset` (x, y, weight); returns exact metrics.

    `xla` compiles the forward pass on a single replica. With several replicas it stays
    off: a jit-compiled replica function reads mirrored variables from the wrong device
    ("Trying to access resource ... located in device CPU:1 from device CPU:0").
    `batch_check(batch)`: a scalar per replica, non-zero when its batch is wrong (a
    tensor-parallel group's replicas must share one); summed into `batch_check`.
    `prepare(batch)`: what each replica evaluates instead of its batch (a tensor-parallel
    group's batch gathered).
    """
    step = _eval_step(model, strategy, xla and strategy.num_replicas_in_sync == 1, batch_check, prepare)
    iterator = iter(dataset)
    totals = tf.zeros([5 if batch_check is None else 6], tf.float64)
    for _ in range(steps):
        totals += tf.cast(step(iterator), tf.float64)
    loss_sum, correct, weight, exact, examples, *checked = totals.numpy().tolist()
    loss = loss_sum / max(weight, 1e-12)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "accuracy": correct / max(weight, 1e-12),
        "exact": exact / max(examples, 1e-12),
        "examples": examples,
        **({"batch_check": checked[0]} if checked else {}),
    }
