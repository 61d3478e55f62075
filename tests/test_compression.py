"""Gradient compression: exactness where it must be exact, error feedback, bytes counted."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar import compression as C
from tfpar.compression import accounting
from tfpar.loop import Trainer

ALL = ["none", "fp16", "bf16", "int8", "topk", "powersgd", "sign"]


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def mlp():
    """Dense layers only: every gradient is dense, so every byte has a static size."""
    inputs = keras.Input((32,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def mlp_data(batch=16, steps=6):
    rng = np.random.RandomState(1)
    x = rng.normal(size=(batch * steps, 32)).astype("float32")
    y = (np.abs(x[:, :4]).argmax(1)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def trainer_for(strategy, build, weights, compression=None, **options):
    with strategy.scope():
        model = build()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, compression=compression, **options)
    return model, trainer


@pytest.fixture(scope="module")
def mlp_weights():
    keras.utils.set_random_seed(0)
    return mlp().get_weights()


def run_per_replica(strategy, function, *values):
    """Runs `function(replica_id, *values)` in every replica inside a tf.function."""
    @tf.function
    def step():
        def replica():
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            return function(index, *values)
        return strategy.run(replica)
    return [r for r in strategy.experimental_local_results(step())]


# -- exactness ---------------------------------------------------------------------------

def test_none_equals_the_plain_loop_bit_for_bit():
    strategy = mirrored(2)
    weights = fit_model.initial_weights()
    dataset = strategy.experimental_distribute_dataset(fit_model.dataset())
    plain_model, plain = trainer_for(strategy, fit_model.build_model, weights)
    plain.fit(dataset, steps=fit_model.STEPS)
    model, trainer = trainer_for(strategy, fit_model.build_model, weights, C.NoCompression())
    trainer.fit(dataset, steps=fit_model.STEPS)
    for a, b in zip(model.get_weights(), plain_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_fp16_stays_within_fp16_rounding(mlp_weights):
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(mlp_data())
    plain_model, plain = trainer_for(strategy, mlp, mlp_weights)
    plain.fit(dataset, steps=6)
    model, trainer = trainer_for(strategy, mlp, mlp_weights, C.Compression(C.FP16(), C.Policy(min_size=0)))
    trainer.fit(dataset, steps=6)
    moved = max(np.abs(a - b).max() for a, b in zip(plain_model.get_weights(), mlp_weights))
    for a, b in zip(model.get_weights(), plain_model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-3 * moved, rtol=2e-3)


def test_topk_with_ratio_one_is_the_dense_sum():
    strategy = mirrored(2)
    grads = [np.random.RandomState(i).normal(size=(2, 40, 30)).astype("float32") for i in range(2)]
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([40, 30])), tf.Variable(tf.zeros([30, 30]))]
        compression = C.Compression(C.TopK(1.0), C.Policy(min_size=0))
        compression.build(variables)
    results = run_per_replica(strategy, lambda r, a, b: compression([tf.gather(a, r)[:40],
                                                                     tf.gather(b, r)[:30]], variables),
                              tf.constant(grads[0]), tf.constant(grads[1][:, :30]))
    for replica in results:
        np.testing.assert_allclose(replica[0], grads[0].sum(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(replica[1], grads[1][:, :30].sum(0), rtol=1e-6, atol=1e-6)


def test_powersgd_is_exact_on_a_matrix_of_rank_at_most_its_rank():
    strategy = mirrored(2)
    rng = np.random.RandomState(3)
    # each replica's gradient has rank 1, the sum rank 2 <= 4
    per_replica = np.stack([np.outer(rng.normal(size=48), rng.normal(size=40)) for _ in range(2)])
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([48, 40]))]
        compression = C.Compression(C.PowerSGD(rank=4), C.Policy(min_size=0))
        compression.build(variables)
    results = run_per_replica(strategy, lambda r, g: compression([tf.gather(g, r)], variables),
                              tf.constant(per_replica.astype("float32")))
    for replica in results:
        np.testing.assert_allclose(replica[0], per_replica.sum(0), rtol=1e-4, atol=1e-4)
    residual = compression.state[next(iter(compression.state))]["residual"]
    owed = sum(v.numpy() for v in strategy.experimental_local_results(residual))
    assert np.abs(owed).max() < 1e-4  # the replicas' residuals cancel: nothing is owed


def test_powersgd_bf16_factors_send_half_the_bytes_and_keep_what_rounding_loses(mlp_weights):
    """factor_dtype="bfloat16": P and Q are summed in bfloat16 (in the graph: half of float32's
    bytes for the same matrices), a rank-2 sum comes back to bfloat16's rounding, and what the
    rounding loses stays in the replicas' residuals."""
    strategy = mirrored(2)
    rng = np.random.RandomState(3)
    per_replica = np.stack([np.outer(rng.normal(size=48), rng.normal(size=40)) for _ in range(2)])
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([48, 40]))]
        compression = C.Compression(C.PowerSGD(rank=4, factor_dtype="bfloat16"), C.Policy(min_size=0))
        compression.build(variables)
    results = run_per_replica(strategy, lambda r, g: compression([tf.gather(g, r)], variables),
                              tf.constant(per_replica.astype("float32")))
    exact = per_replica.sum(0)
    residual = compression.state[next(iter(compression.state))]["residual"]
    owed = sum(v.numpy() for v in strategy.experimental_local_results(residual))
    for replica in results:
        error = np.abs(replica[0].numpy() - exact).max() / np.abs(exact).max()
        assert 0 < error < 2e-2, error  # rounded (bfloat16 keeps 8 bits), not lost
        np.testing.assert_allclose(owed, exact - replica[0].numpy(), atol=1e-5)

    dataset = strategy.experimental_distribute_dataset(mlp_data())
    sent = {}
    for dtype in ("float32", "bfloat16"):
        model, trainer = trainer_for(strategy, mlp, mlp_weights, C.PowerSGD(rank=4, factor_dtype=dtype))
        analytic = trainer.aggregator.payload_bytes(model.trainable_variables)
        low_rank = sum(analytic[p] for p, c in zip(trainer.aggregator.paths, trainer.aggregator.plan) if c)
        found = accounting.collectives(trainer.traced_step(dataset))
        wire = trainer.wire_bytes(dataset)
        wire = wire["bytes_per_step"] - wire["check_bytes_per_step"]  # the gradients' alone
        assert wire == sum(analytic.values()), (dtype, wire, analytic)
        sent[dtype] = (wire, low_rank, {c.dtype for c in found if c.type == "CollectiveReduceV2"})
    assert sent["bfloat16"][1] * 2 == sent["float32"][1] > 0, sent
    assert sent["float32"][0] - sent["bfloat16"][0] == sent["bfloat16"][1], sent  # the rest is unchanged
    assert "bfloat16" in sent["bfloat16"][2] and "bfloat16" not in sent["float32"][2], sent


