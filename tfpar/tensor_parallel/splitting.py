"""Weights created split: where a Keras layer creates a weight, tfpar can create it split.

Inside `split_weights(layout, rules)`, a layer (any Keras layer, one built inside another's
build too) that creates a weight whose path (`variable.path`, e.g.
`gpt/block_0_attn/attention/query/kernel`) matches a rule creates it split along the rule's
axis instead, each tensor-parallel rank holding its shard (tfpar.tensor_parallel.shards).
The whole initial value is drawn first, by the layer's own initializer on the whole shape,
on the host CPU: the very draw the unsplit layer makes (Keras's seeds, Keras's order), so a
split model starts from the unsplit model's weights. This is keras.distribution's idea
(a layout per weight path, applied where the weight is created) on TensorFlow, where
Keras's own hook does nothing.

Splitting a weight does not change what a layer computes: a layer whose kernel and bias
are split on their output axis computes its own part of the outputs (column-parallel);
one whose kernel is split on its input axis needs its partial products summed before its
bias (`tfpar.tensor_parallel.layers.row_parallel`), and a column-parallel layer's input
gradient needs summing over the group (`copy_to_region` before it).

Example:
    >>> with split_weights(layout, [SplitRule(r"/up/kernel$", 1), SplitRule(r"/up/bias$", 0)]):
    ...     mlp.build(input_shape)           # up's kernel [dim, hidden/T] on every rank
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from typing import Iterator, Sequence

import keras
import tensorflow as tf

from tfpar.strategy import private_api
from tfpar.tensor_parallel import shards
from tfpar.tensor_parallel.layout import Layout


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Split every weight whose path matches `pattern` (re.search) along `axis`."""

    pattern: str
    axis: int


def split_weight(layer, name: str, shape: tuple, spec: shards.ShardSpec, layout: Layout,
                 initializer=None, dtype=None, add_weight=None, **kwargs):
    """Creates `layer`'s weight `name` of whole shape `shape`, split by `spec`: the whole
    value drawn by `initializer` (Keras's default for the dtype when None) on the host CPU,
    then each rank's shard. `add_weight`: Keras's own `Layer.add_weight` (default: the
    layer's). Takes `add_weight`'s other arguments (trainable, regularizer, ...)."""
    dtype = keras.backend.standardize_dtype(dtype) if dtype is not None else layer.variable_dtype
    if initializer is None:
        initializer = "glorot_uniform" if "float" in dtype else "zeros"
    initializer = keras.initializers.get(initializer)  # the one draw of a seed Keras makes here
    with tf.device("/cpu:0"):
        whole = keras.ops.convert_to_numpy(initializer(tuple(shape), dtype=dtype))
    add = add_weight or type(layer).add_weight
    variable = add(layer, shape=spec.shard_shape(shape), initializer="zeros", dtype=dtype, name=name, **kwargs)
    shards.make_split(variable, whole, spec, layout)
    return variable


@contextlib.contextmanager
def split_weights(layout: Layout, rules: Sequence[SplitRule | tuple]) -> Iterator[list]:
    """Within the block, weights whose path matches a rule are created split over `layout`
    (the first matching rule wins); yields the list of the weights split so far."""
    rules = [r if isinstance(r, SplitRule) else SplitRule(*r) for r in rules]
    made: list = []

    def add_weight(original, layer, *args, **kwargs):
        given = dict(inspect.signature(original).bind(layer, *args, **kwargs).arguments)
        for key, value in zip(("shape", "initializer", "dtype"), given.pop("args", ())):
            given.setdefault(key, value)  # Keras 2's positional style, which Keras 3 still takes
        shape, name = given.get("shape"), given.get("name")
        path = private_api.weight_path(layer, name) if name else None
        rule = next((r for r in rules if path and re.search(r.pattern, path)), None)
        if rule is None or shape is None:
            return original(layer, *args, **kwargs)
        options = {k: v for k, v in given.items() if k not in ("self", "shape", "name", "initializer", "dtype")}
        variable = split_weight(layer, name, tuple(shape), shards.ShardSpec(rule.axis, layout.degree), layout,
                                given.get("initializer"), given.get("dtype"), original, **options)
        made.append(variable)
        return variable

    with private_api.add_weight_replaced(add_weight):
        yield made
