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
from typing import Callable, Iterator, Optional, Sequence

import keras
import tensorflow as tf

from tfpar.strategy import private_api
from tfpar.tensor_parallel import shards, styles
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


Decide = Callable[[object, str, tuple], Optional[int]]  # (layer, path, whole shape) -> split axis


def weight_maker(layout: Layout, decide: Decide, made: list | None = None):
    """`add_weight(original, layer, *args, **kwargs)`: Keras's `Layer.add_weight`, except that
    a weight `decide` gives an axis (or a bias that follows its kernel's output split) is
    created split over `layout` and its layer made parallel (tfpar.tensor_parallel.styles).
    `made` collects the weights split."""

    def add_weight(original, layer, *args, **kwargs):
        given = dict(inspect.signature(original).bind(layer, *args, **kwargs).arguments)
        for key, value in zip(("shape", "initializer", "dtype"), given.pop("args", ())):
            given.setdefault(key, value)  # Keras 2's positional style, which Keras 3 still takes
        shape, name = given.get("shape"), given.get("name")
        if shape is None or not name:
            return original(layer, *args, **kwargs)
        path = private_api.weight_path(layer, name)
        axis = decide(layer, path, tuple(shape))
        if axis is None and name == "bias":
            axis = styles.bias_axis(layer)  # a column-parallel layer's bias splits with it
        if axis is None:
            return original(layer, *args, **kwargs)
        styles.check_splittable(layer, name, axis)
        options = {k: v for k, v in given.items() if k not in ("self", "shape", "name", "initializer", "dtype")}
        variable = split_weight(layer, name, tuple(shape), shards.ShardSpec(axis, layout.degree), layout,
                                given.get("initializer"), given.get("dtype"), original, **options)
        styles.parallelize(layer, layout)
        if made is not None:
            made.append(variable)
        return variable

    return add_weight


@contextlib.contextmanager
def split_weights(layout: Layout, rules: Sequence[SplitRule | tuple] | Decide) -> Iterator[list]:
    """Within the block, weights whose path matches a rule (the first that matches; or for
    which `rules(layer, path, shape)` gives an axis) are created split over `layout`, and
    their layer computes with them (tfpar.tensor_parallel.styles). A bias follows its
    kernel's output split. Yields the list of the weights split so far.

    Raises:
      TensorParallelError: a weight of a layer type that cannot split, named.
    """
    decide = rules if callable(rules) else by_pattern([r if isinstance(r, SplitRule) else SplitRule(*r)
                                                       for r in rules])
    made: list = []
    with private_api.add_weight_replaced(weight_maker(layout, decide, made)):
        yield made


def by_pattern(rules: list[SplitRule]) -> Decide:
    """The first rule whose pattern is found in the weight's path gives its axis."""
    def decide(layer, path: str, shape: tuple):  # pylint: disable=unused-argument
        rule = next((r for r in rules if re.search(r.pattern, path)), None)
        return None if rule is None else rule.axis
    return decide