@pytest.mark.parametrize("name", ["topk", "sign", "powersgd", "powersgd_bf16"])
def test_error_feedback_sent_plus_new_residual_is_gradient_plus_old(name):
    """On one replica the aggregate is exactly what this replica sent."""
    args = {"topk": {"ratio": 0.05}, "powersgd": {"rank": 2},
            "powersgd_bf16": {"rank": 2, "factor_dtype": "bfloat16"}}.get(name, {})
    compressor = C.get(name.removesuffix("_bf16"), **args)
    variables = [tf.Variable(tf.zeros([24, 20]))]
    compression = C.Compression(compressor, C.Policy(min_size=0))
    compression.build(variables)
    residual = compression.state[next(iter(compression.state))]["residual"]
    step = tf.function(lambda g: compression([g], variables)[0])
    rng = np.random.RandomState(0)
    for _ in range(3):  # the old residual is non-zero from the second call on
        gradient = rng.normal(size=(24, 20)).astype("float32")
        old = residual.numpy().copy()
        sent = step(tf.constant(gradient)).numpy()
        np.testing.assert_allclose(sent + residual.numpy(), gradient + old, rtol=1e-5, atol=1e-5)
        assert np.abs(residual.numpy()).max() > 0  # it does compress


def test_packing_round_trips():
    values = tf.constant(np.arange(-127, 128, dtype=np.int8))
    np.testing.assert_array_equal(C.packing.unpack_int8(C.packing.pack_int8(values), 255), values)
    bits = tf.constant(np.random.RandomState(0).rand(77) > 0.5)
    np.testing.assert_array_equal(C.packing.unpack_bits(C.packing.pack_bits(bits), 77), bits)


