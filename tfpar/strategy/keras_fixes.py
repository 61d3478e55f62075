"""The small, version-guarded fixes Keras 3 needs to run `fit` under a tf.distribute strategy.

`create_strategy` applies them; `apply()` is idempotent and `revert()` undoes them (tests
use it to show each fix is needed). Each fix is scoped to the one call it mends.

1. MultiWorkerMirroredStrategy fails at the first batch (keras#20585), twice over.
   a) `TensorFlowTrainer._maybe_symbolic_build` builds the model from one batch and gets
      it with `strategy.reduce("MEAN", batch)`, handing the whole nested batch to one
      reduction; the multi-worker strategy does not map over nests ("Attempt to convert
      a value (PerReplica...) with an unsupported type"). Building needs shapes only, so
      the fix makes that one `reduce` return the first local replica's value of each
      leaf: no cross-worker traffic, same shapes as before.
   b) The step's logs (scalar loss and metrics) are then reduced with
      `strategy.reduce("MEAN", v, axis=0)`, which fails on a scalar ("Invalid reduction
      dimension 0 for input with 0 dimensions"). The fix reduces scalars with
      axis=None (the mean over replicas, which is what the other strategies compute).

2. MirroredStrategy with `steps_per_execution > 1` fails ("You must feed a value for
   placeholder tensor ... while/cond/Placeholder"). Keras wraps its per-step function in
   a nested `tf.function` and calls it from inside a `tf.while_loop`/`tf.cond`; with
   several replicas the mirrored replica threads trace that nested function against the
   loop's placeholders. The fix leaves the per-step function unwrapped (the outer
   multi-step `tf.function` still compiles everything into one graph; Keras turns
   `jit_compile` off under any strategy, so nothing else changes).

3. ParameterServerStrategy is not supported by Keras 3 `fit` (keras#18624): `fit`,
   `evaluate` and `predict` raise UnsupportedStrategyError pointing to tfpar's loop
   instead of failing deep inside Keras.

Example:
    >>> from tfpar.strategy import keras_fixes
    >>> keras_fixes.apply()
"""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

from tfpar.errors import UnsupportedStrategyError

_Trainer = tf_trainer.TensorFlowTrainer
_ORIGINALS: dict[tuple[object, str], object] = {}

#: Keras releases in which the three problems above were reproduced (3.5 - 3.15).
AFFECTED_KERAS = ((3, 5), (4, 0))


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def is_affected() -> bool:
    """True for the Keras versions these fixes are written for."""
    low, high = AFFECTED_KERAS
    return low <= keras_version() < high


def is_applied() -> bool:
    return bool(_ORIGINALS)


def apply() -> bool:
    """Installs the fixes on Keras's TensorFlow trainer; returns whether they are active."""
    if is_applied() or not is_affected():
        return is_applied()
    for owner, name, fixed in _FIXES:
        original = getattr(owner, name)
        _ORIGINALS[(owner, name)] = original
        setattr(owner, name, fixed(original))
    return True


def revert() -> None:
    """Restores Keras's own methods (for tests that show a fix is needed)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()


# -- 1. symbolic build under multi-worker strategies ---------------------------------

def _first_local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


@contextlib.contextmanager
def _reduce_as_first_local_value(strategy):
    """Within the block, `strategy.reduce(op, batch, axis)` returns replica 0's batch."""

    def reduce(reduce_op, value, axis=None):  # pylint: disable=unused-argument
        return tf.nest.map_structure(_first_local_value, value)

    strategy.reduce = reduce
    try:
        yield
    finally:
        del strategy.reduce


def _fix_symbolic_build(original):
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        with _reduce_as_first_local_value(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def _fix_reduce_per_replica(original):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not tf_trainer._collective_all_reduce_multi_worker(
            strategy
        ):
            return original(values, strategy, reduction)

        def reduce(value):
            if getattr(_first_local_value(value), "shape", None) == ():
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return tf.nest.map_structure(reduce, values)

    return reduce_per_replica


# -- 2. steps_per_execution > 1 under multi-replica strategies -----------------------

class _TFWithInlineStep:
    """The `tf` module as Keras's trainer sees it, except that `tf.function` leaves
    Keras's per-step function (`one_step_on_data`) unwrapped."""

    def __getattr__(self, name):
        return getattr(tf, name)

    @staticmethod
    def function(func=None, **kwargs):
        if func is not None and getattr(func, "__name__", "") == "one_step_on_data":
            return func
        return tf.function(func, **kwargs)


def _fix_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        strategy = self._distribute_strategy
        if strategy is None or strategy.num_replicas_in_sync == 1 or self.run_eagerly:
            return original(self, step_function)
        tf_trainer.tf = _TFWithInlineStep()
        try:
            return original(self, step_function)
        finally:
            tf_trainer.tf = tf

    return _make_function


# -- 3. a clear refusal under parameter-server strategies ----------------------------

def _refuse_parameter_server(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        strategy = self._distribute_strategy or tf.distribute.get_strategy()
        if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise UnsupportedStrategyError(
                f"Keras 3 `model.{original.__name__}` does not support ParameterServerStrategy "
                "(keras#18624). Train with tfpar's own loop instead: "
                "tfpar.Trainer(model, optimizer, loss, strategy=strategy), or "
                "`tfpar-train --config.mode=loop`; or pick another strategy "
                "(e.g. 'multi_worker_mirrored') to keep using fit."
            )
        return original(self, *args, **kwargs)

    return method


_FIXES = (
    (_Trainer, "_maybe_symbolic_build", _fix_symbolic_build),
    (tf_trainer, "reduce_per_replica", _fix_reduce_per_replica),
    (_Trainer, "_make_function", _fix_make_function),
    (_Trainer, "fit", _refuse_parameter_server),
    (_Trainer, "evaluate", _refuse_parameter_server),
    (_Trainer, "predict", _refuse_parameter_server),
)
