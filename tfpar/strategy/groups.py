"""Groups of a strategy's replicas, and TensorFlow's collectives over each: the one owner
of group collectives, for tensor parallelism and ZeRO alike.

tf.distribute gives a strategy one collective group, all its replicas, and two
collectives in a replica context (`all_reduce`, `all_gather`, both merge_calls, refused
inside a `tf.cond` branch). Tensor parallelism needs groups of some replicas (a
tensor-parallel group, a data-parallel group: tfpar.tensor_parallel.layout) and ZeRO needs
what tf.distribute does not expose (reduce-scatter, all-to-all, an all-gather without its
shape exchange: tfpar.zero). A `ReplicaGroup` is either

- the world (`world(strategy)`): every replica, through the strategy's own collective
  launchers (its group key, call-time instance keys and ordering token), so its
  collectives are keyed and ordered like the strategy's own; or
- a subset (`subsets(strategy, groups)`): TensorFlow's own `CollectiveReplicaLauncher`
  over the subset's devices with a group key of its own (issuing the same
  CollectiveReduceV2 / CollectiveGatherV2 / CollectiveAllToAllV2). Across workers the keys
  agree because every worker makes every group, in the same order.

Its ops run in a replica context, inside tf.function, and every member calls them:

| op | what each member gets | TensorFlow op |
| --- | --- | --- |
| `all_reduce(t)`, `batch_all_reduce([t, ...])` | the sum (bfloat16 summed in float32) | CollectiveReduceV2 |
| `all_gather(t, axis)` | every member's `t` along `axis`, in rank order (any length) | a shape exchange, then CollectiveGatherV2 |
| `all_gather_same_shape(t)` | every member's `t` along axis 0 (equal shapes) | CollectiveGatherV2 |
| `all_to_all(t)` | `t` is [G, ...]: row j goes to rank j; row i came from rank i | CollectiveAllToAllV2 |
| `reduce_scatter(rows)` | `rows` is [G, C]: the sum of row `rank()` over the group, [C] | CollectiveReduceScatterV2 on NCCL; elsewhere all-to-all, then a sum (the same bytes) |
| `rank()` | this replica's rank in the group | none |

A group of one replica issues nothing (each op returns its input as the group's result).
The rank of a member is where a gather puts its tensor: a subset's members in the order
given, until `measure_ranks` reads the order TensorFlow's collectives actually use (ZeRO
measures it: it decides which chunk a replica owns). Every private TensorFlow name these
touch is in tfpar.strategy.private_api.

Example:
    >>> tp_groups = subsets(strategy, [[0, 1], [2, 3]])       # under strategy.scope()
    >>> group = tp_groups[here() // 2]                        # in replica context
    >>> summed = group.all_reduce(partial)                    # over replicas {0, 1} or {2, 3}
    >>> mine = world(strategy).reduce_scatter(rows)           # rows [4, C] -> [C]
"""

from __future__ import annotations

import weakref
from typing import Sequence

import tensorflow as tf

from tfpar.errors import TfparError
from tfpar.strategy import private_api


class GroupError(TfparError, RuntimeError):
    """A group collective called where it cannot run; the message says where it can."""


def here() -> int:
    """The global id of the replica whose step is being traced (replica context).

    Raises:
        GroupError: outside a replica context (strategy.run).
    """
    context = tf.distribute.get_replica_context()
    replica = None if context is None else tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        raise GroupError("A group collective runs in a replica context: call it inside "
                         "strategy.run(...) within a tf.function.")
    return int(replica)


def local_replica_ids(strategy) -> list[int]:
    """Global replica ids of this worker's replicas, in the order of its devices."""
    if strategy.num_replicas_in_sync == 1:
        return [0]
    ids: list[int] = []

    def note(context):  # called once per local replica, in local order
        ids.append(int(context.replica_id_in_sync_group))
        return tf.constant(0)

    strategy.experimental_distribute_values_from_function(note)
    return ids


