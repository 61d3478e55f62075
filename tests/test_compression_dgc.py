"""DGC and PowerSGD's schedules: exact cases, error feedback with momentum, bytes, refusals."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mirrored, mlp, mlp_data, run_per_replica, uses_convergence_runs
from tfpar import compression as C
from tfpar.loop import Trainer


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(0)
    return mlp().get_weights()


def train(strategy, weights, compression, momentum=0.0, steps=6, lr=0.1, **options):
    with strategy.scope():
        model = mlp()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(lr, momentum=momentum)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, compression=compression, **options)
    dataset = strategy.experimental_distribute_dataset(mlp_data(steps=steps))
    trainer.fit(dataset, steps=steps)
    return model.get_weights(), trainer, dataset


def gap(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b))


def refused(config, match: str) -> None:
    """The config's validation fails with one ConfigError whose message matches `match`."""
    from tfpar.config import ConfigError, validate

    with pytest.raises(ConfigError, match=match):
        validate(config)


# -- DGC -----------------------------------------------------------------------------------

def test_dgc_density_one_is_sgd_with_momentum(weights):
    """Momentum moved into the compressor: at density 1 nothing is left behind or masked."""
    strategy = mirrored(2)
    reference, _, _ = train(strategy, weights, None, momentum=0.9)
    got, _, _ = train(strategy, weights, C.Compression(C.DGC(ratio=1.0, momentum=0.9), C.Policy(min_size=0)))
    assert gap(got, reference) < 1e-5
    # the default policy leaves small tensors out: momentum on their all-reduced sum, same result
    got, _, _ = train(strategy, weights, C.Compression(C.DGC(ratio=1.0, momentum=0.9)))
    assert gap(got, reference) < 1e-5


@pytest.mark.slow
def test_dgc_warmup_steps_are_sgd_with_momentum_and_then_it_compresses(weights):
    strategy = mirrored(2)
    reference, _, _ = train(strategy, weights, None, momentum=0.9, steps=3)
    compression = C.Compression(C.DGC(ratio=0.05, momentum=0.9), C.Policy(min_size=0, warmup_steps=3))
    got, _, _ = train(strategy, weights, compression, steps=3)
    assert gap(got, reference) < 1e-5
    longer, _, _ = train(strategy, weights, None, momentum=0.9, steps=6)
    got, _, _ = train(strategy, weights, compression, steps=6)
    assert gap(got, longer) > 1e-4


def test_dgc_error_feedback_and_masking_identities():
    """One replica: sent + new accumulation == old accumulation + new velocity, and the
    velocity is zero exactly where something was sent."""
    dgc = C.DGC(ratio=0.05, momentum=0.9)
    variables = [tf.Variable(tf.zeros([24, 20]))]
    compression = C.Compression(dgc, C.Policy(min_size=0))
    compression.build(variables)
    slots = compression.state[next(iter(compression.state))]
    step = tf.function(lambda g: compression([g], variables)[0])
    rng = np.random.RandomState(0)
    for _ in range(4):
        gradient = rng.normal(size=(24, 20)).astype("float32")
        old_v, old_u = slots["residual"].numpy().copy(), slots["velocity"].numpy().copy()
        sent = step(tf.constant(gradient)).numpy()
        velocity = 0.9 * old_u + gradient
        np.testing.assert_allclose(sent + slots["residual"].numpy(), old_v + velocity, rtol=1e-5, atol=1e-5)
        assert (sent != 0).sum() == dgc.k(480, 0.05)
        np.testing.assert_array_equal(slots["velocity"].numpy()[sent != 0], 0)
        np.testing.assert_allclose(slots["velocity"].numpy()[sent == 0], velocity[sent == 0], rtol=1e-6)


