"""ZeRO (Trainer(shard=...)) on the paths a user takes beyond tfpar's own: a model that is
not tfpar's (keras-hub, Keras's own layer names) against Keras's own `fit` on one device,
the user's optimizer object in the user's own tf.train.Checkpoint (restored after the
Trainer is made, and before: TensorFlow's deferred restore), Keras's `.keras` files, and
a late `exclude_from_weight_decay`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mlp_data
from test_sharding import mirrored, odd_mlp
from tfpar.errors import ShardingError
from tfpar.loop import Trainer

VOCAB, LENGTH, BATCH = 64, 16, 8
MODES = ["optimizer", "gradients"]


# -- a keras-hub backbone against Keras's own fit --------------------------------------

def gpt2_lm():
    """keras-hub's GPT2Backbone (dict input with a padding mask, Keras's own layer names)
    under a small language-model head."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=LENGTH, dropout=0.0)
    inputs = {"token_ids": keras.Input((LENGTH,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((LENGTH,), dtype="int32", name="padding_mask")}
    return keras.Model(inputs, keras.layers.Dense(VOCAB, name="lm_head")(backbone(inputs)))


def token_data(steps):
    """Padded token windows (the padding mask zero past each window's length), next-token targets."""
    rng = np.random.RandomState(0)
    ids = rng.randint(1, VOCAB, size=(BATCH * steps, LENGTH)).astype("int32")
    lengths = rng.randint(LENGTH // 2, LENGTH + 1, size=BATCH * steps)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype("int32")
    ids *= mask
    inputs = {"token_ids": ids, "padding_mask": mask}
    return tf.data.Dataset.from_tensor_slices((inputs, np.roll(ids, -1, axis=1))).batch(BATCH)


def hub_adamw(model, steps):
    """AdamW with a schedule and global clipping; decay off for every layer norm and bias
    (by name: Keras matches the variable's path) and for the position embedding (by variable)."""
    optimizer = keras.optimizers.AdamW(keras.optimizers.schedules.PolynomialDecay(3e-3, steps, 3e-4),
                                       weight_decay=0.05, global_clipnorm=1.0, epsilon=1e-3)
    position = next(v for v in model.trainable_variables if v.path == "position_embedding/embeddings")
    optimizer.exclude_from_weight_decay(var_list=[position], var_names=["layer_norm", "bias"])
    return optimizer


def test_weight_decay_exclusions_on_kerass_layer_names_are_kerass_decisions():
    """Which variables ZeRO decays is what Keras's TensorFlow optimizer decides: exclusions
    by name match the variable's path ("transformer_layer_0/self_attention_layer_norm/gamma"),
    as Keras matches the tf.Variable's name, and exclusions by variable hold."""
    strategy = mirrored(2)
    with strategy.scope():
        model = gpt2_lm()
        optimizer = hub_adamw(model, 12)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, shard="optimizer", xla=False)
    decays = dict(zip([v.path for v in model.trainable_variables], trainer._sharded.shard.decays))
    kerass = {v.path: bool(optimizer._use_weight_decay(v.value)) for v in model.trainable_variables}
    assert decays == kerass
    assert not decays["transformer_layer_0/self_attention_layer_norm/gamma"]
    assert not decays["layer_norm/beta"] and not decays["lm_head/bias"]
    assert not decays["position_embedding/embeddings"]  # by variable
    assert decays["token_embedding/embeddings"] and decays["lm_head/kernel"]
    assert sum(decays.values()) == 14  # 13 kernels and the token embedding


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_keras_hub_backbone_with_weight_decay_exclusions_equals_kerass_fit(mode):
    """12 steps of ZeRO on 2 replicas equal Keras's own `fit` on one device (no strategy;
    with tfpar's Keras fixes, which create_strategy applies: a sparse gradient's rows
    summed) to 1e-6. Under HEAD the layer norms were decayed (1.1e-3 off): the exclusion by
    name was matched against the short name ("gamma"), not the path Keras matches."""
    steps = 12
    strategy = mirrored(2)  # before fit: tfpar's Keras fixes (sparse rows summed) are in
    keras.utils.set_random_seed(0)
    weights = gpt2_lm().get_weights()

    reference = gpt2_lm()
    reference.set_weights(weights)
    reference.compile(optimizer=hub_adamw(reference, steps), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(token_data(steps), epochs=1, verbose=0, shuffle=False)

    with strategy.scope():
        model = gpt2_lm()
        model.set_weights(weights)
        optimizer = hub_adamw(model, steps)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, shard=mode, steps_per_loop=4, xla=False)
    trainer.fit(strategy.experimental_distribute_dataset(token_data(steps)), steps=steps)
    differences = [np.abs(a - b).max() for a, b in zip(model.get_weights(), reference.get_weights())]
    assert max(differences) < 1e-6, max(differences)
    assert max(np.abs(a - b).max() for a, b in zip(weights, reference.get_weights())) > 1e-2


# -- the user's optimizer in the user's own checkpoint ---------------------------------

def adamw(exclude: bool = True):
    optimizer = keras.optimizers.AdamW(keras.optimizers.schedules.PolynomialDecay(0.02, 12, 0.002),
                                       weight_decay=0.1, global_clipnorm=0.5, epsilon=1e-3)
    if exclude:  # not in the optimizer's config: a .keras file does not keep it
        optimizer.exclude_from_weight_decay(var_names=["shard_norm"])
    return optimizer


@pytest.fixture(scope="module")
def weights():
    keras.utils.set_random_seed(0)
    return odd_mlp().get_weights()


def built(strategy, weights, optimizer=adamw, compile_model=False):
    with strategy.scope():
        model = odd_mlp()
        model.set_weights(weights)
        made = optimizer()
        if compile_model:
            model.compile(optimizer=made, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, made


def make_trainer(strategy, model, optimizer, shard):
    return Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   strategy=strategy, shard=shard, steps_per_loop=3)


def train(strategy, trainer, start, stop):
    data = strategy.experimental_distribute_dataset(mlp_data(steps=12).skip(start))
    trainer.fit(data, steps=stop, start_step=start)


def uninterrupted(strategy, weights, shard, stop=12):
    model, optimizer = built(strategy, weights)
    train(strategy, make_trainer(strategy, model, optimizer, shard), 0, stop)
    return model.get_weights()


def assert_same(actual, expected, tol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


@pytest.mark.slow  # ~14 s a mode; the fast tier's own-optimizer path: the .keras test
@pytest.mark.parametrize("mode", MODES)
def test_the_users_own_checkpoint_resumes_the_run(tmp_path, weights, mode):
    """tf.train.Checkpoint(model=model, optimizer=optimizer), written at step 6 and resumed
    to 12 by a new model, optimizer and Trainer, equals the uninterrupted run: restored once
    after the Trainer is made, once before (TensorFlow defers what has nowhere to go yet;
    it lands when the partitions are made). Under HEAD the checkpoint held the step counter
    only and Adam restarted from m = v = 0 (3.4e-2 off)."""
    strategy = mirrored(2)
    model, optimizer = built(strategy, weights)
    trainer = make_trainer(strategy, model, optimizer, mode)
    train(strategy, trainer, 0, 6)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    train(strategy, trainer, 6, 12)  # on, uninterrupted
    expected = model.get_weights()

    model, optimizer = built(strategy, weights)  # restored after the Trainer is made
    trainer = make_trainer(strategy, model, optimizer, mode)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path).assert_existing_objects_matched()
    assert int(optimizer.iterations.numpy()) == 6
    train(strategy, trainer, 6, 12)
    assert_same(model.get_weights(), expected)

    model, optimizer = built(strategy, weights)  # restored before: deferred
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
    train(strategy, make_trainer(strategy, model, optimizer, mode), 6, 12)
    assert_same(model.get_weights(), expected)


@pytest.mark.slow
def test_the_users_checkpoint_has_kerass_keys_and_restores_unsharded(tmp_path, weights):
    """What the user's optimizer writes under ZeRO is what an unsharded, built Keras
    optimizer writes (the same keys, the same values); an unsharded run resumes from it."""
    strategy = mirrored(2)
    written, trainers = {}, {}
    for mode in ("none", "gradients"):
        model, optimizer = built(strategy, weights)
        trainers[mode] = make_trainer(strategy, model, optimizer, mode)
        train(strategy, trainers[mode], 0, 6)
        path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / mode))
        reader = tf.train.load_checkpoint(path)
        written[mode] = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                         if k.startswith("optimizer/")}
        written[mode + "_path"] = path
    assert written["none"].keys() == written["gradients"].keys()
    assert sum(k.startswith("optimizer/_variables/") for k in written["none"]) == 16  # m, v of 8 variables
    for key, value in written["none"].items():
        np.testing.assert_allclose(written["gradients"][key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    train(strategy, trainers["none"], 6, 12)  # on, uninterrupted
    model, optimizer = built(strategy, weights)
    trainer = make_trainer(strategy, model, optimizer, "none")
    tf.train.Checkpoint(optimizer=optimizer).restore(written["gradients_path"])
    train(strategy, trainer, 6, 12)
    assert_same(model.get_weights(), trainers["none"].model.get_weights(), tol=1e-5)


@pytest.mark.slow
def test_a_second_trainer_with_the_same_optimizer_takes_its_state_over(weights):
    """The optimizer an earlier ZeRO Trainer sharded stands for that Trainer's partitions:
    a new Trainer given it (another mode, the same model) continues from them, as one
    unsharded optimizer would continue from its slots."""
    strategy = mirrored(2)
    model, optimizer = built(strategy, weights)
    train(strategy, make_trainer(strategy, model, optimizer, "optimizer"), 0, 6)
    train(strategy, make_trainer(strategy, model, optimizer, "gradients"), 6, 12)
    assert_same(model.get_weights(), uninterrupted(strategy, weights, "optimizer"), tol=1e-5)


# -- Keras files --------------------------------------------------------------------------

def keras_file(path) -> dict:
    """Every array of a .keras file's weights, by its path in the file."""
    import zipfile

    import h5py

    found = {}
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as data:
        with h5py.File(data, "r") as h5:
            h5.visititems(lambda name, item: found.__setitem__(name, item[()])
                          if isinstance(item, h5py.Dataset) else None)
    return found


def loss_scaled(precision: str):
    """The optimizer of a run in `precision` (no exclusions: a .keras file does not keep them)."""
    def optimizer():
        inner = adamw(exclude=False)
        return inner if precision == "float32" else keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0 ** 10)
    return optimizer


def saved_keras_files(tmp_path, strategy, weights, precision: str) -> dict:
    """mode -> a .keras file of the model compiled with the user's optimizer, after 6 steps."""
    files = {}
    for mode in ("none", "gradients"):
        model, made = built(strategy, weights, loss_scaled(precision), compile_model=True)
        train(strategy, make_trainer(strategy, model, made, mode), 0, 6)
        files[mode] = str(tmp_path / f"{mode}.keras")
        model.save(files[mode])
    return files


def test_a_keras_file_holds_what_the_unsharded_run_writes(tmp_path, weights):
    """model.save("x.keras") on a model compiled with the user's optimizer writes under ZeRO
    what the unsharded run writes: Keras calls optimizer.save_own_variables, which writes
    the counter and every slot whole, in Keras's order (under HEAD: the counter only).
    load_weights into a model whose ZeRO Trainer exists loads into the partitions: saved
    again, the file is the same."""
    strategy = mirrored(2)
    files = saved_keras_files(tmp_path, strategy, weights, "float32")
    plain, sharded = keras_file(files["none"]), keras_file(files["gradients"])
    assert plain.keys() == sharded.keys() and sum(k.startswith("optimizer/vars/") for k in plain) == 17
    for key, value in plain.items():
        np.testing.assert_allclose(sharded[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    model, made = built(strategy, weights, loss_scaled("float32"), compile_model=True)
    make_trainer(strategy, model, made, "optimizer")
    model.load_weights(files["gradients"])  # into the partitions: Keras's load_own_variables
    reloaded = str(tmp_path / "reloaded.keras")
    model.save(reloaded)
    for key, value in keras_file(reloaded).items():
        np.testing.assert_array_equal(value, sharded[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_a_keras_file_round_trip_continues_the_run(tmp_path, weights, precision):
    """Loaded back: keras.models.load_model builds the optimizer and loads it, and a ZeRO
    Trainer given that optimizer takes its state over; model.load_weights into a model whose
    ZeRO Trainer exists loads into the partitions (Keras's load_own_variables). Both continue
    as the uninterrupted run. Under fp16 the file also holds the loss scale, as unsharded."""
    strategy = mirrored(2)
    keras.mixed_precision.set_global_policy(precision)
    try:
        files = saved_keras_files(tmp_path, strategy, weights, precision)
        plain, sharded = keras_file(files["none"]), keras_file(files["gradients"])
        assert plain.keys() == sharded.keys()
        for key, value in plain.items():
            np.testing.assert_allclose(sharded[key], value, rtol=1e-6, atol=1e-6, err_msg=key)

        model, made = built(strategy, weights, loss_scaled(precision), compile_model=True)
        train(strategy, make_trainer(strategy, model, made, "gradients"), 0, 12)
        with strategy.scope():
            loaded = keras.models.load_model(files["gradients"])
        trainer = make_trainer(strategy, loaded, loaded.optimizer, "gradients")
        assert int(loaded.optimizer.iterations.numpy()) == 6
        train(strategy, trainer, 6, 12)
        assert_same(loaded.get_weights(), model.get_weights())

        again, made = built(strategy, weights, loss_scaled(precision), compile_model=True)
        trainer = make_trainer(strategy, again, made, "gradients")
        again.load_weights(files["gradients"])
        train(strategy, trainer, 6, 12)
        assert_same(again.get_weights(), model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")


# -- a late exclude_from_weight_decay --------------------------------------------------------

def test_a_late_weight_decay_exclusion_is_refused(weights):
    """Keras documents that exclude_from_weight_decay must come before the optimizer is
    built (its check reads `_built`, which Keras 3.15 never sets, so it does not fire);
    under ZeRO the decisions are fixed when the Trainer is made and a later call was
    silently ignored. It is refused, by name (a ValueError), and the decisions stand."""
    strategy = mirrored(2)
    model, optimizer = built(strategy, weights)
    trainer = make_trainer(strategy, model, optimizer, "optimizer")
    decays = list(trainer._sharded.shard.decays)
    with pytest.raises(ShardingError, match=r"exclude_from_weight_decay\(\) after tfpar.Trainer\(shard=...\) "
                                            "was made with it.*Call exclude_from_weight_decay before"):
        optimizer.exclude_from_weight_decay(var_names=["shard_dense"])
    assert isinstance(ShardingError("x"), ValueError)
    assert trainer._sharded.shard.decays == decays
