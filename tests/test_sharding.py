"""Sharded data parallelism (ZeRO-1/2, Trainer(shard=...)): the same training as the
unsharded loop, 1/R of the optimizer state (and gradients) per replica, the same bytes on
the wire, checkpoints that cross replica counts and modes, and every refusal by name.
The user's own paths (a keras-hub model, the user's checkpoint and .keras files) are in
test_zero_user_paths.py; partitioned checkpoints read from their index, across workers,
in test_zero_partitioned_checkpoints.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from test_compression import mlp_data
from tfpar import compression as C
from tfpar.checkpoints import Checkpoints
from tfpar.compression import accounting
from tfpar.errors import NonFiniteError, ShardingError
from tfpar import zero
from tfpar.loop import Trainer
from tfpar.strategy import groups
from tfpar.zero import optimizer as zero_optimizer

TOL = 1e-5
STEPS = 4


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def odd_mlp():
    """Dense layers whose sizes do not divide by 2 or 4: every chunk layout pads."""
    inputs = keras.Input((32,))
    x = keras.layers.Dense(37, activation="relu", name="shard_dense")(inputs)
    x = keras.layers.LayerNormalization(name="shard_norm")(x)
    x = keras.layers.Dense(21, activation="relu", name="shard_dense_1")(x)
    return keras.Model(inputs, keras.layers.Dense(5, name="shard_out")(x))


def adamw():  # a schedule, decoupled weight decay with an exclusion, global clipping
    optimizer = keras.optimizers.AdamW(keras.optimizers.schedules.PolynomialDecay(0.02, 10, 0.002),
                                       weight_decay=0.1, global_clipnorm=0.5, epsilon=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


OPTIMIZERS = {
    "adamw": adamw,
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True, clipnorm=0.2, weight_decay=0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.02, weight_decay=0.01, global_clipnorm=1.0),
}


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(0)
    return odd_mlp().get_weights()


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def trainer_for(strategy, weights, shard="none", optimizer="adamw", bucket_bytes=None, **options):
    if bucket_bytes is not None:
        shard = zero.ZeroUpdate(shard, bucket_bytes=bucket_bytes)
    with strategy.scope():
        model = odd_mlp()
        model.set_weights(weights)
        built = OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer()
    return model, Trainer(model, built, loss(), strategy=strategy, shard=shard, **options)


def train(strategy, weights, shard="none", optimizer="adamw", steps=STEPS, data=None, **options):
    options.setdefault("steps_per_loop", 2)  # steps inside one tf.function call's loop
    model, trainer = trainer_for(strategy, weights, shard, optimizer, **options)
    accumulate = options.get("accumulate", 1)
    data = data if data is not None else mlp_data(steps=steps * accumulate)
    trainer.fit(strategy.experimental_distribute_dataset(data), steps=steps)
    return model.get_weights(), trainer


def assert_same(actual, expected, tol=TOL):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def moved(after, before):
    return max(np.abs(a - b).max() for a, b in zip(after, before))


def saved(trainer, model_weights, path) -> dict:
    """Every value of the checkpoint the Trainer's items (and the optimizer) make, by key."""
    items = {"optimizer": trainer.optimizer, **trainer.checkpoint_items()}
    written = tf.train.Checkpoint(**items).save(str(path))
    reader = tf.train.load_checkpoint(written)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(written)
            if name.startswith("optimizer/")}


# -- the same training -------------------------------------------------------------------

CASES = [("gradients", 2, "adamw")]
SLOW_CASES = [("optimizer", 4, "sgd"), ("gradients", 4, "lamb"), ("optimizer", 2, "adamw"),
              ("gradients", 2, "sgd"), ("optimizer", 2, "lamb")]


