"""StagedModel: a Keras model that is a chain of named stages, ready to be split.

`model.stages()` lists (name, layer) in order: `embed`, `blocks.0.attn`, `blocks.0.mlp`,
..., `head`. `call` applies them one after the other, so any cut of that list is a valid
pipeline: stage i's output is stage i+1's input. `stage_groups()` gives whole blocks.

Example:
    >>> [name for name, _ in GPT.from_preset("tiny").stages()][:3]
    ['embed', 'blocks.0.attn', 'blocks.0.mlp']
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Mapping, NamedTuple

import keras
import tensorflow as tf

_STAGE_DEVICES: contextvars.ContextVar = contextvars.ContextVar("stage_devices", default=None)


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

    @staticmethod
    @contextlib.contextmanager
    def placed(devices: Mapping[str, str]):
        """Models built inside create each stage's variables on `devices[stage name]`.

        Example:
            >>> with StagedModel.placed({"embed": "/cpu:0", ..., "head": "/cpu:1"}):
            ...     model = GPT.from_preset("tiny")
        """
        token = _STAGE_DEVICES.set(dict(devices))
        try:
            yield
        finally:
            _STAGE_DEVICES.reset(token)

    def build(self, input_shape):
        """Builds each stage on the output shape of the one before (on its device, when
        built inside `StagedModel.placed`)."""
        shape = tuple(input_shape)
        devices = _STAGE_DEVICES.get() or {}
        for stage in self._stage_list:
            device = devices.get(stage.name)
            with tf.device(device) if device else contextlib.nullcontext():
                stage.layer.build(shape)
            shape = tuple(stage.layer.compute_output_shape(shape))
        self.built = True

    def call(self, inputs, training=None):
        h = inputs
        for stage in self._stage_list:
            h = stage.layer(h, training=training)
        return h

    def get_config(self):
        return {**dataclasses.asdict(self.config), "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
