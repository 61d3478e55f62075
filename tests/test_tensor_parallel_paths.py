"""Tensor parallelism on every path a user takes: a split model built fresh from a seed,
dropout, Keras's own weight APIs and callbacks, a model built by hand from the exported
layers, replicated weights over many steps, a dataset dealt the wrong way. Each is right
(equal to the unsplit model) or refused by name."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import tensor_parallel as tp
from tfpar.data.pipeline import same_batch_for_groups
from tfpar.loop import Trainer
from tfpar.models.gpt import GPT

TINY = dict(vocab_size=32, max_len=8, dim=32, depth=2, heads=4)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def batch(rows=8, seed=0):
    x = np.random.RandomState(seed).randint(0, 32, size=(rows, 8)).astype("int32")
    return x, np.roll(x, -1, axis=1), np.ones((rows, 8), "float32")


def dealt(strategy, degree, rows=8, seed=0):
    """One fixed batch, every step, dealt per tensor-parallel group (tfpar's way)."""
    data = tf.data.Dataset.from_tensors(batch(rows, seed)).repeat()
    groups = strategy.num_replicas_in_sync // degree
    data = data.unbatch().batch(rows // groups)
    return strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree))


def adamw():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.01, global_clipnorm=0.5)


def split_gpt(strategy, degree, seed=0, **options):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        return GPT(**{**TINY, **options}, tensor_parallel=degree)


def assert_weights_equal(actual, expected, tol=0.0):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


# -- a split model built fresh -----------------------------------------------------------

@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_split_model_starts_from_the_unsplit_models_weights(degree):
    """Built from the same seed, the split model's whole weights are the unsplit model's,
    exactly (each of Q, K, V drawn by Keras on its own shape with its own seed)."""
    keras.utils.set_random_seed(7)
    reference = GPT(**TINY)
    model = split_gpt(mirrored(degree), degree, seed=7)
    assert tp.split_weight_count(model) == 10 * TINY["depth"]  # q, k, v kernels and biases, out; up x2, down
    assert_weights_equal(model.get_weights(), reference.get_weights())
    paths = [w.path for w in model.weights]
    kernels = {name: model.get_weights()[paths.index(f"gpt/block_0_attn/attention/{name}/kernel")]
               for name in ("query", "key", "value")}
    assert not np.allclose(kernels["query"], kernels["key"]) and not np.allclose(kernels["key"], kernels["value"])
    assert model.count_params() == reference.count_params()


def test_exported_layers_draw_as_their_unsplit_twin_and_fused_parts_differ():
    strategy = mirrored(2)
    x = keras.Input((16,))

    def model(degree, parts=1):
        keras.utils.set_random_seed(3)
        up = tp.ColumnParallelLinear(24, degree=degree, parts=parts, name="up")
        down = tp.RowParallelLinear(16, degree=degree, name="down")
        return keras.Model(x, down(up(x)))

    plain = model(1)
    with strategy.scope():
        split = model(2)
    assert_weights_equal(split.get_weights(), plain.get_weights())
    keras.utils.set_random_seed(3)
    fused = tp.ColumnParallelLinear(24, parts=3, bias_initializer="glorot_uniform")
    fused.build((None, 16))
    q, k, v = np.split(fused.kernel.numpy(), 3, axis=1)
    assert not np.allclose(q, k) and not np.allclose(k, v)
    assert not np.allclose(*np.split(fused.bias.numpy(), 3)[:2])


# -- dropout -----------------------------------------------------------------------------

def test_dropout_masks_differ_per_rank_inside_the_split_region_and_agree_outside():
    strategy = mirrored(2)
    model = split_gpt(strategy, 2, dropout=0.5)
    stage = model.stages()[1].layer  # blocks.0.attn
    region = tfpar.strategy.private_api.attention_dropout(stage.attention)
    ones = tf.ones([4, 2, 8, 8])  # (B, H/T, T, T): this rank's heads' probabilities

    @tf.function
    def masks():
        def replica():
            return region(ones, training=True), stage.dropout(ones, training=True), model(batch()[0], training=True)
        return strategy.run(replica)

    inside, outside, logits = (strategy.experimental_local_results(t) for t in masks())
    assert not np.array_equal(inside[0].numpy() > 0, inside[1].numpy() > 0)  # each rank its own mask
    assert 0.3 < float(np.mean(inside[0].numpy() > 0)) < 0.7
    np.testing.assert_array_equal(outside[0], outside[1])  # the residual stream's: one mask
    np.testing.assert_array_equal(logits[0], logits[1])  # so every rank holds the same activations


