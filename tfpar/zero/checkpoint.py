"""The sharded optimizer in a checkpoint, in the layout Keras's own optimizer writes.

Each slot (Adam's m and v, momentum, an EMA average) is saved under the key Keras gives
the unsharded optimizer's slot (`optimizer/_variables/<k>`, `optimizer/_iterations`, and
under fp16 `optimizer/dynamic_scale`, `optimizer/step_counter`,
`optimizer/inner_optimizer/...`), with the variable's shape, as *slices*: each replica
writes its own chunk, cut into a few boxes of that shape (tfpar.zero.partitions.boxes),
from its own copy. Nothing puts a slot together to write it. A restore reads, for each of
its replicas, the boxes of that replica's chunk under its own replica count: TensorFlow
reads any slice of a key whichever slices (or whole tensor) were written. So a sharded
run restores under any replica count, an unsharded run restores a sharded checkpoint (a
plain variable reads its key whole) and the other way round, and tfpar's Checkpoints
(fingerprint, integrity, resume) need nothing new.

What a save writes, by mode (`saving(mode)`; the default is LOCAL where one process holds
every replica, WHOLE where workers hold some each):

- LOCAL: this process's replicas' slices. One process (mirrored): the whole slot, as R
  slices. Under multi_worker_mirrored, tfpar's Checkpoints has each worker write its own
  slices to its own file and the chief's save merge them (tfpar.zero.files).
- SKIP: the keys are recorded, no value written (the chief's object graph, while the
  workers' files carry the values).
- WHOLE: the slot put together (its rows all-gathered across workers, a collective that
  every worker's save reaches) and written whole: what a checkpoint that is not tfpar's
  (your own tf.train.Checkpoint) writes under multi_worker_mirrored, and what Keras's
  `.keras` files get (tfpar.zero.own_optimizer).

A tensor-parallel model's slots are written whole too, as the unsplit model's (and the
unsharded split run's) are: a chunk of shard t is a few boxes of the shard's shape, each
put at its place in the whole weight along the split axis (`whole_boxes`; a fused weight's
box is cut at its parts). A replicated weight's chunks repeat on every TP rank: only TP
rank 0's replicas write them, and every copy restores its own. So a sharded split run, an
unsharded split run, a sharded unsplit run and one device all read each other's files.

Example:
    >>> view = optimizer_view(partitioned_optimizer, layout, Owners(ranks))
    >>> tf.train.Checkpoint(optimizer=view).save(path)    # Keras's keys, sliced per replica
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import keras
import tensorflow as tf

from tfpar.compression import replica_state
from tfpar.strategy import private_api
from tfpar.zero.partitions import slice_spec, whole_boxes

VALUE = "VARIABLE_VALUE"  # the attribute every tf.Variable saves under
LOCAL, SKIP, WHOLE = "local", "skip", "whole"
_MODES: list[str] = []  # the innermost `saving` block's mode last


@contextlib.contextmanager
def saving(mode: str) -> Iterator[None]:
    """Within the block, every PartitionValue saves (and restores) in `mode`.

    Example:
        >>> with saving(SKIP):
        ...     manager.save()          # the object graph; the workers' files hold the slots
    """
    if mode not in (LOCAL, SKIP, WHOLE):
        raise ValueError(f"saving mode {mode!r}: one of {LOCAL}, {SKIP}, {WHOLE}")
    _MODES.append(mode)
    try:
        yield
    finally:
        _MODES.pop()


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def holds_every_replica(variable) -> bool:
    """Whether this process holds every replica's copy of `variable` (not multi-worker)."""
    variable = _tf_variable(variable)
    if not isinstance(variable, tf.distribute.DistributedValues):
        return True
    return len(variable.values) == variable.distribute_strategy.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class Owners:
    """Which replica holds which chunk: `ranks` (replica id -> its rank in its partition
    group, every replica) and, for a tensor-parallel model, `tensor_ranks` (replica id ->
    its TP rank) and `specs` (each variable's ShardSpec; None for a replicated one)."""

    ranks: dict
    tensor_ranks: dict | None = None
    specs: tuple = ()

    def spec(self, index: int):
        return self.specs[index] if self.specs else None


