"""1-bit Adam and the two-phase compressed all-reduce: Adam exactly in warm-up, error
compensation on both sides, bytes counted == analytic for 2 and 4 replicas (flat in R)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mirrored, mlp, mlp_data, run_per_replica
from tfpar import compression as C
from tfpar.compression import accounting, two_phase
from tfpar.loop import Trainer


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(0)
    return mlp().get_weights()


def train(strategy, weights, optimizer, aggregator=None, steps=6):
    with strategy.scope():
        model = mlp()
        model.set_weights(weights)
        optimizer = optimizer()
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, aggregator=aggregator)
    dataset = strategy.experimental_distribute_dataset(mlp_data(steps=steps))
    trainer.fit(dataset, steps=steps)
    return model.get_weights(), trainer, dataset


def gap(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b))


def test_warmup_is_keras_adam_with_global_clipping(weights):
    strategy = mirrored(2)
    reference, _, _ = train(strategy, weights, lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.01, global_clipnorm=0.5), steps=4)
    onebit = C.OneBitAdam(freeze_step=4, clip_norm=0.5)
    got, _, _ = train(strategy, weights, lambda: keras.optimizers.SGD(0.01, weight_decay=0.01), onebit, steps=4)
    assert gap(got, reference) < 2e-6


def test_a_warmup_in_fp16_is_adam_on_fp16_sums_at_half_the_bytes(weights):
    strategy = mirrored(2)
    every_tensor_fp16 = C.Compression(C.FP16(), C.Policy(min_size=0, skip=()))
    reference, _, _ = train(strategy, weights, lambda: keras.optimizers.Adam(0.01), every_tensor_fp16, steps=4)
    onebit = C.OneBitAdam(freeze_step=4, warmup_compressor="fp16")
    got, trainer, dataset = train(strategy, weights, lambda: keras.optimizers.SGD(0.01), onebit, steps=4)
    assert gap(got, reference) < 1e-5  # 1.6e-6 here
    float32, _, _ = train(strategy, weights, lambda: keras.optimizers.Adam(0.01), steps=4)
    assert gap(got, float32) > 1e-4  # 7.7e-4 here: it followed the 16-bit sums
    warm = accounting.bytes_per_replica(trainer.traced_step(dataset, "warmup"), in_loops_only=True, checks=False)
    variables = trainer.model.trainable_variables
    assert warm == sum(onebit.payload_bytes(variables, "warmup").values()) == 2 * trainer.model.count_params()
    assert onebit.describe(variables) == [  # its plan table: one row for every tensor
        ("(all)", repr(onebit), 4 * trainer.model.count_params(), sum(onebit.payload_bytes(variables).values()))]
    assert repr(onebit) == "onebit_adam(freeze=4, fp16 start)"
    with pytest.raises(C.CompressionError, match="warmup_compressor 'sign' is not one of none, fp16, bf16"):
        C.OneBitAdam(warmup_compressor="sign")


@pytest.mark.slow
def test_compressed_phase_moves_from_adam_and_keeps_both_errors(weights):
    strategy = mirrored(2)
    reference, _, _ = train(strategy, weights, lambda: keras.optimizers.Adam(0.01), steps=6)
    onebit = C.OneBitAdam(freeze_step=3)
    got, trainer, dataset = train(strategy, weights, lambda: keras.optimizers.SGD(0.01), onebit, steps=6)
    assert gap(got, reference) > 1e-6 and all(np.isfinite(w).all() for w in got)
    for error in (onebit.worker_error, onebit.server_error):
        assert np.abs(error.numpy()).max() > 0
    ops = {c.type for c in accounting.collectives(trainer.traced_step(dataset, "compressed"))}
    assert "CollectiveAllToAllV2" in ops


@pytest.mark.slow
def test_state_restores_and_the_errors_restart_at_zero_under_another_replica_count(
        tmp_path, weights, capfd):
    """m, v and the step restore exactly; the error buffers restore replica by replica
    for the same count, and start at zero, said once, under
    another count (they are padded per count; DeepSpeed resets them on every load)."""
    onebit = C.OneBitAdam(freeze_step=2)
    train(mirrored(2), weights, lambda: keras.optimizers.SGD(0.01), onebit, steps=4)
    state = lambda ob: [*ob.m, *ob.v, ob.iterations]  # noqa: E731
    saved = [v.numpy() for v in state(onebit)]
    errors = [[r.numpy() for r in e.values] for e in (onebit.worker_error, onebit.server_error)]
    assert all(np.abs(e[0]).max() > 0 and np.abs(e[0] - e[1]).max() > 0 for e in errors)  # per replica
    path = tf.train.Checkpoint(compression=onebit).save(str(tmp_path / "ckpt"))

    for variable in [*state(onebit), onebit.worker_error, onebit.server_error]:
        variable.assign(tf.zeros_like(variable))
    tf.train.Checkpoint(compression=onebit).restore(path).assert_consumed()
    for value, expected in zip(state(onebit), saved):
        np.testing.assert_array_equal(value.numpy(), expected)
    for error, expected in zip((onebit.worker_error, onebit.server_error), errors):
        for value, own in zip(error.values, expected):
            np.testing.assert_array_equal(value.numpy(), own)

    strategy = mirrored(4)
    other = C.OneBitAdam(freeze_step=2)
    _, trainer, _ = train(strategy, weights, lambda: keras.optimizers.SGD(0.01), other, steps=0)
    tf.train.Checkpoint(compression=other).restore(path).expect_partial()
    for value, expected in zip(state(other), saved):
        np.testing.assert_array_equal(value.numpy(), expected)
    assert not np.any(other.worker_error.numpy()) and other.server_error.shape != onebit.server_error.shape
    capfd.readouterr()
    trainer.fit(strategy.experimental_distribute_dataset(mlp_data(steps=2)), steps=6, start_step=4)
    said = capfd.readouterr().err  # two compressed steps: said once
    assert said.count("checkpointed with 2 replicas; this run has 4 so they start at zero") == 1


def test_exchanging_every_k_steps_holds_the_agreed_momentum_and_sends_every_gradient(weights, tmp_path):
    """exchange_every=4 at learning rate 0 (the weights stay put, so every gradient is known):
    three held steps step with the agreed momentum m (identical on both replicas) and keep
    what it missed, (1 - beta)(R g - m) for each local gradient g, pending; the fourth
    exchanges beta m + (1 - beta) R g + pending through the two-phase 1-bit mean, exactly,
    and empties the pending sum. A checkpoint taken between holds restores each replica's
    pending sum exactly, and the exchange goes on from it.
    Bytes counted from the traced step == analytic == a quarter of an exchange per step."""
    strategy, beta, replicas = mirrored(2), 0.9, 2
    onebit = C.OneBitAdam(freeze_step=2, exchange_every=4, policy=C.Policy(min_size=0))
    _, trainer, dataset = train(strategy, weights, lambda: keras.optimizers.SGD(0.0), onebit, steps=5)
    model, index = mlp(), [i for i, c in enumerate(onebit.compressed) if c]
    model.set_weights(weights)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    batches = list(mlp_data(steps=6))

    def gradients(x, y):  # of the global batch's mean loss (16 examples), for these rows
        with tf.GradientTape() as tape:
            value = loss(y, model(x)) / 16
        return [g.numpy() for g in tape.gradient(value, model.trainable_variables)]

    g = [gradients(x, y) for x, y in batches]                       # global, per step
    g_r = [[gradients(x[8 * r:8 * r + 8], y[8 * r:8 * r + 8]) for r in range(replicas)] for x, y in batches]
    m2 = [(1 - beta) * (beta * a + b) for a, b in zip(g[0], g[1])]   # Adam's m after the warm-up
    for i in index:
        for m in strategy.experimental_local_results(onebit.m[i]):   # the same on every replica
            np.testing.assert_allclose(m.numpy(), m2[i], rtol=1e-5, atol=1e-8)
    flat = lambda parts: np.pad(np.concatenate([p.ravel() for p in parts]),  # noqa: E731
                                (0, onebit.padded - sum(p.size for p in parts)))
    pending = onebit.pending
    missed = lambda r, steps: flat([(1 - beta) * sum(replicas * g_r[s][r][i] - m2[i] for s in steps)  # noqa: E731
                                    for i in index])
    for r, value in enumerate(strategy.experimental_local_results(pending)):
        np.testing.assert_allclose(value.numpy(), missed(r, (2, 3, 4)), rtol=1e-5, atol=1e-7)
    saved = [value.numpy() for value in strategy.experimental_local_results(pending)]
    path = tf.train.Checkpoint(compression=onebit).save(str(tmp_path / "between_exchanges"))
    pending.assign(tf.zeros_like(pending))
    tf.train.Checkpoint(compression=onebit).restore(path).assert_consumed()
    for value, before in zip(strategy.experimental_local_results(pending), saved):  # each its own
        np.testing.assert_array_equal(value.numpy(), before)

    sixth = strategy.experimental_distribute_dataset(mlp_data(steps=6).skip(5))
    trainer.fit(sixth, steps=6, start_step=5)  # the fourth compressed step exchanges
    local = [flat([beta * m2[i] + (1 - beta) * replicas * g_r[5][r][i] for i in index]) + missed(r, (2, 3, 4))
             for r in range(replicas)]
    with strategy.scope():
        zeros = lambda n: tf.Variable(tf.zeros([n]), synchronization=tf.VariableSynchronization.ON_READ,  # noqa: E731
                                      aggregation=tf.VariableAggregation.MEAN)
        worker, server = zeros(onebit.padded), zeros(onebit.padded // replicas)
    from tfpar.compression.compressed_aggregator import _all_gather_words

    def exchange(r, momenta):
        context = tf.distribute.get_replica_context()
        return two_phase.compressed_mean(context, tf.gather(momenta, r), worker, server, replicas, True,
                                         lambda w: _all_gather_words(context, w))

    expected = run_per_replica(strategy, exchange, tf.constant(np.stack(local)))[0].numpy()
    got = flat([strategy.experimental_local_results(onebit.m[i])[0].numpy() for i in index])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.any(pending.numpy())

    step = trainer.traced_step(dataset, "compressed")
    variables = trainer.model.trainable_variables
    analytic = onebit.payload_bytes(variables)
    assert accounting.bytes_per_replica(step, in_loops_only=True, checks=False) == pytest.approx(
        sum(analytic.values()))
    every_step = C.OneBitAdam(freeze_step=2, policy=C.Policy(min_size=0))
    every_step.compressed, every_step.padded, every_step.replicas = onebit.compressed, onebit.padded, replicas
    whole = every_step.payload_bytes(variables)
    assert analytic["all_to_all"] == whole["all_to_all"] / 4 and analytic["all_reduce"] == whole["all_reduce"]
    assert repr(onebit) == "onebit_adam(freeze=2, every 4 steps)"


def test_two_phase_error_compensation_identities():
    """sent + new worker error == momentum + old worker error (per replica, per chunk), and
    the server side keeps what its re-compression of the average missed."""
    strategy = mirrored(2)
    size = 128
    with strategy.scope():
        worker = tf.Variable(tf.zeros([size]), synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.MEAN)
        server = tf.Variable(tf.zeros([size // 2]), synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.MEAN)
    xs = np.random.RandomState(0).normal(size=(2, size)).astype("float32")
    from tfpar.compression.compressed_aggregator import _all_gather_words

    def step(r, x):
        context = tf.distribute.get_replica_context()
        old = tf.identity(worker)
        mean = two_phase.compressed_mean(context, tf.gather(x, r), worker, server, 2, True,
                                         lambda w: _all_gather_words(context, w))
        return mean, old, tf.identity(worker), tf.identity(server)

    results = run_per_replica(strategy, step, tf.constant(xs))
    means = [r[0].numpy() for r in results]
    np.testing.assert_array_equal(means[0], means[1])  # every replica decodes the same
    sent = [xs[r] + results[r][1].numpy() - results[r][2].numpy() for r in range(2)]
    for r in range(2):  # what was sent is signs times one scale per chunk
        for chunk in np.split(sent[r], 2):
            assert len(np.unique(np.round(np.abs(chunk), 5))) == 1
    average = (sent[0] + sent[1]) / 2
    for r in range(2):  # replica r serves chunk r
        chunk = np.split(average, 2)[r]
        np.testing.assert_allclose(np.split(means[r], 2)[r] + results[r][3].numpy(), chunk, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
def test_bytes_counted_equal_analytic_and_stay_flat(replicas, weights):
    strategy = mirrored(replicas)
    onebit = C.OneBitAdam(freeze_step=1, policy=C.Policy(min_size=0))
    _, trainer, dataset = train(strategy, weights, lambda: keras.optimizers.SGD(0.01), onebit, steps=2)
    step = trainer.traced_step(dataset, "compressed")
    analytic = onebit.payload_bytes(trainer.model.trainable_variables)
    assert accounting.bytes_per_replica(step, in_loops_only=True, checks=False) == sum(analytic.values())
    link = accounting.link_bytes_per_worker(step, replicas, checks=False)
    expected = accounting.analytic_link_bytes(
        {"reduce": analytic["all_reduce"], "all_to_all": analytic["all_to_all"],
         "gather": analytic["all_gather"] + analytic["(size exchange)"]}, replicas)
    assert link == pytest.approx(expected)
    # flat in R: within 10% of twice one compressed copy, whatever R
    one_copy = onebit.padded / 8
    assert link < 2.2 * one_copy + 4 * replicas * 2 + analytic["all_reduce"] * 2


def test_onebit_refuses_optimizers_and_bad_arguments():
    onebit = C.OneBitAdam()
    for optimizer, said in [
            (keras.optimizers.SGD(0.1, momentum=0.9), "computes Adam's step with compressed momentum.*not SGD"),
            (keras.optimizers.Lamb(0.1), "Adam or AdamW.*not Lamb"),
            (keras.optimizers.Adam(amsgrad=True), "amsgrad off.*not Adam with amsgrad"),
            (keras.optimizers.AdamW(clipnorm=1.0), "clipnorm and clipvalue would clip its step.*global_clipnorm"),
            (keras.optimizers.AdamW(gradient_accumulation_steps=2), "accumulate before the compressor.*accumulate=K")]:
        with pytest.raises(C.CompressionError, match=said):
            onebit.check_optimizer(optimizer)
    with pytest.raises(C.CompressionError, match="was given beta_2=0.95 and the optimizer has beta_2=0.98"):
        C.OneBitAdam(beta_2=0.95).check_optimizer(keras.optimizers.AdamW(beta_2=0.98))
    C.OneBitAdam(beta_2=0.98).check_optimizer(keras.optimizers.AdamW(beta_2=0.98))  # the same: fine
    onebit.check_optimizer(keras.optimizers.SGD(0.1))  # plain SGD: the compressor's own betas
    with pytest.raises(C.CompressionError, match="freeze_step must be >= 1"):
        C.OneBitAdam(freeze_step=0)
    with pytest.raises(C.CompressionError, match="exchange_every must be >= 1"):
        C.OneBitAdam(exchange_every=0)
    C.OneBitAdam(exchange_every=10)  # K (1 - beta_1) = 1: the held momentum's coefficient is 0
    with pytest.raises(C.CompressionError, match=r"exchange_every=11 is more than 1 / \(1 - beta_1\) = 10.*"
                                                 r"flip sign.*Use exchange_every <= 10"):
        C.OneBitAdam(exchange_every=11)
    with pytest.raises(C.CompressionError, match="exchange_every <= 4"):
        C.OneBitAdam(exchange_every=5, beta_1=0.75)


def test_only_a_conditional_named_every_k_steps_counts_as_its_mean():
    """accounting counts `every_K_steps` (TensorFlow may add _N) as a mean, nothing else."""
    period = accounting._period  # pylint: disable=protected-access
    assert period("replica_1/onebit_adam/every_2_steps") == 2 and period("a/every_4_steps_1") == 4
    assert period("log_every_100_steps") is None and period("every_2_steps/If") is None
