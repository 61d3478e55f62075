"""StagedModel: a Keras model that is a chain of named stages, ready to be split.

`model.stages()` lists (name, layer) in order: `embed`, `blocks.0.attn`, `blocks.0.mlp`,
..., `head`. `call` applies them one after the other, so any cut of that list is a valid
pipeline: stage i's output is stage i+1's input. `stage_groups()` gives whole blocks.

Example:
    >>> [name for name, _ in GPT.from_preset("tiny").stages()][:3]
    ['embed', 'blocks.0.attn', 'blocks.0.mlp']
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import NamedTuple

import keras

_BUILDING_STAGE: contextvars.ContextVar = contextvars.ContextVar("building_stage", default=None)


def building_stage() -> str | None:
    """The name of the stage whose variables are being created now (inside
    `StagedModel.build`), else None: what a variable creator needs to place them.

    Example (what tfpar.placement.StagePlan.scope does):
        >>> def creator(next_creator, **kwargs):
        ...     with tf.device(devices[building_stage()]):
        ...         return next_creator(**kwargs)
    """
    return _BUILDING_STAGE.get()


class Stage(NamedTuple):
    name: str
    layer: keras.layers.Layer


class StagedModel(keras.Model):
    """Base class: subclasses set `self._stage_list` (a list of Stage) in __init__."""

    presets: dict = {}

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self._stage_list: list[Stage] = []

    @classmethod
    def from_preset(cls, preset: str, **overrides):
        """Builds a model from a named size (`tiny`, `small`, `base`), fields overridden."""
        if preset not in cls.presets:
            raise ValueError(
                f"Unknown {cls.__name__} preset {preset!r}; choose one of {', '.join(cls.presets)} "
                "or give the fields explicitly."
            )
        return cls(**{**cls.presets[preset], **overrides})

    def stages(self) -> list[Stage]:
        """The model's ordered stages, at sub-block granularity."""
        return list(self._stage_list)

    def stage_groups(self) -> list[list[Stage]]:
        """Stages grouped by block: [embed], [blocks.0.attn, blocks.0.mlp], ..., [head]."""
        groups: dict[str, list[Stage]] = {}
        for stage in self._stage_list:
            key = ".".join(stage.name.split(".")[:2])
            groups.setdefault(key, []).append(stage)
        return list(groups.values())

    def build(self, input_shape):
        """Builds each stage on the output shape of the one before, naming the stage being
        built (see `building_stage`) so a placement's variable creator can place it.
        Models build themselves in __init__; building again is a no-op."""
        if self.built:
            return
        shape = tuple(input_shape)
        for stage in self._stage_list:
            token = _BUILDING_STAGE.set(stage.name)
            try:
                stage.layer.build(shape)
            finally:
                _BUILDING_STAGE.reset(token)
            shape = tuple(stage.layer.compute_output_shape(shape))
        self.built = True

    def call(self, inputs, training=None):
        h = inputs
        for stage in self._stage_list:
            h = stage.layer(h, training=training)
        return h

    def get_config(self):
        """The config, without the tensor-parallel degree: a split model saves, and its
        config builds, the whole model (as keras.distribution leaves its layout out)."""
        config = {**dataclasses.asdict(self.config), "name": self.name}
        config.pop("tensor_parallel", None)
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)
