"""DGC on Adam (tfpar.compression.DGCAdam): Adam with the variance frozen at ratio 1, the
top-k's error feedback and masking identities entry for entry, bytes counted == analytic,
checkpointed state, refusals."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mirrored, mlp, mlp_data
from test_compression_onebit import gap, train, weights  # noqa: F401  (weights: a fixture)
from tfpar import compression as C
from tfpar.compression import accounting

BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7
EVERY_TENSOR = C.Policy(min_size=0, skip=())


def adam_frozen_at(weights, freeze_step, steps, momentum, learning_rate=0.01):
    """One device: Keras Adam's update, with v and its bias factor frozen after `freeze_step`
    and the momentum's coefficient `momentum` from there on."""
    model = mlp()
    model.set_weights(weights)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
    v = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
    for t, (x, y) in enumerate(mlp_data(steps=steps), start=1):
        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        beta = BETA_1 if t <= freeze_step else momentum
        for i, (g, w) in enumerate(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables)):
            m[i] = beta * m[i] + (1 - beta) * g.numpy()
            if t <= freeze_step:
                v[i] = BETA_2 * v[i] + (1 - BETA_2) * np.square(g.numpy())
            factor = math.sqrt(1 - BETA_2 ** min(t, freeze_step))
            if t <= freeze_step or momentum:  # no momentum, no momentum bias to correct
                factor /= 1 - BETA_1 ** t
            w.assign_sub(learning_rate * factor * m[i] / (np.sqrt(v[i]) + EPSILON))
    return model.get_weights()


@pytest.mark.parametrize("momentum", [BETA_1, 0.0])
def test_at_ratio_one_it_is_adam_with_the_variance_frozen(weights, momentum):
    """Nothing left behind: with momentum beta_1 the local velocities average to Adam's m and
    the step is Adam's with v frozen at freeze_step; with momentum 0 it is Adam's step of
    the gradient itself (RMSprop on the frozen v, no momentum bias factor), on 2 replicas."""
    reference = adam_frozen_at(weights, freeze_step=3, steps=6, momentum=momentum)
    dgc = C.DGCAdam(ratio=1.0, freeze_step=3, momentum=momentum, policy=EVERY_TENSOR)
    got, _, _ = train(mirrored(2), weights, lambda: keras.optimizers.SGD(0.01), dgc, steps=6)
    adam, _, _ = train(mirrored(2), weights, lambda: keras.optimizers.Adam(0.01), steps=6)
    # 1.0e-5 with momentum, 1.6e-5 without: float32 round-off through 1 / sqrt(v) of
    # near-zero gradients; unfrozen Adam ends 0.29 and 0.46 away
    assert gap(got, reference) < 5e-5 and gap(got, adam) > 0.1, (gap(got, reference), gap(got, adam))


def assert_close(actual, expected, tolerance=1e-4):
    """Entry for entry, to `tolerance` of the largest entry (Adam's units amplify round-off
    where the variance is near zero)."""
    assert np.abs(actual - expected).max() <= tolerance * np.abs(expected).max(), np.abs(actual - expected).max()


def replica_gradients(weights, replicas=2, steps=3):
    """[step][replica] -> this replica's gradient of the global batch's mean loss (16 rows)."""
    model = mlp()
    model.set_weights(weights)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    rows = 16 // replicas
    found = []
    for x, y in mlp_data(steps=steps):
        per_replica = []
        for r in range(replicas):
            with tf.GradientTape() as tape:
                value = loss(y[rows * r:rows * (r + 1)], model(x[rows * r:rows * (r + 1)])) / 16
            per_replica.append([g.numpy().ravel() for g in tape.gradient(value, model.trainable_variables)])
        found.append([np.concatenate(g) for g in per_replica])
    return found


