"""The replicas of a tensor-parallel group must see the same batch: checked, not assumed.

`tfpar.data.distribute_train(..., tensor_parallel=T)` (and `distribute_eval`) deal each
group's batch to its T replicas. A dataset dealt any other way (Keras's
`strategy.experimental_distribute_dataset`, a hand-written `distribute_datasets_from_function`)
gives each replica its own batch, and the split layers then add up activations of
different examples: wrong numbers, no error. So the first step of `Trainer.fit`, and every
batch of `Trainer.evaluate`, compares a fingerprint of each replica's batch across its TP
group (one all-gather of a few floats) and refuses a dataset whose replicas differ.

Example:
    >>> check = GroupBatchCheck(layout)          # under strategy.scope()
    >>> check.arm()                              # before a fit: the next step checks
    >>> check.in_step(batch)                     # replica context, each step (a no-op once checked)
    >>> check.raise_if_differed()                # after the call that ran it
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.compression import accounting
from tfpar.strategy import private_api
from tfpar.tensor_parallel.layout import Layout, TensorParallelError

_SEED = (20261206, 40)  # the fingerprint's fixed weights: any fixed seed does


def fingerprint(batch) -> tf.Tensor:
    """[2 k] float64 for the k numeric tensors of `batch` (any nest): each one's size and a
    sum weighted by fixed pseudo-random numbers. Equal batches give equal fingerprints."""
    found = []
    for index, tensor in enumerate(tf.nest.flatten(batch)):
        tensor = tf.convert_to_tensor(tensor)
        if not (tensor.dtype.is_floating or tensor.dtype.is_integer or tensor.dtype.is_bool):
            continue
        flat = tf.cast(tf.reshape(tensor, [-1]), tf.float64)
        weights = tf.random.stateless_uniform(tf.shape(flat), seed=[_SEED[0], _SEED[1] + index], dtype=tf.float64)
        found += [tf.cast(tf.size(flat), tf.float64), tf.reduce_sum(flat * weights)]
    return tf.stack(found) if found else tf.zeros([1], tf.float64)


def batch_differs(batch, layout: Layout) -> tf.Tensor:
    """1.0 when a replica of this replica's TP group holds another batch, else 0.0 (replica
    context: every replica of the group calls it)."""
    mine = fingerprint(batch)
    launcher = layout.tp_launcher(layout.here())
    with tf.name_scope(accounting.CHECK_SCOPE):  # a check, not a gradient: counted apart
        gathered = private_api.launcher_all_gather_same_shape(launcher, mine[None])  # (T, 2k)
    tolerance = 1e-9 * (1.0 + tf.abs(mine))
    return tf.cast(tf.reduce_any(tf.abs(gathered - mine) > tolerance), tf.float32)


def gather_group_batch(batch, layout: Layout):
    """Every replica of this replica's TP group given the group's whole batch: each
    tensor of `batch` (any nest) all-gathered along its first axis, in rank order (replica
    context). What a dataset dealt per replica (Keras's own, under keras.distribution)
    needs: the group's replicas held consecutive slices of one global batch."""
    def gather(tensor):
        if not tf.is_tensor(tensor) or tensor.shape.rank == 0:
            return tensor
        with tf.name_scope("tensor_parallel/group_batch"):
            return layout.tp_all_gather(tensor, axis=0)
    return tf.nest.map_structure(gather, batch)


def mismatch_error(layout: Layout, what: str = "The training dataset") -> TensorParallelError:
    return TensorParallelError(
        f"{what} gives the {layout.degree} replicas of a tensor-parallel group different batches "
        f"(TP groups {layout.tp_groups}); they must see the same one, or the split layers add up "
        "activations of different examples. Deal it with tfpar.data.distribute_train(strategy, "
        f"source, global_batch, tensor_parallel={layout.degree}) (evaluation: distribute_eval(..., "
        f"tensor_parallel={layout.degree})), or repeat each batch {layout.degree} times in a row "
        "(tfpar.data.pipeline.same_batch_for_groups) in your own dataset function.")


class GroupBatchCheck:
    """The first step after `arm()` checks that every TP group shares its batch (see module
    docstring); later steps skip it (one per-replica flag read)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        on_read = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)
        with layout.strategy.scope():
            self.pending = tf.Variable(1.0, name="tp_batch_check_pending", **on_read)
            self.differed = tf.Variable(0.0, name="tp_batch_check_differed", **on_read)

        def reset():  # each replica its own copy: no collective
            self.pending.assign(1.0)
            self.differed.assign(0.0)

        self._arm = tf.function(lambda: layout.strategy.run(reset))

    def arm(self) -> None:
        """The next step checks (called from the cross-replica context)."""
        self._arm()

    def in_step(self, batch) -> None:
        """Replica context: checks `batch` if armed, then disarms."""
        def check():
            self.differed.assign(batch_differs(batch, self.layout))
            self.pending.assign(0.0)
            return tf.constant(True)

        tf.cond(self.pending > 0, check, lambda: tf.constant(False))

    def raise_if_differed(self) -> None:
        """After the call that ran the check: TensorParallelError if a group's batches differed."""
        if float(self.differed.read_value()) > 0:
            raise mismatch_error(self.layout)
