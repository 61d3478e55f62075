"""Which replicas form a tensor-parallel group, and the collectives of each group.

T-way tensor parallelism over a strategy's N replicas (global order) makes N / T
tensor-parallel (TP) groups of T consecutive replicas: the replicas of a group see the
same batch and hold different shards of each split layer (TP rank r holds shard r).
Replicas with the same TP rank form the data-parallel (DP) groups: they hold the same
shards and see different batches. With T = N there is one TP group and no DP group of
more than one replica.

    replicas 0 1 2 3, T = 2:   TP groups {0, 1} {2, 3}     DP groups {0, 2} {1, 3}

Each group is a tfpar.strategy.groups.ReplicaGroup: TensorFlow's own collective launcher
over its devices, with its own group key (the same CollectiveReduceV2 the strategy
issues), plus one group of every replica (its own key too) for the replicated weights'
sums. Across workers the keys agree because every worker numbers the groups alike. The
layout keeps only which replicas form which group; the collectives are the groups'.

Example:
    >>> with strategy.scope():                    # mirrored over 4 devices
    ...     layout = Layout.of(tf.distribute.get_strategy(), 2)
    >>> layout.tp_groups, layout.dp_groups
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> layout.tp_group(3).all_reduce(partial)  # in replica 3's context: over replicas {2, 3}
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.errors import TfparError
from tfpar.strategy import groups
from tfpar.strategy.groups import ReplicaGroup, local_replica_ids  # noqa: F401  (re-exported)


class TensorParallelError(TfparError, ValueError):
    """A tensor-parallel degree, model or call that cannot work; the message names the fix."""


_LAYOUTS: dict = {}  # (id(strategy), degree) -> (strategy, Layout): one per strategy and T


class Layout:
    """T-way tensor parallelism over `strategy`'s replicas (see module docstring).

    Use `Layout.of(strategy, T)`: one layout (and one set of collective groups) per
    strategy and degree.
    """

    def __init__(self, strategy: tf.distribute.Strategy, degree: int):
        check_degree(strategy, degree)
        self.strategy, self.degree = strategy, degree
        self.replicas = strategy.num_replicas_in_sync
        self.groups = self.replicas // degree
        self.tp_groups = [[g * degree + r for r in range(degree)] for g in range(self.groups)]
        self.dp_groups = [[g * degree + r for g in range(self.groups)] for r in range(degree)]
        self.device_of = groups.local_devices(strategy)  # this worker's replicas only
        self.tp = groups.subsets(strategy, self.tp_groups)
        self.dp = groups.subsets(strategy, self.dp_groups)
        self.world = (self.tp[0] if self.groups == 1 else  # T = N: the one TP group is every replica
                      groups.subsets(strategy, [list(range(self.replicas))])[0])

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy, degree: int) -> "Layout":
        """The layout of `degree`-way tensor parallelism over `strategy` (made once)."""
        key = (id(strategy), degree)
        if key not in _LAYOUTS:
            if len(_LAYOUTS) > 32:
                _LAYOUTS.clear()
            _LAYOUTS[key] = (strategy, cls(strategy, degree))  # holding it keeps its id unique
        return _LAYOUTS[key][1]

    def rank(self, replica_id: int) -> int:
        """The TP rank (which shard) of global replica `replica_id`."""
        return replica_id % self.degree

    def here(self) -> int:
        """The global id of the replica whose step is being traced (replica context).

        Raises:
            TensorParallelError: outside a replica context of this layout's strategy.
        """
        context = tf.distribute.get_replica_context()
        replica = None if context is None else tf.get_static_value(context.replica_id_in_sync_group)
        if context is None or replica is None or context.strategy is not self.strategy and self.replicas > 1:
            raise TensorParallelError(
                f"A {self.degree}-way tensor-parallel layer runs inside strategy.run of the strategy "
                "it was built under (tfpar.Trainer does); its replicas hold different shards. To "
                "call the model from Python, use tensor_parallel.replicated_call(model, strategy), "
                "or tensor_parallel.unsplit(model) for a whole copy.")
        return int(replica)

    def tp_group(self, replica_id: int) -> ReplicaGroup:
        """The TP group of global replica `replica_id` (its ranks: the shards it holds)."""
        return self.tp[replica_id // self.degree]

    def dp_group(self, replica_id: int) -> ReplicaGroup:
        """The DP group of global replica `replica_id`: the replicas that hold its shards."""
        return self.dp[self.rank(replica_id)]

    def tp_launcher(self, replica_id: int):
        """The launcher of this replica's TP group, on its device."""
        return self.tp_group(replica_id).launcher(replica_id)

    def dp_launcher(self, replica_id: int):
        """The launcher of this replica's DP group (None when the DP group is one replica)."""
        if self.groups == 1:
            return None
        return self.dp_group(replica_id).launcher(replica_id)

    def world_launcher(self, replica_id: int):
        """The launcher of the group of every replica (its own group key), on this replica's
        device: what replicated weights' gradients are summed over."""
        return self.world.launcher(replica_id)

    def tp_all_reduce(self, tensor: tf.Tensor) -> tf.Tensor:
        """SUM over this replica's TP group (replica context). bfloat16 is summed in float32
        (TensorFlow's NCCL path cannot sum bfloat16)."""
        return self.tp_group(self.here()).all_reduce(tensor)

    def tp_all_gather(self, tensor: tf.Tensor, axis: int) -> tf.Tensor:
        """Concatenation along `axis` of every TP rank's `tensor`, in rank order (its static
        shape kept: the launcher's gather loses it)."""
        return self.tp_group(self.here()).all_gather(tensor, axis)

    def describe(self) -> str:
        return (f"{self.degree}-way tensor parallel x {self.groups} data-parallel group(s) over "
                f"{self.replicas} replica(s): TP groups {self.tp_groups}")


