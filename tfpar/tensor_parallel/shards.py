"""Split weights: one variable per weight whose copies differ, replica r holding shard r.

A split weight is an ordinary mirrored variable of the shard's shape whose copies are
given different values on purpose: the copy on tensor-parallel (TP) rank r holds shard r
of the whole (unsplit) weight. Every read in a replica context reads that replica's copy,
and the optimizer updates each copy with its own replica's gradient (tfpar's loop sums
nothing across the TP group), so the copies stay shards. A `ShardSpec` says how the whole
splits: along `axis`, in T equal parts; a fused weight (Q, K and V in one kernel) is
`parts` weights side by side, each split alike, so shard r is [q_r | k_r | v_r].

Outside the replicas a split weight is its whole value, so T is a performance switch only:

- made (`make_split`) from one whole initial value, drawn by the layer's own initializer on
  the whole shape, exactly as the unsplit layer draws it (on the host CPU); across workers
  the first replica's draw is given to every worker, seeded or not (`agreed`);
- Keras's weight APIs read and write it whole: `numpy()`, `np.asarray`, `get_weights`,
  `save_weights`/`.keras` (through `save_own_variables`), and `assign`/`set_weights`/
  `load_weights` of a whole value split it (tfpar.tensor_parallel.keras_weights);
- a TensorFlow checkpoint holds the whole value (the shards joined; across workers
  all-gathered) and a restore splits it (`set_checkpoint_hooks`); the optimizer's slots of
  a split weight, matched by the variable they were made from, get the same hooks
  (`shard_slots`).

Example:
    >>> spec = ShardSpec(axis=1, degree=2, parts=3)
    >>> spec.split(np.arange(12).reshape(1, 12))[1]       # rank 1: [q_1 | k_1 | v_1]
    array([[ 2,  3,  6,  7, 10, 11]])
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfpar.strategy import private_api
from tfpar.strategy.replicas import spans_workers
from tfpar.tensor_parallel.layout import Layout, TensorParallelError, local_replica_ids

SPEC = "_tfpar_shard_spec"  # the attribute that marks a variable as a shard
LAYOUT = "_tfpar_layout"  # the Layout it was split over


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a whole weight splits into `degree` shards along `axis` (`parts` fused weights)."""

    axis: int
    degree: int
    parts: int = 1

    def shard_shape(self, full_shape) -> tuple:
        shape = list(full_shape)
        if shape[self.axis] % (self.parts * self.degree):
            raise TensorParallelError(
                f"Axis {self.axis} of a weight of shape {tuple(full_shape)} does not split into "
                f"{self.degree} equal shards{f' per fused part ({self.parts})' if self.parts > 1 else ''}: "
                f"use a tensor-parallel degree that divides {shape[self.axis] // self.parts}.")
        shape[self.axis] //= self.degree
        return tuple(shape)

    def whole_shape(self, shard_shape) -> tuple:
        """The unsplit shape of a weight whose shards have `shard_shape`."""
        shape = [int(d) for d in shard_shape]
        shape[self.axis] *= self.degree
        return tuple(shape)

    def split(self, full) -> list:
        """The `degree` shards of a whole value (numpy array or tensor), in rank order."""
        split, concat = (np.split, np.concatenate) if isinstance(full, np.ndarray) else (tf.split, tf.concat)
        pieces = [split(part, self.degree, axis=self.axis) for part in split(full, self.parts, axis=self.axis)]
        return [concat([pieces[p][r] for p in range(self.parts)], axis=self.axis) for r in range(self.degree)]

    def join(self, shards: list):
        """The whole value from the `degree` shards (rank order): the inverse of `split`."""
        split, concat = (np.split, np.concatenate) if isinstance(shards[0], np.ndarray) else (tf.split, tf.concat)
        by_rank = [split(s, self.parts, axis=self.axis) for s in shards]
        return concat([by_rank[r][p] for p in range(self.parts) for r in range(self.degree)], axis=self.axis)


def spec_of(variable) -> ShardSpec | None:
    """The ShardSpec of a split weight (a Keras or tf variable); None for a replicated one."""
    return getattr(variable, SPEC, None) or getattr(_tf_variable(variable), SPEC, None)


def layout_of_variable(variable) -> Layout | None:
    """The Layout a split weight was split over (None for a replicated one)."""
    return getattr(variable, LAYOUT, None) or getattr(_tf_variable(variable), LAYOUT, None)


def whole_shape(variable) -> tuple:
    """The weight's unsplit shape: its own shape when it is not split."""
    spec = spec_of(variable)
    shape = tuple(int(d) for d in variable.shape)
    return shape if spec is None else spec.whole_shape(shape)


def copies(variable) -> list[tuple[int, tf.Variable]]:
    """(global replica id, this worker's copy) of a (Keras or tf) variable, local order."""
    tf_variable = _tf_variable(variable)
    if not isinstance(tf_variable, tf.distribute.DistributedValues):
        return [(0, tf_variable)]
    strategy = tf_variable.distribute_strategy
    return list(zip(local_replica_ids(strategy), strategy.experimental_local_results(tf_variable)))


