"""keras.distribution on TensorFlow through tfpar: the keras.io guide's programs ("distributed
training with Keras 3"), rewritten here with one line added, `tfpar.distribution.enable()`,
train with `model.fit` and with `tfpar.Trainer` and equal the same model on one device."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import tensor_parallel as tp

STEPS, BATCH = 3, 16


@pytest.fixture(autouse=True)
def enabled():
    tfpar.distribution.enable()
    yield
    keras.distribution.set_distribution(None)
    tfpar.distribution.disable()  # Keras's own functions back for the worker's next module


def mnist_like():
    rng = np.random.RandomState(0)
    x = rng.rand(STEPS * BATCH, 28, 28, 1).astype("float32")
    y = keras.utils.to_categorical(rng.randint(0, 10, STEPS * BATCH), 10).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def guide_model():
    """The guide's model, its Dense layers named as its layout map names them (and dropout
    off: its masks are random)."""
    inputs = keras.layers.Input(shape=(28, 28, 1))
    y = keras.layers.Flatten()(inputs)
    y = keras.layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = keras.layers.Dropout(0.0)(y)
    y = keras.layers.Dense(units=10, activation="softmax", name="d2")(y)
    return keras.Model(inputs=inputs, outputs=y)


def one_device():
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    model = guide_model()
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(1e-2))
    model.fit(mnist_like(), epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def assert_equal(actual, expected, tol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def test_the_guides_data_parallel_program_runs_on_tensorflow():
    expected = one_device()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape=(2,), axis_names=["batch"], devices=devices[:2])
    keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
    keras.utils.set_random_seed(0)
    model = guide_model()
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(1e-2))
    assert model.distribute_strategy.num_replicas_in_sync == 2
    model.fit(mnist_like(), epochs=1, verbose=0, shuffle=False)
    model.evaluate(mnist_like(), verbose=0)
    assert_equal(model.get_weights(), expected)


def model_parallel(devices=4, model_axis=2):
    mesh = keras.distribution.DeviceMesh(shape=(devices // model_axis, model_axis), axis_names=["batch", "model"],
                                         devices=keras.distribution.list_devices()[:devices])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("batch", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_the_guides_model_parallel_program_runs_on_tensorflow():
    expected = one_device()
    keras.distribution.set_distribution(model_parallel())
    keras.utils.set_random_seed(0)
    model = guide_model()
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(1e-2))
    kernel = model.get_layer("d1").kernel
    assert tp.spec_of(kernel) is not None and tuple(kernel.shape) == (784, 100)  # half of 200 per device
    model.fit(mnist_like(), epochs=1, verbose=0, shuffle=False)
    assert_equal(model.get_weights(), expected)
    evaluated = model.evaluate(mnist_like(), verbose=0)
    predicted = model.predict(mnist_like(), verbose=0)
    keras.distribution.set_distribution(None)
    plain = guide_model()
    plain.set_weights(model.get_weights())
    plain.compile(loss="mse")
    np.testing.assert_allclose(evaluated, plain.evaluate(mnist_like(), verbose=0), rtol=1e-5)
    np.testing.assert_allclose(predicted, plain.predict(mnist_like(), verbose=0), rtol=1e-5, atol=1e-6)


# -- a transformer of plain keras.layers, split by a hand-written layout map -----------------

def user_transformer(vocab=32, dim=32, heads=4, seq=8):
    """The user's own: an embedding, a pre-norm attention and MLP block, a head."""
    tokens = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="embed")(tokens)
    a = keras.layers.LayerNormalization(name="ln1")(h)
    a = keras.layers.MultiHeadAttention(heads, dim // heads, name="attn")(a, a, use_causal_mask=True)
    h = keras.layers.Add()([h, a])
    m = keras.layers.LayerNormalization(name="ln2")(h)
    m = keras.layers.Dense(4 * dim, activation="gelu", name="up")(m)
    m = keras.layers.Dense(dim, name="down")(m)
    h = keras.layers.Add()([h, m])
    return keras.Model(tokens, keras.layers.Dense(vocab, name="head")(h))


def megatron_map(mesh, changed=None):
    """Megatron's split, by hand: heads, the MLP's width, the vocabulary (embedding, head);
    `changed`: entries given other layouts, or added."""
    entries = {
        "embed/embeddings": ("model", None),
        "attn/(query|key|value)/kernel": (None, "model", None),
        "attn/(query|key|value)/bias": ("model", None),
        "attn/attention_output/kernel": ("model", None, None),
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "down/kernel": ("model", None),
        "head/kernel": (None, "model"),  # the logits split, gathered as the model returns them
        **(changed or {})}
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, layout in entries.items():
        layout_map[key] = layout
    return layout_map


def tokens(count=3, rows=8):
    x = np.random.RandomState(1).randint(0, 32, size=(count * rows, 9)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x[:, :-1], x[:, 1:])).batch(rows)


