"""The shared building blocks of tfpar's transformers: pre-norm attention and MLP stages.

Each block of a transformer is two stages, so that placement can put self-attention on
one device and the feed-forward part on another:

    x = x + Dropout(SelfAttention(LayerNorm(x)))     # SelfAttentionStage
    x = x + Dropout(MLP(LayerNorm(x)))               # FeedForwardStage

With `tensor_parallel=T` (built under a strategy with a multiple of T replicas) each stage
splits as Megatron-LM splits it, with Keras's own layers and weights: attention by heads
(the query, key and value kernels column-parallel, the output projection row-parallel),
the MLP by its width (`up` column-parallel, `down` row-parallel). The rules below are all
the model code says; the layers then compute with their split weights, one f before each
split region and one g in its row-parallel layer (tfpar.tensor_parallel.styles). The split
stage has the unsplit stage's layers, weight paths and initial values, so T is a
performance switch: the same seed gives the same weights, the same files.

Example:
    >>> h = SelfAttentionStage(dim=64, heads=4, causal=True)(h)
    >>> h = FeedForwardStage(dim=64, hidden=256)(h)
"""

from __future__ import annotations

import contextlib
import contextvars

import keras
import tensorflow as tf
from keras import layers, ops

from tfpar import tensor_parallel as tp
from tfpar.models.staged import Stage
from tfpar.strategy import private_api

PACKAGE = "tfpar"

#: Which weights of a stage are split, and along which axis (Megatron's layout; the
#: paths are Keras's own: MultiHeadAttention's kernels are [dim, heads, head_dim] and
#: [heads, head_dim, dim], so both split by heads).
ATTENTION_SPLIT = ((r"(^|/)attention/(query|key|value)/kernel$", 1), (r"(^|/)attention/(query|key|value)/bias$", 0),
                   (r"(^|/)attention/attention_output/kernel$", 0))
FEED_FORWARD_SPLIT = ((r"(^|/)up/kernel$", 1), (r"(^|/)up/bias$", 0), (r"(^|/)down/kernel$", 0))
_RECOMPUTE_CORE: contextvars.ContextVar = contextvars.ContextVar("recompute_core", default=False)


@contextlib.contextmanager
def recompute_attention_core(enabled: bool = True):
    """Selective recompute (Megatron's): attention calls traced inside keep only the
    core's inputs (Q, K, V, mask) for the backward and recompute softmax(QK^T/sqrt(d)) V
    there; the linear layers' activations are kept. The probabilities, [B, heads, T, T],
    are the largest activation of a block at long sequence lengths.

    Example:
        >>> with recompute_attention_core():
        ...     loss = loss_fn(y, model(x, training=True))     # under a GradientTape
    """
    token = _RECOMPUTE_CORE.set(enabled)
    try:
        yield
    finally:
        _RECOMPUTE_CORE.reset(token)


class CoreRecomputingAttention(layers.MultiHeadAttention):
    """MultiHeadAttention whose core is recomputed in the backward inside
    `recompute_attention_core()` (same weights, same numbers)."""

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
        parent = super()._compute_attention
        if not _RECOMPUTE_CORE.get() or return_attention_scores:
            return parent(query, key, value, attention_mask=attention_mask, training=training,
                          return_attention_scores=return_attention_scores,
                          use_causal_mask=use_causal_mask)
        if self._dropout > 0.0 and training:
            raise ValueError("Selective recompute would draw a second dropout mask in the "
                             "backward: use attention dropout 0, or whole-stage remat=True.")

        def core(q, k, v):  # (B, T, heads, head_dim) each
            return parent(q, k, v, attention_mask=attention_mask, training=training,
                          use_causal_mask=use_causal_mask)[0]

        return tf.recompute_grad(core)(query, key, value), None


@contextlib.contextmanager
def _split_over(degree: int, rules):
    """Yields the Layout of `degree`-way tensor parallelism (None for 1), inside which the
    weights matching `rules` are created split."""
    if degree == 1:
        yield None
        return
    layout = tp.current_layout(degree)
    with tp.split_weights(layout, rules):
        yield layout


