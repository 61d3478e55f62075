"""Keras fixes 1-3, the mended methods of Keras's TensorFlow trainer (see tfpar.strategy.keras_fixes
for what each mends and how they are installed, checked and reverted).

Example:
    >>> TensorFlowTrainer._make_function = fix_make_function(TensorFlowTrainer._make_function)
"""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf

from tfpar.errors import UnsupportedStrategyError
from tfpar.strategy import private_api


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


def fix_symbolic_build(original):
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        with _reduce_as_first_local_value(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def fix_reduce_per_replica(original):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not private_api.trainer_module()._collective_all_reduce_multi_worker(  # pylint: disable=protected-access
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

STEP_CLOSURE = "one_step_on_data"  # Keras's per-step function inside _make_function


class _TFWithInlineStep:
    """The `tf` module as Keras's trainer sees it, except that `tf.function` leaves
    Keras's per-step function (`one_step_on_data`) unwrapped; `seen` says whether it came."""

    def __init__(self):
        self.seen = False

    def __getattr__(self, name):
        return getattr(tf, name)

    def function(self, func=None, **kwargs):
        if func is not None and getattr(func, "__name__", "") == STEP_CLOSURE:
            self.seen = True
            return func
        return tf.function(func, **kwargs)


def fix_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        strategy = self._distribute_strategy
        if strategy is None or strategy.num_replicas_in_sync == 1 or self.run_eagerly:
            return original(self, step_function)
        module = private_api.trainer_module()
        module.tf = inline = _TFWithInlineStep()
        try:
            function = original(self, step_function)
        finally:
            module.tf = tf
        if not inline.seen:  # detected, never skipped: fit would fail further on
            raise private_api.KerasFixError(
                f"Keras {keras.__version__} no longer wraps a function named {STEP_CLOSURE!r} "
                "in _make_function, so tfpar's steps_per_execution fix cannot find it. Use a "
                "Keras in setup.py's range, or steps_per_execution=1, or tfpar's loop.")
        return function

    return _make_function


# -- 3. a clear refusal where Keras's trainer cannot run ------------------------------

#: Further checks of fix 3, registered by the packages that need them: `check(model)`
#: returns the error to raise (e.g. tensor parallelism: a split model), or None.
REFUSALS: list = []


def add_refusal(check) -> None:
    """Makes fix 3 also raise `check(model)`'s error, when it returns one (idempotent)."""
    if check not in REFUSALS:
        REFUSALS.append(check)


def refuse_parameter_server(original):
    """Keras's fit/evaluate/predict, refused by name under ParameterServerStrategy and for
    what a registered check refuses (REFUSALS)."""
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
        for check in REFUSALS:
            error = check(self)
            if error is not None:
                raise error
        return original(self, *args, **kwargs)

    return method
