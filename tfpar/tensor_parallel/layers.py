"""Megatron's two tensor-parallel linear layers, one class per idea, and the row-parallel
call for Keras's own Dense and EinsumDense.

- `ColumnParallelLinear`: Y = X A, A split by columns: rank r holds A_r, [in, out/T], and
  computes Y_r = X A_r, its 1/T of the outputs (no communication forward; f's all-reduce
  of the input's gradient backward). A fused weight (`parts=3`: Q, K, V side by side) is
  split part by part, so rank r holds [Q_r | K_r | V_r]: whole heads.
- `RowParallelLinear`: Y = X A, A split by rows: rank r holds A_r, [in/T, out], takes its
  1/T of the inputs (a column-parallel layer's outputs) and the partial products are
  summed by g's all-reduce; the bias, whole on every rank, is added once after the sum.
- `row_parallel(layer, layout)`: the same for a Keras Dense or EinsumDense whose kernel was
  created split on its input axis (tfpar.tensor_parallel.splitting): its call sums the
  partial products (g) before its bias and activation.

Both layers draw their weights as a Keras Dense of the whole size does (the initializer
made when the layer is, called once on the whole shape; a fused weight: each part on its
own shape with its own seed), so the same code with `degree=1` is the unsplit twin of a
model built from them: the same weights from the same seed, the same files. Their config
leaves `degree` out, as a split model's does (tfpar.tensor_parallel.keras_weights).

Build them under `strategy.scope()` of a strategy with a multiple of T replicas; call them
in its replica context (tfpar.Trainer's step). With degree 1 they are plain dense layers.

Example:
    >>> up = ColumnParallelLinear(4 * dim, degree=2, activation="gelu")
    >>> down = RowParallelLinear(dim, degree=2)
    >>> y = down(up(x))                        # x [B, T, dim] whole -> y [B, T, dim] whole
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers, ops

from tfpar.tensor_parallel import shards
from tfpar.tensor_parallel.layout import Layout, TensorParallelError
from tfpar.tensor_parallel.mappings import (copy_to_region, gather_from_region,
                                            reduce_from_region, scatter_to_region)
from tfpar.tensor_parallel.splitting import split_weight

PACKAGE = "tfpar"


def current_layout(degree: int) -> Layout | None:
    """The layout of `degree`-way tensor parallelism over the strategy in scope (None: 1)."""
    return None if degree == 1 else Layout.of(tf.distribute.get_strategy(), degree)


class _PartsInitializer:
    """`parts` weights side by side along `axis`, each drawn on its own shape by its own
    initializer (a fresh seed each when unseeded, seed + p when seeded): a fused Q, K, V
    never starts with Q = K = V."""

    def __init__(self, initializer, parts: int, axis: int):
        self.axis = axis
        self.each = [_reseeded(initializer, p) for p in range(parts)]

    def __call__(self, shape, dtype=None):
        part = list(shape)
        part[self.axis] //= len(self.each)
        return ops.concatenate([init(tuple(part), dtype=dtype) for init in self.each], axis=self.axis)


def _reseeded(initializer, index: int):
    config = initializer.get_config()
    if isinstance(config.get("seed"), int):
        config["seed"] += index
    elif index == 0:
        return initializer
    return type(initializer).from_config(config)  # unseeded: its own draw of a seed


class _ParallelLinear(layers.Layer):
    """What both layers share: a weight split along one axis, drawn whole."""

    def __init__(self, units: int, degree: int = 1, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise TensorParallelError(f"degree must be a positive integer (1: unsplit), got {degree!r}.")
        self.units, self.degree, self.use_bias = units, degree, use_bias
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.layout: Layout | None = None
        self.collective_name = self.name  # its collectives' names

    def _weight(self, name: str, full_shape: tuple, spec: shards.ShardSpec | None, initializer):
        """A weight of the whole shape `full_shape`: split by `spec`, or whole on every rank."""
        if spec is None or self.degree == 1:
            return self.add_weight(name=name, shape=full_shape, initializer=initializer)
        return split_weight(self, name, full_shape, spec, self.layout, initializer)

    def get_config(self):
        return {**super().get_config(), "units": self.units,
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
        kernel_init, bias_init = self.kernel_initializer, self.bias_initializer
        if self.parts > 1:
            kernel_init = _PartsInitializer(kernel_init, self.parts, axis=1)
            bias_init = _PartsInitializer(bias_init, self.parts, axis=0)
        self.kernel = self._weight("kernel", (input_shape[-1], self.units),
                                   shards.ShardSpec(1, self.degree, self.parts), kernel_init)
        self.bias = (self._weight("bias", (self.units,), shards.ShardSpec(0, self.degree, self.parts), bias_init)
                     if self.use_bias else None)
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


def row_parallel(layer, layout: Layout, name: str | None = None) -> None:
    """Makes a built Keras `Dense` or `EinsumDense` whose kernel is split on its input axis
    row-parallel: its call sums the partial products over the TP group (g) before adding
    its (whole) bias and applying its activation, the collective named `name`_g.

    Raises:
      TensorParallelError: another layer type, LoRA or quantization enabled, a bias split.
    """
    if not isinstance(layer, (layers.Dense, layers.EinsumDense)):
        raise TensorParallelError(f"{layer.name} is a {type(layer).__name__}: a row-parallel split "
                                  "runs on Dense and EinsumDense layers.")
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise TensorParallelError(f"{layer.name} has LoRA or quantization enabled: split layers run "
                                  "their plain kernel; enable them on the unsplit model.")
    if layer.bias is not None and shards.spec_of(layer.bias) is not None:
        raise TensorParallelError(f"{layer.name}'s bias is split: a row-parallel layer adds its whole "
                                  "bias once, after the sum.")
    name = name or layer.name
    product = ((lambda x: ops.matmul(x, layer.kernel)) if isinstance(layer, layers.Dense)
               else (lambda x: ops.einsum(layer.equation, x, layer.kernel)))

    if isinstance(layer, layers.Dense):  # its input is this rank's part of the features
        layer.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: int(layer.kernel.shape[0])})

    def call(inputs, training=None):  # pylint: disable=unused-argument
        y = reduce_from_region(product(inputs), layout, name=f"{name}_g")
        if layer.bias is not None:
            y = ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    layer.call = call

