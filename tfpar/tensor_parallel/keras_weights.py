"""Keras's weight APIs on a split model: whole values out, whole values in.

A split weight's copies hold different shards (tfpar.tensor_parallel.shards); Keras's own
weight APIs read one copy and assign one value to all of them, which would save one
replica's shard as if it were the model and load a whole value nowhere. Here every
split weight reads and writes its whole (unsplit) value outside the replicas, so a model
split T ways gives and takes exactly what the unsplit model gives and takes:

| API | what it touches | split weight |
| --- | --- | --- |
| `get_weights`, `numpy()`, `np.asarray(v)` | `variable.numpy()` / `__array__` | the whole value |
| `save_weights` (`.weights.h5`), `model.save` (`.keras`), `ModelCheckpoint` | `save_own_variables` -> `np.array(v)` | the whole value |
| `load_weights`, `load_model`, `variable.assign(whole)` | `load_own_variables` -> `assign` | split, each copy its shard |
| `set_weights`, `EarlyStopping(restore_best_weights=True)` | `Layer.set_weights` (shape check) | checked against the whole shape |
| `count_params`, `summary()` | `summary_utils.count_params` | counted whole |
| a layer given a split activation | `Layer.__call__` | gathered whole, or kept split by an elementwise layer (tfpar.tensor_parallel.styles) |
| `fit`, `evaluate`, `predict` | Keras's trainer deals each replica its own batch and sums every gradient | refused by name (use tfpar.Trainer) |

The first two rows are the variable's own methods (a subclass of its class, made for each
split weight); `set_weights`, `count_params` and `Layer.__call__` are Keras's, replaced once
for every layer (`install()`; `revert()` puts Keras's back) and unchanged where nothing is
split (`__call__` asks one attribute of the graph being traced).
A split model's config leaves T out (as keras.distribution leaves its layout out): a file
is the model, whatever T wrote it, and a model of any T loads it.

Example:
    >>> model.save_weights("gpt.weights.h5")                # T = 2: whole weights
    >>> GPT(**config).load_weights("gpt.weights.h5")        # the unsplit model loads them
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfpar.strategy import keras_fixes, private_api, trainer_fixes
from tfpar.tensor_parallel import shards, styles
from tfpar.tensor_parallel.layout import TensorParallelError

_CLASSES: dict = {}  # a Keras variable class -> its whole-value subclass
_ORIGINALS: dict = {}  # (owner, name) -> Keras's own function, while installed


class _WholeOutsideReplicas:
    """Mixed into a split weight's Keras variable class: whole values outside the replicas."""

    def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
        value = np.asarray(shards.full_value(self))
        return value if dtype is None else value.astype(dtype)

    def numpy(self):
        return np.asarray(shards.full_value(self))

    def assign(self, value):
        if _in_replica(self):
            return super().assign(value)
        value = np.asarray(value)
        whole = shards.whole_shape(self)
        if tuple(value.shape) != whole:
            raise TensorParallelError(
                f"{self.path} is split over {shards.spec_of(self).degree} replicas (each holds "
                f"{tuple(self.shape)}); outside strategy.run it takes its whole value, of shape "
                f"{whole}, not {tuple(value.shape)}. Give the unsplit model's weights "
                "(model.get_weights() of any model, split or not, gives them).")
        shards.assign_full(self, value.astype(self.dtype))
        return value


def _in_replica(variable) -> bool:
    """Inside strategy.run of the strategy the weight is split over (its shard is meant)."""
    context = tf.distribute.get_replica_context()
    layout = shards.layout_of_variable(variable)
    return context is not None and layout is not None and context.strategy is layout.strategy


def read_and_written_whole(variable) -> None:
    """Makes Keras's weight APIs read and write `variable` (a split weight) whole."""
    install()
    cls = type(variable)
    if issubclass(cls, _WholeOutsideReplicas):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Split{cls.__name__}", (_WholeOutsideReplicas, cls), {})
    private_api.set_instance_class(variable, _CLASSES[cls])


