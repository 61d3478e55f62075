"""The gradient aggregation of a tensor-parallel model in tfpar's loop.

The replicas of a tensor-parallel (TP) group see the same batch. A split weight's gradient
on TP rank r is the gradient of shard r, held by no other rank of the group: summing it
across the group would add different shards together. A replicated weight's gradient (a
norm, an embedding, a row-parallel bias) is the same on every rank of the group already
(every rank computes it from the same whole activations): summing it would count it T
times. So each gradient is summed over its data-parallel (DP) group only (the replicas
with the same TP rank: the same shards, different batches), once, in one batched
all-reduce; with one TP group (T = all replicas) nothing is all-reduced at all.

The Trainer's loss divides each replica's share by all N = R x T replicas (the loss it
reports sums them); the TP group's gradient is the group's share, so the gradients are
multiplied by T (exact for T a power of two).

Keras's optimizer then updates each replica's copy (its shard) with its own gradient.
Its global-norm clip would see only this replica's shards: the norm of the whole gradient
is agreed here instead (the replicated part once, every shard's part summed over the TP
group: one scalar all-reduce) and the gradients are clipped by it, Keras's formula; Keras's
own clip then sees a norm at most the threshold and changes nothing. A non-finite norm
makes every gradient NaN on every replica, so the non-finite policy and fp16's loss scale
decide alike on every rank.

Refused: compression (it would replace this sum), per-variable `clipnorm` and LAMB (they
need each whole variable's norm), `use_ema` (its average is taken in the cross-replica
context, which reads one shard).

Example:
    >>> aggregator = TensorParallelSum(layout_of(model))   # tfpar.Trainer picks it itself
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.compression import accounting
from tfpar.aggregation import GradientAggregator
from tfpar.models.tensor_parallel import Layout, TensorParallelError, shard_slots, spec_of
from tfpar.strategy import private_api


class TensorParallelSum(GradientAggregator):
    """Sums each gradient over its data-parallel group only (see module docstring)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.clip_norm: float | None = None
        self._variables: list = []
        self._split: list[bool] = []

    def check_optimizer(self, optimizer) -> None:
        base = private_api.base_optimizer(optimizer)
        if getattr(base, "clipnorm", None):
            raise TensorParallelError(
                f"clipnorm={base.clipnorm} clips each variable by its own norm, which a "
                "tensor-parallel replica holds only a shard of: use global_clipnorm (the norm "
                "of the whole gradient, agreed across the TP group).")
        if type(base).__name__ in ("Lamb", "Adafactor"):
            raise TensorParallelError(
                f"{type(base).__name__} scales each variable's update by norms of the whole "
                "variable, which a tensor-parallel replica holds only a shard of: use AdamW, Adam "
                "or SGD (--config.optimizer.name=adamw).")
        if getattr(base, "use_ema", False):
            raise TensorParallelError(
                "use_ema averages the weights in the cross-replica context, which reads one "
                "shard for every replica: train without use_ema under tensor parallelism.")
        self.clip_norm = getattr(base, "global_clipnorm", None) or None

    def build(self, variables) -> None:
        self._variables = list(variables)
        self._split = [spec_of(v) is not None for v in self._variables]

    def optimizer_for(self, optimizer):
        """Builds the optimizer now (its slots of a split weight are shards too) and gives
        those slots whole-value checkpoints."""
        optimizer.build(self._variables)
        shard_slots(optimizer, self._variables, self.layout)
        return optimizer

    def __call__(self, gradients, variables):
        replica = self.layout.here()
        degree = tf.constant(float(self.layout.degree))
        grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g) * tf.cast(degree, g.dtype)
                 for g, v in zip(gradients, variables)]
        launcher = self.layout.dp_launcher(replica)
        if launcher is not None:  # data x tensor parallel: one batched all-reduce per step
            with tf.name_scope("tensor_parallel/data_parallel_sum"):
                grads = launcher.batch_all_reduce([grads])
        return self._clipped(grads, replica)

    def _clipped(self, grads: list, replica: int) -> list:
        """Clips by the whole gradient's norm (Keras's formula); NaN everywhere when it is
        not finite."""
        split = tf.add_n([tf.reduce_sum(tf.square(g)) for g, s in zip(grads, self._split) if s] or [tf.constant(0.0)])
        whole = tf.add_n([tf.reduce_sum(tf.square(g)) for g, s in zip(grads, self._split) if not s]
                         or [tf.constant(0.0)])
        with tf.name_scope(accounting.CHECK_SCOPE):  # a scalar, not a gradient: named apart
            split = self.layout.tp_launcher(replica).all_reduce(split)
        norm = tf.sqrt(whole + split)
        if self.clip_norm:
            scale = self.clip_norm * tf.minimum(1.0 / norm, 1.0 / self.clip_norm) + (norm - norm)
        else:
            scale = 1.0 + (norm - norm)  # 1, or NaN when the norm is not finite
        return [g * tf.cast(scale, g.dtype) for g in grads]
