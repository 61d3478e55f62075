"""A keras-hub causal language model as one of tfpar's models: token ids in, logits out.

The binary trains `--config.model=keras_hub` on its byte corpus like its own GPT: a
keras-hub backbone (by class name, e.g. `LlamaBackbone`, built from `model_args.args`, or
loaded from `model_args.preset`: a keras-hub preset name or a preset directory) under its
causal LM (`LlamaCausalLM`...), called with the token ids and an all-ones padding mask (the
corpus has no padding). `--config.parallel.tensor=T` splits it by its layout map
(tfpar.models.layout_maps: the backbone's own `get_layout_map`, or tfpar's).

Example:
    >>> model = KerasHubLM("LlamaBackbone", args=dict(num_layers=2, num_query_heads=4,
    ...     num_key_value_heads=2, hidden_dim=64, intermediate_dim=128), vocab_size=256, max_len=128)
    >>> logits = model(token_ids)      # [batch, seq, 256]
"""

from __future__ import annotations

import keras

PACKAGE = "tfpar"
VOCABULARY_ARGS = ("vocabulary_size",)
LENGTH_ARGS = ("max_sequence_length",)


def _keras_hub():
    try:
        import keras_hub  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ImportError("--config.model=keras_hub needs keras-hub: pip install keras-hub "
                          "(tfpar's test extra has it).") from error
    return keras_hub


def causal_lm_class(backbone: str):
    """keras-hub's causal LM for a backbone class name (LlamaBackbone -> LlamaCausalLM)."""
    keras_hub = _keras_hub()
    name = backbone[:-len("Backbone")] + "CausalLM" if backbone.endswith("Backbone") else None
    cls = getattr(keras_hub.models, name, None) if name else None
    if cls is None or not hasattr(keras_hub.models, backbone):
        known = sorted(n[:-len("CausalLM")] + "Backbone" for n in dir(keras_hub.models) if n.endswith("CausalLM"))
        raise ValueError(f"keras-hub has no causal LM for {backbone!r}: use one of {', '.join(known)}.")
    return getattr(keras_hub.models, backbone), cls


@keras.saving.register_keras_serializable(PACKAGE)
class KerasHubLM(keras.Model):
    """A keras-hub backbone and its causal LM head, called on token ids (see module docstring).

    Args:
      backbone: the backbone's class name in keras_hub.models.
      args: its constructor's arguments (vocabulary and length come from the data).
      preset: a keras-hub preset (name or directory) to load instead of `args`.
      vocab_size, max_len: from the data (the binary fills them in).
    """

    def __init__(self, backbone: str = "LlamaBackbone", args: dict | None = None, preset: str = "",
                 vocab_size: int = 256, max_len: int = 128, name: str = "keras_hub_lm", **kwargs):
        super().__init__(name=name, **kwargs)
        self.backbone_name, self.args, self.preset = backbone, dict(args or {}), preset
        self.vocab_size, self.max_len = vocab_size, max_len
        backbone_class, lm_class = causal_lm_class(backbone)
        if preset:
            built = backbone_class.from_preset(preset)
        else:
            fields = backbone_class.__init__.__code__.co_varnames
            sized = {k: vocab_size for k in VOCABULARY_ARGS if k in fields}
            sized.update({k: max_len for k in LENGTH_ARGS if k in fields})
            built = backbone_class(**{**sized, **self.args})
        self.lm = lm_class(backbone=built, preprocessor=None)
        self.built = True  # the backbone is built (a functional model): nothing to build here

    def call(self, token_ids, training=None):
        inputs = {"token_ids": token_ids, "padding_mask": keras.ops.ones_like(token_ids)}
        return self.lm(inputs, training=training)

    def stages(self) -> list:
        """(name, layer) in order, as tfpar's models list them (for messages; a pipeline of
        a keras-hub backbone is not built: its blocks take a padding mask beside h)."""
        backbone = self.lm.backbone
        return [(layer.name, layer) for layer in backbone.layers if layer.weights]

    def get_config(self):
        """The backbone's own config (not the preset: a config rebuilds the model without a
        download, e.g. the binary's unsplit copy for sampling)."""
        return {"backbone": self.backbone_name, "args": self.lm.backbone.get_config(), "preset": "",
                "vocab_size": self.vocab_size, "max_len": self.max_len, "name": self.name}
