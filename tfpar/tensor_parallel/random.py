"""Dropout in a tensor-parallel model, drawn as Megatron's RNG tracker draws it.

- Inside the split region (the attention probabilities of a rank's own heads: anything a
  rank computes on its shard of the features), each tensor-parallel rank draws its own
  mask: the dropout layer's seed, stepped as Keras steps it, folded with the rank
  (`tf.random.experimental.stateless_fold_in`), Megatron's `tensor_model_parallel_seed`.
  With one shared seed, head h on rank 0 and head h + H/T on rank 1 would share a mask.
- Outside it (the residual stream after the row-parallel sum, the embeddings: whole
  activations that every rank of a group holds), the ranks of a group draw the same mask,
  or their copies of the model would drift apart: Keras's own Dropout does that already
  (its seed generator is a mirrored variable that every replica steps alike).
- Across data-parallel replicas: as Keras does today under tf.distribute, for the same
  reason: every replica draws the same mask for the same shape (on different examples).
  That is also Megatron's default (one seed for every data-parallel rank), and it keeps a
  split model's dropout outside the region bit-identical to the unsplit model's under the
  same strategy: T changes only the region's draws.

Example:
    >>> split_region_dropout(attention._dropout_layer, layout)   # per-rank masks on its heads
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.tensor_parallel.layout import Layout, TensorParallelError


def split_region_dropout(dropout: keras.layers.Dropout, layout: Layout) -> None:
    """Makes `dropout` (a built Keras Dropout applied inside the split region) draw its own
    mask on each tensor-parallel rank (see module docstring)."""
    if not isinstance(dropout, keras.layers.Dropout):
        raise TensorParallelError(f"{dropout.name} is a {type(dropout).__name__}, not a Dropout.")
    if dropout.noise_shape is not None:
        raise TensorParallelError(f"{dropout.name} has a noise_shape: a split region's dropout draws "
                                  "a mask of its input's shape.")

    def call(inputs, training=False):
        if not training or dropout.rate == 0:
            return inputs
        seed = tf.cast(dropout.seed_generator.next(), tf.int64)  # Keras's step of its state
        rank = layout.rank(layout.here())
        seed = tf.random.experimental.stateless_fold_in(seed, rank)
        return tf.nn.experimental.stateless_dropout(inputs, rate=dropout.rate, seed=seed)

    dropout.call = call