def assign_full(variable, full, layout: Layout | None = None) -> None:
    """Gives every copy of a split weight its shard of `full` (eager, cross-replica)."""
    layout = layout or layout_of_variable(variable)
    pieces = spec_of(variable).split(np.asarray(full))
    for replica, copy in copies(variable):
        copy.assign(pieces[layout.rank(replica)])


def full_value(variable, layout: Layout | None = None) -> tf.Tensor:
    """The whole weight: the shards of TP group 0 joined where this worker holds them all,
    else each local copy all-gathered over its TP group (a collective: every worker calls it)."""
    layout = layout or layout_of_variable(variable)
    spec, here = spec_of(variable), dict(copies(variable))
    group = layout.tp_groups[0]
    if all(r in here for r in group):
        return spec.join([tf.convert_to_tensor(here[r]) for r in group])
    tf_variable = _tf_variable(variable)

    @tf.function
    def gather():
        def fn():  # every local replica in its own TP group; the groups' wholes are equal
            own = tf.expand_dims(tf.convert_to_tensor(tf_variable), 0)  # this replica's copy
            gathered = layout.tp_launcher(layout.here()).all_gather(own, 0)  # shape lost: restore it
            return spec.join(tf.unstack(tf.reshape(gathered, [layout.degree, *tf_variable.shape])))
        return layout.strategy.experimental_local_results(layout.strategy.run(fn))[0]

    return gather()


def agreed(whole: np.ndarray, layout: Layout) -> np.ndarray:
    """`whole` as replica 0 drew it, on every worker: each worker draws its own initial
    values (unseeded, they differ), and the shards of one weight must come from one draw.
    One all-reduce in which replica 0 alone contributes (exact: x + 0 = x); nothing to do
    within one worker."""
    strategy = layout.strategy
    if not spans_workers(strategy):
        return whole
    value = tf.constant(whole)

    @tf.function
    def broadcast():
        def fn():
            context = tf.distribute.get_replica_context()
            mine = tf.where(tf.equal(context.replica_id_in_sync_group, 0), value, tf.zeros_like(value))
            return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)
        return strategy.experimental_local_results(strategy.run(fn))[0]

    return broadcast().numpy()


def _tf_variable(variable) -> tf.Variable:
    """The tf.Variable behind a Keras variable (itself for a tf.Variable)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def make_split(variable, whole, spec: ShardSpec, layout: Layout) -> None:
    """Makes `variable` (a Keras variable of the shard's shape) shard r on TP rank r of the
    whole value `whole`: marks it, assigns each copy its shard, installs the checkpoint hooks
    (whole value saved, split on restore) and Keras's whole-value reads and writes."""
    from tfpar.tensor_parallel import keras_weights  # pylint: disable=import-outside-toplevel

    for target in (variable, _tf_variable(variable)):
        setattr(target, SPEC, spec)
        setattr(target, LAYOUT, layout)
    assign_full(variable, agreed(np.asarray(whole), layout), layout)
    set_checkpoint_hooks(variable, spec, layout)
    keras_weights.read_and_written_whole(variable)


def set_checkpoint_hooks(variable, spec: ShardSpec, layout: Layout) -> None:
    """A checkpoint holds the whole (unsplit) value of this split weight or slot."""
    tf_variable = _tf_variable(variable)
    setattr(tf_variable, SPEC, spec)
    setattr(tf_variable, LAYOUT, layout)
    first = copies(tf_variable)[0][1]
    host = tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
        device_type="CPU", device_index=0).to_string()

    def serialize():  # computed only when written: a restore calls this too
        return {"VARIABLE_VALUE": private_api.save_spec(lambda: full_value(tf_variable, layout),
                                                        tf_variable.dtype, host)}

    def restore(restored: dict):
        whole = restored["VARIABLE_VALUE"]
        pieces = spec.split(whole)
        return tf.group([copy.assign(pieces[layout.rank(replica)]) for replica, copy in copies(tf_variable)])

    private_api.set_checkpoint_hooks(tf_variable, serialize, restore)


def shard_slots(optimizer, variables, layout: Layout) -> int:
    """Builds `optimizer` on `variables` and makes the slots (momentum, velocity, ...) made
    from each split weight shards of the same spec (whole-value checkpoints, and Keras's
    weight APIs: a `.keras` file holds each slot whole, as the unsplit model's optimizer
    writes it); returns how many. A slot is matched by the variable it was made from
    (Keras's `add_variable_from_reference`), never by its name."""
    from tfpar.tensor_parallel import keras_weights  # pylint: disable=import-outside-toplevel

    made = private_api.slots_by_reference(optimizer, variables)
    count = 0
    for slot, reference in made:
        spec = spec_of(reference)
        if spec is None:
            continue
        if tuple(slot.shape) != tuple(reference.shape):
            raise TensorParallelError(
                f"{type(private_api.base_optimizer(optimizer)).__name__} made a slot of shape "
                f"{tuple(slot.shape)} from the split weight {reference.path} of shape "
                f"{tuple(reference.shape)}: only optimizers whose state is elementwise train "
                "split weights (tfpar.loop.tensor_parallel.SUPPORTED).")
        set_checkpoint_hooks(slot, spec, layout)
        keras_weights.read_and_written_whole(slot)
        count += 1
    return count
