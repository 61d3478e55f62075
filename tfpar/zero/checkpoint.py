"""The sharded optimizer in a checkpoint, in the layout Keras's own optimizer writes.

Each slot (Adam's m and v, momentum, an EMA average) is saved whole: its R pieces put
back together, the padding dropped, the variable's shape, under the key Keras gives the
unsharded optimizer's slot (`optimizer/_variables/<k>`, `optimizer/_iterations`, and under
fp16 `optimizer/dynamic_scale`, `optimizer/step_counter`, `optimizer/inner_optimizer/...`).
So the layout a checkpoint needs is the model's own: a sharded run restores under any
replica count (each replica takes its chunk of the whole slot), an unsharded run restores
a sharded checkpoint and the other way round, and tfpar's Checkpoints (fingerprint,
integrity, resume) need nothing new. The rows are put together only when a checkpoint is
written (on this worker's host; across workers by an all-gather that every worker reaches,
as every worker saves), never when one is restored.

Example:
    >>> tf.train.Checkpoint(optimizer=optimizer_view(partitioned_optimizer, layout, ranks))
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.compression import replica_state
from tfpar.strategy import private_api

VALUE = "VARIABLE_VALUE"  # the attribute every tf.Variable saves under


class PartitionValue(tf.__internal__.tracking.Trackable):
    """One per-replica slot of variable `index`, saved and restored whole."""

    def __init__(self, variable, index: int, layout, ranks: dict[int, int]):
        self.variable, self.index, self.layout, self.ranks = variable, index, layout, ranks
        self._gather = None

    def _serialize_to_tensors(self) -> dict:
        variable = _tf_variable(self.variable)
        first = variable.values[0] if isinstance(variable, tf.distribute.DistributedValues) else variable
        host = tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
            device_type="CPU", device_index=0).to_string()
        return {VALUE: private_api.save_spec(lambda: self._whole(host), variable.dtype, host)}

    def _whole(self, host: str) -> tf.Tensor:
        """The slot whole ([R, c] rows in rank order, unpadded, in the variable's shape)."""
        variable = _tf_variable(self.variable)
        with tf.device(host):
            if not isinstance(variable, tf.distribute.DistributedValues):
                rows = tf.convert_to_tensor(variable)[None]
            elif len(variable.values) == variable.distribute_strategy.num_replicas_in_sync:
                rows = replica_state.stacked(variable)  # every replica on this worker
            else:
                if self._gather is None:
                    self._gather = replica_state.gathered(variable)
                rows = self._gather()
            by_rank = sorted(self.ranks, key=self.ranks.get)  # replica id of rank 0, 1, ...
            return self.layout.unrows(tf.gather(rows, by_rank), [self.index])[0]

    def _restore_from_tensors(self, restored_tensors: dict):
        whole = restored_tensors[VALUE]
        shape = self.layout.shapes[self.index]
        if whole.shape.rank is not None and tuple(whole.shape) != shape:
            raise ValueError(f"the checkpoint's slot of {self.layout.paths[self.index]} has shape "
                             f"{tuple(whole.shape)}, the model's variable {shape}")
        ids, copies = replica_state.components(_tf_variable(self.variable))
        return tf.group([copy.assign(self.layout.chunk(whole, self.index, self.ranks[i]))
                         for i, copy in zip(ids, copies)])


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


class _Children(tf.__internal__.tracking.Trackable):
    """A checkpoint node whose children are given by name."""

    def __init__(self, children: dict):
        for name, child in children.items():
            self._track_trackable(child, name)


def optimizer_view(shard, layout, ranks: dict[int, int]):
    """The checkpoint node of the sharded optimizer, as Keras would save `shard.optimizer`."""
    inner = _inner_view(shard, layout, ranks)
    if not shard.loss_scaled:
        return inner
    outer = shard.optimizer  # the LossScaleOptimizer: its own counter, then the inner one's
    children = {"dynamic_scale": shard.scale, "step_counter": shard.counter, "inner_optimizer": inner,
                **_counter_and_rate(outer), **_trainable(shard)}
    return _Children(children)


def _inner_view(shard, layout, ranks):
    clone, slots = shard.clone, {}
    for k, variable in enumerate(clone.variables):
        if k < shard.own_variables:  # the copy's own counter and rate: the caller's are saved
            continue
        index = shard.slot_of.get(k)
        slots[str(k)] = variable if index is None else PartitionValue(variable, index, layout, ranks)
    return _Children({**_counter_and_rate(shard.base), **_trainable(shard), "_variables": _Children(slots)})


def _trainable(shard) -> dict:
    """The model's variables, where a built Keras optimizer lists them (its checkpoint keys)."""
    return {"_trainable_variables": _Children({str(i): v for i, v in enumerate(shard.variables)})}


def _counter_and_rate(optimizer) -> dict:
    found = {"_iterations": optimizer._iterations}  # pylint: disable=protected-access
    rate = optimizer._learning_rate  # pylint: disable=protected-access
    if isinstance(rate, tf.__internal__.tracking.Trackable) and hasattr(rate, "assign"):
        found["_learning_rate"] = rate
    return found