def local_devices(strategy) -> dict[int, str]:
    """{global replica id: its device} for this worker's replicas."""
    if strategy.num_replicas_in_sync == 1:
        first = tf.config.list_logical_devices()[0].name
        return {0: tf.DeviceSpec.from_string(first).to_string()}
    return dict(zip(local_replica_ids(strategy), strategy.extended.worker_devices))


class ReplicaGroup:
    """Some replicas of one strategy and TensorFlow's collectives over them (see module
    docstring). Make one with `world` or `subsets`.

    Args:
      members: global replica ids, in rank order (until `measure_ranks`).
      launchers: {global replica id: its CollectiveReplicaLauncher} for this worker's
        members; empty for a group of one replica without a launcher.
    """

    def __init__(self, members: Sequence[int], launchers: dict):
        self.members = [int(m) for m in members]
        self.size = len(self.members)
        self.launchers = dict(launchers)
        self.ranks = {m: k for k, m in enumerate(self.members)}
        self.measured = self.size == 1
        #: whether the reduce-scatter runs on NCCL (GPU launchers that use it)
        self.nccl = any(private_api.launcher_uses_nccl(l) for l in self.launchers.values())

    def __contains__(self, replica: int) -> bool:
        return replica in self.ranks

    def __repr__(self) -> str:
        return f"ReplicaGroup({self.members})"

    def rank(self, replica: int | None = None) -> int:
        """The rank of `replica` (default: the one being traced) in this group."""
        return self.ranks[here() if replica is None else replica]

    def launcher(self, replica: int | None = None):
        """The CollectiveReplicaLauncher of `replica` (default: the one being traced)."""
        replica = here() if replica is None else replica
        if replica not in self.launchers:
            raise GroupError(f"Replica {replica} is not a member of {self} on this worker.")
        return self.launchers[replica]

    # -- the ops (replica context) -------------------------------------------------------

    def all_reduce(self, tensor: tf.Tensor) -> tf.Tensor:
        """The SUM over the group; bfloat16 is summed in float32 (NCCL cannot sum it)."""
        if self.size == 1:
            return tensor
        launcher = self.launcher()
        if tensor.dtype == tf.bfloat16:
            return tf.cast(private_api.launcher_all_reduce(launcher, tf.cast(tensor, tf.float32)), tf.bfloat16)
        return private_api.launcher_all_reduce(launcher, tensor)

    def batch_all_reduce(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor summed over the group, in one packed all-reduce."""
        if self.size == 1:
            return list(tensors)
        return private_api.launcher_batch_all_reduce(self.launcher(), list(tensors))

    def all_gather(self, tensor: tf.Tensor, axis: int = 0) -> tf.Tensor:
        """Every member's `tensor` concatenated along `axis` in rank order (lengths along
        `axis` may differ; the static shape is kept where it is known)."""
        if self.size == 1:
            return tensor
        gathered = private_api.launcher_all_gather(self.launcher(), tensor, axis)
        shape = tensor.shape.as_list() if tensor.shape.rank is not None else None
        if shape is not None:
            shape[axis] = None if shape[axis] is None else shape[axis] * self.size
            gathered.set_shape(shape)
        return gathered

    def all_gather_same_shape(self, tensor: tf.Tensor) -> tf.Tensor:
        """Every member's `tensor` (one shape on all) concatenated along axis 0 in rank
        order: one CollectiveGatherV2, no shape exchange; callable inside a tf.cond branch."""
        if self.size == 1:
            return tensor
        return private_api.launcher_all_gather_same_shape(self.launcher(), tensor)

    def all_to_all(self, tensor: tf.Tensor) -> tf.Tensor:
        """`tensor` [G, ...]: row j goes to the member of rank j; returns [G, ...], row i
        from the member of rank i."""
        if self.size == 1:
            return tensor
        return private_api.launcher_all_to_all(self.launcher(), tensor)

    def reduce_scatter(self, rows: tf.Tensor) -> tf.Tensor:
        """[G, C] rows on every member -> the sum of row `rank()` over the members, [C].

        On NCCL: CollectiveReduceScatterV2. Elsewhere TensorFlow has none ("did not find
        collective implementation undef" on CPU): an all-to-all of the rows, then their sum
        in the members' order (the same order in every group of one layout: groups that
        scatter equal rows get equal bits). The same bytes on the wire either way.
        """
        if self.size == 1:
            return rows[0]
        if self.nccl:
            summed = private_api.launcher_reduce_scatter(self.launcher(), tf.reshape(rows, [-1]))
            return tf.ensure_shape(summed, rows.shape[1:])  # the op leaves its length unknown
        received = self.all_to_all(rows)  # row i from rank i
        order = [self.ranks[m] for m in self.members]
        if order != list(range(self.size)):
            received = tf.gather(received, order)  # row j from members[j]
        return tf.reduce_sum(received, axis=0)


# -- making groups --------------------------------------------------------------------

_WORLDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def world(strategy) -> ReplicaGroup:
    """Every replica of `strategy`, through its own collective launchers (made once per
    strategy).

    Raises:
        GroupError: a strategy with several replicas but no collective launchers (e.g.
        MirroredStrategy with NCCL or reduction-to-one cross-device ops, TPUStrategy).
    """
    if strategy not in _WORLDS:
        replicas = strategy.num_replicas_in_sync
        launchers = private_api.strategy_launchers(strategy) if replicas > 1 else []
        if replicas > 1 and not launchers:
            raise GroupError(f"{type(strategy).__name__} has no collective launchers: group collectives "
                             "run under mirrored (with collective all-reduce, tfpar's default) or "
                             "multi_worker_mirrored.")
        _WORLDS[strategy] = ReplicaGroup(range(replicas), dict(zip(local_replica_ids(strategy), launchers)))
    return _WORLDS[strategy]


def subsets(strategy, groups: Sequence[Sequence[int]]) -> list[ReplicaGroup]:
    """A ReplicaGroup for each list of global replica ids in `groups` (every group of the
    run, also those with no member on this worker: every worker numbers them alike, so
    their group keys agree), each with TensorFlow's own launchers over its devices and a
    group key of its own. Make them once (at build), in the same order on every worker.

    Example:
        >>> dp = subsets(strategy, [[0, 2], [1, 3]])
    """
    device_of = local_devices(strategy)

    def named(group):  # a remote member only fills the key table: any unique name does
        return [device_of.get(i, f"/job:remote/replica:0/task:0/device:CPU:{i}") for i in group]

    found = private_api.group_launchers([named(g) for g in groups], list(device_of.values()), strategy)
    replica_of = {device: replica for replica, device in device_of.items()}
    return [ReplicaGroup(group, {replica_of[d]: launcher for d, launcher in by_device.items()})
            for group, by_device in zip(groups, found)]


def measure_ranks(strategy, partition: Sequence[ReplicaGroup], world_group: ReplicaGroup | None = None) -> None:
    """Sets `ranks` of every group in `partition` (disjoint groups, one size, that cover
    every replica: e.g. all data-parallel groups, or [the world]) to the order TensorFlow's
    collectives give their members: one gather of the replica ids over each group and,
    for several groups, one over `world_group`, so every worker knows every group's order.
    A collective: every worker calls it, once per partition (measured groups are skipped).
    """
    partition = list(partition)
    if all(g.measured for g in partition):
        return
    if len(partition) > 1 and world_group is None:
        raise ValueError("measure_ranks of several groups needs the world group to share their orders.")

    def order():  # replica context: this replica's group's ids in rank order (then every group's)
        replica = here()
        group = next(g for g in partition if replica in g)
        ids = group.all_gather_same_shape(tf.reshape(tf.constant(replica, tf.int32), [1]))  # (G,)
        return ids if len(partition) == 1 else world_group.all_gather_same_shape(ids[None])  # (N, G)

    found = strategy.experimental_local_results(tf.function(lambda: strategy.run(order))())[0]
    rows = found.numpy().reshape(-1, partition[0].size)
    for group in partition:
        row = next((r for r in rows if sorted(int(i) for i in r) == sorted(group.members)), None)
        if row is None:
            raise GroupError(f"The collectives of {group} did not gather its members' ids "
                             f"({rows.tolist()}): its launchers are not one group.")
        group.ranks = {int(replica): k for k, replica in enumerate(row)}
        group.measured = True