@pytest.mark.parametrize("mode,replicas,optimizer", CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                                           for c in SLOW_CASES])
def test_sharded_equals_unsharded(weights, tmp_path, mode, replicas, optimizer):
    """The weights, the step count and the optimizer's state (its checkpoint: each slot
    under Keras's own keys, written as the replicas' slices and read back whole) equal the
    unsharded run's; with clipping (global or per
    variable, by the norm of the whole gradient), weight decay and its exclusion, a
    schedule, LAMB's per-variable trust ratio. Each replica holds a different chunk."""
    strategy = mirrored(replicas)
    expected, plain = train(strategy, weights, "none", optimizer)
    actual, sharded = train(strategy, weights, mode, optimizer, bucket_bytes=2048)
    assert len(sharded._sharded.layout.buckets) > 2  # several reduce-scatters and gathers
    assert_same(actual, expected)
    assert moved(expected, weights) > 1e-2
    assert int(sharded.optimizer.iterations.numpy()) == STEPS
    reference, got = saved(plain, expected, tmp_path / "plain"), saved(sharded, actual, tmp_path / "sharded")
    assert got.keys() == reference.keys() and any("_variables" in k for k in got)
    for key, value in reference.items():
        np.testing.assert_allclose(got[key], value, rtol=TOL, atol=TOL, err_msg=key)
    chunks = strategy.experimental_local_results(sharded._sharded.shard.pieces[0])
    assert np.abs(chunks[0].numpy() - chunks[1].numpy()).max() > 0


@pytest.mark.parametrize("precision,mode", [("mixed_float16", "gradients"),
                                            pytest.param("mixed_float16", "optimizer", marks=pytest.mark.slow),
                                            pytest.param("mixed_bfloat16", "gradients", marks=pytest.mark.slow)])
def test_accumulation_and_mixed_precision_equal_unsharded(weights, precision, mode):
    """Two micro-batches a step (ZeRO-2 reduce-scatters each and keeps only its chunk) under
    a mixed policy; fp16's loss scale starts so high that the first steps overflow: those
    steps are skipped and the scale halved, later it grows (every 2 finite steps), exactly
    as Keras's LossScaleOptimizer does, and the same on every replica."""
    strategy = mirrored(2)

    def optimizer():
        inner = keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5)
        if precision != "mixed_float16":
            return inner
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0 ** 22, dynamic_growth_steps=2)

    keras.mixed_precision.set_global_policy(precision)
    try:
        expected, plain = train(strategy, weights, "none", optimizer, steps=6, accumulate=2)
        actual, sharded = train(strategy, weights, mode, optimizer, steps=6, accumulate=2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_same(actual, expected)
    assert moved(expected, weights) > 1e-2
    if precision == "mixed_float16":
        scale = float(plain.optimizer.dynamic_scale.numpy())
        copies = [float(c.numpy()) for c in strategy.experimental_local_results(sharded._sharded.shard.scale)]
        assert copies == [scale, scale]
        assert scale != 2.0 ** 22 and int(plain.optimizer.iterations.numpy()) < 6  # overflowed, skipped
        assert int(sharded.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())


def nan_data(steps=STEPS, bad=1):
    """mlp_data with NaN sample weights in the first half of batch `bad` (one replica's)."""
    x, y = next(iter(mlp_data(batch=16 * steps, steps=1)))
    w = np.ones(16 * steps, "float32")
    w[16 * bad:16 * bad + 8] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(16)


def test_nonfinite_skip_and_stop_agree_across_shards(weights):
    """A NaN in one replica's half of step 2: every shard agrees (one flag), skip leaves out
    exactly that update (as unsharded), stop names the step."""
    strategy = mirrored(2)
    expected, plain = train(strategy, weights, "none", data=nan_data(), nonfinite="skip")
    actual, sharded = train(strategy, weights, "gradients", data=nan_data(), nonfinite="skip")
    assert sharded.skipped_steps == plain.skipped_steps == 1
    assert int(sharded.optimizer.iterations.numpy()) == STEPS - 1
    assert_same(actual, expected)
    assert np.isfinite(actual[0]).all()
    with pytest.raises(NonFiniteError, match="Step 2: the gradients"):
        train(strategy, weights, "optimizer", data=nan_data())


@pytest.mark.slow
def test_moving_average_equals_unsharded(weights):
    """use_ema: each replica keeps the averages of its chunks; the periodic overwrite and the
    final one (as fit ends) put the same weights in the model as unsharded."""
    strategy = mirrored(2)

    def optimizer():
        return keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)

    expected, _ = train(strategy, weights, "none", optimizer, steps=5)
    actual, sharded = train(strategy, weights, "optimizer", optimizer, steps=5)
    assert_same(actual, expected)
    assert len(sharded._sharded.shard.averages()) == len(weights)


@pytest.mark.parametrize("mode,compression", [
    pytest.param("optimizer", C.Compression(C.TopK(0.1), C.Policy(min_size=0)), marks=pytest.mark.slow),
    ("gradients", C.Compression(C.FP16(), C.Policy(min_size=0)))])
