"""Keras 3 transformers built from shared blocks; each exposes its ordered stages."""

from tfpar.models.chain import Chain, NotAChainError, chain_layers
from tfpar.models.encoder import EncoderClassifier
from tfpar.models.gpt import GPT
from tfpar.models.keras_hub_lm import KerasHubLM
from tfpar.models.staged import Stage, StagedModel
from tfpar.models.vit import ViT

MODELS = {"gpt": GPT, "encoder": EncoderClassifier, "vit": ViT, "keras_hub": KerasHubLM}

__all__ = ["Chain", "EncoderClassifier", "NotAChainError", "chain_layers", "GPT", "KerasHubLM", "MODELS", "Stage",
           "StagedModel", "ViT"]
