"""GPT: a decoder-only causal language model.

Example:
    >>> model = GPT.from_preset("tiny", vocab_size=256, max_len=128)
    >>> logits = model(token_ids)        # [batch, seq, vocab], position t sees tokens <= t
"""

from __future__ import annotations

import dataclasses

import keras

from tfpar.models.blocks import PACKAGE, TokenEmbedding, transformer_stages
from tfpar.models.heads import LMHead
from tfpar.models.staged import Stage, StagedModel


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_len: int = 128
    dim: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = False
    tensor_parallel: int = 1


@keras.saving.register_keras_serializable(PACKAGE)
class GPT(StagedModel):
    """Decoder-only transformer LM: token+position embedding, causal pre-norm blocks, LM head.

    `tensor_parallel=T` splits every block over T replicas (attention by heads, the MLP by
    its width; tfpar.tensor_parallel): build it under `strategy.scope()` of a
    strategy with a multiple of T replicas and train it with tfpar.Trainer.
    """

    presets = {
        "tiny": dict(dim=128, depth=2, heads=4, max_len=128),
        "small": dict(dim=384, depth=6, heads=6, max_len=256),
        "base": dict(dim=768, depth=12, heads=12, max_len=1024),
    }

    def __init__(self, vocab_size=256, max_len=128, dim=128, depth=2, heads=4, mlp_ratio=4,
                 dropout=0.0, tie_embeddings=False, tensor_parallel=1, name="gpt", **kwargs):
        config = GPTConfig(vocab_size, max_len, dim, depth, heads, mlp_ratio, dropout, tie_embeddings,
                           tensor_parallel)
        super().__init__(config, name=name, **kwargs)
        self.embed = TokenEmbedding(vocab_size, max_len, dim, dropout, name="embed")
        self.blocks = transformer_stages(config, causal=True)
        self.head = LMHead(vocab_size, self.embed.tokens if tie_embeddings else None, name="head")
        self._stage_list = [Stage("embed", self.embed), *self.blocks, Stage("head", self.head)]
        self.build((None, max_len))