def test_dgc_clips_by_the_global_norm_of_the_mean_gradient():
    """At density 1 the clip is exact: the summed gradients scaled by min(1, clip / ||sum||),
    every tensor together (it was each replica's own gradient at clip / sqrt(R))."""
    strategy = mirrored(4)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([30, 20])), tf.Variable(tf.zeros([8]))]
        compression = C.Compression(C.DGC(ratio=1.0, momentum=0.0, clip_norm=1.0), C.Policy(min_size=100))
        compression.build(variables)
    grads = np.stack([np.full((30, 20), 1.0 + r, np.float32) for r in range(4)])
    small = np.stack([np.full((8,), 2.0 - r, np.float32) for r in range(4)])
    results = run_per_replica(strategy, lambda r, g, b: compression([tf.gather(g, r), tf.gather(b, r)], variables),
                              tf.constant(grads), tf.constant(small))
    total = [grads.sum(0), small.sum(0)]
    scale = min(1.0, 1.0 / np.sqrt(sum((t ** 2).sum() for t in total)))
    for replica in results:
        for got, expected in zip(replica, total):
            np.testing.assert_allclose(got, expected * scale, rtol=1e-5)


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_in_a_sparse_stage_on_identical_replicas_is_the_one_replica_step(nesterov):
    """Every replica sees the same gradient: its estimate R g is the mean, so the agreed clip
    norm is the exact one and each replica sends what one replica alone would: the sum of
    what R replicas send is one replica's step, clip, momentum and nesterov included."""
    rng = np.random.RandomState(0)
    steps = [rng.normal(size=(24, 20)).astype("float32") for _ in range(3)]
    bias = [rng.normal(size=(6,)).astype("float32") for _ in range(3)]
    outputs = {}
    for replicas in (1, 2):
        strategy = mirrored(replicas)
        with strategy.scope():
            variables = [tf.Variable(tf.zeros([24, 20]), name="kernel"), tf.Variable(tf.zeros([6]), name="bias")]
            dgc = C.DGC(ratio=0.1, momentum=0.9, clip_norm=5.0, nesterov=nesterov)
            compression = C.Compression(dgc, C.Policy(min_size=100))
            compression.build(variables)
        got = []
        for g, b in zip(steps, bias):  # each replica's share of the sum: g / R
            results = run_per_replica(strategy, lambda r, g, b: compression([g, b], variables),
                                      tf.constant(g / replicas), tf.constant(b / replicas))
            got.append([t.numpy() for t in results[0]])
        outputs[replicas] = got
    for one, two in zip(outputs[1], outputs[2]):
        for a, b in zip(one, two):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    assert np.abs(outputs[1][0][0]).sum() > 0 and (outputs[1][0][0] == 0).mean() > 0.8  # sparse


@pytest.mark.slow
def test_dgc_sparsity_warmup_is_exponential_and_traced_per_stage(weights):
    dgc = C.DGC(ratio=0.001, warmup_steps=200)
    sparsity = [round(100 * (1 - d), 2) for d in dgc.densities()]
    assert sparsity == [74.88, 93.69, 98.42, 99.6, 99.9]
    strategy = mirrored(2)
    compression = C.Compression(C.DGC(ratio=0.02, warmup_steps=4, stages=2), C.Policy(min_size=0, warmup_steps=1))
    _, trainer, dataset = train(strategy, weights, compression, steps=6)
    assert compression.boundaries() == (1, 3, 5)
    phases = [compression.phase(s) for s in range(7)]
    assert phases[0] == "warmup" and phases[-1] == ("compressed", 0.02)
    assert len(set(phases)) == 4
    variables = trainer.model.trainable_variables
    for phase in set(phases):
        counted = C.accounting.bytes_per_replica(trainer.traced_step(dataset, phase),
                                                   in_loops_only=True, checks=False)
        assert counted == sum(compression.payload_bytes(variables, phase).values()), phase
    assert trainer.wire_bytes(dataset)["ratio"] > 10


