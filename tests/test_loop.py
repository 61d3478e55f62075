"""tfpar.Trainer: Keras fit's numbers, one all-reduce per step, accumulation, clipping."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar.loop import Trainer
from tfpar.strategy import private_api

TOL = 1e-5


def crossentropy():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def make_trainer(strategy, weights, clip=None, **options):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, global_clipnorm=clip)
    return model, Trainer(model, optimizer, crossentropy(), strategy=strategy, **options)


def batches(strategy, global_batch=fit_model.GLOBAL_BATCH):
    """The 96 examples of fit_model.data(), batched by `global_batch`."""
    x, y = fit_model.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    return strategy.experimental_distribute_dataset(dataset)


def assert_same(actual, expected, tol=TOL):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def fit_reference():
    weights = fit_model.initial_weights()
    trained, history = fit_model.train(tf.distribute.get_strategy(), weights)
    return weights, trained, history


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_loop_matches_keras_fit(fit_reference, replicas):
    weights, trained, history = fit_reference
    strategy = mirrored(replicas)
    model, trainer = make_trainer(strategy, weights, steps_per_loop=4)  # 6 steps = 4 + 2
    logs = trainer.fit(batches(strategy), steps=fit_model.STEPS)
    assert_same(model.get_weights(), trained)
    np.testing.assert_allclose(logs["loss"], history["loss"][-1], rtol=TOL)


def test_gradients_cross_the_wire_once(fit_reference, monkeypatch):
    """Collectives in the traced step: all in the aggregator, none in the optimizer."""
    strategy = mirrored(2)
    model, trainer = make_trainer(strategy, fit_reference[0])
    ops = trainer.collective_ops(batches(strategy))
    optimizer_scope = trainer.optimizer.name
    assert ops and not [name for _, name in ops if f"{optimizer_scope}" in name.split("/")[1]]
    dense = [name for kind, name in ops if kind == "CollectiveReduceV2"]
    # one packed all-reduce of every gradient per replica (the embedding's sparse gradient,
    # with more rows than the table, goes dense in it).
    assert len(dense) == strategy.num_replicas_in_sync

    # Without tfpar's guard Keras's optimizer all-reduces the same gradients again.
    monkeypatch.setattr(private_api, "trainer_step", lambda *a, **k: contextlib.nullcontext())
    trainer._train_loop = tf.function(trainer._train_loop_fn)  # pylint: disable=protected-access
    assert len(trainer.collective_ops(batches(strategy))) == 2 * len(ops)


def test_the_callers_optimizer_still_clips_and_synchronises_after_the_trainer(fit_reference):
    """The Trainer turns Keras's all-reduce and clip off only while it traces."""
    weights = fit_reference[0]
    strategy = mirrored(2)

    def fit(model, optimizer):
        model.compile(optimizer=optimizer, loss=crossentropy())
        model.fit(fit_model.dataset(), epochs=1, verbose=0, shuffle=False)
        return model.get_weights()

    with strategy.scope():  # plain SGD: no state that a fresh optimizer would lack
        model = fit_model.build_model()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, global_clipnorm=0.05)
    Trainer(model, optimizer, crossentropy(), strategy=strategy).fit(batches(strategy), steps=2)
    assert optimizer.global_clipnorm == 0.05
    assert "_all_reduce_sum_gradients" not in vars(optimizer)  # Keras's own method again
    after_trainer = model.get_weights()
    with strategy.scope():
        used = fit(model, optimizer)
        runs = {}
        for clip in (0.05, None):
            fresh = fit_model.build_model()
            fresh.set_weights(after_trainer)
            runs[clip] = fit(fresh, keras.optimizers.SGD(learning_rate=0.1, global_clipnorm=clip))
    expected, unclipped = runs[0.05], runs[None]
    assert_same(used, expected, tol=1e-6)  # synchronised: replicas agree with the fresh run
    assert max(np.abs(a - b).max() for a, b in zip(used, unclipped)) > 1e-3  # and clipped


def test_accumulating_k_batches_equals_one_k_times_larger_batch(fit_reference):
    weights = fit_reference[0]
    strategy = mirrored(2)
    model_big, big = make_trainer(strategy, weights)
    big.fit(batches(strategy, global_batch=32), steps=3)
    model_acc, accumulated = make_trainer(strategy, weights, accumulate=2, steps_per_loop=3)
    accumulated.fit(batches(strategy, global_batch=16), steps=3)
    assert_same(model_acc.get_weights(), model_big.get_weights())


