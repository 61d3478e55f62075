"""How the sharded update cuts the parameters, and the collectives that move the pieces.

Every trainable variable is flattened, padded with zeros to a multiple of R (the replica
count) and cut into R equal chunks; the replica of collective rank k owns chunk k of every
variable. So every replica holds the same structure (one piece per variable, the same
shapes), which is what tf.distribute needs to keep a per-replica variable, and a variable's
pieces are contiguous runs of its own elements (a per-variable quantity such as LAMB's
trust ratio is a sum over R pieces). The padding is at most R - 1 elements per variable.

In a checkpoint a replica's chunk of a variable is a few boxes of the variable's own shape
(`boxes`: a run of a flattened array is at most 2 boxes per dimension), each written as a
slice of the variable's key (`slice_spec`, TensorFlow's "full shape, then start,length per
dimension"), so the checkpoint reads like the whole variable's and any slice can be read.

A bucket is a run of consecutive variables (one wire dtype) whose rows are sent together:
`rows` lays a bucket's gradients out as [R, C] (row j: every variable's chunk j), the
reduce-scatter leaves each replica the sum of its own row ([C]), and the all-gather of the
updated pieces ([C] each) gives [R, C] back, which `unrows` turns into whole variables. A
bucket bounds the full-size concatenation that exists at one time.

Which replicas share the chunks (`PartitionGroups`): every replica, or, for a
tensor-parallel model, each data-parallel (DP) group (the replicas that hold the same
shards). Under tensor parallelism a split weight's chunks are chunks of its shard: the R
members of DP group t each hold 1/R of shard t, 1/(R T) of the whole weight; a replicated
weight is partitioned over each DP group alike (1/R of it per replica, the same chunks on
every TP rank). In a checkpoint a shard's box is then offset along the split axis to its
place in the whole weight (`whole_boxes`; a fused weight's box is cut at its parts).

The collectives are tfpar.strategy.groups' (replica context, inside tf.function): the
reduce-scatter (CollectiveReduceScatterV2 on NCCL; elsewhere an all-to-all of the rows,
then a local sum: the same bytes on the wire), the all-gather of equal-sized pieces (no
shape exchange) and the small all-reduces (norms, the finiteness flag), all through
TensorFlow's own collective launchers (the strategy's for every replica, so they also
run inside a `tf.cond` branch, where a merge_call cannot).

Example:
    >>> layout = PartitionLayout(model.trainable_variables, replicas=2)
    >>> layout.chunks           # elements each replica holds of each variable
    >>> groups = PartitionGroups(strategy)                   # under strategy.scope()
    >>> comm = groups.partition(here())                      # replica context
    >>> mine = comm.reduce_scatter(layout.rows(grads, layout.buckets[0]))   # [C]
    >>> layout.boxes(0, rank=1)  # [((8, 0), (12, 37))]: rows 8-19 of a [32, 37] kernel
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfpar.errors import ShardingError
from tfpar.strategy import groups
from tfpar.strategy.groups import GroupError, ReplicaGroup

#: Bytes of one bucket's rows (R x C elements in its wire dtype): the full-size
#: concatenation that the reduce-scatter and the all-gather hold at one time.
BUCKET_BYTES = 32 * 2 ** 20


class PartitionLayout:
    """Which elements of which variable each replica owns (see module docstring).

    Args:
      variables: the trainable variables, in the optimizer's order.
      replicas: R.
      bucket_bytes: the largest [R, C] rows of one bucket (a larger variable is a bucket alone).
    """

    def __init__(self, variables: Sequence, replicas: int, bucket_bytes: int = BUCKET_BYTES):
        self.replicas, self.bucket_bytes = replicas, bucket_bytes
        self.paths = [getattr(v, "path", v.name) for v in variables]
        self.shapes = [tuple(v.shape) for v in variables]
        self.dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self.sizes = [_size(path, shape) for path, shape in zip(self.paths, self.shapes)]
        self.chunks = [-(-n // replicas) for n in self.sizes]
        self.buckets = self.buckets_for(self.dtypes)

    def buckets_for(self, wire_dtypes: Sequence) -> list[list[int]]:
        """Runs of consecutive variables with one wire dtype (and one dtype), each at most
        `bucket_bytes` of rows (a larger variable is a bucket alone)."""
        kinds = [(tf.as_dtype(w), d) for w, d in zip(wire_dtypes, self.dtypes)]
        buckets: list[list[int]] = []
        used = 0
        for i, (chunk, kind) in enumerate(zip(self.chunks, kinds)):
            size = self.replicas * chunk * kind[0].size
            if buckets and kinds[buckets[-1][-1]] == kind and used + size <= self.bucket_bytes:
                buckets[-1].append(i)
                used += size
            else:
                buckets.append([i])
                used = size
        return buckets

    @property
    def shard_elements(self) -> int:
        """Elements of every variable one replica owns (its piece of the flat parameters)."""
        return sum(self.chunks)

    @property
    def padding(self) -> int:
        """Zeros added so that every variable divides into R chunks (all replicas together)."""
        return sum(self.replicas * c - n for c, n in zip(self.chunks, self.sizes))

    def chunk(self, tensor: tf.Tensor, index: int, rank: int) -> tf.Tensor:
        """Chunk `rank` ([c]) of variable `index`'s value (or gradient), zero-padded."""
        size, chunk = self.sizes[index], self.chunks[index]
        start, stop = min(rank * chunk, size), min((rank + 1) * chunk, size)
        piece = tf.reshape(tensor, [-1])[start:stop]
        if stop - start < chunk:
            piece = tf.pad(piece, [[0, chunk - (stop - start)]])
        return piece

    def run(self, index: int, rank: int) -> tuple[int, int]:
        """[start, stop) of the flattened variable `index` that rank `rank` owns (empty for
        a rank that holds padding only)."""
        size, chunk = self.sizes[index], self.chunks[index]
        return min(rank * chunk, size), min((rank + 1) * chunk, size)

    def boxes(self, index: int, rank: int) -> list:
        """Rank `rank`'s elements of variable `index` as boxes of the variable's shape,
        ((start, ...), (length, ...)) in flat order; [] for a rank that holds padding only.
        A scalar (or an empty variable) is one box `None`, the whole, owned by rank 0."""
        if not self.shapes[index] or self.sizes[index] == 0:
            return [None] if rank == 0 else []
        return flat_run_boxes(self.shapes[index], *self.run(index, rank))

    def rows(self, tensors: Sequence[tf.Tensor], bucket: Sequence[int]) -> tf.Tensor:
        """A bucket's tensors (whole, indexed by variable, in one dtype) as [R, C]: row j
        holds chunk j of each."""
        parts = []
        for i in bucket:
            flat = tf.reshape(tensors[i], [-1])
            padded = tf.pad(flat, [[0, self.replicas * self.chunks[i] - self.sizes[i]]])
            parts.append(tf.reshape(padded, [self.replicas, self.chunks[i]]))  # (R, c_i)
        return tf.concat(parts, axis=1) if len(parts) > 1 else parts[0]

    def split(self, shard: tf.Tensor, bucket: Sequence[int]) -> list[tf.Tensor]:
        """A bucket's [C] (this replica's row) as one [c_i] piece per variable."""
        return tf.split(shard, [self.chunks[i] for i in bucket]) if len(bucket) > 1 else [shard]

    def unrows(self, gathered: tf.Tensor, bucket: Sequence[int]) -> list[tf.Tensor]:
        """[R, C] rows of a bucket (row k: rank k's pieces) -> each variable whole."""
        columns = tf.split(gathered, [self.chunks[i] for i in bucket], axis=1) if len(bucket) > 1 else [gathered]
        return [tf.reshape(tf.reshape(column, [-1])[:self.sizes[i]], self.shapes[i])  # (R c_i,) -> shape
                for i, column in zip(bucket, columns)]

    def describe(self) -> dict:
        """The layout in numbers: what a checkpoint or a report needs to name it."""
        return {"replicas": self.replicas, "variables": len(self.sizes), "elements": sum(self.sizes),
                "shard_elements": self.shard_elements, "padding": self.padding,
                "buckets": len(self.buckets)}