def counting_batches(count=16, rows=8):
    """Sequences that count up from a random start (mod 32): a task a GPT learns."""
    start = np.random.RandomState(5).randint(0, 32, size=(count * rows, 1))
    x = ((start + np.arange(9)) % 32).astype("int32")
    return x[:, :8], x[:, 1:], np.ones((count * rows, 8), "float32")


def dropout_run(degree: int, seed: int, steps: int = 20) -> float:
    """A GPT with dropout 0.1 trained `steps` steps; its loss (no dropout) on the data."""
    x, y, w = counting_batches()
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8).repeat()
    strategy = mirrored(degree) if degree > 1 else tf.distribute.get_strategy()
    model = split_gpt(strategy, degree, seed=seed, dropout=0.1) if degree > 1 else None
    if model is None:
        keras.utils.set_random_seed(seed)
        model = GPT(**TINY, dropout=0.1)
    with strategy.scope():
        optimizer = adamw()
    trainer = Trainer(model, optimizer, LOSS, strategy=strategy, steps_per_loop=10, xla=False)
    if degree > 1:
        trainer.fit(strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree)), steps)
        logits = tp.replicated_call(model)(x)
    else:
        trainer.fit(data, steps)
        logits = model(x)
    return float(tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)))


@pytest.mark.slow
def test_with_dropout_a_split_run_lands_within_the_spread_of_unsplit_runs_over_seeds():
    """Only the split region's masks differ between T = 2 and T = 1 with one seed (the same
    initial weights, the same masks outside): the T = 2 run lands closer to the T = 1 run of
    its seed than T = 1 runs of four seeds are to each other."""
    unsplit = [dropout_run(1, seed) for seed in range(4)]
    spread = max(unsplit) - min(unsplit)
    split = dropout_run(2, 0)
    print(f"T=1 over seeds 0-3: {unsplit} (spread {spread:.4f}); T=2, seed 0: {split:.4f}")
    assert unsplit[0] < 2.0 and spread > 0  # it learned; seeds matter
    assert abs(split - unsplit[0]) <= spread


# -- Keras's own weight APIs and callbacks ---------------------------------------------------

def trained(degree=2, steps=2, callbacks=()):
    """A split GPT after a few steps of AdamW (its weights are no longer the initial ones)."""
    strategy = mirrored(degree)
    model = split_gpt(strategy, degree)
    with strategy.scope():
        optimizer = adamw()
    trainer = Trainer(model, optimizer, LOSS, strategy=strategy)
    trainer.fit(dealt(strategy, degree), steps=steps, callbacks=callbacks)
    return model


def test_keras_weight_apis_give_and_take_the_unsplit_models_weights(tmp_path):
    model = trained()
    whole = model.get_weights()
    plain = GPT(**TINY)
    plain.set_weights(whole)  # get_weights -> an unsplit model
    np.testing.assert_allclose(tp.replicated_call(model)(batch()[0]), plain(batch()[0]), rtol=1e-5, atol=1e-6)

    model.save_weights(tmp_path / "split.weights.h5")  # .weights.h5: T = 2 -> T = 1
    loaded = GPT(**TINY)
    loaded.load_weights(tmp_path / "split.weights.h5")
    assert_weights_equal(loaded.get_weights(), whole)

    model.save(tmp_path / "split.keras")  # .keras: loads anywhere as the unsplit model
    restored = keras.models.load_model(tmp_path / "split.keras")
    assert tp.split_weight_count(restored) == 0
    assert_weights_equal(restored.get_weights(), whole)

    other = GPT(**TINY)  # and back: T = 1 files into the split model
    other.save_weights(tmp_path / "plain.weights.h5")
    model.load_weights(tmp_path / "plain.weights.h5")
    assert_weights_equal(model.get_weights(), other.get_weights())
    model.load_weights(tmp_path / "split.keras")
    assert_weights_equal(model.get_weights(), whole)
    model.set_weights(other.get_weights())  # set_weights splits
    assert_weights_equal(model.get_weights(), other.get_weights())
    assert model.count_params() == other.count_params()

    from tfpar.tensor_parallel import keras_weights

    keras_weights.revert()  # Keras's own set_weights: it compares the shard's shape
    with pytest.raises(ValueError, match="not compatible with provided weight shape"):
        model.set_weights(whole)
    keras_weights.install()
    model.set_weights(whole)
    assert_weights_equal(model.get_weights(), whole)

    shard = next(w for w in model.weights if tp.spec_of(w) is not None)
    with pytest.raises(tp.TensorParallelError, match="outside strategy.run it takes its whole value"):
        shard.assign(np.zeros(shard.shape, "float32"))
    with pytest.raises(tp.TensorParallelError, match="Keras fit, evaluate and predict .* tfpar.Trainer"):
        model.compile(optimizer="adam", loss=LOSS)
        model.fit(*batch()[:2], verbose=0)


