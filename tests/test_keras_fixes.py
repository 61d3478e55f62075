"""tfpar's Keras fixes apply all or nothing, and say so: a moved target, a changed
signature, a renamed closure or an untested Keras leaves Keras untouched and is reported
once, naming the fix, the Keras version and what still works."""

import logging
import re

import keras
import pytest
import tensorflow as tf

import tfpar
from procs import REPO
from tfpar.strategy import keras_fixes, private_api, trainer_fixes

Trainer = private_api.trainer_module().TensorFlowTrainer
KERAS_OWN: dict = {}


@pytest.fixture
def unapplied():
    """Keras's own methods during the test; the fixes back afterwards."""
    keras_fixes.revert()
    keras_fixes._REPORTED.clear()  # pylint: disable=protected-access
    KERAS_OWN.update(fit=Trainer.fit, reduce=private_api.optimizer_class()._all_reduce_sum_gradients)
    yield
    keras_fixes.revert()
    assert keras_fixes.apply()


def assert_nothing_applied():
    assert not keras_fixes.apply() and not keras_fixes.is_applied()
    assert Trainer.fit is KERAS_OWN["fit"]  # Keras's own, untouched
    assert private_api.optimizer_class()._all_reduce_sum_gradients is KERAS_OWN["reduce"]


def test_every_fix_applies_on_this_keras():
    assert keras_fixes.apply() and keras_fixes.problems() == []
    status = keras_fixes.status()
    assert status.applied and status.keras == keras.__version__


def test_the_fixes_apply_while_keras_distribution_is_enabled(unapplied):
    """tfpar.distribution wraps TensorFlowTrainer.__init__ (functools.wraps): the checks read
    through it to Keras's own code (CI once ran the fixes' tests after an enable() that
    was never undone, and every fix was refused)."""
    tfpar.distribution.enable()
    try:
        assert Trainer.__init__.__wrapped__ is not None
        assert keras_fixes.problems() == [] and keras_fixes.apply()
    finally:
        tfpar.distribution.disable()


def test_setup_py_bounds_keras_to_the_tested_releases():
    (low, high) = keras_fixes.TESTED_KERAS
    bound = re.search(r'"keras>=([\d.]+),<([\d.]+)"', (REPO / "setup.py").read_text())
    assert bound and bound.groups() == (f"{low[0]}.{low[1]}", f"{high[0]}.{high[1]}")
    assert keras_fixes.is_affected()  # the installed Keras is one of them


def test_a_moved_target_applies_nothing(unapplied, monkeypatch):
    monkeypatch.delattr(Trainer, "_make_function")
    assert_nothing_applied()
    (problem,) = keras_fixes.problems()
    assert problem.startswith("steps_per_execution > 1 under mirrored:") and "missing" in problem


def test_a_changed_signature_applies_nothing(unapplied, monkeypatch):
    monkeypatch.setattr(private_api.trainer_module(), "reduce_per_replica",
                        lambda values, strategy, reduction, axis=0: values)
    assert_nothing_applied()
    assert "reduce_per_replica takes" in keras_fixes.problems()[0]


def test_a_renamed_closure_is_detected(unapplied, monkeypatch):
    def _make_function(self, step_function):
        def one_step(data):  # Keras's per-step function under another name
            return step_function(data)
        return tf.function(one_step)

    monkeypatch.setattr(Trainer, "_make_function", _make_function)
    assert_nothing_applied()
    assert "'one_step_on_data' was renamed" in keras_fixes.problems()[0]


def test_a_closure_renamed_after_the_check_fails_at_trace_time(monkeypatch):
    """Belt and braces: if the closure is not seen while the fix runs, fit stops, loudly."""
    from scripts import fit_model

    monkeypatch.setattr(trainer_fixes, "STEP_CLOSURE", "no_such_closure")
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    with pytest.raises(private_api.KerasFixError, match="one_step_on_data|no_such_closure"):
        fit_model.train(strategy, fit_model.initial_weights(), steps_per_execution=2, steps=2)


def test_an_untested_keras_applies_nothing_and_create_strategy_says_it_once(
        unapplied, monkeypatch, caplog):
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    assert_nothing_applied()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            tfpar.create_strategy("default")
    said = [r.getMessage() for r in caplog.records if "Keras fixes are not applied" in r.getMessage()]
    assert len(said) == 1, said
    assert "Keras 3.16.0" in said[0] and "outside the tested releases 3.5 - 3.15" in said[0]
    assert "tfpar's own loop" in said[0] and "keras>=3.5,<3.16" in said[0]