def test_dgc_takes_the_sgds_momentum_and_clip_and_refuses_what_cannot_work():
    dgc = C.DGC()
    sgd = keras.optimizers.SGD(0.1, momentum=0.8, nesterov=True, global_clipnorm=2.0, weight_decay=0.01)
    C.Compression(dgc).check_optimizer(sgd)
    assert (dgc.momentum, dgc.nesterov, dgc.clip_norm) == (0.8, True, 2.0)
    applies = C.Compression(dgc).optimizer_for(sgd)
    assert isinstance(applies, keras.optimizers.SGD) and applies.momentum == 0 and not applies.global_clipnorm
    assert applies.weight_decay == 0.01 and float(applies.learning_rate) == pytest.approx(0.1)
    plain = keras.optimizers.SGD(0.1)
    legacy = C.DGC()
    C.Compression(legacy).check_optimizer(plain)  # a plain SGD: DGC's own momentum (0.9)
    assert legacy.momentum == 0.9 and C.Compression(legacy).optimizer_for(plain) is plain
    with pytest.raises(C.CompressionError, match="given momentum=0.5 and the optimizer has momentum=0.9"):
        C.Compression(C.DGC(momentum=0.5)).check_optimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(C.CompressionError, match="dgc is momentum SGD.*not Adam.*dgc_adam"):
        C.Compression(C.DGC()).check_optimizer(keras.optimizers.Adam())
    with pytest.raises(C.CompressionError, match="clipnorm and clipvalue would clip its step"):
        C.Compression(C.DGC()).check_optimizer(keras.optimizers.SGD(0.1, clipvalue=1.0))
    with pytest.raises(C.CompressionError, match="ends before its 4 stages start"):
        C.DGC(warmup_steps=2)
    with pytest.raises(C.CompressionError, match="dgc ratio"):
        C.get("dgc", ratio=2.0)
    with pytest.raises(C.CompressionError, match="overrides may only say 'dgc' or 'none'"):
        C.Compression(C.DGC(), C.Policy(min_size=0, overrides={"dense": "topk"})).build(
            [tf.Variable(tf.zeros([40, 40]), name="dense")])


def test_dgc_state_checkpoint_round_trip(tmp_path, weights):
    strategy = mirrored(2)
    compression = C.Compression(C.DGC(ratio=0.05), C.Policy(min_size=0))
    _, trainer, _ = train(strategy, weights, compression, steps=3)
    local = lambda v: [r.numpy() for r in strategy.experimental_local_results(v)]  # noqa: E731
    saved = {k: {n: local(v) for n, v in slots.items()} for k, slots in compression.state.items()}
    assert all(np.abs(s["velocity"][0]).max() > 0 for s in saved.values())
    assert any(np.abs(a - b).max() > 0 for s in saved.values() for a, b in [s["velocity"]])  # local
    checkpoint = tf.train.Checkpoint(**trainer.checkpoint_items())
    path = checkpoint.save(str(tmp_path / "ckpt"))
    for slots in compression.state.values():
        for v in slots.values():
            v.assign(tf.zeros_like(v))
    checkpoint.restore(path)
    for key, slots in compression.state.items():  # every replica its own velocity and accumulation
        for name, variable in slots.items():
            for value, expected in zip(local(variable), saved[key][name]):
                np.testing.assert_array_equal(value, expected)


# -- PowerSGD: uncompressed start, rank schedule --------------------------------------------

@pytest.mark.slow
def test_powersgd_rank_schedule_stages_and_bytes(weights):
    strategy = mirrored(2)
    psgd = C.PowerSGD(rank_schedule="8@0,2@2")
    compression = C.Compression(psgd, C.Policy(warmup_steps=2))  # the 64x4 head stays out
    _, trainer, dataset = train(strategy, weights, compression, steps=6)
    assert compression.boundaries() == (2, 4)
    assert [compression.phase(s) for s in (0, 2, 4)] == ["warmup", ("compressed", 8), ("compressed", 2)]
    variables = trainer.model.trainable_variables
    for phase in ("warmup", ("compressed", 8), ("compressed", 2)):
        counted = C.accounting.bytes_per_replica(trainer.traced_step(dataset, phase),
                                                   in_loops_only=True, checks=False)
        assert counted == sum(compression.payload_bytes(variables, phase).values()), phase
    assert repr(psgd) == "powersgd(8@0,2@2)"


def test_powersgd_uncompressed_start_equals_the_plain_loop(weights):
    strategy = mirrored(2)
    reference, _, _ = train(strategy, weights, None, momentum=0.9, steps=4)
    got, _, _ = train(strategy, weights, C.Compression(C.PowerSGD(2), C.Policy(min_size=0, warmup_steps=4)),
                      momentum=0.9, steps=4)
    assert gap(got, reference) < 1e-6