@pytest.mark.parametrize("devices,model_axis", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_a_transformer_of_plain_keras_layers_split_by_a_hand_written_map(devices, model_axis):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def trained():
        keras.utils.set_random_seed(0)
        model = user_transformer()
        model.compile(loss=loss, optimizer=keras.optimizers.AdamW(1e-2, global_clipnorm=0.5, epsilon=1e-3))
        model.fit(tokens(), epochs=1, verbose=0, shuffle=False)
        return model

    expected = trained().get_weights()
    mesh = keras.distribution.DeviceMesh((devices // model_axis, model_axis), ["batch", "model"],
                                         keras.distribution.list_devices()[:devices])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=megatron_map(mesh),
                                                                         batch_dim_name="batch"))
    model = trained()
    assert tp.split_weight_count(model) == 13  # q, k, v (kernels, biases), out; up x2, down; embed; head x2
    assert_equal(model.get_weights(), expected)


# -- weights laid out on the batch axis (FSDP-style, as keras-hub's maps do) -------------------

def fsdp_map(mesh):
    """Megatron's split, with some weights also laid out on "batch" (keras-hub's style)."""
    return megatron_map(mesh, {"up/kernel": ("batch", "model"), "down/kernel": ("model", "batch"),
                               "ln2/gamma": ("batch",)})


def adam_moment_bytes(trainer) -> dict:
    """Bytes per device of the Adam moments the Trainer's optimizer keeps (sharded or not)."""
    sharded = trainer._sharded  # pylint: disable=protected-access
    if sharded is None:
        slots = [v for v in trainer.optimizer.variables if v.path.split("/")[-1].rsplit("_", 1)[-1]
                 in ("momentum", "velocity")]
    else:
        slots = [v for k, v in enumerate(sharded.shard.clone.variables) if k in sharded.shard.slot_of]
    from tfpar import zero  # pylint: disable=import-outside-toplevel

    return dict(zero.device_bytes(slots))


@pytest.mark.parametrize("devices,model_axis", [(4, 2), pytest.param(4, 1, marks=pytest.mark.slow), (2, 2)])
def test_weights_laid_out_on_the_batch_axis_partition_their_state_in_the_trainer(devices, model_axis, caplog):
    """A map that lays weights on "batch": tfpar.Trainer runs ZeRO-2 over the R replicas of
    the batch axis by default, whole weights, one line at start says so; 3 AdamW steps with
    a clip equal the unsplit model on one device (1e-5); each device keeps 1/R of the Adam
    moments it would keep unsharded. R = 1: nothing to partition, said. (The model ends in a
    column-parallel head: the Trainer's pure pass gathers its logits too.)"""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def adamw():
        return keras.optimizers.AdamW(1e-2, global_clipnorm=0.5, epsilon=1e-3)

    keras.utils.set_random_seed(0)
    reference = user_transformer()
    reference.compile(loss=loss, optimizer=adamw())
    reference.fit(tokens(), epochs=1, verbose=0, shuffle=False)
    mesh = keras.distribution.DeviceMesh((devices // model_axis, model_axis), ["batch", "model"],
                                         keras.distribution.list_devices()[:devices])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=fsdp_map(mesh),
                                                                         batch_dim_name="batch"))
    replicas = devices // model_axis

    def trainer(**shard):
        keras.utils.set_random_seed(0)
        model = user_transformer()
        with caplog.at_level(logging.INFO):
            caplog.clear()
            made = tfpar.Trainer(model, adamw(), loss, **shard)
        said = [r.getMessage() for r in caplog.records if "laid out on 'batch'" in r.getMessage()]
        assert len(said) == 1, said
        return made, said[0]

    made, line = trainer()
    assert "3 weight(s) laid out on 'batch'" in line
    if replicas == 1:
        assert made._sharded is None and "nothing to partition" in line
    else:
        assert made._sharded.mode == "gradients"
        assert f"optimizer state and gradients (ZeRO-2) partitioned over the {replicas} replicas" in line
    made.fit(tokens(), steps=STEPS)
    assert_equal(made.model.get_weights(), reference.get_weights())
    if replicas > 1:
        whole, _ = trainer(shard="none")
        assert whole._sharded is None
        partitioned, kept = adam_moment_bytes(made), adam_moment_bytes(whole)
        assert len(partitioned) == devices and set(partitioned) == set(kept)
        padding = len(made.model.trainable_variables) * 2 * 4 * (replicas - 1)  # 2 moments, < R floats each
        for device, held in partitioned.items():  # 1/R, up to each variable's padding to R chunks
            assert kept[device] / replicas <= held <= kept[device] / replicas + padding, (device, held)


