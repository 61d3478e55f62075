"""Three models whose embeddings get sparse gradients with repeated rows, trained with
Adam, AdamW and LAMB: in Keras fit, in tfpar's loop, and densely (the reference).

Shared by tests/test_sparse_gradients.py and its two-worker script. fp32, no dropout.
"""

from __future__ import annotations

import numpy as np

SEQ, GLOBAL_BATCH, STEPS = 8, 16, 4
MODELS = ("gpt", "sequential", "dict_inputs")
OPTIMIZERS = ("adam", "adamw", "lamb")
# GPT: 64 tokens, fewer than a replica's rows, so tfpar's all-reduce sends it dense;
# the Sequential's 200 rows stay sparse (all-gathered) on 2 and 4 replicas.
VOCAB = {"gpt": 64, "sequential": 200, "dict_inputs": 16}


def build(name: str):
    import keras

    from tfpar.models import GPT

    keras.utils.set_random_seed(0)
    if name == "gpt":
        return GPT(vocab_size=VOCAB[name], max_len=SEQ, dim=16, depth=1, heads=2)
    if name == "sequential":
        return keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                                 keras.layers.Embedding(VOCAB[name], 8),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    extra = keras.Input((3,), name="extra")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB[name], 8)(tokens))
    h = keras.layers.Concatenate()([h, keras.layers.Dense(8, activation="tanh")(extra)])
    return keras.Model({"tokens": tokens, "extra": extra}, keras.layers.Dense(4)(h))


def data(name: str):
    """(x, y) for STEPS global batches; tokens repeat within every batch."""
    rng = np.random.RandomState(1)
    n = STEPS * GLOBAL_BATCH
    tokens = rng.randint(0, VOCAB[name], size=(n, SEQ)).astype("int32")
    if name == "gpt":
        return tokens, np.roll(tokens, -1, axis=1)
    y = (tokens[:, 0] % 4).astype("int32")
    if name == "sequential":
        return tokens, y
    return {"tokens": tokens, "extra": rng.normal(size=(n, 3)).astype("float32")}, y


def dataset(name: str):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data(name)).batch(GLOBAL_BATCH)


def optimizer(name: str):
    """epsilon=1e-3: Adam turns the rounding noise of a gradient that is zero in exact
    arithmetic (a GPT's attention key bias: softmax ignores it) into a full step of +-lr,
    which differs between any two summation orders (measured: 6e-5 with epsilon=1e-7, on one
    device too). A larger epsilon keeps the comparison about the math, not the rounding;
    Keras's sparse bug still moves weights by 1e-3 (test_the_fixes_can_be_turned_off)."""
    import keras

    eps = 1e-3
    return {"adam": lambda: keras.optimizers.Adam(0.01, epsilon=eps),
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, epsilon=eps),
            "lamb": lambda: keras.optimizers.Lamb(0.01, epsilon=eps)}[name]()


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fresh(strategy, name: str, weights, optimizer_name: str):
    with strategy.scope():
        model = build(name)
        model.set_weights(weights)
        return model, optimizer(optimizer_name)


def dense_reference(name: str, weights, optimizer_name: str) -> list:
    """One device; every gradient converted to a dense tensor before the optimizer."""
    import tensorflow as tf

    model, opt = _fresh(tf.distribute.get_strategy(), name, weights, optimizer_name)
    loss_fn = loss()
    for x, y in dataset(name):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return model.get_weights()


def fit(strategy, name: str, weights, optimizer_name: str) -> list:
    model, opt = _fresh(strategy, name, weights, optimizer_name)
    with strategy.scope():
        model.compile(optimizer=opt, loss=loss())
    model.fit(dataset(name), epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def loop(strategy, name: str, weights, optimizer_name: str, **options) -> list:
    from tfpar.loop import Trainer

    model, opt = _fresh(strategy, name, weights, optimizer_name)
    trainer = Trainer(model, opt, loss(), strategy=strategy, steps_per_loop=STEPS, **options)
    trainer.fit(strategy.experimental_distribute_dataset(dataset(name)), steps=STEPS)
    return model.get_weights()


def initial_weights(name: str) -> list:
    return build(name).get_weights()


def max_difference(actual, expected) -> float:
    return max(float(np.abs(a - e).max()) for a, e in zip(actual, expected))
