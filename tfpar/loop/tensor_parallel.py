"""The gradient aggregation of a tensor-parallel model in tfpar's loop.

The replicas of a tensor-parallel (TP) group see the same batch. A split weight's gradient
on TP rank r is the gradient of shard r, held by no other rank of the group: summing it
across the group would add different shards together, so it is summed over its
data-parallel (DP) group only (the replicas with the same TP rank: the same shards,
different batches). A replicated weight (a norm, an embedding, the head, a row-parallel
bias) gets the same gradient on every rank of a group, up to the order of the sums the
ranks do: its gradient is summed over all N = R x T replicas (T times the sum over the DP
group), one all-reduce whose result is the same bits on every replica, so the replicated
weights stay bit-identical on every replica of every group however each rank computed them.

The Trainer's loss divides each replica's share by all N replicas (the loss it reports
sums them); a split gradient is the group's share divided by T, so split gradients are
multiplied by T (exact for T a power of two); summed over N, a replicated one is already
whole.

Keras's optimizer then updates each replica's copy (its shard) with its own gradient.
Its global-norm clip would see only this replica's shards: the norm of the whole gradient
is agreed here instead (the replicated part once, every shard's part summed over the TP
group: one scalar all-reduce) and the gradients are clipped by it, Keras's formula; Keras's
own clip then sees a norm at most the threshold and changes nothing. A non-finite norm
makes every gradient NaN on every replica, so the non-finite policy and fp16's loss scale
decide alike on every rank.

Optimizers: an allow-list, as under ZeRO (`SUPPORTED`: those whose update of an element
reads only that element and a few scalars, so a shard updates as its part of the whole).
Refused: compression (it would replace these sums), per-variable `clipnorm` (it needs each
whole variable's norm), LAMB, Adafactor, Muon and any optimizer not listed. `use_ema` and
Keras's `gradient_accumulation_steps` update each replica's copy from its own copies
(tfpar.strategy.optimizer_update), so a shard's average and accumulator are its own.

With ZeRO (`Trainer(shard="optimizer" | "gradients")`) the sums, the clip and the update
are ZeRO's, over each DP group (tfpar.zero.update: the same math, on 1/R of each shard):
this aggregator then only checks the optimizer and leaves it unbuilt
(`leave_to_partitions`).

The groups and their collectives are tfpar.strategy.groups' (the layout's TP, DP and
every-replica groups).

Example:
    >>> aggregator = TensorParallelSum(layout_of(model))   # tfpar.Trainer picks it itself
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.aggregation import GradientAggregator
from tfpar.compression import accounting
from tfpar.strategy import private_api
from tfpar.tensor_parallel import Layout, TensorParallelError, shard_slots, spec_of
from tfpar.zero.optimizer import ELEMENTWISE

SUPPORTED = ", ".join(c.__name__ for c in ELEMENTWISE)
WHY_NOT = {
    "Lamb": "scales each variable's update by norms of the whole variable",
    "Adafactor": "factors its second moment over each whole matrix's rows and columns",
    "Muon": "orthogonalises each whole matrix (Newton-Schulz)",
    "ScheduleFreeAdamW": "swaps the model's weights for evaluation in the cross-replica context",
}


def check_tensor_parallel_optimizer(optimizer) -> None:
    """Raises TensorParallelError, naming why and what to use, for an optimizer that cannot
    update a shard as its part of the whole weight."""
    base = private_api.base_optimizer(optimizer)
    name = type(base).__name__
    if type(base) not in ELEMENTWISE:
        why = WHY_NOT.get(name, "is not one tfpar knows to update element by element (a custom "
                                "update_step may read the whole variable)")
        raise TensorParallelError(f"Tensor parallelism cannot run {name} on a shard of a split weight: it "
                                  f"{why}, which a tensor-parallel replica holds only a shard of. "
                                  f"Optimizers that train split weights: {SUPPORTED} "
                                  "(--config.optimizer.name=adamw).")
    if base.clipnorm:
        raise TensorParallelError(
            f"clipnorm={base.clipnorm} clips each variable by its own norm, which a "
            "tensor-parallel replica holds only a shard of: use global_clipnorm (the norm "
            "of the whole gradient, agreed across the TP group).")


class TensorParallelSum(GradientAggregator):
    """Sums split gradients over their data-parallel group and replicated ones over every
    replica (see module docstring)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.clip_norm: float | None = None
        self.partitioned = False
        self._variables: list = []

    def leave_to_partitions(self) -> None:
        """ZeRO sums, clips and updates this model's gradients over each data-parallel group
        (tfpar.zero.update): this aggregator only checks the optimizer then, and leaves it
        unbuilt (ZeRO builds it on its partitions)."""
        self.partitioned = True

    def check_optimizer(self, optimizer) -> None:
        check_tensor_parallel_optimizer(optimizer)
        self.clip_norm = private_api.base_optimizer(optimizer).global_clipnorm or None

    def build(self, variables) -> None:
        self._variables = list(variables)

    def optimizer_for(self, optimizer):
        """Builds the optimizer now (its slots of a split weight are shards too, matched by
        the weight each was made from) and gives those slots whole-value checkpoints.
        Partitioned (ZeRO): unbuilt, as given."""
        if self.partitioned:
            return optimizer
        shard_slots(optimizer, self._variables, self.layout)
        return optimizer

    def __call__(self, gradients, variables):
        if self.partitioned:
            raise TensorParallelError("TensorParallelSum was left to ZeRO's partitions "
                                      "(leave_to_partitions): its update sums the gradients itself.")
        replica = self.layout.here()
        degree = float(self.layout.degree)
        grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.ensure_shape(tf.convert_to_tensor(g), v.shape)
                 for g, v in zip(gradients, variables)]  # an embedding's rows summed densely, static shape
        flags = [spec_of(v) is not None for v in variables]
        split = [i for i, s in enumerate(flags) if s]
        whole = [i for i, s in enumerate(flags) if not s]
        summed = list(grads)
        if split:
            parts = [grads[i] * tf.cast(degree, grads[i].dtype) for i in split]
            if self.layout.groups > 1:  # data x tensor parallel: one batched all-reduce
                with tf.name_scope("tensor_parallel/data_parallel_sum"):
                    parts = self.layout.dp_group(replica).batch_all_reduce(parts)
            for i, part in zip(split, parts):
                summed[i] = part
        if whole:
            with tf.name_scope("tensor_parallel/replicated_sum"):  # every replica: the same bits
                parts = self.layout.world.batch_all_reduce([grads[i] for i in whole])
            for i, part in zip(whole, parts):
                summed[i] = part
        return self._clipped(summed, flags, replica)

    def _clipped(self, grads: list, flags: list, replica: int) -> list:
        """Clips by the whole gradient's norm (Keras's formula); NaN everywhere when it is
        not finite."""
        split = tf.add_n([tf.reduce_sum(tf.square(g)) for g, s in zip(grads, flags) if s] or [tf.constant(0.0)])
        whole = tf.add_n([tf.reduce_sum(tf.square(g)) for g, s in zip(grads, flags) if not s]
                         or [tf.constant(0.0)])
        with tf.name_scope(accounting.CHECK_SCOPE):  # a scalar, not a gradient: named apart
            split = self.layout.tp_group(replica).all_reduce(split)
        norm = tf.sqrt(whole + split)
        if self.clip_norm:
            scale = self.clip_norm * tf.minimum(1.0 / norm, 1.0 / self.clip_norm) + (norm - norm)
        else:
            scale = 1.0 + (norm - norm)  # 1, or NaN when the norm is not finite
        return [g * tf.cast(scale, g.dtype) for g in grads]