def check_degree(strategy: tf.distribute.Strategy, degree: int) -> None:
    """Refuses a degree that does not fit the strategy's replicas, naming the fix."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise TensorParallelError(f"tensor_parallel must be a positive integer, got {degree!r}.")
    replicas = strategy.num_replicas_in_sync
    if degree > replicas:
        raise TensorParallelError(
            f"tensor_parallel={degree} needs {degree} replicas (one per shard) but the strategy "
            f"has {replicas}: build the model under a strategy with a multiple of {degree} "
            f"replicas (e.g. tfpar.create_strategy('mirrored', devices=[...{degree} devices]), or "
            f"--config.strategy=mirrored --config.strategy_args.virtual_devices={degree} on a "
            "CPU), or lower tensor_parallel.")
    if replicas % degree:
        raise TensorParallelError(
            f"tensor_parallel={degree} does not divide the strategy's {replicas} replicas into "
            f"tensor-parallel groups: use a degree that divides {replicas}, or "
            f"{replicas // degree * degree or degree} replicas.")
    if isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.ParameterServerStrategy)):
        raise TensorParallelError(
            f"tensor_parallel under {type(strategy).__name__}: the layers' collectives run under "
            "mirrored or multi_worker_mirrored. On a TPU the engine is XLA's own sharding "
            "(docs/tensor_parallel.md: not built in tfpar); under parameter_server "
            "there are no replica groups to split a layer over.")


def check_divides(degree: int, heads: int | None = None, hidden: int | None = None) -> None:
    """T must be a positive integer that splits the heads and the MLP's hidden width into
    equal shards (1: unsplit)."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise TensorParallelError(f"tensor_parallel must be a positive integer (1: unsplit), got {degree!r}.")
    if heads is not None and heads % degree:
        raise TensorParallelError(
            f"tensor_parallel={degree} does not divide the {heads} attention heads (each rank holds "
            f"whole heads): use a degree that divides {heads}, or a multiple of {degree} heads.")
    if hidden is not None and hidden % degree:
        raise TensorParallelError(
            f"tensor_parallel={degree} does not divide the MLP width {hidden}: use a degree that "
            f"divides {hidden}.")
