"""Sparse (embedding) gradients reach the optimizer with one row per index, so Adam, AdamW
and LAMB give the dense math on 1, 2 and 4 replicas and on 2 workers, in Keras fit (tfpar's
Keras fix 4) and in tfpar's loop: tfpar's GPT, a Sequential with an Embedding, and a
functional model with dict inputs, each equal to a dense one-device reference to 1e-6."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from procs import launch
from scripts import sparse_models as sm
from tfpar.strategy import keras_fixes

TOL = 1e-6
_CACHE: dict = {}


def reference(name, optimizer):
    """(initial weights, weights after STEPS dense steps on one device), computed once."""
    if (name, optimizer) not in _CACHE:
        weights = _CACHE.setdefault(name, sm.initial_weights(name))
        _CACHE[name, optimizer] = weights, sm.dense_reference(name, weights, optimizer)
    return _CACHE[name, optimizer]


def strategy_for(replicas):
    if replicas == 1:  # through tfpar, which applies the Keras fixes (fix 4) as users get them
        return tfpar.create_strategy("default")
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def one_step_of_adam(gradient):
    variable = keras.Variable(np.zeros((3, 1), "float32"))
    keras.optimizers.Adam(0.1).apply([gradient], [variable])
    return variable.numpy()[:, 0]


def two_equal_slices_of_row_0():
    return tf.IndexedSlices(tf.ones([2, 1]), tf.constant([0, 0]), tf.constant([3, 1]))


def test_keras_adam_squares_repeated_rows_unless_fixed():
    """Fails when a Keras release sums repeated rows itself: fix 4 is then unnecessary."""
    keras_fixes.revert()
    try:
        unfixed = one_step_of_adam(two_equal_slices_of_row_0())
    finally:
        keras_fixes.apply()
    np.testing.assert_allclose(unfixed[0], -0.1 * np.sqrt(2), rtol=1e-4)  # Keras's bug
    np.testing.assert_allclose(one_step_of_adam(two_equal_slices_of_row_0())[0], -0.1, rtol=1e-4)
    dense = tf.convert_to_tensor(two_equal_slices_of_row_0())
    np.testing.assert_allclose(one_step_of_adam(dense)[0], -0.1, rtol=1e-4)


def test_sum_repeated_rows():
    g = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([2, 0, 2]),
                         tf.constant([3, 1]))
    summed = keras_fixes.sum_repeated_rows(g)
    np.testing.assert_array_equal(tf.convert_to_tensor(summed), tf.convert_to_tensor(g))
    assert sorted(summed.indices.numpy()) == [0, 2]
    dense = tf.ones([3, 1])
    assert keras_fixes.sum_repeated_rows(dense) is dense


def test_the_fixes_can_be_turned_off():
    """Keras's own behaviour, in fit (set_sum_sparse_rows) and in the loop (sum_sparse_rows)."""
    name, optimizer = "sequential", "adam"
    weights, dense = reference(name, optimizer)
    one = tf.distribute.get_strategy()
    keras_fixes.set_sum_sparse_rows(False)
    try:
        fit = sm.fit(one, name, weights, optimizer)
    finally:
        keras_fixes.set_sum_sparse_rows(True)
    loop = sm.loop(one, name, weights, optimizer, sum_sparse_rows=False)
    assert sm.max_difference(fit, dense) > 1e-4 and sm.max_difference(loop, dense) > 1e-4, (
        sm.max_difference(fit, dense), sm.max_difference(loop, dense))


FAST = {("sequential", "adam", 2), ("dict_inputs", "lamb", 1)}  # the rest: -m slow
# 1 and 4 replicas for every model and optimizer (4 repeats rows across replicas the most);
# 2 replicas in the fast case and on 2 workers below
CASES = [pytest.param(m, o, r, marks=() if (m, o, r) in FAST else pytest.mark.slow,
                      id=f"{m}-{o}-{r}")
         for m in sm.MODELS for o in sm.OPTIMIZERS for r in (1, 2, 4)
         if r != 2 or (m, o, r) in FAST]
WORKER_OPTIMIZERS = ("adam", "lamb")  # adamw takes adam's sparse path (its 4-replica cases above)


@pytest.mark.parametrize("name,optimizer,replicas", CASES)
def test_fit_and_loop_equal_the_dense_reference(name, optimizer, replicas, request):
    if (name, optimizer, replicas) not in FAST:  # numbers only: the fast cases keep grappler
        request.getfixturevalue("without_grappler")
    weights, dense = reference(name, optimizer)
    strategy = strategy_for(replicas)
    for run in (sm.fit, sm.loop):
        trained = run(strategy, name, weights, optimizer)
        assert sm.max_difference(trained, dense) <= TOL, run.__name__
    assert sm.max_difference(weights, dense) > 1e-3  # the steps moved the weights


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_workers_equal_the_dense_reference(tmp_path):
    result = launch(2, "sparse_worker.py", str(tmp_path), *WORKER_OPTIMIZERS, timeout=900)
    assert result.returncode == 0 and result.stdout.count("SPARSE_WORKER: done") == 2, \
        result.stdout[-4000:]
    for name in sm.MODELS:
        for optimizer in WORKER_OPTIMIZERS:
            _, dense = reference(name, optimizer)
            for mode in ("fit", "loop"):
                for task in (0, 1):
                    saved = np.load(tmp_path / f"{mode}-{name}-{optimizer}-w{task}.npz")
                    trained = [saved[f"arr_{i}"] for i in range(len(saved.files))]
                    assert sm.max_difference(trained, dense) <= TOL, (mode, name, optimizer, task)
