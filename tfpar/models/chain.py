"""Chain: any Keras model whose layers form a chain, as a StagedModel split by layer.

A Sequential model, or a functional one where every layer takes exactly the previous
layer's output, is a chain: any cut of its layer list is a valid pipeline. `Chain.from_keras`
rebuilds such a model's layers (fresh, from their configs) as stages named after the
layers, so tfpar.placement can plan, place and pipeline it like tfpar's own models. Models
with branches (residual connections, several inputs) are refused by name.

Example:
    >>> cnn = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3), ...])
    >>> plan = tfpar.placement.balanced(Chain.from_keras(cnn), ["/gpu:0", "/gpu:1"])
    >>> with plan.scope():
    ...     model = Chain.from_keras(cnn)       # each layer's weights on its stage's device
    >>> model.set_weights(cnn.get_weights())
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfpar.errors import TfparError
from tfpar.models.staged import Stage, StagedModel
from tfpar.strategy import private_api


class NotAChainError(TfparError, ValueError):
    """A Keras model whose layers do not form a single chain."""


def chain_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of a Sequential or chain-shaped functional model, input layer excluded."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if isinstance(model, keras.Sequential):
        return layers
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise NotAChainError(f"{model.name} has {len(model.inputs)} inputs and {len(model.outputs)} "
                             "outputs; a chain has one of each.")
    previous = model.inputs[0]._keras_history[0].name
    for layer in layers:
        nodes = private_api.inbound_nodes(layer)
        sources = [t._keras_history[0].name for t in nodes[0].input_tensors] if nodes else []
        if len(nodes) != 1 or sources != [previous]:
            raise NotAChainError(
                f"Layer {layer.name!r} of {model.name} takes {sources or 'nothing'}, not just the "
                f"previous layer {previous!r}: the model branches (e.g. a residual connection), so "
                "it cannot be cut by layer. Wrap each branching block in one layer, or use a "
                "tfpar StagedModel.")
        previous = layer.name
    return layers


class Chain(StagedModel):
    """A StagedModel of `layers` applied in order; one stage per layer."""

    def __init__(self, layers: Sequence[keras.layers.Layer], input_shape, **kwargs):
        super().__init__(config=None, **kwargs)
        self.chain = list(layers)  # tracked by Keras
        self._stage_list = [Stage(layer.name, layer) for layer in self.chain]
        self._chain_input_shape = tuple(input_shape)
        self.build(tuple(input_shape))

    @classmethod
    def from_keras(cls, model: keras.Model, name: str | None = None) -> "Chain":
        """Fresh copies of `model`'s layers (same configs, new weights), as a Chain."""
        layers = [type(layer).from_config(layer.get_config()) for layer in chain_layers(model)]
        return cls(layers, model.inputs[0].shape, name=name or f"{model.name}_chain")

    def get_config(self):
        return {"name": self.name, "input_shape": list(self._chain_input_shape),
                "layers": [keras.saving.serialize_keras_object(layer) for layer in self.chain]}

    @classmethod
    def from_config(cls, config):
        """The chain again from get_config (fresh weights): Keras serialization round-trips."""
        # unbuilt: the chain builds each layer itself (under a placement scope, on its device)
        layers = [keras.saving.deserialize_keras_object({k: v for k, v in layer.items() if k != "build_config"})
                  for layer in config["layers"]]
        return cls(layers, tuple(config["input_shape"]), name=config["name"])