def test_composes_with_compression(weights, mode, compression):
    """ZeRO-1 after topk's compressed sum (each replica its chunk of it); ZeRO-2 with fp16:
    the reduce-scatter runs in float16. Both as the same compression unsharded."""
    strategy = mirrored(2)
    fresh = lambda: C.Compression(compression.compressor, compression.policy)  # noqa: E731
    expected, _ = train(strategy, weights, "none", compression=fresh())
    actual, sharded = train(strategy, weights, mode, compression=fresh())
    assert_same(actual, expected)
    if mode == "gradients":
        step = sharded.traced_step(strategy.experimental_distribute_dataset(mlp_data()))
        sent = {c.dtype for c in accounting.collectives(step, checks=False) if c.type == "CollectiveAllToAllV2"}
        assert sent == {"float16", "float32"}  # the policy's default skip list (norms, biases) in float32


# -- bytes -------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bytes_per_replica_and_on_the_wire(weights, replicas):
    """Read from the variables and buffers actually created: the optimizer state per replica
    is 1/R of the unsharded (+ padding), the gradient buffer held across micro-batches too
    (ZeRO-2), and the bytes on the wire (a reduce-scatter and an all-gather, counted from the
    traced step) are the all-reduce's: 2(R-1)/R of the (padded) gradients per replica."""
    strategy = mirrored(replicas)
    data = strategy.experimental_distribute_dataset(mlp_data(steps=2))
    report = {}
    for mode in ("none", "optimizer", "gradients"):
        model, trainer = trainer_for(strategy, weights, mode, accumulate=2)
        step = trainer.traced_step(data)
        report[mode] = {
            "state": zero.state_bytes(trainer)["optimizer_state"],
            "gradients": zero.held_gradient_bytes(step),
            "link": accounting.link_bytes_per_worker(step, replicas, checks=False),
            "types": {c.type for c in accounting.collectives(step, checks=False)}}
    layout = trainer._sharded.layout
    elements, padded = sum(layout.sizes), replicas * layout.shard_elements
    assert padded - elements == layout.padding and layout.padding > 0
    assert report["none"]["state"] == 2 * 4 * elements + 8  # m, v; the step counter
    assert report["gradients"]["state"] == report["optimizer"]["state"] == 2 * 4 * padded // replicas + 8
    assert report["none"]["gradients"] == report["optimizer"]["gradients"] == 4 * elements
    assert report["gradients"]["gradients"] == 4 * padded // replicas
    assert report["none"]["link"] == 2 * (replicas - 1) / replicas * 4 * elements
    for mode in ("optimizer", "gradients"):
        assert report[mode]["types"] == {"CollectiveAllToAllV2", "CollectiveGatherV2"}
    assert report["optimizer"]["link"] == 2 * (replicas - 1) / replicas * 4 * padded
    assert report["gradients"]["link"] == 2 * report["optimizer"]["link"] - (replicas - 1) * 4 * padded / replicas


def test_the_gpu_reduce_scatter_is_traced_and_counted():
    """Where the launchers run NCCL (GPUs) the reduce-scatter is CollectiveReduceScatterV2;
    on CPU TensorFlow has none, and the all-to-all + sum above replaces it. Traced here (not
    run): each replica hands its [R, C] rows and gets [C]; a link carries (R-1)/R of them."""
    strategy = mirrored(2)
    world = groups.world(strategy)  # the partition group of every replica (tfpar.zero.PartitionGroups)
    assert not world.nccl  # logical CPUs

    @tf.function
    def scatter():
        return strategy.run(lambda: world.reduce_scatter(tf.ones([2, 6])))

    world.nccl = True  # as a GPU launcher says
    try:
        traced = scatter.get_concrete_function()
    finally:
        world.nccl = False
    found = accounting.collectives(traced)
    assert [c.type for c in found] == ["CollectiveReduceScatterV2"] * 2
    assert {c.bytes for c in found} == {2 * 6 * 4}
    assert accounting.link_bytes_per_worker(traced, 2, in_loops_only=False) == 6 * 4
    assert [tuple(o.shape) for o in traced.outputs] == [(6,), (6,)]


# -- checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(weights):
    return train(tf.distribute.get_strategy(), weights, "none", steps=6)[0]