@pytest.mark.slow  # traces fit and evaluate of a split model: ~10 s
def test_model_fit_says_it_keeps_the_batch_axis_weights_state_whole(caplog):
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices()[:4])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=fsdp_map(mesh),
                                                                         batch_dim_name="batch"))
    model = user_transformer()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="adamw")
    with caplog.at_level(logging.INFO):
        model.fit(tokens(1), epochs=1, verbose=0)
        model.evaluate(tokens(1), verbose=0)
    said = [r.getMessage() for r in caplog.records if "laid out on 'batch'" in r.getMessage()]
    assert len(said) == 1 and "under model.fit (the same numbers, not partitioned)" in said[0], said
    assert "tfpar.Trainer partitions them (ZeRO-2)" in said[0]


# -- what cannot be honoured is refused by name ------------------------------------------------

def refused(layout_map_entries, build, match, error=tp.TensorParallelError):
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], keras.distribution.list_devices()[:2])
    with pytest.raises(error, match=match):
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, value in layout_map_entries.items():
            layout_map[key] = value
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        build()
    keras.distribution.set_distribution(None)


def test_layout_maps_tfpar_cannot_honour_are_refused_by_name():
    def functional(layer, shape=(4,)):  # a functional model: the layer's weights are "<name>/<weight>"
        inputs = keras.Input(shape)
        return keras.Model(inputs, layer(inputs))

    def dense(units=3):
        return lambda: functional(keras.layers.Dense(units, name="d"))

    refused({"d/kernel": (None, "model")}, dense(3),
            r"splits d/kernel \(shape \(4, 3\)\) along dimension 1 over the 2 devices of 'model', which do not divide 3")
    refused({"d/kernel": ("data", "model")}, dense(4), r"Invalid axis names .* Got \{'(data|model)', '(data|model)'\}",
            ValueError)  # Keras's own LayoutMap refuses it (a set: either order; tfpar refuses it where the map has no mesh)
    refused({"d/kernel": ("model",)}, dense(4), r"1 dimension\(s\), but the weight has shape \(4, 4\)")
    refused({"d/kernel": ("model", "model")}, dense(4), r"2 dimensions on 'model'")
    refused({"d/output": (None, "model")}, dense(4), r"lays the activation d/output out as \(None, 'model'\)")
    refused({"n/gamma": ("model",)}, lambda: functional(keras.layers.LayerNormalization(name="n")),
            r"n/gamma \(a LayerNormalization weight\) cannot be split")
    refused({"c/kernel": (None, None, None, "model")}, lambda: functional(keras.layers.Conv2D(4, 3, name="c"), (8, 8, 1)),
            r"c/kernel \(a Conv2D weight\) cannot be split")


@pytest.mark.multiprocess
def test_the_guides_data_parallel_program_runs_on_two_worker_processes(tmp_path):
    """The same program in 2 processes of a cluster (tfpar-launch's TF_CONFIG): tfpar runs
    it under multi_worker_mirrored; `model.fit` and `tfpar.Trainer` (a plain dataset) each
    end on one device's weights (1e-5), the same on both workers."""
    from procs import launch
    from scripts import fit_model

    keras.distribution.set_distribution(None)
    init = fit_model.initial_weights()
    np.savez(tmp_path / "init.npz", **{f"w{i}": w for i, w in enumerate(init)})
    result = launch(2, "distribution_worker.py", str(tmp_path / "init.npz"), str(tmp_path))
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert out.count("STRATEGY multi_worker_mirrored replicas=2 workers=2") == 2, out[-4000:]
    assert out.count("DONE") == 2
    reference, _ = fit_model.train(tf.distribute.get_strategy(), init)
    for name in ("fit", "loop"):
        files = [np.load(tmp_path / f"{name}{i}.npz") for i in range(2)]
        workers = [[f[f"arr_{i}"] for i in range(len(f.files))] for f in files]
        for a, b in zip(*workers):
            np.testing.assert_array_equal(a, b)
        assert_equal(workers[0], reference)


def test_enable_in_a_cluster_process_after_tensorflow_started_names_the_fix(monkeypatch):
    """The multi-worker strategy must exist before TensorFlow starts (here it has)."""
    import json

    from tfpar.distribution import mesh
    from tfpar.errors import RuntimeAlreadyStartedError

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                "task": {"type": "worker", "index": 0}}))
    monkeypatch.setattr(mesh, "_CLUSTER", {})
    with pytest.raises(RuntimeAlreadyStartedError, match=r"call tfpar.distribution.enable\(\) first thing"):
        mesh.start_cluster_strategy()
