"""Tensor-parallel transformer stages: drop-in for blocks.SelfAttentionStage and
blocks.FeedForwardStage, split over T replicas as Megatron splits them.

    attention:  x + Dropout(Row(Attention_heads/T(Column_qkv(f(LayerNorm(x))))))  -> g inside Row
    MLP:        x + Dropout(Row(gelu(Column_up(LayerNorm(x)))))

Attention's Q, K and V are one column-parallel layer (3 fused parts), so rank r computes
whole heads r*H/T .. (r+1)*H/T - 1; the output projection is row-parallel over those heads.
The norms and the output projection's bias are whole on every rank (replicated); their
gradients are identical across a TP group. Per block: 2 all-reduces forward, 2 backward.

`full_weights()` / `set_full_weights()` read and write the stage's weights as the unsplit
stage holds them (Keras's MultiHeadAttention and Dense layout, the same order), so a
tensor-parallel model can be compared with, loaded from and unsplit into a plain one.

Example:
    >>> with strategy.scope():                       # 2 replicas
    ...     stage = ParallelSelfAttentionStage(dim=64, heads=4, causal=True, tensor_parallel=2)
    ...     stage.build((None, 16, 64))
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import layers, ops

from tfpar.models.tensor_parallel import shards
from tfpar.models.tensor_parallel.layers import PACKAGE, ColumnParallelLinear, RowParallelLinear
from tfpar.models.tensor_parallel.layout import TensorParallelError


def check_divides(degree: int, heads: int | None = None, hidden: int | None = None) -> None:
    """T must split the heads and the MLP's hidden width into equal shards."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise TensorParallelError(f"tensor_parallel must be a positive integer (1: unsplit), got {degree!r}.")
    if heads is not None and heads % degree:
        raise TensorParallelError(
            f"tensor_parallel={degree} does not divide the {heads} attention heads (each rank holds "
            f"whole heads): use a degree that divides {heads}, or a multiple of {degree} heads.")
    if hidden is not None and hidden % degree:
        raise TensorParallelError(
            f"tensor_parallel={degree} does not divide the MLP width {hidden}: use a degree that "
            f"divides {hidden}.")


def _read(variable) -> np.ndarray:
    """The whole value of a weight (joined shards for a split one)."""
    spec = shards.spec_of(variable)
    if spec is None:
        return np.asarray(keras.ops.convert_to_numpy(variable.value))
    return np.asarray(shards.full_value(variable, variable._tfpar_layout))  # pylint: disable=protected-access


def _write(variable, value) -> None:
    if shards.spec_of(variable) is None:
        variable.assign(value)
    else:
        shards.assign_full(variable, value, variable._tfpar_layout)  # pylint: disable=protected-access


@keras.saving.register_keras_serializable(PACKAGE)
class ParallelSelfAttentionStage(layers.Layer):
    """Pre-norm multi-head self-attention, heads split over `tensor_parallel` ranks."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False,
                 tensor_parallel: int = 1, **kwargs):
        super().__init__(**kwargs)
        check_divides(tensor_parallel, heads=heads)
        self.dim, self.heads, self.dropout_rate, self.causal = dim, heads, dropout, causal
        self.tensor_parallel, self.head_dim = tensor_parallel, dim // heads
        self.local_heads = heads // tensor_parallel
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.qkv = ColumnParallelLinear(3 * dim, tensor_parallel, parts=3, name="qkv")
        self.out = RowParallelLinear(dim, tensor_parallel, name="out")
        self.softmax = layers.Softmax(axis=-1)
        self.attention_dropout = layers.Dropout(dropout)
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.qkv.build(input_shape)
        self.out.build(tuple(input_shape[:-1]) + (self.dim // self.tensor_parallel,))
        _note_layout(self, self.qkv, self.out)
        self.built = True

    def call(self, x, training=None, mask=None):
        length = ops.shape(x)[1]
        q, k, v = ops.split(self.qkv(self.norm(x)), 3, axis=-1)  # (B, T, H/T * hd) each
        q, k, v = (ops.reshape(t, (-1, length, self.local_heads, self.head_dim)) for t in (q, k, v))
        context = self._attend(q, k, v, mask, training)  # (B, T, H/T, hd)
        context = ops.reshape(context, (-1, length, self.local_heads * self.head_dim))
        return x + self.dropout(self.out(context), training=training)

    def _attend(self, q, k, v, mask, training):
        """Keras MultiHeadAttention's core on this rank's heads (same ops, same numbers)."""
        scale = 1.0 / math.sqrt(float(self.head_dim))
        attention_mask = None
        if mask is not None:  # (B, T) padding mask -> (B, 1, T, T)
            attention_mask = ops.logical_and(ops.expand_dims(mask, 1), ops.expand_dims(mask, 2))
            if self.causal:
                attention_mask = ops.logical_and(attention_mask, _causal(ops.shape(q)[1]))
            attention_mask = ops.expand_dims(ops.cast(attention_mask, "bool"), 1)
        if self.dropout_rate == 0.0:
            return ops.dot_product_attention(q, k, v, bias=None, mask=attention_mask, scale=scale,
                                             is_causal=self.causal and mask is None)
        if self.causal and attention_mask is None:
            attention_mask = ops.expand_dims(_causal(ops.shape(q)[1]), 0)[None]
        scores = ops.einsum("aecd,abcd->acbe", k, ops.multiply(q, ops.cast(scale, q.dtype)))
        probabilities = self.attention_dropout(self.softmax(scores, mask=attention_mask), training=training)
        return ops.einsum("acbe,aecd->abcd", probabilities, v)

    def full_weights(self, read=None) -> list[np.ndarray]:
        """The unsplit stage's weights: norm, then Q, K, V, output kernel and bias as Keras's
        MultiHeadAttention holds them ([dim, heads, hd], [heads, hd], [heads, hd, dim], [dim]).
        `read(weight)`: a weight's whole value (default: the variable's; e.g. its gradient)."""
        read = read or _read
        gamma, beta = (read(w) for w in self.norm.weights)
        qkv_kernel, qkv_bias = (np.split(read(w), 3, axis=-1) for w in (self.qkv.kernel, self.qkv.bias))
        h, hd, dim = self.heads, self.head_dim, self.dim
        attention = []
        for kernel, bias in zip(qkv_kernel, qkv_bias):
            attention += [kernel.reshape(dim, h, hd), bias.reshape(h, hd)]
        return [gamma, beta, *attention, read(self.out.kernel).reshape(h, hd, dim), read(self.out.bias)]

    def set_full_weights(self, values) -> None:
        """Loads the unsplit stage's weights (the order of `full_weights`)."""
        gamma, beta, qk, qb, kk, kb, vk, vb, ok, ob = (np.asarray(v) for v in values)
        dim = self.dim
        for weight, value in ((self.norm.weights[0], gamma), (self.norm.weights[1], beta),
                              (self.qkv.kernel, np.concatenate([t.reshape(dim, dim) for t in (qk, kk, vk)], 1)),
                              (self.qkv.bias, np.concatenate([t.reshape(dim) for t in (qb, kb, vb)])),
                              (self.out.kernel, ok.reshape(dim, dim)), (self.out.bias, ob)):
            _write(weight, value)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "heads": self.heads, "dropout": self.dropout_rate,
                "causal": self.causal, "tensor_parallel": self.tensor_parallel}