def resumed_run(workdir, strategy, weights, shard, start, stop):
    model, trainer = trainer_for(strategy, weights, shard)
    items = {"optimizer": trainer.optimizer, **trainer.checkpoint_items()}
    checkpoints = Checkpoints(str(workdir), True, model=model, **items)
    assert checkpoints.restore() == start
    data = strategy.experimental_distribute_dataset(mlp_data(steps=6).skip(start))
    trainer.fit(data, steps=stop, start_step=start)
    checkpoints.save(stop)
    return model.get_weights(), trainer


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [
    (("gradients", 2), ("gradients", 4)),
    (("gradients", 4), ("none", 1)),
    (("none", 2), ("optimizer", 4))])
def test_resume_across_replica_counts_and_modes(tmp_path, weights, uninterrupted, first, second):
    """Three steps, a checkpoint, three more under another replica count (and mode): the
    weights of an uninterrupted run. The optimizer state is saved in Keras's layout (each
    replica's slices of each slot; a restore reads any slice), so 2 -> 4, 4 -> 1 (unsharded)
    and unsharded -> sharded all restore it."""
    def strategy(replicas):
        return tf.distribute.get_strategy() if replicas == 1 else mirrored(replicas)

    resumed_run(tmp_path, strategy(first[1]), weights, first[0], 0, 3)
    after, trainer = resumed_run(tmp_path, strategy(second[1]), weights, second[0], 3, 6)
    assert_same(after, uninterrupted)
    assert int(trainer.optimizer.iterations.numpy()) == 6


# -- refusals ------------------------------------------------------------------------------

