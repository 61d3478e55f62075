"""A tensor-parallel model as a whole: its layout, its weights as the unsplit model holds
them, the bytes each device holds, and calling it from Python.

Example:
    >>> with strategy.scope():                                  # 2 replicas
    ...     model = GPT(vocab_size=256, tensor_parallel=2)
    >>> copy_weights(GPT(vocab_size=256), model)                 # an unsplit model's weights, split
    >>> [w.shape for w in full_weights(model)][:4]               # the unsplit model's shapes
    >>> kernel_bytes_by_device(model)                            # {'/job:.../CPU:0': ..., ...}
    >>> logits = replicated_call(model)(x)                       # from the cross-replica context
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import tensorflow as tf

from tfpar.models.tensor_parallel import shards
from tfpar.models.tensor_parallel.layout import Layout, TensorParallelError
from tfpar.models.tensor_parallel.stages import ParallelFeedForwardStage, ParallelSelfAttentionStage

PARALLEL_STAGES = (ParallelSelfAttentionStage, ParallelFeedForwardStage)


def layout_of(model) -> Layout | None:
    """The Layout the model's split layers were built with; None for an unsplit model."""
    for _, layer in _stages(model):
        if isinstance(layer, PARALLEL_STAGES) and getattr(layer, "tensor_parallel", 1) > 1:
            return layer.out.layout if isinstance(layer, ParallelSelfAttentionStage) else layer.down.layout
    return None


def _stages(model) -> list:
    stages = getattr(model, "stages", None)
    return stages() if callable(stages) else []


def _check_pair(source, target) -> list:
    a, b = _stages(source), _stages(target)
    if [n for n, _ in a] != [n for n, _ in b]:
        raise TensorParallelError("The two models have different stages: copy between a model and "
                                  "its tensor-parallel twin (the same class and sizes).")
    return list(zip(a, b))


def full_weights(model, read: Callable | None = None) -> list[np.ndarray]:
    """Every weight as the unsplit model's `get_weights()` lists them (split ones joined).
    `read(weight)`: a weight's whole value instead of the variable's (e.g. its gradient,
    joined from the replicas' shards), in the same layout.

    Example:
        >>> for mine, theirs in zip(full_weights(model), reference.get_weights()): ...
    """
    values = []
    for _, layer in _stages(model):
        if isinstance(layer, PARALLEL_STAGES):
            values += layer.full_weights(read)
        elif read is not None:
            values += [np.asarray(read(w)) for w in layer.weights]
        else:
            values += [np.asarray(w) for w in layer.get_weights()]
    return values


def copy_weights(source, target) -> None:
    """Gives `target` the weights of `source`; either may be split (eager, cross-replica).

    Example:
        >>> copy_weights(reference, model)      # the unsplit reference's weights, split
    """
    for (_, from_layer), (_, to_layer) in _check_pair(source, target):
        values = (from_layer.full_weights() if isinstance(from_layer, PARALLEL_STAGES)
                  else from_layer.get_weights())
        if isinstance(to_layer, PARALLEL_STAGES):
            to_layer.set_full_weights(values)
        else:
            to_layer.set_weights(values)


def unsplit(model, factory: Callable | None = None):
    """A plain (unsplit) copy of a tensor-parallel model, with its weights: for sampling,
    export, or loading into any strategy. `factory` builds the plain model (default: the
    model's class from its config with tensor_parallel=1)."""
    if factory is None:
        config = {**model.get_config(), "tensor_parallel": 1}
        config.pop("name", None)
        factory = lambda: type(model)(**config)  # noqa: E731
    plain = factory()
    copy_weights(model, plain)
    return plain


def kernel_bytes_by_device(model, split_only: bool = True) -> dict[str, int]:
    """Bytes of the model's weights held by each device, read from every copy of every
    variable (split weights: their shards; `split_only=False` adds the replicated ones)."""
    held = collections.Counter()
    for weight in model.weights:
        if split_only and shards.spec_of(weight) is None:
            continue
        for _, copy in shards.copies(weight):
            held[tf.DeviceSpec.from_string(copy.device).to_string()] += (
                int(np.prod(copy.shape)) * copy.dtype.size)
    return dict(held)


def replicated_call(model, strategy: tf.distribute.Strategy | None = None) -> Callable:
    """`f(x, training=False)` that runs a tensor-parallel model in every replica of its
    strategy on the same `x` and returns replica 0's output: for sampling or a quick
    forward from Python (its layers need a replica context).

    Example:
        >>> logits = replicated_call(model)(tf.constant(tokens))
    """
    layout = layout_of(model)
    strategy = strategy or (layout.strategy if layout is not None else tf.distribute.get_strategy())

    @tf.function(reduce_retracing=True)  # eagerly, the replicas' collectives would deadlock
    def run(x, training):
        return strategy.experimental_local_results(
            strategy.run(lambda x: model(x, training=training), args=(x,)))[0]

    def call(x, training=False):
        return run(tf.convert_to_tensor(x), bool(training))

    return call