@pytest.mark.slow  # a Trainer and two callbacks: ~9 s
def test_callbacks_that_save_and_restore_weights_work_on_a_split_model(tmp_path):
    """ModelCheckpoint (whole model and weights only) in Trainer.fit writes the unsplit
    model's files; EarlyStopping(restore_best_weights=True) puts the best whole weights back."""
    every = keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"))
    weights_only = keras.callbacks.ModelCheckpoint(str(tmp_path / "model.weights.h5"), save_weights_only=True)
    model = trained(callbacks=[every, weights_only])
    for path in ("model.keras", "model.weights.h5"):
        plain = GPT(**TINY)
        plain.load_weights(tmp_path / path)
        assert_weights_equal(plain.get_weights(), model.get_weights())

    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, restore_best_weights=True)
    stop.set_model(model)
    stop.on_train_begin()
    stop.on_epoch_end(0, {"loss": 1.0})  # the best: its weights are kept (whole)
    best = model.get_weights()
    model.set_weights([w + 1.0 for w in best])
    stop.on_epoch_end(1, {"loss": 2.0})  # worse: training stops
    stop.on_train_end()
    assert_weights_equal(model.get_weights(), best)


def gpt_trainer(degree):
    """A GPT split `degree` ways (1: unsplit) on 2 replicas from seed 0, and its Trainer."""
    strategy = mirrored(2)
    if degree > 1:
        model = split_gpt(strategy, degree)
    else:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = GPT(**TINY)
    with strategy.scope():
        optimizer = adamw()
    return model, Trainer(model, optimizer, LOSS, strategy=strategy, xla=False), strategy


@pytest.mark.slow  # 3 Trainers each: ~20 s
@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_under_another_degree(tmp_path, first, then):
    """tfpar's Checkpoints hold whole weights and whole Adam slots: a run stopped at step 2
    resumes with T changed and ends where the run that kept its T ends (1e-5)."""
    from tfpar.checkpoints import Checkpoints

    def run(degree, steps, workdir):
        model, trainer, strategy = gpt_trainer(degree)
        checkpoints = Checkpoints(str(workdir), True, model=model, optimizer=trainer.optimizer)
        trainer.fit(dealt(strategy, degree), steps=steps, start_step=checkpoints.restore())
        checkpoints.save(steps)
        return model

    run(first, 2, tmp_path / "switched")
    resumed = run(then, 4, tmp_path / "switched")  # restores step 2 of the other degree
    kept = run(first, 4, tmp_path / "kept")
    assert_weights_equal(resumed.get_weights(), kept.get_weights(), tol=1e-5)


# -- a model of the user's own, from the exported layers ----------------------------------

def mlp_lm(degree):
    """An embedding, a Megatron MLP of the exported layers, a head: any Keras model."""
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(32, 16, name="embed")(tokens)
    h = tp.ColumnParallelLinear(64, degree=degree, activation="gelu", name="up")(h)
    h = tp.RowParallelLinear(16, degree=degree, name="down")(h)
    return keras.Model(tokens, keras.layers.Dense(32, name="head")(h))


def test_a_model_built_from_the_exported_layers_trains_like_its_unsplit_twin():
    keras.utils.set_random_seed(1)
    twin = mlp_lm(1)
    strategy = mirrored(2)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = mlp_lm(2)
        optimizer = adamw()
    assert tp.layout_of(model).degree == 2 and tp.split_weight_count(model) == 3
    assert_weights_equal(model.get_weights(), twin.get_weights())
    Trainer(twin, adamw(), LOSS, xla=False).fit(tf.data.Dataset.from_tensors(batch()).repeat(), steps=3)
    Trainer(model, optimizer, LOSS, strategy=strategy).fit(dealt(strategy, 2), steps=3)
    assert_weights_equal(model.get_weights(), twin.get_weights(), tol=1e-5)


def test_an_optimizer_not_on_the_list_is_refused_under_tensor_parallelism():
    strategy = mirrored(2)
    model = split_gpt(strategy, 2)

    class MySGD(keras.optimizers.SGD):  # its update_step may read the whole variable
        pass

    for optimizer, name in ((keras.optimizers.Lamb(0.1), "Lamb"), (keras.optimizers.Adafactor(0.1), "Adafactor"),
                            (MySGD(0.1), "MySGD")):
        with pytest.raises(tp.TensorParallelError, match=f"cannot run {name} on a shard .* Optimizers that train"):
            Trainer(model, optimizer, LOSS, strategy=strategy)


