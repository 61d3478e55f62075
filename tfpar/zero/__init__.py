"""ZeRO: sharded data parallelism in tfpar's loop (`Trainer(shard="optimizer" | "gradients")`).

Each replica keeps and updates its own partition (1/R) of the optimizer state (ZeRO-1) and
of the accumulated gradients (ZeRO-2), with the user's own Keras optimizer. A ZeRO
*partition* is a replica's 1/R of every flattened variable; a tensor-parallel *shard*
(tfpar.tensor_parallel) is a block of one layer's weight: the two words name two things.

- partitions.py: which elements each replica owns (PartitionLayout), as boxes of each
  variable's shape, and which replicas share them (PartitionGroups: every replica, or each
  data-parallel group of a tensor-parallel model); the collectives that move them are
  tfpar.strategy.groups'
- optimizer.py: the user's optimizer run on the partitions (PartitionedOptimizer)
- checkpoint.py: the partitioned state in a checkpoint, in Keras's own layout, written
  as each replica's slices
- own_optimizer.py: the user's own optimizer object stands for the partitioned state
  (tf.train.Checkpoint, deferred restores, .keras files, a late weight-decay exclusion)
- files.py: under multi_worker_mirrored, one partition file per worker, merged by the chief
- checks.py: what is refused, by name, before anything is built
- update.py: the Trainer's sharded step (ZeroUpdate)

Example:
    >>> trainer = tfpar.Trainer(model, keras.optimizers.AdamW(1e-3), loss, strategy=strategy,
    ...                         shard="gradients", accumulate=4)
"""

from tfpar.zero.checks import GRADIENTS, MODES, NONE, OPTIMIZER, check_shard, check_variable
from tfpar.zero.partitions import BUCKET_BYTES, PartitionGroups, PartitionLayout
from tfpar.zero.update import ZeroUpdate, device_bytes, held_gradient_bytes, state_bytes, zero_update

__all__ = ["BUCKET_BYTES", "GRADIENTS", "MODES", "NONE", "OPTIMIZER", "PartitionGroups",
           "PartitionLayout", "ZeroUpdate", "check_shard", "check_variable", "device_bytes",
           "held_gradient_bytes", "state_bytes", "zero_update"]
