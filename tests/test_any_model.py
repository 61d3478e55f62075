"""Any Keras 3 model: fit with the injected strategy, tfpar's loop with compression, and
layer placement for chain-shaped models (split by layer)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import placement
from tfpar.loop import Trainer
from tfpar.models import Chain, NotAChainError

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def cnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4),
    ], name="cnn")


def transformer():
    """A functional transformer block from plain keras.layers (residuals: not a chain)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(16, 16)(tokens)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(16)(f))
    return keras.Model(tokens, keras.layers.Dense(16)(h), name="plain_transformer")


def images():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(32, 12, 12, 1)).astype("float32")
    return x, (x.reshape(32, -1).sum(axis=1) > 0).astype("int32") + 2 * (x[:, 0, 0, 0] > 0)


def sequences():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 16, size=(32, 8)).astype("int32")
    return x, x[:, ::-1].copy()


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=DEVICES[:replicas])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("build,data", [(cnn, images), (transformer, sequences)])
def test_fit_with_the_injected_strategy_gives_one_device_numbers(build, data):
    x, y = data()
    weights = None
    results = []
    for strategy in (tf.distribute.get_strategy(), mirrored(2)):
        with strategy.scope():
            model = build()
            weights = weights or model.get_weights()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build,data", [(cnn, images), (transformer, sequences)])
def test_the_loop_with_compression_trains_any_model(build, data):
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    finals = {}
    int8 = tfpar.compression.Compression(tfpar.compression.Int8(), tfpar.compression.Policy(min_size=0))
    for name, compression in (("none", None), ("int8", int8)):  # small model: compress all sizes
        strategy = mirrored(2)
        with strategy.scope():
            model = build()
            optimizer = keras.optimizers.Adam(0.01)
        trainer = Trainer(model, optimizer, loss(), strategy=strategy, steps_per_loop=5,
                          compression=compression)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        first = trainer.train_steps(iterator, 5)
        for _ in range(9):
            last = trainer.train_steps(iterator, 5)
        finals[name] = (first, last)
        assert last < 0.7 * first, (name, first, last)
        if compression is not None:
            assert trainer.wire_bytes(strategy.experimental_distribute_dataset(dataset))["ratio"] > 1.5


def test_a_sequential_model_is_placed_and_pipelined_by_layer():
    x, y = images()
    reference = cnn()
    with tf.GradientTape() as tape:
        expected_loss = loss()(y, reference(x))
    expected = tape.gradient(expected_loss, reference.trainable_variables)

    template = Chain.from_keras(reference)
    assert [name for name, _ in template.stages()] == [layer.name for layer in reference.layers]
    plan = placement.balanced(template, DEVICES[:2])
    with plan.scope():
        model = Chain.from_keras(reference)
    model.set_weights(reference.get_weights())
    for name, layer in model.stages():
        for v in layer.weights:
            assert tf.DeviceSpec.from_string(v.value.device).device_index == \
                tf.DeviceSpec.from_string(plan.device_of(name)).device_index
    pipe = placement.Pipeline(model, plan, micro_batches=4, schedule="1f1b")

    def share(y_part, logits, w):
        return tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y_part, logits, from_logits=True)) / 32.0

    got_loss, grads = tf.function(lambda: pipe.forward_backward(x, y, None, share))()
    np.testing.assert_allclose(got_loss, expected_loss, rtol=1e-5)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_a_model_with_branches_is_refused_for_placement_by_name():
    with pytest.raises(NotAChainError, match="the model branches \\(e.g. a residual connection\\)"):
        Chain.from_keras(transformer())


def test_a_chain_round_trips_through_keras_serialization(tmp_path):
    """A Chain saved as .keras loads as the same chain: layers, stages and outputs."""
    model = Chain.from_keras(cnn())
    x = images()[0][:4]
    path = str(tmp_path / "chain.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Chain": Chain})
    assert [name for name, _ in loaded.stages()] == [name for name, _ in model.stages()]
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)