def test_a_start_in_fp16_is_the_fp16_run_at_half_the_bytes_then_powersgd_takes_over(weights):
    strategy = mirrored(2)
    every_tensor_fp16 = C.Compression(C.FP16(), C.Policy(min_size=0, skip=()))  # biases, norms too
    fp16, _, _ = train(strategy, weights, every_tensor_fp16, steps=4)
    started = C.Compression(C.PowerSGD(2), C.Policy(min_size=0, warmup_steps=4, warmup_compressor="fp16"))
    got, trainer, dataset = train(strategy, weights, started, steps=4)
    assert gap(got, fp16) == 0.0
    variables = trainer.model.trainable_variables
    counted = C.accounting.bytes_per_replica(trainer.traced_step(dataset, "warmup"),
                                               in_loops_only=True, checks=False)
    assert counted == sum(started.payload_bytes(variables, "warmup").values()) == 2 * trainer.model.count_params()
    assert started.phase(4) == "compressed" and started.plan[0] is started.compressor
    longer, _, _ = train(strategy, weights, every_tensor_fp16, steps=6)
    got, _, _ = train(strategy, weights, started, steps=6)
    assert gap(got, longer) > 1e-4  # PowerSGD from step 4


def test_in_an_fp16_start_a_sparse_gradient_stays_sparse_and_float32():
    """As without a start compressor: an embedding gradient with fewer rows than its table is
    summed sparse in float32 (16 bits would make it dense); dense ones go in fp16."""
    strategy = mirrored(2)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([100, 8])), tf.Variable(tf.zeros([8, 8]))]
        compression = C.Compression(C.PowerSGD(2), C.Policy(min_size=0, skip=(), warmup_steps=2,
                                                            warmup_compressor="fp16"))
        compression.build(variables)
    compression.set_phase("warmup")
    rng = np.random.RandomState(5)
    rows = (1 + 1e-3 * rng.normal(size=(2, 3, 8))).astype("float32")  # fp16 would round these
    dense = rng.normal(size=(2, 8, 8)).astype("float32")
    kinds = []

    def step(r, rows, dense):
        sparse = tf.IndexedSlices(tf.gather(rows, r), tf.constant([1, 5, 7]), tf.constant([100, 8]))
        table, matrix = compression([sparse, tf.gather(dense, r)], variables)
        kinds.append(type(table).__name__)
        return tf.convert_to_tensor(table), matrix

    for table, matrix in run_per_replica(strategy, step, tf.constant(rows), tf.constant(dense)):
        np.testing.assert_allclose(tf.gather(table, [1, 5, 7]), rows.sum(0), rtol=1e-7)
        assert 0 < np.abs(matrix - dense.sum(0)).max() < 1e-2  # fp16 rounding
    assert set(kinds) == {"IndexedSlices"}


def test_bf16_is_refused_on_gpus_also_as_a_start():
    from tfpar.compression.compressed_aggregator import _check_dtype_support

    gpus = types.SimpleNamespace(extended=types.SimpleNamespace(worker_devices=("/device:GPU:0",)))
    with pytest.raises(C.CompressionError, match="bf16 gradients cannot be summed by NCCL"):
        _check_dtype_support(C.Policy(warmup_steps=3, warmup_compressor="bf16").start(), gpus)
    with pytest.raises(C.CompressionError, match="bf16 gradients cannot be summed by NCCL"):
        _check_dtype_support(C.OneBitAdam(warmup_compressor="bf16").warmup_compressor, gpus)
    _check_dtype_support(C.OneBitAdam(warmup_compressor="fp16").warmup_compressor, gpus)
    with pytest.raises(C.CompressionError, match="factor_dtype bfloat16 cannot be summed by NCCL.*float32"):
        _check_dtype_support(C.PowerSGD(factor_dtype="bfloat16"), gpus)
    _check_dtype_support(C.PowerSGD(), gpus)