class PartitionValue(tf.__internal__.tracking.Trackable):
    """One per-replica slot of variable `index` in a checkpoint: its key is the unsharded
    (and unsplit) slot's, its value the replicas' chunks as slices (see module docstring)."""

    def __init__(self, variable, index: int, layout, owners: Owners):
        self.variable, self.index, self.layout, self.owners = variable, index, layout, owners
        self.ranks, self.spec = owners.ranks, owners.spec(index)
        self._gather = None

    @property
    def shape(self) -> tuple:
        """The slot's shape in a checkpoint: the whole (unsplit) variable's."""
        shape = self.layout.shapes[self.index]
        return tuple(shape) if self.spec is None else self.spec.whole_shape(shape)

    @property
    def mode(self) -> str:
        """The mode a save or restore runs in now (see module docstring)."""
        if _MODES:
            return _MODES[-1]
        return LOCAL if holds_every_replica(self.variable) else WHOLE

    def _gather_saveables_for_checkpoint(self) -> dict:
        return {VALUE: self.saveables}

    def saveables(self, name: str) -> list:
        """What a save writes (a restore reads) under checkpoint key `name`, in `mode`."""
        mode = self.mode
        variable = _tf_variable(self.variable)
        if mode == WHOLE:
            host = _host(variable)
            return [private_api.slices_saveable(
                name, [(lambda: self.whole(host), "", variable.dtype, host)], lambda t: self.assign_whole(t[0]))]
        found = []
        for (shard, rank), copies, writer in self._holders(variable):
            boxes = self.layout.boxes(self.index, rank)
            if boxes:
                found.append(self._chunk_saveable(name, copies, writer if mode != SKIP else None,
                                                  rank, shard, boxes))
        return found or [self._nothing(name, variable)]

    def _holders(self, variable) -> list:
        """[((TP shard or None, rank), this worker's copies that hold that chunk, the copy
        that writes it or None)]: one chunk per replica, except a replicated weight's under
        tensor parallelism, whose chunk repeats on every TP rank and is written by rank 0's."""
        tensor_ranks = self.owners.tensor_ranks
        held: dict = {}
        for replica, copy in zip(*replica_state.components(variable)):
            shard = None if tensor_ranks is None or self.spec is None else tensor_ranks[replica]
            copies, writer = held.get((shard, self.ranks[replica]), ([], None))
            if writer is None and (tensor_ranks is None or self.spec is not None or tensor_ranks[replica] == 0):
                writer = copy
            held[(shard, self.ranks[replica])] = (copies + [copy], writer)
        return [(key, copies, writer) for key, (copies, writer) in held.items()]

    def _chunk_saveable(self, name: str, copies: list, writer, rank: int, shard, boxes: list):
        """One chunk as its boxes (placed in the whole weight); `writer` writes them (None:
        nothing written); restored, they fill every copy that holds the chunk."""
        start, _ = self.layout.run(self.index, rank)
        dtype, device = copies[0].dtype, (copies[0] if writer is None else writer).device
        parts, counts = [], []
        for box in boxes:
            pieces = [(box, None)] if self.spec is None else whole_boxes(box, self.spec, self.layout.shapes[self.index], shard)
            counts.append(len(pieces))
            for whole_box, within in pieces:
                make = (lambda: None) if writer is None else self._box_of(writer, start, box, within)
                parts.append((make, slice_spec(self.shape, whole_box), dtype, device))
        return private_api.slices_saveable(name, parts, lambda tensors: self._fill(copies, tensors, counts))

    def _box_of(self, copy, start: int, box, within=None):
        """A function that reads `box` of the variable from `copy` (the chunk from `start`);
        `within`: only (start, stop) of it along the split axis (a fused part's)."""
        def read() -> tf.Tensor:
            with tf.device(copy.device):
                if box is None:  # a scalar (or empty) variable, owned whole by rank 0
                    return tf.reshape(copy[:self.layout.sizes[self.index]], self.layout.shapes[self.index])
                first = _flat_index(self.layout.shapes[self.index], box[0]) - start
                count = 1
                for n in box[1]:
                    count *= n
                value = tf.reshape(copy[first:first + count], box[1])
                if within is None:
                    return value
                return tf.gather(value, tf.range(*within), axis=self.spec.axis)
        return read

    def _fill(self, copies: list, tensors: list, counts: list):
        """A chunk from its restored boxes (in flat order; a box cut at fused parts comes
        as `counts` pieces), zero-padded, into every copy that holds it."""
        flats, at = [], 0
        for n in counts:
            box = tensors[at] if n == 1 else tf.concat(tensors[at:at + n], axis=self.spec.axis)
            flats.append(tf.reshape(box, [-1]))
            at += n
        flat = tf.concat(flats, 0)
        chunk = self.layout.chunks[self.index]
        padded = tf.pad(flat, [[0, chunk - tf.shape(flat)[0]]])
        return tf.group([copy.assign(tf.cast(padded, copy.dtype)) for copy in copies])

    def _nothing(self, name: str, variable):
        """For a process none of whose replicas holds an element of this (tiny) variable:
        writes nothing; restoring reads one element (rank 0's first) and assigns nothing."""
        shape = self.shape
        box = self.layout.boxes(self.index, 0)[0]
        if box is not None:
            box = ((0,) * len(shape), (1,) * len(shape))
        return private_api.slices_saveable(
            name, [(lambda: None, slice_spec(shape, box), variable.dtype, _host(variable))], lambda _: None)

    def whole(self, host: str | None = None) -> tf.Tensor:
        """The slot whole (each partition group's [R, c] rows in rank order, unpadded, in
        the variable's shape; a split weight's shards joined), on `host` (default: this
        worker's CPU): across workers an all-gather, which every worker must reach."""
        variable = _tf_variable(self.variable)
        with tf.device(host or _host(variable)):
            if not isinstance(variable, tf.distribute.DistributedValues):
                rows = tf.convert_to_tensor(variable)[None]
            elif holds_every_replica(variable):
                rows = replica_state.stacked(variable)  # every replica in this process
            else:
                if self._gather is None:
                    self._gather = replica_state.gathered(variable)
                rows = self._gather()
            shards = [self.layout.unrows(tf.gather(rows, self._by_rank(shard)), [self.index])[0]
                      for shard in range(self.spec.degree if self.spec is not None else 1)]
            return shards[0] if self.spec is None else self.spec.join(shards)

    def _by_rank(self, shard: int) -> list[int]:
        """The replica ids of partition ranks 0, 1, ... that hold TP shard `shard` (every
        replica's chunks without tensor parallelism; TP rank 0's for a replicated weight)."""
        tensor_ranks = self.owners.tensor_ranks
        members = [r for r in self.ranks if tensor_ranks is None or tensor_ranks[r] == shard]
        return sorted(members, key=self.ranks.get)

    def assign_whole(self, whole) -> tf.Operation:
        """Every replica here takes its chunk of the whole slot `whole` (of a split weight:
        of its shard of it)."""
        whole = tf.convert_to_tensor(whole)
        if whole.shape.rank is not None and tuple(whole.shape) != self.shape:
            raise ValueError(f"the checkpoint's slot of {self.layout.paths[self.index]} has shape "
                             f"{tuple(whole.shape)}, the model's variable {self.shape}")
        shards = None if self.spec is None else self.spec.split(whole)
        ids, copies = replica_state.components(_tf_variable(self.variable))
        assigned = []
        for i, copy in zip(ids, copies):
            value = whole if shards is None else shards[self.owners.tensor_ranks[i]]
            assigned.append(copy.assign(tf.cast(self.layout.chunk(value, self.index, self.ranks[i]), copy.dtype)))
        return tf.group(assigned)