def test_payload_bits_survive_the_collective_unchanged():
    """Words travel as float32 bits: NaN and denormal patterns must arrive as sent."""
    from tfpar.compression.compressed_aggregator import _all_gather_words

    strategy = mirrored(2)
    words = tf.constant([0, 1, 5, -1, 0x7FC00001, 0x7F800001, -0x00400000, 2**31 - 1, -2**31], tf.int32)
    results = run_per_replica(strategy, lambda r, w: _all_gather_words(
        tf.distribute.get_replica_context(), (w + tf.cast(r, tf.int32) * 0)[None]), words)
    for gathered in results:
        np.testing.assert_array_equal(gathered.numpy(), np.stack([words.numpy()] * 2))


def test_int8_is_unbiased():
    gradient = tf.constant(np.random.RandomState(0).normal(size=1000).astype("float32"))
    int8 = C.Int8(seed=1)
    decoded = np.mean([int8.decode_sum(int8.encode(gradient)[None], 1000).numpy() for _ in range(200)], 0)
    scale = float(tf.reduce_max(tf.abs(gradient))) / 127
    assert np.abs(decoded - gradient.numpy()).max() < 0.35 * scale  # one step: up to `scale`


# -- the wire ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_bytes_counted_in_the_graph_match_the_analytic_size(name, mlp_weights):
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(mlp_data())
    model, trainer = trainer_for(strategy, mlp, mlp_weights, C.get(name))
    wire = trainer.wire_bytes(dataset)
    analytic = trainer.aggregator.payload_bytes(model.trainable_variables)
    assert wire["dynamic_collectives"] == 0
    # + one float32 a step where the compressor keeps state: the replicas agree that every
    # gradient is finite (a NaN may stay in one replica's error feedback, unsent)
    assert wire["check_bytes_per_step"] == (4 if trainer.aggregator.state_variables() else 0), wire
    assert wire["bytes_per_step"] - wire["check_bytes_per_step"] == sum(analytic.values()), (wire, analytic)
    assert wire["fp32_bytes_per_step"] == 4 * model.count_params()
    expected_ratio = {"none": 1.0, "fp16": 1.8, "bf16": 1.8, "int8": 2.5, "topk": 5.0,
                      "powersgd": 4.5, "sign": 6.0}[name]
    assert wire["ratio"] >= expected_ratio, wire


def test_the_finiteness_flag_is_named_apart_by_its_scope_only():
    """A scope TensorFlow renamed (`_1`) is still the flag's; a look-alike is a gradient's."""
    def op(name, size):
        return accounting.Collective("CollectiveReduceV2", name, "/cpu:0", "float32", (), size)
    found = [op(f"while/{accounting.CHECK_SCOPE}/CollectiveReduceV2", 4),
             op(f"while/{accounting.CHECK_SCOPE}_1/CollectiveReduceV2", 4),
             op(f"while/{accounting.CHECK_SCOPE}s/CollectiveReduceV2", 100),
             op(f"while/grads/{accounting.CHECK_SCOPE}", 1000)]  # an op so named, not its scope
    assert accounting.bytes_in_scope(found) == 8


