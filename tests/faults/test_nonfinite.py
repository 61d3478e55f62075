"""NaN or Inf in a step: the Trainer stops naming the step, or skips exactly that update."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar.errors import NonFiniteError
from tfpar.loop import Trainer

BAD = 2  # the third batch (step 3) carries a NaN sample weight


def data(drop_bad=False, global_batch=16):
    """6 batches of 16 examples (x, y, weight); batch BAD's weights are NaN unless dropped."""
    x, y = fit_model.data()
    w = np.ones(len(y), "float32")
    w[BAD * global_batch:(BAD + 1) * global_batch] = np.nan
    keep = np.ones(len(y), bool)
    if drop_bad:
        keep[BAD * global_batch:(BAD + 1) * global_batch] = False
    return tf.data.Dataset.from_tensor_slices((x[keep], y[keep], w[keep])).batch(global_batch)


def train(strategy, dataset, steps, **options):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(fit_model.initial_weights())
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)  # Adam amplifies summation-order noise in near-zero weights
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


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="nonfinite='halt': choose one of stop, skip, ignore"):
        train(tf.distribute.get_strategy(), data(), steps=1, nonfinite="halt")