@pytest.mark.parametrize("momentum", [0.0, BETA_1])
def test_what_is_sent_plus_what_is_kept_is_the_step_and_sent_entries_are_masked(weights, tmp_path, momentum):
    """Two Adam steps at learning rate 0, then one compressed step at learning rate 1 (the
    weights do not move before it, so every gradient is known): on each replica the kept
    accumulation + what was sent == what was accumulated, entry for entry; the k sent entries
    are the largest in Adam's units; with a velocity (DGC's momentum correction) it started
    from the warm-up's momentum and is zeroed where sent (masking); the weights move by
    exactly the mean of what was sent. Checkpointed accumulations restore replica by
    replica under 2 replicas, as their mean under 4. Bytes counted from the traced
    step == analytic == 8 k."""
    replicas, ratio = 2, 0.05
    dgc = C.DGCAdam(ratio=ratio, freeze_step=2, momentum=momentum, policy=EVERY_TENSOR)
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.0, 1.0])
    after, trainer, dataset = train(mirrored(replicas), weights, lambda: keras.optimizers.SGD(schedule), dgc, steps=3)
    g = replica_gradients(weights, replicas)
    total = lambda s: g[s][0] + g[s][1]  # noqa: E731
    m2 = (1 - BETA_1) * (BETA_1 * total(0) + total(1))
    v2 = (1 - BETA_2) * (BETA_2 * np.square(total(0)) + np.square(total(1)))
    scale = math.sqrt(1 - BETA_2 ** 2) / (1 - BETA_1 ** 3 if momentum else 1) / (np.sqrt(v2) + EPSILON)
    k = math.ceil(ratio * dgc.size)
    sent, kept = [], []
    for r in range(replicas):
        velocity = momentum * m2 + (1 - momentum) * replicas * g[2][r]
        accumulated = scale * velocity
        picked = np.argsort(-np.abs(accumulated), kind="stable")[:k]
        sent.append(np.zeros_like(accumulated))
        sent[r][picked] = accumulated[picked]
        kept.append(accumulated - sent[r])
        assert_close(dgc.accumulated.values[r].numpy(), kept[r])
        if momentum:
            masked = velocity.copy()
            masked[picked] = 0
            assert_close(dgc.velocity.values[r].numpy(), masked)
    moved = np.concatenate([(w0 - w1).ravel() for w0, w1 in zip(weights, after)])
    assert_close(moved, (sent[0] + sent[1]) / replicas)

    path = tf.train.Checkpoint(compression=dgc).save(str(tmp_path / "ckpt"))
    dgc.accumulated.assign(tf.zeros_like(dgc.accumulated))
    tf.train.Checkpoint(compression=dgc).restore(path).assert_consumed()
    for r, value in enumerate(dgc.accumulated.values):  # each replica its own
        assert_close(value.numpy(), kept[r])
    # under another replica count: each replica's estimates the whole (R g), so every new
    # replica gets their mean, which is what the model is owed; one flat accumulation (no padding)
    other = C.DGCAdam(ratio=ratio, freeze_step=2, momentum=momentum, policy=EVERY_TENSOR)
    train(mirrored(4), weights, lambda: keras.optimizers.SGD(0.0), other, steps=0)
    tf.train.Checkpoint(compression=other).restore(path).assert_consumed()
    assert len(other.accumulated.values) == 4
    for value in other.accumulated.values:
        assert_close(value.numpy(), (kept[0] + kept[1]) / 2)
    np.testing.assert_array_equal(other.v[0].values[3].numpy(), dgc.v[0].values[0].numpy())

    step = trainer.traced_step(dataset, "compressed")
    analytic = dgc.payload_bytes(trainer.model.trainable_variables)
    assert analytic["all_gather"] == 8 * k and analytic["all_reduce"] == 0
    assert accounting.bytes_per_replica(step, in_loops_only=True, checks=False) == sum(analytic.values())


def test_dgc_adam_refuses_bad_arguments_and_optimizers():
    for ratio in (0.0, 1.5):
        with pytest.raises(C.CompressionError, match=r"dgc_adam ratio must be in \(0, 1\]"):
            C.DGCAdam(ratio=ratio)
    with pytest.raises(C.CompressionError, match="dgc_adam freeze_step must be >= 1"):
        C.DGCAdam(freeze_step=0)
    with pytest.raises(C.CompressionError, match="dgc_adam computes Adam's step with compressed momentum.*not SGD"):
        C.DGCAdam().check_optimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    adam = C.DGCAdam()
    adam.check_optimizer(keras.optimizers.AdamW(beta_2=0.98, epsilon=1e-6, global_clipnorm=0.5))
    assert (adam.beta_1, adam.beta_2, adam.epsilon, adam.clip_norm) == (0.9, 0.98, 1e-6, 0.5)
    with pytest.raises(C.CompressionError, match="overrides do not apply"):
        C.from_config("dgc_adam", overrides="dense=fp16")
    with pytest.raises(C.CompressionError, match=r"dgc_adam momentum must be in \[0, 1\)"):
        C.DGCAdam(momentum=1.0)
    built = C.from_config("dgc_adam", ratio=0.02, freeze_step=30, min_size=0, skip="none")
    assert repr(built) == "dgc_adam(0.02, freeze=30)" and built.policy.skip == () and built.momentum == 0
    assert C.from_config("dgc_adam", momentum=0.9).momentum == 0.9
    assert C.from_config("dgc").compressor.momentum == 0.9  # an unset momentum is each one's default