def flat_run_boxes(shape: Sequence[int], start: int, stop: int) -> list:
    """Elements [start, stop) of a row-major array of `shape` as boxes
    ((start, ...), (length, ...)), in flat order: a partial leading row, whole rows, a
    partial trailing row, each partial row split the same way one dimension down.

    Example:
        >>> flat_run_boxes((4, 6), 3, 15)   # rest of row 0, row 1, first 3 of row 2
        [((0, 3), (1, 3)), ((1, 0), (1, 6)), ((2, 0), (1, 3))]
    """
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = 1
    for d in shape[1:]:
        inner *= int(d)
    (first, head), (last, tail) = divmod(start, inner), divmod(stop, inner)

    def within(row: int, a: int, b: int) -> list:  # elements [a, b) of one row
        return [((row, *s), (1, *n)) for s, n in flat_run_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, head, tail)
    found = []
    if head:
        found += within(first, head, inner)
        first += 1
    if last > first:
        found.append(((first, *[0] * (len(shape) - 1)), (last - first, *[int(d) for d in shape[1:]])))
    if tail:
        found += within(last, 0, tail)
    return found


def slice_spec(shape: Sequence[int], box) -> str:
    """TensorFlow's slice spec of a box of a variable of `shape` ("" for the whole, None).

    Example:
        >>> slice_spec((4, 6), ((1, 0), (2, 6)))
        '4 6 1,2:0,6'
    """
    if box is None:
        return ""
    starts, lengths = box
    return " ".join(str(int(d)) for d in shape) + " " + ":".join(f"{s},{n}" for s, n in zip(starts, lengths))