# -- Keras's functions that read shapes, replaced while tensor parallelism is in use ---

def _set_weights(original):
    def set_weights(self, weights):
        """Keras's `Layer.set_weights`, with a split weight's shape taken whole."""
        layer_weights = self.weights
        if len(layer_weights) != len(weights) or not any(shards.spec_of(v) for v in layer_weights):
            return original(self, weights)
        for variable, value in zip(layer_weights, weights):
            if shards.whole_shape(variable) != tuple(np.shape(value)):
                raise ValueError(f"Layer {self.name} weight shape {shards.whole_shape(variable)} "
                                 f"is not compatible with provided weight shape {tuple(np.shape(value))}.")
        for variable, value in zip(layer_weights, weights):
            variable.assign(value)
    return set_weights


def _count_params(original):
    def count_params(weights):
        """Keras's `summary_utils.count_params`, a split weight counted whole."""
        if not any(shards.spec_of(v) for v in weights):
            return original(weights)
        return int(sum(math.prod(shards.whole_shape(v)) for v in weights))
    return count_params


def _refuse_keras_trainer(model):
    """fix 3's guard (tfpar.strategy.trainer_fixes): Keras fit/evaluate/predict on a split
    model are refused by name, except for one split under a keras.distribution that tfpar
    runs (tfpar.distribution prepares those)."""
    layouts = [shards.layout_of_variable(v) for v in getattr(model, "weights", ())]
    layouts = [layout for layout in layouts if layout is not None]
    if layouts and getattr(layouts[0].strategy, "_tfpar_plan", None) is None:
        return TensorParallelError(
            "Keras fit, evaluate and predict give every replica its own batch and sum every "
            "gradient over all replicas, which adds the shards of a tensor-parallel model "
            "together. Train and evaluate it with tfpar.Trainer (trainer.fit, "
            "trainer.evaluate, with tfpar.data.distribute_train(..., tensor_parallel=T)); "
            "call it with tensor_parallel.replicated_call(model)(x), or use "
            "tensor_parallel.unsplit(model), a whole copy, anywhere.")
    return None


def _layer_call(original):
    def __call__(self, *args, **kwargs):
        """Keras's `Layer.__call__`; where the graph being traced holds split activations,
        a layer that is not parallel gets them as tfpar.tensor_parallel.styles says."""
        if getattr(self, styles.STYLE, None) is not None:
            styles.fit_input_spec(self)
        styles.attention_dropout_per_rank(self)
        styles.local_head_counts(self)
        if styles.marks_in_graph():
            outputs = styles.layer_call(self, lambda *a, **k: original(self, *a, **k), args, kwargs)
        else:
            outputs = original(self, *args, **kwargs)
        if styles.marks_in_graph():  # marks made inside this call too (a model ending column-parallel)
            outputs = styles.leaving(self, outputs)
        return outputs
    return __call__


def _targets():
    from keras.src.layers import layer  # pylint: disable=import-outside-toplevel
    from keras.src.utils import summary_utils  # pylint: disable=import-outside-toplevel

    return ((layer.Layer, "set_weights", _set_weights), (summary_utils, "count_params", _count_params),
            (layer.Layer, "__call__", _layer_call))


def install() -> None:
    """Replaces Keras's `set_weights` and `count_params` (idempotent) and registers the
    refusal of Keras's trainer on split models (fix 3 of tfpar.strategy.keras_fixes, applied
    here too); done when the first weight is split."""
    if _ORIGINALS:
        return
    keras_fixes.apply_and_report()
    for owner, name, make in _targets():
        original = getattr(owner, name)
        _ORIGINALS[(owner, name)] = original
        setattr(owner, name, make(original))
    trainer_fixes.add_refusal(_refuse_keras_trainer)


def revert() -> None:
    """Keras's own `set_weights` and `count_params` back (split weights keep their class)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