def test_a_start_compressor_that_cannot_start_is_refused_by_name():
    with pytest.raises(C.CompressionError, match="'topk' is not one of none, fp16, bf16"):
        C.Policy(warmup_steps=5, warmup_compressor="topk")
    with pytest.raises(C.CompressionError, match="needs warmup_steps > 0"):
        C.Policy(warmup_compressor="fp16")
    with pytest.raises(C.CompressionError, match="dgc's start is momentum SGD"):
        C.Compression(C.DGC(), C.Policy(warmup_steps=3, warmup_compressor="fp16")).build(
            [tf.Variable(tf.zeros([40, 40]))])
    psgd = C.from_config("powersgd", warmup_steps=5, warmup_compression="bf16")
    assert repr(psgd.policy.start()) == "bf16"
    from tfpar.config import base_config, validate

    config = base_config()
    config.mode, config.compression = "loop", "powersgd"
    config.compression_args.update(dict(warmup_steps=10, warmup_compression="int8"))
    refused(config, "compression_args.warmup_compression: 'int8' is not one of")
    config.compression_args.warmup_compression = "fp16"
    validate(config)
    config.compression_args.warmup_steps = 0
    refused(config, "give it --config.compression_args.warmup_steps > 0")
    config.compression, config.compression_args.warmup_steps = "auto", 10
    refused(config, "not auto")
    config.compression, config.compression_args.warmup_steps = "onebit_adam", 0  # its freeze_step
    validate(config)
    assert C.from_config("onebit_adam", freeze_step=7, warmup_compression="fp16").warmup_compressor.name == "fp16"


def test_powersgd_at_full_rank_is_exact():
    """At rank min(n, m) the summed approximation is the sum itself. The policy never sends a
    full rank (it saves no bytes: refused, or left in float32), so this is the math alone."""
    strategy = mirrored(2)
    rng = np.random.RandomState(4)
    per_replica = rng.normal(size=(2, 12, 40)).astype("float32")
    psgd = C.PowerSGD(rank=12)
    with strategy.scope():
        q = C.replica_state.per_replica(psgd.initial_q((12, 40), 0), "q", C.replica_state.SAME)

    def replica(r, g):
        context = tf.distribute.get_replica_context()
        return psgd.aggregate([tf.gather(g, r)], [q], lambda xs: context.all_reduce(tf.distribute.ReduceOp.SUM, xs))[0]

    for total in run_per_replica(strategy, replica, tf.constant(per_replica)):
        np.testing.assert_allclose(total, per_replica.sum(0), rtol=1e-4, atol=1e-4)


def test_powersgd_bad_schedules_and_ranks_are_refused_at_start():
    with pytest.raises(C.CompressionError, match="must start at step 0 and its steps must rise"):
        C.PowerSGD(rank_schedule="8@300,4@100")
    with pytest.raises(C.CompressionError, match="must start at step 0"):
        C.PowerSGD(rank_schedule="4@10")
    with pytest.raises(C.CompressionError, match="is not 'RANK@STEP'"):
        C.PowerSGD(rank_schedule="4-0")
    compression = C.Compression(C.PowerSGD(rank=8), C.Policy(min_size=0))
    with pytest.raises(C.CompressionError, match=r"rank 8 is larger than the matrix 'thin(:0)?' \(6x50\)"):
        compression.build([tf.Variable(tf.zeros([6, 50]), name="thin")])
    with pytest.raises(C.CompressionError, match="does not take"):
        C.get("powersgd", ratio=0.1)
    square = C.Compression(C.PowerSGD(rank=8), C.Policy(min_size=0))  # 8 x (16 + 16) = 16 x 16
    with pytest.raises(C.CompressionError, match=r"no fewer floats .* \(16x16\)\): use a rank of at most 7"):
        square.build([tf.Variable(tf.zeros([16, 16]), name="square")])


def test_powersgd_names_the_matrices_its_rank_leaves_in_float32(caplog):
    compression = C.Compression(C.PowerSGD(rank=8), C.Policy(min_size=0))
    with caplog.at_level("WARNING"):
        compression.build([tf.Variable(tf.zeros([16, 16]), name="small"), tf.Variable(tf.zeros([64, 64]), name="big")])
    assert [type(c).__name__ if c else None for c in compression.plan] == [None, "PowerSGD"]
    said = [r.getMessage() for r in caplog.records if "float32, where rank 8" in r.getMessage()]
    assert len(said) == 1 and "leaves 1 matrix" in said[0] and "small" in said[0] and "big" not in said[0], said