@pytest.mark.parametrize("name", ["topk", "powersgd", "sign", "int8"])
def test_no_compressed_tensor_is_also_sent_dense(name, mlp_weights):
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(mlp_data())
    model, trainer = trainer_for(strategy, mlp, mlp_weights, C.get(name))
    plan = trainer.aggregator.plan
    assert any(plan), "something must be compressed"
    uncompressed = sum(4 * int(v.shape.num_elements())
                       for v, c in zip(model.trainable_variables, plan) if c is None)
    found = accounting.collectives(trainer.traced_step(dataset), checks=False)
    device = found[0].device
    dense = sum(c.bytes for c in found if c.device == device and c.type == "CollectiveReduceV2"
                and c.dtype == "float32" and name != "powersgd")
    if name == "powersgd":  # its P and Q all-reduces are float32 too: count them out
        low_rank = sum(trainer.aggregator.payload_bytes(model.trainable_variables)[p]
                       for p, c in zip(trainer.aggregator.paths, plan) if c is not None)
        dense = sum(c.bytes for c in found if c.device == device and c.type == "CollectiveReduceV2"
                    and c.dtype == "float32") - low_rank
    assert dense == uncompressed


def test_warmup_steps_go_uncompressed(mlp_weights):
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(mlp_data(steps=8))
    model, trainer = trainer_for(strategy, mlp, mlp_weights,
                                 C.Compression(C.TopK(0.1), C.Policy(warmup_steps=3)), steps_per_loop=2)
    assert trainer._chunks(0, 8) == [2, 1, 1, 2, 2]  # cut at the warm-up boundary
    warm = accounting.bytes_per_replica(trainer.traced_step(dataset, "warmup"), checks=False)
    assert warm == 4 * model.count_params()
    trainer.fit(dataset, steps=8)
    assert trainer.step == 8


def test_the_plan_table_and_link_bytes_match_what_the_step_sends(mlp_weights):
    """Compression.describe: per variable its float32 bytes and the bytes it sends (a sum
    of the analytic sizes); a warm-up all-reduce on 2 replicas carries 2(R-1)/R = 1x its
    payload per link, counted from the traced step and from the analytic size alike."""
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(mlp_data(steps=2))
    compression = C.Compression(C.TopK(0.1), C.Policy(warmup_steps=1, min_size=0))
    model, trainer = trainer_for(strategy, mlp, mlp_weights, compression)
    variables = model.trainable_variables
    rows = compression.describe(variables)
    assert [r[2] for r in rows] == [4 * int(v.shape.num_elements()) for v in variables]
    assert {name for _, name, _, _ in rows} == {"topk(0.1)", "none"}, rows  # norms and biases skipped
    assert all((sent < fp32) == (name != "none") for _, name, fp32, sent in rows), rows
    sent = compression.payload_bytes(variables)
    assert sum(r[3] for r in rows) == sum(b for path, b in sent.items() if not path.startswith("("))
    warm = trainer.traced_step(dataset, "warmup")
    assert accounting.link_bytes_per_worker(warm, 2, checks=False) == \
        accounting.analytic_link_bytes({"reduce": 4 * model.count_params()}, 2) == 4 * model.count_params()


def test_bad_options_are_refused_clearly():
    with pytest.raises(C.CompressionError, match="Unknown compressor 'zip'; choose one of none, fp16"):
        C.get("zip")
    with pytest.raises(C.CompressionError, match="topk ratio must be in"):
        C.get("topk", ratio=0)
    with pytest.raises(C.CompressionError, match="does not take"):
        C.get("sign", rank=3)
    with pytest.raises(C.CompressionError, match="factor_dtype 'float16' is not one of float32, bfloat16"):
        C.get("powersgd", factor_dtype="float16")
    with pytest.raises(C.CompressionError, match="regex"):
        C.Policy(overrides={"(": "none"})


# -- Keras fit ---------------------------------------------------------------------------------

