"""A tensor-parallel model as a whole: its layout (read from its variables), its weights as
the unsplit model holds them, the bytes each device holds, and calling it from Python.

A model is split when some of its variables are (their shard specs, whatever layer made
them: tfpar's stages, Megatron's ColumnParallelLinear / RowParallelLinear, a Keras layer
created inside `split_weights`); its weights are then, outside the replicas, exactly the
unsplit model's (tfpar.tensor_parallel.keras_weights), so `get_weights` / `set_weights`
move weights between a model and its split twin.

Example:
    >>> with strategy.scope():                                  # 2 replicas
    ...     model = GPT(vocab_size=256, tensor_parallel=2)
    >>> layout_of(model).degree                                  # 2
    >>> copy_weights(GPT(vocab_size=256), model)                 # an unsplit model's weights, split
    >>> kernel_bytes_by_device(model)                            # {'/job:.../CPU:0': ..., ...}
    >>> logits = replicated_call(model)(x)                       # from the cross-replica context
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import tensorflow as tf

from tfpar.tensor_parallel import shards
from tfpar.tensor_parallel.layout import Layout, TensorParallelError


def layout_of(model) -> Layout | None:
    """The Layout the model's split weights were split over; None for an unsplit model.

    Raises:
        TensorParallelError: weights split over different layouts (degrees or strategies).
    """
    found = {id(layout): layout for layout in map(shards.layout_of_variable, model.weights) if layout is not None}
    if len(found) > 1:
        described = "; ".join(layout.describe() for layout in found.values())
        raise TensorParallelError(f"{model.name}'s weights are split over {len(found)} layouts ({described}): "
                                  "build every split layer of a model with one degree under one strategy.")
    return next(iter(found.values()), None)


def split_weight_count(model) -> int:
    """How many of the model's weights are split."""
    return sum(shards.spec_of(v) is not None for v in model.weights)


def full_weights(model, read: Callable | None = None) -> list[np.ndarray]:
    """Every weight as the unsplit model's `get_weights()` lists them. `read(weight)`: a
    weight's whole value instead of the variable's (e.g. its gradient, joined from the
    replicas' shards).

    Example:
        >>> for mine, theirs in zip(full_weights(model), reference.get_weights()): ...
    """
    if read is None:
        return model.get_weights()
    return [np.asarray(read(w)) for w in model.weights]


def copy_weights(source, target) -> None:
    """Gives `target` the weights of `source`; either may be split (eager, cross-replica).

    Example:
        >>> copy_weights(reference, model)      # the unsplit reference's weights, split
    """
    if len(source.weights) != len(target.weights):
        raise TensorParallelError(f"{source.name} has {len(source.weights)} weights, {target.name} "
                                  f"{len(target.weights)}: copy between a model and its tensor-parallel "
                                  "twin (the same class and sizes).")
    target.set_weights(source.get_weights())


def unsplit(model, factory: Callable | None = None):
    """A plain (unsplit) copy of a model, with its weights: for sampling, export, or loading
    into any strategy. `factory` builds the plain model (default: the model's class from
    its config, which leaves the tensor-parallel degree out)."""
    if factory is None:
        factory = lambda: type(model).from_config(model.get_config())  # noqa: E731
    plain = factory()
    if split_weight_count(plain):
        raise TensorParallelError(f"unsplit({model.name}): the factory built a split model; build it "
                                  "with tensor_parallel=1 (degree=1), outside a tensor-parallel strategy.")
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

    def call(x, training=False):  # x: a tensor or any nest of them (a dict of inputs)
        return run(tf.nest.map_structure(tf.convert_to_tensor, x), bool(training))

    return call