def test_global_norm_clipping_equals_the_one_device_clip(fit_reference):
    weights = fit_reference[0]
    one = tf.distribute.get_strategy()
    model_one, trainer_one = make_trainer(one, weights, clip=0.05)
    trainer_one.fit(one.experimental_distribute_dataset(fit_model.dataset()), steps=fit_model.STEPS)
    model_two, trainer_two = make_trainer(mirrored(2), weights, clip=0.05)
    trainer_two.fit(batches(trainer_two.strategy), steps=fit_model.STEPS)
    assert_same(model_two.get_weights(), model_one.get_weights())
    _, trained, _ = fit_reference
    assert max(np.abs(a - b).max() for a, b in zip(model_one.get_weights(), trained)) > 1e-3


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_the_reverse_task_to_100_percent(tmp_path, precision):
    """Convergence on one device (fast); fp16 with Keras's dynamic loss scaling."""
    import runpy
    from procs import REPO
    from tfpar.train import train_and_evaluate

    config = runpy.run_path(str(REPO / "configs" / "reverse_tiny.py"))["get_config"]()
    config.mode, config.precision, config.strategy = "loop", precision, "default"
    config.train.update(dict(steps=200, checkpoint_every=100, log_every=100))
    try:
        results = train_and_evaluate(config, str(tmp_path))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert results["exact"] == 1.0


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_under_mirrored_matches_one_device(fit_reference, precision):
    """Same low-precision run on 1 and 2 replicas: equal up to the precision's rounding.

    4 steps: at the 5th, fp16 overflows on one device (its per-replica loss is twice the
    size) and dynamic loss scaling skips that step there but not on 2 replicas.
    """
    weights = fit_reference[0]
    keras.mixed_precision.set_global_policy(precision)
    try:
        results = []
        for strategy in (tf.distribute.get_strategy(), mirrored(2)):
            with strategy.scope():
                model = fit_model.build_model()
                model.set_weights(weights)
                optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
                if precision == "mixed_float16":
                    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            trainer = Trainer(model, optimizer, crossentropy(), strategy=strategy, steps_per_loop=3)
            trainer.fit(batches(strategy), steps=4)
            results.append(model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    tol = 2e-2 if precision == "mixed_bfloat16" else 2e-3
    assert_same(results[1], results[0], tol=tol)
    moved = max(np.abs(a - b).max() for a, b in zip(results[0], weights))
    assert moved > 5 * tol


def test_loss_scaling_changes_nothing_but_the_scale(fit_reference):
    """LossScaleOptimizer(SGD) == SGD: the loss is scaled once, unscaled once, reduced once."""
    weights, trained, _ = fit_reference
    strategy = mirrored(2)
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(weights)
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, global_clipnorm=100.0))
    trainer = Trainer(model, optimizer, crossentropy(), strategy=strategy, steps_per_loop=3)
    trainer.fit(batches(strategy), steps=fit_model.STEPS)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 15
    assert_same(model.get_weights(), trained)


def test_trainer_evaluate_is_exact_on_any_replica_count(fit_reference):
    """Same weights: 1 and 2 replicas report the same loss and accuracy over the same examples."""
    from tfpar import data as data_lib

    x, y = fit_model.data(steps=2)  # 32 examples; 3 per batch of 10 leaves zero-weight padding
    source = data_lib.Source("fixed", lambda shard=None, training=False: tf.data.Dataset.from_tensor_slices((x, y)),
                             num_files=0, num_examples=len(x))
    results = []
    for strategy in (tf.distribute.get_strategy(), mirrored(2)):
        _, trainer = make_trainer(strategy, fit_reference[1])
        dataset, steps = data_lib.distribute_eval(strategy, source, 10)
        results.append(trainer.evaluate(dataset, steps))
    assert results[0]["examples"] == results[1]["examples"] == 32
    for key in ("loss", "accuracy"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5)


def test_bad_options_are_refused(fit_reference):
    with pytest.raises(tfpar.TfparError, match="must be >= 1"):
        make_trainer(mirrored(2), fit_reference[0], accumulate=0)


def test_an_optimizer_made_under_another_strategy_is_refused_by_name():
    """Made outside the strategy's scope, Keras's optimizer fails deep inside `build`
    ("Mixing different tf.distribute.Strategy objects"); the Trainer says what to do."""
    strategy = mirrored(2)
    with strategy.scope():
        model = fit_model.build_model()
    with pytest.raises(tfpar.TfparError, match=r"made under another strategy \(_DefaultDistributionStrategy\) "
                       r"than the Trainer's \(MirroredStrategy\): make it inside `with strategy.scope\(\):`"):
        Trainer(model, keras.optimizers.Adam(0.01), crossentropy(), strategy=strategy)


def test_the_aggregator_contract_defaults_and_no_reduce():
    """An aggregator checkpoints nothing unless it says so; NoReduce (each parameter-server
    worker applies its own gradients) hands the gradients back untouched."""
    from tfpar.aggregation import AllReduce, NoReduce

    gradients, variables = [tf.constant([1.0, -2.0])], [tf.Variable([0.0, 0.0])]
    assert AllReduce().checkpoint_items() == {} == NoReduce().checkpoint_items()
    assert NoReduce()(gradients, variables)[0] is gradients[0]
