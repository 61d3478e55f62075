"""The shared building blocks of tfpar's transformers: pre-norm attention and MLP stages.

Each block of a transformer is two stages, so that placement can put self-attention on
one device and the feed-forward part on another:

    x = x + Dropout(SelfAttention(LayerNorm(x)))     # SelfAttentionStage
    x = x + Dropout(MLP(LayerNorm(x)))               # FeedForwardStage

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

from tfpar.models.staged import Stage

PACKAGE = "tfpar"
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


@keras.saving.register_keras_serializable(PACKAGE)
class SelfAttentionStage(layers.Layer):
    """Pre-norm multi-head self-attention with a residual connection."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads, self.dropout_rate, self.causal = dim, heads, dropout, causal
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.attention = CoreRecomputingAttention(
            num_heads=heads, key_dim=dim // heads, dropout=dropout, name="attention"
        )
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
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

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "heads": self.heads,
                "dropout": self.dropout_rate, "causal": self.causal}


@keras.saving.register_keras_serializable(PACKAGE)
class FeedForwardStage(layers.Layer):
    """Pre-norm two-layer GELU MLP with a residual connection."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.hidden, self.dropout_rate = dim, hidden, dropout
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.up = layers.Dense(hidden, activation="gelu", name="up")
        self.down = layers.Dense(dim, name="down")
        self.dropout = layers.Dropout(dropout)
        self.supports_masking = True

    def build(self, input_shape):
        self.norm.build(input_shape)
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
    `config.tensor_parallel` = T > 1, each split over T replicas
    (tfpar.models.tensor_parallel)."""
    degree = getattr(config, "tensor_parallel", 1)
    if degree != 1:  # split (a degree below 1 is refused there, by name)
        from tfpar.models.tensor_parallel import parallel_transformer_stages  # pylint: disable=import-outside-toplevel

        return parallel_transformer_stages(config, causal, degree)
    stages = []
    for i in range(config.depth):
        stages.append(Stage(f"blocks.{i}.attn", SelfAttentionStage(
            config.dim, config.heads, config.dropout, causal=causal, name=f"block_{i}_attn")))
        stages.append(Stage(f"blocks.{i}.mlp", FeedForwardStage(
            config.dim, config.dim * config.mlp_ratio, config.dropout, name=f"block_{i}_mlp")))
    return stages
