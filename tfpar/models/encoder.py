"""EncoderClassifier: a BERT-style bidirectional encoder with [CLS] pooling.

Token id 0 is padding (masked out of attention); position 0 is the [CLS] token whose
final state feeds the classifier.

Example:
    >>> model = EncoderClassifier.from_preset("tiny", vocab_size=1000, num_classes=2)
    >>> logits = model(token_ids)        # [batch, num_classes]
"""

from __future__ import annotations

import dataclasses

import keras

from tfpar.models.blocks import PACKAGE, TokenEmbedding, transformer_stages
from tfpar.models.heads import ClassifierHead
from tfpar.models.staged import Stage, StagedModel


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 1000
    max_len: int = 128
    num_classes: int = 2
    dim: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


@keras.saving.register_keras_serializable(PACKAGE)
class EncoderClassifier(StagedModel):
    """Bidirectional pre-norm encoder; classifies from the [CLS] position."""

    presets = {
        "tiny": dict(dim=128, depth=2, heads=4),
        "small": dict(dim=384, depth=6, heads=6, max_len=256),
        "base": dict(dim=768, depth=12, heads=12, max_len=512),
    }

    def __init__(self, vocab_size=1000, max_len=128, num_classes=2, dim=128, depth=2, heads=4,
                 mlp_ratio=4, dropout=0.0, name="encoder_classifier", **kwargs):
        config = EncoderConfig(vocab_size, max_len, num_classes, dim, depth, heads, mlp_ratio, dropout)
        super().__init__(config, name=name, **kwargs)
        self.embed = TokenEmbedding(vocab_size, max_len, dim, dropout, mask_zero=True, name="embed")
        self.blocks = transformer_stages(config, causal=False)
        self.head = ClassifierHead(num_classes, dropout, name="head")
        self._stage_list = [Stage("embed", self.embed), *self.blocks, Stage("head", self.head)]
        self.build((None, max_len))