# -- two worker processes --------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
def test_new_compressors_run_on_two_worker_processes(tmp_path):
    """dgc, powersgd (start + rank schedule), 1-bit Adam (its all-to-all; also exchanging
    every 2nd step, inside a tf.cond) and DGC on Adam (one top-k, all-gathered) across two processes: both workers end equal, bytes counted == analytic in every phase, and dgc at
    density 1 equals one device with SGD + momentum."""
    from procs import launch
    from scripts import fit_model

    result = launch(2, "compression_schedules_worker.py", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    wires = [l.split()[1:] for l in result.stdout.splitlines() if "[worker:0] WIRE " in l]
    runs = ("dgc_dense", "dgc", "powersgd", "onebit_adam", "onebit_adam_every2", "dgc_adam")
    assert {w[1] for w in wires} >= set(runs), wires
    for _, name, phase, counted, analytic in [l.split("] ")[1].split() for l in result.stdout.splitlines()
                                              if "[worker:0] WIRE " in l]:  # every2: the mean per step
        assert float(counted) == pytest.approx(float(analytic)) and float(analytic) > 0, (name, phase, counted, analytic)

    def load(name, worker):
        saved = np.load(tmp_path / f"{name}_{worker}.npz")
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]

    for name in runs:
        for a, b in zip(load(name, 0), load(name, 1)):
            np.testing.assert_array_equal(a, b)
    with tf.distribute.get_strategy().scope():
        model = fit_model.build_model()
        model.set_weights(fit_model.initial_weights())
    trainer = Trainer(model, keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer.fit(fit_model.dataset(), steps=fit_model.STEPS)
    assert gap(load("dgc_dense", 0), model.get_weights()) < 1e-5


# -- convergence, through the training binary -----------------------------------------------

@pytest.mark.slow
@uses_convergence_runs
@pytest.mark.parametrize("name", ["dgc", "onebit_adam", "onebit_adam_every2", "dgc_adam", "powersgd_schedule",
                                  "powersgd_fp16_start", "powersgd_bf16"])
def test_new_compressors_learn_the_reverse_task_through_the_binary(reverse_task_runs, name):
    """reverse_tiny on 2 replicas, 200 steps, through tfpar.train in loop mode: dgc(0.01)
    with a density warm-up, 1-bit Adam after 60 Adam steps (also exchanging every 2nd step,
    embeddings too), DGC on Adam (ratio 0.01 after 60 Adam steps) and PowerSGD with a float32 or
    an fp16 start and a rank schedule (also with bfloat16 factors) each reach the exact-sequence accuracy that the
    uncompressed run reaches (>= 0.95, see test_compression). Runs: conftest.CONVERGENCE_RUNS."""
    result = reverse_task_runs[name]
    assert result["name"].split(":")[0] == result["compression"] and name.startswith(result["compression"])
    assert result["exact"] >= 0.95, result


# -- config and Keras fit ----------------------------------------------------------------------

def test_config_builds_the_new_compressors_and_refuses_what_cannot_work():
    from tfpar.config import base_config, validate

    config = base_config()
    config.mode, config.compression = "loop", "dgc"
    refused(config, "config.compression: dgc is momentum SGD .*--config.optimizer.name=sgd .*dgc_adam")
    config.optimizer.name = "sgd"
    validate(config)  # its momentum, nesterov and clip_norm move into dgc
    config.compression_args.clip_norm = 1.0
    refused(config, "compression_args.clip_norm: clipping is --config.optimizer.clip_norm for every compressor")
    config.compression_args.clip_norm, config.compression_args.momentum = 0.0, 0.9
    refused(config, "compression_args.momentum: is read by dgc_adam only; dgc would ignore 0.9")
    config.compression_args.momentum = None
    for name in ("onebit_adam", "dgc_adam"):
        config.compression = name
        refused(config, f"{name} computes AdamW's step.*--config.optimizer.name=adamw .*not sgd")
        config.optimizer.name = "adamw"
        validate(config)
        config.compression_args.warmup_steps = 50  # their Adam warm-up is the start
        refused(config, f"warmup_steps: does not apply to {name}: .*--config.compression_args.freeze_step")
        config.compression_args.warmup_steps, config.compression_args.sparsity_warmup_steps = 0, 50
        refused(config, f"sparsity_warmup_steps: is dgc's density ramp; {name} has none")
        config.compression_args.sparsity_warmup_steps = 0
        config.optimizer.name = "sgd"
    config.optimizer.name = "adamw"
    config.compression_args.stages = 8  # dgc's ramp: dgc_adam would ignore it
    refused(config, "compression_args.stages: is read by dgc only; dgc_adam would ignore 8: drop it")
    config.compression, config.compression_args.stages, config.optimizer.name = "dgc", 4, "sgd"
    config.compression_args.rank = 8
    refused(config, "compression_args.rank: is read by powersgd only; dgc would ignore 8")
    config.compression, config.compression_args.overrides = "topk", "embed=powersgd"  # an override reads it
    config.optimizer.update(dict(name="adamw", clip_norm=1.0))
    validate(config)
    config.compression = "auto"  # which drops overrides
    refused(config, "compression_args.rank: is read by powersgd only; auto would ignore 8")
    config.compression, config.compression_args.rank_schedule = "powersgd", "8@0,4@300"
    refused(config, "compression_args.rank: is ignored when rank_schedule is set")
    config.compression, config.compression_args.overrides, config.compression_args.rank_schedule = "dgc", "", ""
    config.compression_args.rank = 4
    config.optimizer.name = "sgd"
    config.compression = "zip"
    refused(config, "'zip' is not one of .*dgc, onebit_adam")
    with pytest.raises(C.CompressionError, match="clipping is the optimizer's global_clipnorm"):
        C.from_config("dgc", clip_norm=1.0)
    dgc = C.from_config("dgc", ratio=0.001, sparsity_warmup_steps=100, embeddings=True)
    assert isinstance(dgc.compressor, C.DGC) and dgc.compressor.warmup_steps == 100
    assert not any("embed" in p for p in dgc.policy.skip)
    psgd = C.from_config("powersgd", rank_schedule="8@0,4@300", warmup_steps=50)
    assert psgd.compressor.stages_at() == [(0, 8), (300, 4)] and psgd.boundaries() == (50, 350)
    assert isinstance(C.from_config("onebit_adam", freeze_step=7), C.OneBitAdam)
    every = C.from_config("onebit_adam", exchange_every=3, embeddings=True)
    assert every.exchange_every == 3 and not any("embed" in p for p in every.policy.skip)
    config.compression, config.compression_args.exchange_every, config.optimizer.name = "onebit_adam", 0, "adamw"
    refused(config, "compression_args.exchange_every: must be >= 1")
    config.compression_args.exchange_every = 11
    refused(config, "exchange_every: must be <= 10")
    config.compression, config.compression_args.exchange_every, config.optimizer.name = "dgc", 2, "sgd"
    refused(config, "exchange_every: applies to onebit_adam only")
    config.compression_args.exchange_every = 1
    config.compression_args.factor_dtype = "bfloat16"
    refused(config, "factor_dtype: is PowerSGD's wire dtype; dgc sends no PowerSGD factors")
    config.compression = "powersgd"
    config.optimizer.update(dict(name="adamw", clip_norm=1.0))
    validate(config)
    assert C.from_config("powersgd", rank=3, factor_dtype="bfloat16").compressor.wire_dtype == tf.bfloat16
    config.compression_args.factor_dtype = "float16"
    refused(config, "factor_dtype: 'float16' is not one of float32, bfloat16")
    config.compression_args.factor_dtype = "float32"
    with pytest.raises(C.CompressionError, match="ends before its 4 stages start"):
        C.from_config("dgc", sparsity_warmup_steps=3)


@pytest.mark.slow
def test_keras_fit_takes_dgc_and_refuses_phases_by_name(weights):
    strategy = mirrored(2)

    def fit(optimizer, compression=None):
        with strategy.scope():
            model = mlp()
            model.set_weights(weights)
            model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if compression is not None:
                C.compress_fit(model, compression)
        model.fit(mlp_data(), epochs=1, verbose=0, shuffle=False)
        return model.get_weights()

    plain = fit(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    got = fit(lambda: keras.optimizers.SGD(0.1), C.Compression(C.DGC(ratio=1.0), C.Policy(min_size=0)))
    assert gap(got, plain) < 1e-5
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for phased in (C.Compression(C.DGC(warmup_steps=8)), C.OneBitAdam(freeze_step=5),
                   C.Compression(C.PowerSGD(rank_schedule="4@0,2@9"))):
        with pytest.raises(C.CompressionError, match="changes phase at steps .* needs tfpar.Trainer"):
            C.compress_fit(model, phased)
    with pytest.raises(C.CompressionError, match="compression='auto' .* use tfpar.Trainer"):
        C.compress_fit(model, C.Auto())
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(C.CompressionError, match="dgc is momentum SGD"):
        C.compress_fit(model, C.DGC())
