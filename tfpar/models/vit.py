"""ViT: a Vision Transformer image classifier.

Example:
    >>> model = ViT.from_preset("tiny", image_size=32, patch_size=4, num_classes=10)
    >>> logits = model(images)           # images [batch, 32, 32, 3] in [0, 1]
"""

from __future__ import annotations

import dataclasses

import keras

from tfpar.models.blocks import PACKAGE, PatchEmbedding, transformer_stages
from tfpar.models.heads import ClassifierHead
from tfpar.models.staged import Stage, StagedModel


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    channels: int = 3
    num_classes: int = 10
    dim: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


@keras.saving.register_keras_serializable(PACKAGE)
class ViT(StagedModel):
    """Patch embedding + [CLS], bidirectional pre-norm blocks, classifier on [CLS]."""

    presets = {
        "tiny": dict(dim=128, depth=2, heads=4),
        "small": dict(dim=384, depth=6, heads=6, image_size=224, patch_size=16),
        "base": dict(dim=768, depth=12, heads=12, image_size=224, patch_size=16),
    }

    def __init__(self, image_size=32, patch_size=4, channels=3, num_classes=10, dim=128, depth=2,
                 heads=4, mlp_ratio=4, dropout=0.0, name="vit", **kwargs):
        config = ViTConfig(image_size, patch_size, channels, num_classes, dim, depth, heads,
                           mlp_ratio, dropout)
        super().__init__(config, name=name, **kwargs)
        self.embed = PatchEmbedding(image_size, patch_size, dim, dropout, name="embed")
        self.blocks = transformer_stages(config, causal=False)
        self.head = ClassifierHead(num_classes, dropout, name="head")
        self._stage_list = [Stage("embed", self.embed), *self.blocks, Stage("head", self.head)]
        self.build((None, image_size, image_size, channels))
