"""NaN or Inf in a step: the Trainer stops naming the step, or skips exactly that update."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar import compression as C
from tfpar.errors import NonFiniteError
from tfpar.loop import Trainer

BAD = 2  # the third batch (step 3) carries a NaN sample weight


def data(drop_bad=False, global_batch=16, one_replica=False):
    """6 batches of 16 examples (x, y, weight); batch BAD's weights are NaN unless dropped
    (`one_replica`: only its first half's, which one of 2 replicas gets)."""
    x, y = fit_model.data()
    w = np.ones(len(y), "float32")
    w[BAD * global_batch:(BAD + 1) * global_batch - (global_batch // 2 if one_replica else 0)] = np.nan
    keep = np.ones(len(y), bool)
    if drop_bad:
        keep[BAD * global_batch:(BAD + 1) * global_batch] = False
    return tf.data.Dataset.from_tensor_slices((x[keep], y[keep], w[keep])).batch(global_batch)


def train(strategy, dataset, steps, momentum=0.9, learning_rate=0.1, **options):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(fit_model.initial_weights())
        # SGD: Adam amplifies summation-order noise in near-zero weights
        optimizer = keras.optimizers.SGD(learning_rate, momentum=momentum)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, steps_per_loop=2, **options)
    logs = trainer.fit(strategy.experimental_distribute_dataset(dataset), steps=steps)
    return model, trainer, logs


def test_a_nan_step_stops_the_run_naming_the_step():
    with pytest.raises(NonFiniteError, match=r"Step 3: the gradients \(or the loss\) are NaN"):
        train(tf.distribute.get_strategy(), data(), steps=6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_skip_leaves_out_exactly_the_bad_update(replicas):
    strategy = tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])
    skipped_model, trainer, logs = train(strategy, data(), steps=6, nonfinite="skip")
    assert trainer.skipped_steps == 1
    assert int(np.asarray(trainer.optimizer.iterations.value)) == 5  # the step count (schedules) too
    reference, _, _ = train(tf.distribute.get_strategy(), data(drop_bad=True), steps=5)
    for a, b in zip(skipped_model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


EVERY_TENSOR = C.Policy(min_size=0, skip=())  # the test model's tensors are small
# name: (compression, SGD's momentum and learning rate). The ones that keep momentum
# themselves train with momentum 0; the Adam ones at 0.01 (at 0.1 they diverge even
# without the bad batch).
COMPRESSIONS = {
    "topk": (lambda: C.Compression(C.TopK(0.05), EVERY_TENSOR), 0.9, 0.1),
    "powersgd": (lambda: C.Compression(C.PowerSGD(2), EVERY_TENSOR), 0.9, 0.1),
    "dgc": (lambda: C.Compression(C.DGC(0.05), EVERY_TENSOR), 0.0, 0.1),
    "onebit_adam": (lambda: C.OneBitAdam(freeze_step=2, policy=EVERY_TENSOR), 0.0, 0.01),
    "dgc_adam": (lambda: C.DGCAdam(0.05, freeze_step=2, policy=EVERY_TENSOR, momentum=0.9), 0.0, 0.01),
    # the bad step is a held one: nothing is exchanged, yet every replica must skip it
    "onebit_adam_every2": (lambda: C.OneBitAdam(freeze_step=2, exchange_every=2, policy=EVERY_TENSOR), 0.0, 0.01)}


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_skip_with_compression_leaves_its_state_as_before_the_bad_step(name):
    """NaN in one replica's half of a batch: every replica skips that step, and the
    compressor's error feedback (and its moments) stay as they were: the run equals the one
    without that batch. One NaN used to stay in the error feedback and skip every later step."""
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    compression, momentum, learning_rate = COMPRESSIONS[name]
    options = dict(momentum=momentum, learning_rate=learning_rate)
    skipped_model, trainer, _ = train(strategy, data(one_replica=True), steps=6, nonfinite="skip",
                                      compression=compression(), **options)
    assert trainer.skipped_steps == 1
    reference, _, _ = train(strategy, data(drop_bad=True), steps=5, compression=compression(), **options)
    for a, b in zip(skipped_model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stop_names_the_step_where_one_replica_met_nan_under_compression():
    """Under the default nonfinite="stop", NaN in one replica's gradients stops the run at
    that step, also where the compressed sum is finite: step 3 is a held 1-bit Adam step
    that exchanges nothing, so the NaN used to surface only at step 4's exchange (a top-k
    that leaves it unsent would hide it longer)."""
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    compression, momentum, learning_rate = COMPRESSIONS["onebit_adam_every2"]
    with pytest.raises(NonFiniteError, match=r"Step 3: the gradients \(or the loss\) are NaN"):
        train(strategy, data(one_replica=True), steps=6, compression=compression(),
              momentum=momentum, learning_rate=learning_rate)


def test_a_step_the_fp16_loss_scale_skips_leaves_the_error_feedback_as_it_was():
    """Under mixed_float16 the LossScaleOptimizer skips the step with NaN on one replica;
    topk's residuals stay finite and every other step is applied (before, every later step
    was skipped too)."""
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = fit_model.build_model()
            model.set_weights(fit_model.initial_weights())
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, steps_per_loop=2,
                          compression=C.Compression(C.TopK(0.05), EVERY_TENSOR))
        trainer.fit(strategy.experimental_distribute_dataset(data(one_replica=True)), steps=6)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(np.asarray(optimizer.inner_optimizer.iterations.value)) == 5  # only the NaN step skipped
    residuals = trainer.aggregator.variables
    assert residuals and all(np.isfinite(v.numpy()).all() for v in residuals)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="nonfinite='halt': choose one of stop, skip, ignore"):
        train(tf.distribute.get_strategy(), data(), steps=1, nonfinite="halt")
