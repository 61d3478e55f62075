"""Keras 3 transformers built from shared blocks; each exposes its ordered stages."""

from tfpar.models.chain import Chain, NotAChainError, chain_layers
from tfpar.models.encoder import EncoderClassifier
from tfpar.models.gpt import GPT
from tfpar.models.staged import Stage, StagedModel
from tfpar.models.vit import ViT

MODELS = {"gpt": GPT, "encoder": EncoderClassifier, "vit": ViT}

__all__ = ["Chain", "EncoderClassifier", "NotAChainError", "chain_layers", "GPT", "MODELS", "Stage", "StagedModel", "ViT"]