REFUSALS = {
    "name": (dict(shard="zero2"), "Unknown shard mode 'zero2': choose 'none', 'optimizer'"),
    "adafactor": (dict(optimizer=lambda: keras.optimizers.Adafactor()),
                  "cannot run Adafactor on a shard of the parameters: it factors its second moment"),
    "muon": (dict(optimizer=lambda: keras.optimizers.Muon()), "cannot run Muon on a shard"),
    "accumulation_steps": (dict(optimizer=lambda: keras.optimizers.Adam(gradient_accumulation_steps=2)),
                           r"gradient_accumulation_steps=2\): the sharded update accumulates .*Trainer\(accumulate=K\)"),
    "onebit_adam": (dict(compression=C.OneBitAdam()), "compression onebit_adam: onebit_adam computes Adam's"),
    "dgc": (dict(compression=C.DGC(0.1), optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
            "compression dgc: dgc computes"),
    "topk_gradients": (dict(compression=C.TopK(0.1)), "shard='gradients' with compression topk: topk's exchange"),
    "aggregator_gradients": (dict(aggregator=tfpar.loop.NoReduce()), "shard='gradients' with the aggregator NoReduce"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_by_name(weights, case):
    options, message = REFUSALS[case]
    options = {"shard": "gradients", **options}
    with pytest.raises(ShardingError, match=message):
        trainer_for(tf.distribute.get_strategy(), weights, **options)


def test_the_binary_check_and_what_cannot_be_flattened():
    """check_shard is what the binary calls before it builds anything."""
    assert zero.check_shard("none", "parameter_server", "dgc") == "none"
    assert zero.check_shard("optimizer", "multi_worker_mirrored", "topk") == "optimizer"
    assert zero.check_shard("gradients", "mirrored", "fp16") == "gradients"
    for args, message in [(("optimizer", "parameter_server"), "under parameter_server: the variables live"),
                          (("optimizer", "tpu"), "under tpu: the sharded update runs under default"),
                          (("gradients", "mirrored", None, object()), "with layer placement"),
                          (("gradients", "mirrored", "auto"), "compression auto: auto decides"),
                          (("optimizer", "mirrored", "dgc_adam"), "compression dgc_adam")]:
        with pytest.raises(ShardingError, match=message):
            zero.check_shard(*args)
    strategy = tf.distribute.get_strategy()
    with strategy.scope():
        counter = tf.Variable(tf.zeros([3], tf.int32), name="counter")
    with pytest.raises(ShardingError, match="is int32: the sharded update flattens floating-point"):
        zero.check_variable(counter)
    with pytest.raises(ShardingError, match=r"has shape \(None, 4\): the sharded update flattens"):
        zero.PartitionLayout([tf.Variable(tf.zeros([2, 4]), shape=tf.TensorShape([None, 4]))], 2)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [c.__name__ for c in zero_optimizer.ELEMENTWISE
                                       if c.__name__ not in ("SGD", "Adam", "AdamW")])
def test_every_elementwise_optimizer_is_kerass_update(weights, optimizer):
    """Every other optimizer the sharded update accepts (SGD, AdamW: above; Adam: with EMA),
    with its defaults (Nadam's once-a-step product, RMSprop's and Ftrl's accumulators),
    equals it unsharded."""
    strategy = mirrored(2)
    rate = 1.0 if optimizer == "Adadelta" else 0.01  # Adadelta's steps are small at any rate below 1
    build = lambda: getattr(keras.optimizers, optimizer)(learning_rate=rate)  # noqa: E731
    expected, _ = train(strategy, weights, "none", build, steps=3)
    actual, _ = train(strategy, weights, "gradients", build, steps=3)
    assert_same(actual, expected)
    assert moved(expected, weights) > 1e-4


@pytest.mark.multiprocess
def test_two_workers_equal_unsharded_and_checkpoint_across_workers(tmp_path):
    """multi_worker_mirrored, two processes: AdamW in mixed_float16, SGD with momentum in
    mixed_bfloat16 and LAMB in float32 (clipped), 2 micro-batches a step; both modes equal the unsharded loop;
    the checkpoint (each worker's partitions in its own file, merged by the chief) read
    back whole equals the unsharded one, and restores."""
    from procs import launch

    result = launch(2, "sharding_worker.py", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    for worker in (0, 1):
        for case in ("adamw-fp16", "sgd-bf16", "lamb"):
            for mode in ("optimizer", "gradients"):
                assert f"[worker:{worker}] SHARD {case} {mode} equal=True moved=True" in result.stdout, \
                    result.stdout[-4000:]
        assert f"[worker:{worker}] CKPT slots_equal=True restored=True" in result.stdout, result.stdout[-4000:]


# -- the binary ----------------------------------------------------------------------------

def binary_run(workdir, shard: str, steps: int) -> None:
    """python -m tfpar.train with --config.parallel.shard=SHARD: 2 replicas on 2 logical
    CPUs, the config's AdamW (cosine schedule, clipping, weight decay), 2 micro-batches a step,
    a checkpoint every 2 steps."""
    from procs import run_python

    done = run_python(["-m", "tfpar.train", "--config=configs/gpt_tiny.py", f"--workdir={workdir}",
                       "--config.mode=loop", "--config.strategy=mirrored",
                       "--config.strategy_args.virtual_devices=2", f"--config.parallel.shard={shard}",
                       "--config.model_args.dim=32", "--config.model_args.depth=1", "--config.data.seq_len=32",
                       f"--config.train.steps={steps}", "--config.train.batch_size=8",
                       "--config.train.steps_per_loop=2", "--config.train.accumulate=2",
                       "--config.train.checkpoint_every=2", "--config.train.eval_examples=32",
                       "--config.train.eval_batch_size=32", "--config.sample.length=4",
                       "--config.optimizer.warmup_steps=1"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def checkpoint_at(workdir, step: int) -> dict:
    reader = tf.train.load_checkpoint(str(workdir / "checkpoints" / f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "save_counter" not in name and not name.startswith("_CHECKPOINTABLE")}


@pytest.mark.slow
def test_the_binary_shards_with_one_config_key(tmp_path):
    """--config.parallel.shard=gradients writes the checkpoint the unsharded run writes (the
    weights and every optimizer slot, under the same keys), and that sharded checkpoint
    resumes unsharded to the uninterrupted run's weights and state."""
    binary_run(tmp_path / "none", "none", 4)
    binary_run(tmp_path / "switched", "gradients", 2)
    plain, sharded = checkpoint_at(tmp_path / "none", 2), checkpoint_at(tmp_path / "switched", 2)
    assert sharded.keys() == plain.keys() and any(n.startswith("optimizer/_variables/") for n in plain)
    for name, value in plain.items():
        np.testing.assert_allclose(sharded[name], value, rtol=TOL, atol=TOL, err_msg=name)
    binary_run(tmp_path / "switched", "none", 4)
    plain, switched = checkpoint_at(tmp_path / "none", 4), checkpoint_at(tmp_path / "switched", 4)
    assert switched.keys() == plain.keys()
    for name, value in plain.items():
        np.testing.assert_allclose(switched[name], value, rtol=TOL, atol=TOL, err_msg=name)
