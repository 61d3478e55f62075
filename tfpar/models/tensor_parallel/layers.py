"""Megatron's two tensor-parallel linear layers, one class per idea.

- `ColumnParallelLinear`: Y = X A, A split by columns: rank r holds A_r, [in, out/T], and
  computes Y_r = X A_r, its 1/T of the outputs (no communication forward; f's all-reduce
  of the input's gradient backward). A fused weight (`parts=3`: attention's Q, K, V) is
  split part by part, so rank r holds [Q_r | K_r | V_r]: whole heads.
- `RowParallelLinear`: Y = X A, A split by rows: rank r holds A_r, [in/T, out], takes its
  1/T of the inputs (a column-parallel layer's outputs) and the partial products are
  summed by g's all-reduce; the bias, whole on every rank, is added once after the sum.

A column-parallel layer followed by a row-parallel one (the MLP; attention's QKV and its
output projection) costs one all-reduce forward and one backward.

Build them under `strategy.scope()` of a strategy with a multiple of T replicas; call them
in its replica context (tfpar.Trainer's step). With degree 1 they are plain dense layers.

Example:
    >>> up = ColumnParallelLinear(4 * dim, degree=2, activation="gelu")
    >>> down = RowParallelLinear(dim, degree=2)
    >>> y = down(up(x))                        # x [B, T, dim] whole -> y [B, T, dim] whole
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

from tfpar.models.tensor_parallel import shards
from tfpar.models.tensor_parallel.layout import Layout
from tfpar.models.tensor_parallel.mappings import (copy_to_region, gather_from_region,
                                                   reduce_from_region, scatter_to_region)

PACKAGE = "tfpar"


def current_layout(degree: int) -> Layout | None:
    """The layout of `degree`-way tensor parallelism over the strategy in scope (None: 1)."""
    return None if degree == 1 else Layout.of(tf.distribute.get_strategy(), degree)


class _ParallelLinear(layers.Layer):
    """What both layers share: a weight split along one axis, made whole-then-split."""

    def __init__(self, units: int, degree: int = 1, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.units, self.degree, self.use_bias = units, degree, use_bias
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.layout: Layout | None = None
        self.collective_name = self.name  # its collectives' names (a stage qualifies it)

    def _weight(self, name: str, full_shape: tuple, spec: shards.ShardSpec | None, initializer,
                parts: int = 1):
        """A weight of the whole shape `full_shape`; split by `spec` (each copy its shard of
        one whole initial value, drawn part by part), or whole on every rank."""
        if spec is None or self.degree == 1:
            return self.add_weight(name=name, shape=full_shape, initializer=initializer)
        variable = self.add_weight(name=name, shape=spec.shard_shape(full_shape), initializer="zeros")
        axis_part = list(full_shape)
        axis_part[spec.axis] //= parts
        whole = np.concatenate([np.asarray(initializer(tuple(axis_part), dtype=variable.dtype))
                                for _ in range(parts)], axis=spec.axis)
        shards.shard_variable(variable, whole, spec, self.layout)
        return variable

    def get_config(self):
        return {**super().get_config(), "units": self.units, "degree": self.degree,
                "activation": keras.activations.serialize(self.activation), "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}


@keras.saving.register_keras_serializable(PACKAGE)
class ColumnParallelLinear(_ParallelLinear):
    """Y = act(X A + b), A and b split by columns (see module docstring).

    Args:
      units: the whole layer's outputs (each rank computes units / degree of them).
      degree: T, the tensor-parallel degree.
      parts: fused weights side by side (3 for attention's Q, K, V), each split alike.
      gather_output: all-gather the outputs (each rank then holds all of them); Megatron's
        blocks keep them split for a row-parallel layer (False).
    """

    def __init__(self, units: int, degree: int = 1, parts: int = 1, gather_output: bool = False, **kwargs):
        super().__init__(units, degree, **kwargs)
        self.parts, self.gather_output = parts, gather_output

    def build(self, input_shape):
        self.layout = current_layout(self.degree)
        spec = shards.ShardSpec(axis=1, degree=self.degree, parts=self.parts)
        self.kernel = self._weight("kernel", (input_shape[-1], self.units), spec,
                                   self.kernel_initializer, self.parts)
        self.bias = (self._weight("bias", (self.units,), shards.ShardSpec(0, self.degree, self.parts),
                                  self.bias_initializer, self.parts) if self.use_bias else None)
        self.built = True

    def call(self, x):
        if self.layout is not None:
            x = copy_to_region(x, self.layout, name=f"{self.collective_name}_f")
        y = ops.matmul(x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        if self.gather_output and self.layout is not None:
            y = gather_from_region(y, self.layout, name=f"{self.collective_name}_gather")
        return y

    def compute_output_shape(self, input_shape):
        width = self.units if self.gather_output or self.degree == 1 else self.units // self.degree
        return tuple(input_shape[:-1]) + (width,)

    def get_config(self):
        return {**super().get_config(), "parts": self.parts, "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(PACKAGE)
class RowParallelLinear(_ParallelLinear):
    """Y = act(sum over ranks of X_r A_r + b), A split by rows, b whole (see module docstring).

    Args:
      units: the layer's outputs (whole on every rank after the sum).
      degree: T, the tensor-parallel degree.
      input_is_parallel: the input is this rank's 1/T of the features already (a
        column-parallel layer's output); False scatters a whole input first.
    """

    def __init__(self, units: int, degree: int = 1, input_is_parallel: bool = True, **kwargs):
        super().__init__(units, degree, **kwargs)
        self.input_is_parallel = input_is_parallel

    def build(self, input_shape):
        self.layout = current_layout(self.degree)
        whole_in = input_shape[-1] * (self.degree if self.input_is_parallel else 1)
        self.kernel = self._weight("kernel", (whole_in, self.units), shards.ShardSpec(0, self.degree),
                                   self.kernel_initializer)
        self.bias = self._weight("bias", (self.units,), None, self.bias_initializer) if self.use_bias else None
        self.built = True

    def call(self, x):
        if self.layout is not None and not self.input_is_parallel:
            x = scatter_to_region(x, self.layout, name=f"{self.collective_name}_scatter")
        y = ops.matmul(x, self.kernel)
        if self.layout is not None:
            y = reduce_from_region(y, self.layout, name=f"{self.collective_name}_g")
        if self.bias is not None:  # once, after the sum
            y = y + self.bias
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        return {**super().get_config(), "input_is_parallel": self.input_is_parallel}