@keras.saving.register_keras_serializable(PACKAGE)
class SelfAttentionStage(layers.Layer):
    """Pre-norm multi-head self-attention with a residual connection; heads split over
    `tensor_parallel` replicas when it is above 1."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False,
                 tensor_parallel: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads, self.dropout_rate, self.causal = dim, heads, dropout, causal
        tp.check_divides(tensor_parallel, heads=heads)
        self.tensor_parallel, self.layout = tensor_parallel, None
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.attention = CoreRecomputingAttention(
            num_heads=heads, key_dim=dim // heads, dropout=dropout, name="attention"
        )
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
        with _split_over(self.tensor_parallel, ATTENTION_SPLIT) as self.layout:
            self.attention.build(input_shape, input_shape)
        if self.layout is not None:  # the attention probabilities of a rank's heads: its own masks
            tp.split_region_dropout(private_api.attention_dropout(self.attention), self.layout)
        self.built = True

    def call(self, x, training=None, mask=None):
        h = self.norm(x)
        attention_mask = None
        if mask is not None:
            attention_mask = ops.logical_and(ops.expand_dims(mask, 1), ops.expand_dims(mask, 2))
        h = self.attention(
            h, h, attention_mask=attention_mask, use_causal_mask=self.causal, training=training
        )
        return x + self.dropout(h, training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):  # the tensor-parallel degree is left out (a split stage saves whole)
        return {**super().get_config(), "dim": self.dim, "heads": self.heads,
                "dropout": self.dropout_rate, "causal": self.causal}


@keras.saving.register_keras_serializable(PACKAGE)
class FeedForwardStage(layers.Layer):
    """Pre-norm two-layer GELU MLP with a residual connection; its width split over
    `tensor_parallel` replicas when it is above 1."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, tensor_parallel: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.hidden, self.dropout_rate = dim, hidden, dropout
        tp.check_divides(tensor_parallel, hidden=hidden)
        self.tensor_parallel, self.layout = tensor_parallel, None
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.up = layers.Dense(hidden, activation="gelu", name="up")
        self.down = layers.Dense(dim, name="down")
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
        with _split_over(self.tensor_parallel, FEED_FORWARD_SPLIT) as self.layout:
            self.up.build(input_shape)
            self.down.build(tuple(input_shape[:-1]) + (self.hidden,))
        self.built = True

    def call(self, x, training=None):
        return x + self.dropout(self.down(self.up(self.norm(x))), training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "hidden": self.hidden,
                "dropout": self.dropout_rate}


@keras.saving.register_keras_serializable(PACKAGE)
class TokenEmbedding(layers.Layer):
    """Token embedding plus learned position embedding (and dropout)."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, dropout: float = 0.0,
                 mask_zero: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.max_len, self.dim = vocab_size, max_len, dim
        self.dropout_rate, self.mask_zero = dropout, mask_zero
        self.tokens = layers.Embedding(vocab_size, dim, mask_zero=mask_zero, name="tokens")
        self.positions = layers.Embedding(max_len, dim, name="positions")
        self.dropout = layers.Dropout(dropout)

    def build(self, input_shape):
        self.tokens.build(input_shape)
        self.positions.build((None,))
        self.built = True

    def call(self, token_ids, training=None):
        length = ops.shape(token_ids)[-1]
        h = self.tokens(token_ids) + self.positions(ops.arange(length))
        return self.dropout(h, training=training)

    def compute_mask(self, token_ids, mask=None):
        return self.tokens.compute_mask(token_ids, mask)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.dim,)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "max_len": self.max_len,
                "dim": self.dim, "dropout": self.dropout_rate, "mask_zero": self.mask_zero}


@keras.saving.register_keras_serializable(PACKAGE)
class PatchEmbedding(layers.Layer):
    """Image -> [CLS] + patch embeddings + learned positions (ViT)."""

    def __init__(self, image_size: int, patch_size: int, dim: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}.")
        self.image_size, self.patch_size, self.dim, self.dropout_rate = image_size, patch_size, dim, dropout
        self.num_patches = (image_size // patch_size) ** 2
        self.project = layers.Conv2D(dim, patch_size, strides=patch_size, name="project")
        self.dropout = layers.Dropout(dropout)

    def build(self, input_shape):
        self.project.build(input_shape)
        self.cls = self.add_weight(name="cls", shape=(1, 1, self.dim), initializer="zeros")
        self.positions = self.add_weight(
            name="positions", shape=(1, self.num_patches + 1, self.dim),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
        )
        self.built = True

    def call(self, images, training=None):
        patches = self.project(images)
        patches = ops.reshape(patches, (-1, self.num_patches, self.dim))
        cls = ops.cast(ops.broadcast_to(self.cls, (ops.shape(patches)[0], 1, self.dim)), patches.dtype)
        h = ops.concatenate([cls, patches], axis=1) + ops.cast(self.positions, patches.dtype)
        return self.dropout(h, training=training)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_patches + 1, self.dim)

    def get_config(self):
        return {**super().get_config(), "image_size": self.image_size,
                "patch_size": self.patch_size, "dim": self.dim, "dropout": self.dropout_rate}


def transformer_stages(config, causal: bool) -> list[Stage]:
    """The attention and feed-forward stages of `config.depth` blocks; with
    `config.tensor_parallel` = T > 1, each split over T replicas (a degree below 1 is
    refused by name)."""
    degree = getattr(config, "tensor_parallel", 1)
    stages = []
    for i in range(config.depth):
        stages.append(Stage(f"blocks.{i}.attn", SelfAttentionStage(
            config.dim, config.heads, config.dropout, causal=causal, tensor_parallel=degree,
            name=f"block_{i}_attn")))
        stages.append(Stage(f"blocks.{i}.mlp", FeedForwardStage(
            config.dim, config.dim * config.mlp_ratio, config.dropout, tensor_parallel=degree,
            name=f"block_{i}_mlp")))
    return stages