def test_keras_fit_sends_gradients_once_through_the_compressor(mlp_weights):
    """topk(1.0) is exact: fit with it equals plain fit only if every gradient is summed once."""
    strategy = mirrored(2)

    def fit(compression=None):
        with strategy.scope():
            model = mlp()
            model.set_weights(mlp_weights)
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if compression is not None:
                C.compress_fit(model, compression)
        model.fit(mlp_data(), epochs=1, verbose=0, shuffle=False)
        return model.get_weights()

    plain = fit()
    exact = fit(C.Compression(C.TopK(1.0), C.Policy(min_size=0, skip=())))
    for a, b in zip(exact, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    lossy = fit(C.TopK(0.05))
    assert max(np.abs(a - b).max() for a, b in zip(lossy, plain)) > 1e-4  # it did compress
    low_rank = fit(C.PowerSGD(rank=2, factor_dtype="bfloat16"))  # no phases: fit takes it
    assert all(np.isfinite(w).all() for w in low_rank)
    assert max(np.abs(a - b).max() for a, b in zip(low_rank, plain)) > 1e-4


def test_compress_fit_refuses_what_it_cannot_do():
    model = mlp()
    with pytest.raises(C.CompressionError, match="compiled model"):
        C.compress_fit(model, C.TopK(0.01))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(C.CompressionError, match="warm-up steps need tfpar.Trainer"):
        C.compress_fit(model, C.Compression(C.TopK(0.01), C.Policy(warmup_steps=5)))


# -- two worker processes --------------------------------------------------------------------

@pytest.mark.multiprocess
def test_every_compressor_runs_on_two_worker_processes(tmp_path):
    from procs import launch

    result = launch(2, "compression_worker.py", str(tmp_path), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    # one device, same global batch: what `none` must reproduce
    model, trainer = trainer_for(tf.distribute.get_strategy(), fit_model.build_model,
                                 fit_model.initial_weights())
    trainer.fit(fit_model.dataset(), steps=fit_model.STEPS)
    expected = model.get_weights()

    def load(name, worker):
        saved = np.load(tmp_path / f"{name}_{worker}.npz")
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]

    for name in ALL:
        line = next(l for l in result.stdout.splitlines() if f"[worker:0] WIRE {name} " in l)
        counted, analytic, ratio, per_call, check, stateful = line.split()[3:9]
        assert int(counted) == int(analytic) > 0 and int(per_call) == 4, line  # + the loss sum
        assert int(check) == (4 if stateful == "True" else 0), line  # the agreed-finite flag
        first, second = load(name, 0), load(name, 1)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)  # every replica applies the same sum
        gap = max(np.abs(a - b).max() for a, b in zip(first, expected))
        if name == "none":
            assert gap < 1e-5
        else:
            assert float(ratio) > 1.3 and gap > 1e-6, (name, ratio, gap)


# -- convergence, through the training binary -----------------------------------------------

def uses_convergence_runs(test):
    """For the users of `reverse_task_runs`: one pytest-xdist worker runs them all (the runs
    are trained once), and the first one's setup, which trains them (400-500 s idle, past
    600 under load), gets the fixture's own 1500 s limit."""
    return pytest.mark.xdist_group("convergence")(pytest.mark.timeout(1500)(test))


@uses_convergence_runs
def test_compressed_runs_learn_the_task_like_the_uncompressed_one(reverse_task_runs):
    """reverse_tiny on 2 replicas, same steps: topk(0.01), powersgd(4), int8 and sign reach
    the accuracy of `none` (margin: 2 points of exact-sequence accuracy)."""
    names = ["none", "topk", "powersgd", "int8", "sign"]
    results = {name: reverse_task_runs[name] for name in names}
    assert results["none"]["exact"] >= 0.95, results["none"]
    for name in names[1:]:
        assert results[name]["name"] == name  # the spec the run was given
        assert results[name]["exact"] >= results["none"]["exact"] - 0.02, (name, results[name])
        assert results[name]["compression_ratio"] > 3, (name, results[name])
    assert results["none"]["compression_ratio"] == 1.0