# -- replicated weights, and the batch a group shares ---------------------------------------

@pytest.mark.slow
def test_replicated_weights_stay_bit_identical_on_every_replica():
    """2 data x 2 tensor replicas, 20 steps of AdamW with a clip: every replicated weight
    (norms, embeddings, the head, row-parallel biases) is the same bits on all 4 replicas,
    and each shard on the 2 replicas that hold it."""
    strategy = mirrored(4)
    model = split_gpt(strategy, 2)
    with strategy.scope():
        optimizer = adamw()
    Trainer(model, optimizer, LOSS, strategy=strategy, steps_per_loop=5).fit(dealt(strategy, 2), steps=20)
    for weight in model.weights:
        copies = [c.numpy() for _, c in tp.shards.copies(weight)]
        if tp.spec_of(weight) is None:
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=weight.path)
        else:  # replicas 0 and 2 hold shard 0, replicas 1 and 3 shard 1
            np.testing.assert_array_equal(copies[0], copies[2], err_msg=weight.path)
            np.testing.assert_array_equal(copies[1], copies[3], err_msg=weight.path)


def test_replicated_gradients_that_differ_between_ranks_are_summed_to_the_same_bits():
    """Ranks of a group may compute a replicated weight's gradient in another order (GPUs:
    an embedding's dense conversion): the aggregator gives every replica one sum."""
    from tfpar.loop.tensor_parallel import TensorParallelSum

    strategy = mirrored(2)
    model = split_gpt(strategy, 2)
    variables = model.trainable_variables
    aggregator = TensorParallelSum(tp.layout_of(model))
    aggregator.build(variables)

    @tf.function
    def summed():
        def replica():
            rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return aggregator([tf.fill(v.shape, 1.0 + 1e-6 * rank) for v in variables], variables)  # last bits differ
        return strategy.run(replica)

    per_replica = [strategy.experimental_local_results(g) for g in summed()]
    for variable, (first, second) in zip(variables, per_replica):
        if tp.spec_of(variable) is None:
            np.testing.assert_array_equal(first, second, err_msg=variable.path)
            np.testing.assert_allclose(first, 2.0, rtol=1e-5)  # the sum over both ranks
        else:  # each rank's own shard, times T
            assert not np.array_equal(first, second)


@pytest.mark.slow  # ~16 s: fit and evaluate, refused and then run
def test_a_dataset_not_dealt_per_group_is_refused_at_the_first_step():
    strategy = mirrored(2)
    model = split_gpt(strategy, 2)
    with strategy.scope():
        optimizer = adamw()
    trainer = Trainer(model, optimizer, LOSS, strategy=strategy)
    mixed = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch()).repeat())  # halves
    with pytest.raises(tp.TensorParallelError, match="different batches .* tensor_parallel=2"):
        trainer.fit(mixed, steps=3)
    assert trainer.step == 0  # the first call raised: nothing counted, no callback ran
    trainer.fit(dealt(strategy, 2), steps=2)  # a dataset dealt per group trains
    with pytest.raises(tp.TensorParallelError, match="The evaluation dataset gives"):
        trainer.evaluate(mixed, steps=1)
    evaluated = trainer.evaluate(dealt(strategy, 2), steps=1)
    assert evaluated["examples"] == 8


# -- seeds across workers ------------------------------------------------------------------

@pytest.mark.multiprocess
def test_two_workers_without_a_seed_agree_on_every_shard(tmp_path):
    """Each worker seeds Python's random differently (as unseeded processes do); the shards
    of one weight still come from one draw: worker 0's."""
    from procs import launch

    result = launch(2, "tensor_parallel_seed_worker.py", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    import random
    random.seed(100)  # worker 0's seed: its draw is the model
    reference = GPT(**TINY).get_weights()
    for task in range(2):
        saved = np.load(tmp_path / f"shards_{task}.npz")
        for i, whole in enumerate(reference):
            if f"shard_{i}" in saved.files:  # this worker's shard of split weight i
                spec = tp.ShardSpec(int(saved[f"axis_{i}"]), 2)
                np.testing.assert_array_equal(saved[f"shard_{i}"], spec.split(whole)[task], err_msg=f"{task} {i}")
            else:
                np.testing.assert_array_equal(saved[f"whole_{i}"], whole, err_msg=f"{task} {i}")
    assert os.path.exists(tmp_path / "shards_1.npz")