def _size(path: str, shape: tuple) -> int:
    if any(d is None for d in shape):
        raise ShardingError(f"Variable {path} has shape {shape}: the sharded update flattens every "
                            "trainable variable and needs its full shape. Give the layer a fixed "
                            "input shape (build the model on keras.Input) or train with shard='none'.")
    size = 1
    for d in shape:
        size *= int(d)
    return size


def whole_boxes(box, spec, shard_shape: Sequence[int], rank: int) -> list:
    """A box of tensor-parallel shard `rank` (in the shard's coordinates; `spec` its
    ShardSpec) as boxes of the whole weight, one per fused part it crosses:
    [(whole box, (start, stop) along spec.axis within `box`)].

    Example:
        >>> spec = ShardSpec(axis=1, degree=2, parts=3)      # [4, 12] = q | k | v, shards [4, 6]
        >>> whole_boxes(((0, 2), (4, 4)), spec, (4, 6), rank=1)   # k_1 and v_1
        [(((0, 6), (4, 2)), (0, 2)), (((0, 10), (4, 2)), (2, 4))]
    """
    starts, lengths = box
    axis, width = spec.axis, int(shard_shape[spec.axis]) // spec.parts  # one part of one shard
    first, stop = starts[axis], starts[axis] + lengths[axis]
    found = []
    for part in range(first // width, -(-stop // width)):
        lo, hi = max(first, part * width), min(stop, (part + 1) * width)
        whole_start = part * width * spec.degree + rank * width + lo - part * width
        new_starts = tuple(whole_start if d == axis else s for d, s in enumerate(starts))
        new_lengths = tuple(hi - lo if d == axis else n for d, n in enumerate(lengths))
        found.append(((new_starts, new_lengths), (lo - first, hi - first)))
    return found


class PartitionGroups:
    """Which replicas share a ZeRO run's chunks, and the groups its collectives run over.

    Without tensor parallelism every replica is one partition group (the strategy's own
    launchers). With a tensor-parallel `tensor_layout` each data-parallel group is one (its
    R members hold the chunks of one shard), each replica's tensor-parallel group sums the
    replicated weights' gradients, and the layout's group of every replica agrees on the
    norms. Made under `strategy.scope()`: it reads the collective ranks (a gather every
    worker reaches), which decide which chunk a replica owns.

    Example:
        >>> groups = PartitionGroups(strategy, layout_of(model))
        >>> groups.replicas, groups.ranks          # R, {replica id: its chunk}
    """

    def __init__(self, strategy, tensor_layout=None):
        self.tensor_layout = tensor_layout
        try:
            if tensor_layout is None:
                self.world = groups.world(strategy)
                self.partitions = [self.world]
            else:
                self.world, self.partitions = tensor_layout.world, list(tensor_layout.dp)
            groups.measure_ranks(strategy, self.partitions, self.world)
        except GroupError as e:
            raise ShardingError(f"{e} The sharded update runs under mirrored or multi_worker_mirrored.") from None
        self.replicas = self.partitions[0].size
        #: replica id -> its rank in its partition group (the chunk it owns), every replica
        self.ranks = {r: k for g in self.partitions for r, k in g.ranks.items()}
        #: replica id -> its tensor-parallel rank (the shard it holds); None: not split
        self.tensor_ranks = None if tensor_layout is None else {
            r: tensor_layout.rank(r) for r in range(tensor_layout.replicas)}

    def partition(self, replica: int) -> ReplicaGroup:
        """The group whose members share `replica`'s chunks."""
        return next(g for g in self.partitions if replica in g)

    def tensor(self, replica: int) -> ReplicaGroup | None:
        """`replica`'s tensor-parallel group (None without tensor parallelism)."""
        return None if self.tensor_layout is None else self.tensor_layout.tp_group(replica)
