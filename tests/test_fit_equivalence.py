"""Keras `fit` with the injected strategy gives one-device numbers on every strategy."""

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar.strategy import keras_fixes

TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    """Initial weights, and the weights after fit on the default (no) strategy."""
    weights = fit_model.initial_weights()
    trained, history = fit_model.train(tf.distribute.get_strategy(), weights)
    return weights, trained, history


def assert_same_weights(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def test_training_moved_the_weights(reference):
    weights, trained, history = reference
    assert max(np.abs(a - b).max() for a, b in zip(weights, trained)) > 1e-2
    assert np.isfinite(history["loss"][-1])


@pytest.mark.parametrize("name,replicas", [("one_device", 1), ("mirrored", 2), ("mirrored", 4)])
def test_fit_matches_one_device(reference, name, replicas):
    weights, trained, history = reference
    devices = [f"/cpu:{i}" for i in range(replicas)] if name == "mirrored" else None
    strategy = tfpar.create_strategy(name, devices=devices)
    assert strategy.num_replicas_in_sync == replicas
    actual, actual_history = fit_model.train(strategy, weights)
    assert_same_weights(actual, trained)
    np.testing.assert_allclose(actual_history["loss"], history["loss"], rtol=TOL)
    np.testing.assert_allclose(actual_history["accuracy"], history["accuracy"], rtol=TOL)


def test_mirrored_steps_per_execution(reference):
    """steps_per_execution > 1 (with a partial last execution) under 2 replicas."""
    weights, trained, _ = reference
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    actual, _ = fit_model.train(strategy, weights, steps_per_execution=4)  # 6 steps = 4 + 2
    assert_same_weights(actual, trained)


def test_mirrored_steps_per_execution_fails_without_the_fix(reference):
    weights, _, _ = reference
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    keras_fixes.revert()
    try:
        with pytest.raises(tf.errors.InvalidArgumentError, match="placeholder"):
            fit_model.train(strategy, weights, steps_per_execution=3)
    finally:
        keras_fixes.apply()
    assert keras_fixes.is_applied()