def _flat_index(shape, index) -> int:
    """The row-major position of `index` in an array of `shape`."""
    position = 0
    for d, i in zip(shape, index):
        position = position * int(d) + int(i)
    return position


def _host(variable) -> str:
    first = variable.values[0] if isinstance(variable, tf.distribute.DistributedValues) else variable
    return tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
        device_type="CPU", device_index=0).to_string()


class _Children(tf.__internal__.tracking.Trackable):
    """A checkpoint node whose children are given by name."""

    def __init__(self, children: dict):
        for name, child in children.items():
            self._track_trackable(child, name)


def optimizer_view(shard, layout, owners: Owners):
    """The checkpoint node of the sharded optimizer, as Keras would save `shard.optimizer`."""
    inner = _inner_view(shard, layout, owners)
    if not shard.loss_scaled:
        return inner
    outer = shard.optimizer  # the LossScaleOptimizer: its own counter, then the inner one's
    children = {"dynamic_scale": shard.scale, "step_counter": shard.counter, "inner_optimizer": inner,
                **_counter_and_rate(outer), **_trainable(shard)}
    return _Children(children)


def inner_view(view, shard):
    """The node of the optimizer that holds the slots (under fp16, the wrapped one's)."""
    return view._lookup_dependency("inner_optimizer") if shard.loss_scaled else view  # pylint: disable=protected-access


def slots(view, shard) -> list:
    """The optimizer's `variables` past its counter and rate, in Keras's order: a
    PartitionValue for each slot made from a piece, the variable itself otherwise."""
    node = inner_view(view, shard)._lookup_dependency("_variables")  # pylint: disable=protected-access
    return [node._lookup_dependency(str(k)) for k in range(shard.own_variables, len(shard.clone.variables))]  # pylint: disable=protected-access


def _inner_view(shard, layout, owners: Owners):
    clone, found = shard.clone, {}
    for k, variable in enumerate(clone.variables):
        if k < shard.own_variables:  # the copy's own counter and rate: the caller's are saved
            continue
        index = shard.slot_of.get(k)
        found[str(k)] = variable if index is None else PartitionValue(variable, index, layout, owners)
    return _Children({**_counter_and_rate(shard.base), **_trainable(shard), "_variables": _Children(found)})


def _trainable(shard) -> dict:
    """The model's variables, where a built Keras optimizer lists them (its checkpoint keys)."""
    return {"_trainable_variables": _Children({str(i): v for i, v in enumerate(shard.variables)})}


def _counter_and_rate(optimizer) -> dict:
    found = {"_iterations": optimizer._iterations}  # pylint: disable=protected-access
    rate = optimizer._learning_rate  # pylint: disable=protected-access
    if isinstance(rate, tf.__internal__.tracking.Trackable) and hasattr(rate, "assign"):
        found["_learning_rate"] = rate
    return found
