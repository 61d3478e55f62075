"""Tensor parallelism (Megatron's) on TensorFlow: each layer split over T replicas.

The machinery, laid out as Megatron's `core/tensor_parallel/`; the model code that uses it
(which weights of an attention or MLP stage split, where f and g go) lives with the models
(tfpar.models.blocks). A split weight is one mirrored variable whose copies hold different
shards; outside the replicas it is its whole value, so T is a performance switch: the same
seed gives the same initial weights, the same training and the same files as T = 1.

- layout.py: which replicas form tensor-parallel (TP) and data-parallel groups; their
  collectives (one TensorFlow collective launcher per group)
- mappings.py: copy_to_region (f), reduce_from_region (g), scatter/gather, their gradients
- shards.py: split weights (made from one whole draw, whole-value checkpoints, slots)
- splitting.py: weights of Keras's own layers created split, by path (`split_weights`)
- layers.py: ColumnParallelLinear, RowParallelLinear; `row_parallel` for a Dense/EinsumDense
- random.py: dropout per rank inside the split region (Megatron's RNG tracker)
- keras_weights.py: Keras's weight APIs (get/set/save/load, count_params) take whole values
- data.py: the check that a TP group's replicas share their batch
- model_weights.py: a split model as a whole (layout, weights, bytes, calls from Python)

Example:
    >>> strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     model = GPT(vocab_size=256, dim=128, heads=4, tensor_parallel=2)
    ...     optimizer = keras.optimizers.AdamW(1e-3, global_clipnorm=1.0)
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy)
    >>> trainer.fit(tfpar.data.distribute_train(strategy, source, 32, tensor_parallel=2), steps=100)
"""

from tfpar.tensor_parallel.data import GroupBatchCheck, batch_differs, gather_group_batch, mismatch_error
from tfpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, current_layout, row_parallel
from tfpar.tensor_parallel.layout import Layout, TensorParallelError, check_degree, check_divides
from tfpar.tensor_parallel.mappings import (copy_to_region, gather_from_region, reduce_from_region,
                                            scatter_to_region)
from tfpar.tensor_parallel.model_weights import (copy_weights, full_weights, kernel_bytes_by_device, layout_of,
                                                 replicated_call, split_weight_count, unsplit)
from tfpar.tensor_parallel.random import split_region_dropout
from tfpar.tensor_parallel.shards import ShardSpec, shard_slots, spec_of, whole_shape
from tfpar.tensor_parallel.splitting import SplitRule, split_weight, split_weights

__all__ = ["ColumnParallelLinear", "GroupBatchCheck", "Layout", "RowParallelLinear", "ShardSpec", "SplitRule", "TensorParallelError",
           "batch_differs", "check_degree", "check_divides", "copy_to_region", "copy_weights", "current_layout", "full_weights",
           "gather_from_region", "gather_group_batch", "kernel_bytes_by_device", "layout_of", "mismatch_error", "reduce_from_region", "replicated_call",
           "row_parallel", "scatter_to_region", "shard_slots", "spec_of", "split_region_dropout", "split_weight",
           "split_weight_count", "split_weights", "unsplit", "whole_shape"]
