"""Tensor parallelism (Megatron's) for tfpar's transformers: each layer split over T replicas.

`GPT(..., tensor_parallel=T)` built under a strategy with a multiple of T replicas splits
attention by heads (QKV column-parallel, the output projection row-parallel) and the MLP
(first layer column-parallel, second row-parallel); tfpar.Trainer trains it (the gradients
of split weights are never summed across their TP group; replicated ones count once).

- layers.py: ColumnParallelLinear, RowParallelLinear (one class per idea)
- mappings.py: copy_to_region (f), reduce_from_region (g), scatter/gather, their gradients
- layout.py: which replicas form TP and data-parallel groups; their collectives
- shards.py: split weights (init, whole-value checkpoints, optimizer slots)
- stages.py: the tensor-parallel attention and MLP stages
- model_weights.py: a split model's weights as the unsplit model holds them, bytes per device

On a TPU the engine is XLA's SPMD partitioner, not these layers (docs/tensor_parallel.md).

Example:
    >>> strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     model = GPT(vocab_size=256, dim=128, heads=4, tensor_parallel=2)
    ...     optimizer = keras.optimizers.AdamW(1e-3, global_clipnorm=1.0)
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy)
    >>> trainer.fit(tfpar.data.distribute_train(strategy, source, 32, tensor_parallel=2), steps=100)
"""

from tfpar.models.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tfpar.models.tensor_parallel.layout import Layout, TensorParallelError, check_degree
from tfpar.models.tensor_parallel.mappings import (copy_to_region, gather_from_region, reduce_from_region,
                                                   scatter_to_region)
from tfpar.models.tensor_parallel.model_weights import (copy_weights, full_weights, kernel_bytes_by_device,
                                                        layout_of, replicated_call, unsplit)
from tfpar.models.tensor_parallel.shards import ShardSpec, shard_slots, spec_of
from tfpar.models.tensor_parallel.stages import (ParallelFeedForwardStage, ParallelSelfAttentionStage,
                                                 check_divides, parallel_transformer_stages)

__all__ = ["ColumnParallelLinear", "Layout", "ParallelFeedForwardStage", "ParallelSelfAttentionStage",
           "RowParallelLinear", "ShardSpec", "TensorParallelError", "check_degree", "check_divides",
           "copy_to_region", "copy_weights", "full_weights", "gather_from_region",
           "kernel_bytes_by_device", "layout_of", "reduce_from_region", "replicated_call", "scatter_to_region",
           "parallel_transformer_stages", "shard_slots", "spec_of", "unsplit"]
