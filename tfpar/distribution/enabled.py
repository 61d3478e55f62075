"""`enable()`: Keras's own distribution API runs on TensorFlow, through tfpar.

After `tfpar.distribution.enable()`, a program written for keras.distribution (the keras.io
"distributed training with Keras 3" guide: `DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`, `set_distribution` or `distribution.scope()`) runs on TensorFlow: the
variables Keras creates while a distribution is in effect are created under its strategy
(tfpar.distribution.mesh), the weights its layout map puts on the model axis are created
split, a model built then trains under that strategy with `model.fit` (and evaluates,
predicts) or with `tfpar.Trainer`, and equals the same model on one device.

What enable() changes, each Keras name in one place (undone by `disable()`):

| Keras | why |
| --- | --- |
| `Layer.add_weight` | a weight on the model axis is created split (tfpar.tensor_parallel.splitting) |
| TensorFlow `Variable._initialize` | every variable (weights, optimizer slots, metrics, seed generators) under the strategy's scope: mirrored |
| `TensorFlowTrainer.__init__`, TensorFlow `Optimizer.__init__` | a model or optimizer made under a distribution trains under its strategy |
| TensorFlow `distribution_lib.distribute_tensor` (missing in Keras's TensorFlow prototype) | an activation's layout: the batch axis is the strategy's own; the model axis is refused by name |
| `fit` / `evaluate` / `predict` of a split model (tfpar's Keras fix 3) | prepared instead of refused: the gradients summed as a split model needs, each tensor-parallel group given its whole batch, predictions once per group (tfpar.distribution.keras_trainer) |

Example:
    >>> import tfpar; tfpar.distribution.enable()
    >>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices())
    >>> layout_map = keras.distribution.LayoutMap(mesh); layout_map["d1/kernel"] = (None, "model")
    >>> keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
    ...                                                                      batch_dim_name="batch"))
    >>> model = make_model(); model.compile(...); model.fit(dataset)
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfpar.distribution import keras_trainer, mesh
from tfpar.distribution.mesh import current_plan
from tfpar.strategy import keras_fixes, private_api, trainer_fixes
from tfpar.tensor_parallel import splitting
from tfpar.tensor_parallel.layout import TensorParallelError

_ORIGINALS: dict = {}  # (owner, name) -> Keras's own, while enabled


def _add_weight(original):
    @functools.wraps(original)
    def add_weight(layer, *args, **kwargs):
        plan = current_plan()
        if plan is None or plan.splits is None:  # degree 1 too: the map is read (batch-axis entries, refusals)
            return original(layer, *args, **kwargs)
        return splitting.weight_maker(plan.layout, plan.splits.decide)(original, layer, *args, **kwargs)
    return add_weight


def _initialize(original):
    @functools.wraps(original)
    def initialize(variable, value):
        plan = current_plan()
        if plan is None or tf.distribute.has_strategy() and tf.distribute.get_strategy() is plan.strategy:
            return original(variable, value)
        if tf.distribute.has_strategy():
            raise TensorParallelError(
                f"A keras.distribution {type(plan.distribution).__name__} is in effect inside the scope of "
                f"another strategy ({type(tf.distribute.get_strategy()).__name__}): use one of them, the "
                "distribution (tfpar makes its strategy) or strategy.scope().")
        with plan.strategy.scope():
            return original(variable, value)
    return initialize


def _strategy_of_plan(attribute: str):
    """An `__init__` wrapper that sets `attribute` to the distribution's strategy: Keras's
    TensorFlow trainer (`_distribute_strategy`) and optimizer (`_distribution_strategy`)
    keep the strategy they were made in."""
    def wrap(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            plan = current_plan()
            if plan is not None:
                setattr(self, attribute, plan.strategy)
        return __init__
    return wrap


def _distribute_tensor(tensor, layout):
    """An activation's layout under a tfpar-run distribution: the batch axis is the
    strategy's already; the model axis is refused by name (Plan checks the map's entries
    at start; this catches a layout given at call time)."""
    plan = current_plan()
    axes = tuple(getattr(layout, "axes", layout) or ())
    if plan is not None and plan.splits is not None:
        plan.splits.check_activation("an activation", axes)
    return tensor


def _targets():
    from keras.src.backend.tensorflow import core  # pylint: disable=import-outside-toplevel
    from keras.src.backend.tensorflow import distribution_lib  # pylint: disable=import-outside-toplevel
    from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel
    from keras.src.layers import layer  # pylint: disable=import-outside-toplevel

    return ((layer.Layer, "add_weight", _add_weight), (core.Variable, "_initialize", _initialize),
            (trainer.TensorFlowTrainer, "__init__", _strategy_of_plan("_distribute_strategy")),
            (private_api.optimizer_class(), "__init__", _strategy_of_plan("_distribution_strategy")),
            (distribution_lib, "distribute_tensor", lambda original: _distribute_tensor))


def enable() -> None:
    """keras.distribution on TensorFlow through tfpar, from now on (idempotent)."""
    if _ORIGINALS:
        return
    mesh.start_cluster_strategy()  # in a cluster process: before anything starts TensorFlow
    keras_fixes.apply_and_report()  # what fit needs under a strategy (and on one device: sparse rows)
    for owner, name, make in _targets():
        original = getattr(owner, name, None)
        _ORIGINALS[(owner, name)] = original
        setattr(owner, name, make(original))
    trainer_fixes.add_refusal(keras_trainer.prepare_or_refuse)


def disable() -> None:
    """Keras's own functions back (models built meanwhile keep their strategy)."""
    for (owner, name), original in _ORIGINALS.items():
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ORIGINALS.clear()
    if keras_trainer.prepare_or_refuse in trainer_fixes.REFUSALS:
        trainer_fixes.REFUSALS.remove(keras_trainer.prepare_or_refuse)


def is_enabled() -> bool:
    return bool(_ORIGINALS)
