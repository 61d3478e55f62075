"""Output stages: the language-model head and the classifier head.

Both end in float32 so that bf16 mixed precision keeps its logits (and the loss) in fp32.

Example:
    >>> logits = LMHead(vocab_size=256)(h)             # [batch, seq, 256]
    >>> logits = ClassifierHead(num_classes=10)(h)     # [batch, 10], from position 0 ([CLS])
"""

from __future__ import annotations

import keras
from keras import layers, ops

from tfpar.models.blocks import PACKAGE


@keras.saving.register_keras_serializable(PACKAGE)
class LMHead(layers.Layer):
    """Final LayerNorm, then logits over the vocabulary; tied to the token embedding if given."""

    def __init__(self, vocab_size: int, tied_embedding: layers.Embedding | None = None, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.tied_embedding = tied_embedding
        self.project = None if tied_embedding is not None else layers.Dense(
            vocab_size, name="project", dtype="float32"
        )

    def build(self, input_shape):
        self.norm.build(input_shape)
        if self.project is not None:
            self.project.build(input_shape)
        self.built = True

    def call(self, h):
        h = ops.cast(self.norm(h), "float32")
        if self.project is not None:
            return self.project(h)
        return ops.matmul(h, ops.transpose(ops.cast(self.tied_embedding.embeddings, "float32")))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.vocab_size,)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size}


@keras.saving.register_keras_serializable(PACKAGE)
class ClassifierHead(layers.Layer):
    """Final LayerNorm, the first position ([CLS]), dropout, then class logits."""

    def __init__(self, num_classes: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.dropout_rate = num_classes, dropout
        self.norm = layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.dropout = layers.Dropout(dropout)
        self.project = layers.Dense(num_classes, name="project", dtype="float32")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.project.build((input_shape[0], input_shape[-1]))
        self.built = True

    def call(self, h, training=None):
        cls = self.dropout(self.norm(h)[:, 0], training=training)
        return self.project(ops.cast(cls, "float32"))

    def compute_mask(self, h, mask=None):
        return None

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_classes)

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "dropout": self.dropout_rate}
