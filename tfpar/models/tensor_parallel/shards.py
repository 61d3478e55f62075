"""Sharded weights: one variable per layer whose copies differ, replica r holding shard r.

A split weight is an ordinary mirrored variable of the shard's shape whose copies are
given different values on purpose: the copy on TP rank r holds shard r of the whole
(unsplit) weight. Every read in a replica context reads that replica's copy, and Keras's
optimizer updates each copy with its own replica's gradient (tfpar's loop sums nothing
across the TP group), so the copies stay shards. A `ShardSpec` says how the whole splits:
along `axis`, in T equal parts; a fused weight (attention's Q, K and V in one kernel) is
`parts` weights side by side, each split alike, so shard r is [q_r | k_r | v_r].

What makes this safe:
- `shard_variable` gives each copy its shard of one whole initial value (drawn once, by the
  layer's initializer on the whole shape: the same distribution as the unsplit layer);
- checkpoints hold the whole, unsplit value (the shards concatenated; across workers,
  all-gathered) and a restore splits it (`set_checkpoint_hooks`); the optimizer's slots of
  a split weight get the same hooks (`shard_slots`);
- `full_value` and `assign_full` read and write the whole weight.

Example:
    >>> spec = ShardSpec(axis=1, degree=2, parts=3)
    >>> spec.split(np.arange(12).reshape(1, 12))[1]       # rank 1: [q_1 | k_1 | v_1]
    array([[ 2,  3,  6,  7, 10, 11]])
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfpar.models.tensor_parallel.layout import Layout, TensorParallelError, local_replica_ids
from tfpar.strategy import private_api

SPEC = "_tfpar_shard_spec"  # the attribute that marks a variable as a shard


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


def copies(variable) -> list[tuple[int, tf.Variable]]:
    """(global replica id, this worker's copy) of a (Keras or tf) variable, local order."""
    tf_variable = _tf_variable(variable)
    if not isinstance(tf_variable, tf.distribute.DistributedValues):
        return [(0, tf_variable)]
    strategy = tf_variable.distribute_strategy
    return list(zip(local_replica_ids(strategy), strategy.experimental_local_results(tf_variable)))


def assign_full(variable, full, layout: Layout) -> None:
    """Gives every copy of a split weight its shard of `full` (eager, cross-replica)."""
    shards = spec_of(variable).split(np.asarray(full))
    for replica, copy in copies(variable):
        copy.assign(shards[layout.rank(replica)])


def full_value(variable, layout: Layout) -> tf.Tensor:
    """The whole weight: the shards of TP group 0 joined where this worker holds them all,
    else each local copy all-gathered over its TP group (a collective: every worker calls it)."""
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


def _tf_variable(variable) -> tf.Variable:
    """The tf.Variable behind a Keras variable (itself for a tf.Variable)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def shard_variable(variable, full, spec: ShardSpec, layout: Layout) -> None:
    """Marks `variable` (a Keras variable of the shard's shape) as a shard, gives each copy
    its shard of `full` and installs the checkpoint hooks (whole value saved, split on
    restore)."""
    setattr(variable, SPEC, spec)
    assign_full(variable, full, layout)
    set_checkpoint_hooks(variable, spec, layout)


def set_checkpoint_hooks(variable, spec: ShardSpec, layout: Layout) -> None:
    """A checkpoint holds the whole (unsplit) value of this split weight or slot."""
    tf_variable = _tf_variable(variable)
    setattr(tf_variable, SPEC, spec)
    first = copies(tf_variable)[0][1]
    host = tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
        device_type="CPU", device_index=0).to_string()

    def serialize():  # computed only when written: a restore calls this too
        return {"VARIABLE_VALUE": private_api.save_spec(lambda: full_value(tf_variable, layout),
                                                        tf_variable.dtype, host)}

    def restore(restored: dict):
        whole = restored["VARIABLE_VALUE"]
        shards = spec.split(whole)
        return tf.group([copy.assign(shards[layout.rank(replica)]) for replica, copy in copies(tf_variable)])

    private_api.set_checkpoint_hooks(tf_variable, serialize, restore)


def shard_slots(optimizer, variables, layout: Layout) -> int:
    """Marks the optimizer's slots (momentum, velocity, ...) of every split weight as shards
    of the same spec (checkpoint hooks); returns how many. Keras names a slot after its
    variable: `<variable path with '_' for '/'>_<slot>`; the longest such prefix wins."""
    prefixes = [(v.path.replace("/", "_") + "_", v) for v in variables if spec_of(v) is not None]
    prefixes.sort(key=lambda item: -len(item[0]))
    count = 0
    for slot in optimizer.variables:
        name = slot.path.split("/")[-1]
        for prefix, variable in prefixes:
            if name.startswith(prefix) and tuple(slot.shape) == tuple(variable.shape):
                set_checkpoint_hooks(slot, spec_of(variable), layout)
                count += 1
                break
    return count