@keras.saving.register_keras_serializable(PACKAGE)
class ParallelFeedForwardStage(layers.Layer):
    """Pre-norm two-layer GELU MLP: the first layer column-parallel, the second row-parallel."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, tensor_parallel: int = 1, **kwargs):
        super().__init__(**kwargs)
        check_divides(tensor_parallel, hidden=hidden)
        self.dim, self.hidden, self.dropout_rate, self.tensor_parallel = dim, hidden, dropout, tensor_parallel
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.up = ColumnParallelLinear(hidden, tensor_parallel, activation="gelu", name="up")
        self.down = RowParallelLinear(dim, tensor_parallel, name="down")
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.hidden // self.tensor_parallel,))
        _note_layout(self, self.up, self.down)
        self.built = True

    def call(self, x, training=None):
        return x + self.dropout(self.down(self.up(self.norm(x))), training=training)

    def full_weights(self, read=None) -> list[np.ndarray]:
        """The unsplit stage's weights: norm, up kernel and bias, down kernel and bias
        (`read` as for the attention stage)."""
        return [(read or _read)(w) for w in (*self.norm.weights, self.up.kernel, self.up.bias,
                                             self.down.kernel, self.down.bias)]

    def set_full_weights(self, values) -> None:
        for weight, value in zip((*self.norm.weights, self.up.kernel, self.up.bias, self.down.kernel,
                                  self.down.bias), values):
            _write(weight, np.asarray(value))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "hidden": self.hidden, "dropout": self.dropout_rate,
                "tensor_parallel": self.tensor_parallel}


def _causal(length):
    """(T, T) lower-triangular: position t sees positions <= t."""
    rows = ops.expand_dims(ops.arange(length), 1)
    return ops.greater_equal(rows, ops.expand_dims(ops.arange(length), 0))


def _note_layout(stage, *linears) -> None:
    """Each weight remembers its layer's layout (for whole-value reads and writes); each
    layer's collectives are named after the stage (block_0_attn_qkv_f_backward, ...)."""
    for linear in linears:
        linear.collective_name = f"{stage.name}_{linear.name}"
        for weight in linear.weights:
            weight._tfpar_layout = linear.layout  # pylint: disable=protected-access


def parallel_transformer_stages(config, causal: bool, degree: int) -> list:
    """The stages of `config.depth` blocks, each split over `degree` ranks (see blocks)."""
    from tfpar.models.staged import Stage  # pylint: disable=import-outside-toplevel

    check_divides(degree, config.heads, config.dim * config.mlp_ratio)
    stages = []
    for i in range(config.depth):
        stages.append(Stage(f"blocks.{i}.attn", ParallelSelfAttentionStage(
            config.dim, config.heads, config.dropout, causal=causal, tensor_parallel=degree,
            name=f"block_{i}_attn")))
        stages.append(Stage(f"blocks.{i}.mlp", ParallelFeedForwardStage(
            config.dim, config.dim * config.mlp_ratio, config.dropout, tensor_parallel=degree,
            name=f"block_{i}_mlp")))
    return stages
