"""The four collective functions of tensor parallelism, with their gradients (Megatron's
mappings.py): to and from the tensor-parallel region, where each replica of a TP group
holds 1/T of a layer.

| function             | forward                       | backward                      |
|----------------------|-------------------------------|-------------------------------|
| `copy_to_region`     | identity (f)                  | all-reduce over the TP group  |
| `reduce_from_region` | all-reduce over the TP group (g) | identity                   |
| `scatter_to_region`  | this rank's slice of the last axis | all-gather of the slices |
| `gather_from_region` | all-gather of the last axis   | this rank's slice             |
| `scatter_along`, `gather_along` | the same along any axis (e.g. attention heads) | |

`f` goes before a column-parallel layer: its input is whole on every rank, and the input's
gradient is the sum of every rank's part. `g` ends a row-parallel layer: the partial
products are summed, and the gradient of the sum, the same on every rank, goes to each
unchanged. A Megatron block of attention or MLP has one f and one g: two all-reduces
forward (the g's) and two backward (the f's) per transformer block.

Each runs in a replica context (tfpar.Trainer's step) over the layout's TP group, through
tf.distribute's own collective launcher (tfpar.tensor_parallel.layout).

Example:
    >>> h = copy_to_region(x, layout)                      # [B, T, dim], whole on every rank
    >>> partial = ops.matmul(h, w_column) @ w_row          # this rank's share
    >>> y = reduce_from_region(partial, layout)            # [B, T, dim], the sum
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.tensor_parallel.layout import Layout

SCOPE = "tensor_parallel"  # every collective of the layers is named under it (see count_collectives)


def copy_to_region(x: tf.Tensor, layout: Layout, name: str = "f") -> tf.Tensor:
    """f: identity forward, all-reduce of the gradient over the TP group backward."""

    @tf.custom_gradient
    def f(x):
        def grad(dy):
            with tf.name_scope(f"{SCOPE}/{name}_backward"):
                return layout.tp_all_reduce(dy)
        return tf.identity(x), grad

    return f(x)


def reduce_from_region(x: tf.Tensor, layout: Layout, name: str = "g") -> tf.Tensor:
    """g: all-reduce over the TP group forward, identity backward."""

    @tf.custom_gradient
    def g(x):
        with tf.name_scope(f"{SCOPE}/{name}_forward"):
            summed = layout.tp_all_reduce(x)
        return summed, lambda dy: tf.identity(dy)

    return g(x)


def _own_slice(x: tf.Tensor, layout: Layout, axis: int = -1) -> tf.Tensor:
    axis %= x.shape.rank
    width = x.shape[axis]
    if width is None or width % layout.degree:
        raise ValueError(f"Axis {axis} ({width}) does not split into {layout.degree} equal parts.")
    part = width // layout.degree
    start = layout.rank(layout.here()) * part
    return tf.gather(x, tf.range(start, start + part), axis=axis) if axis != x.shape.rank - 1 else \
        x[..., start:start + part]


def _all_gather(x: tf.Tensor, layout: Layout, axis: int) -> tf.Tensor:
    """All-gather over the TP group along `axis`; bfloat16 travels as float32 (exact), as
    TensorFlow's collective gather has no bfloat16 kernel."""
    if x.dtype == tf.bfloat16:
        return tf.cast(layout.tp_all_gather(tf.cast(x, tf.float32), axis=axis), tf.bfloat16)
    return layout.tp_all_gather(x, axis=axis)


def scatter_along(x: tf.Tensor, layout: Layout, axis: int = -1, name: str = "scatter") -> tf.Tensor:
    """This rank's 1/T of `axis` forward; the slices all-gathered backward."""

    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            with tf.name_scope(f"{SCOPE}/{name}_backward"):
                return _all_gather(dy, layout, axis % dy.shape.rank)
        return _own_slice(x, layout, axis), grad

    return scatter(x)


def gather_along(x: tf.Tensor, layout: Layout, axis: int = -1, name: str = "gather") -> tf.Tensor:
    """Every rank's slice concatenated along `axis` (in rank order) forward; this rank's
    slice of the gradient backward."""

    @tf.custom_gradient
    def gather(x):
        with tf.name_scope(f"{SCOPE}/{name}_forward"):
            whole = _all_gather(x, layout, axis % x.shape.rank)
        return whole, lambda dy: _own_slice(dy, layout, axis)

    return gather(x)


def scatter_to_region(x: tf.Tensor, layout: Layout, name: str = "scatter") -> tf.Tensor:
    """This rank's 1/T of the last axis forward; the slices all-gathered backward."""
    return scatter_along(x, layout, -1, name)


def gather_from_region(x: tf.Tensor, layout: Layout, name: str = "gather") -> tf.Tensor:
    """Every rank's slice concatenated along the last axis (in rank order) forward; this
    rank's slice of the gradient backward."""
    return gather_along(x, layout, -1, name)
