"""A small transformer classifier and fixed data, shared by the fit-equivalence tests.

Built from plain keras.layers (embedding, self-attention, MLP, layer norm), no dropout,
fp32, trained with SGD + momentum so that replica counts can be compared to 1e-5.
"""

from __future__ import annotations

import numpy as np

VOCAB, SEQ, DIM, CLASSES = 32, 8, 16, 4
GLOBAL_BATCH, STEPS = 16, 6


def build_model():
    import keras

    inputs = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(inputs)
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=DIM // 2)(h, h)
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.Dense(DIM)(keras.layers.Dense(2 * DIM, activation="gelu")(h))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(CLASSES)(x)
    return keras.Model(inputs, outputs)


def compile_model(model, steps_per_execution: int = 1) -> None:
    import keras

    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )


def data(steps: int = STEPS):
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(steps * GLOBAL_BATCH, SEQ)).astype("int32")
    y = (x[:, 0] % CLASSES).astype("int32")
    return x, y


def dataset(steps: int = STEPS):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data(steps)).batch(GLOBAL_BATCH)


def replica_dataset(replica: int, replicas: int, steps: int = STEPS):
    """The rows replica `replica` of `replicas` gets of each global batch when a strategy
    distributes `dataset(steps)` (each replica a contiguous slice), batched per step."""
    import tensorflow as tf

    x, y = data(steps)
    rows = GLOBAL_BATCH // replicas
    pick = np.concatenate([np.arange(s * GLOBAL_BATCH + replica * rows, s * GLOBAL_BATCH + (replica + 1) * rows)
                           for s in range(steps)])
    return tf.data.Dataset.from_tensor_slices((x[pick], y[pick])).batch(rows)


def initial_weights():
    import keras

    keras.utils.set_random_seed(0)
    return build_model().get_weights()


def train(strategy, weights, steps_per_execution: int = 1, steps: int = STEPS):
    """Trains a fresh model from `weights` for `steps` global batches under `strategy`."""
    with strategy.scope():
        model = build_model()
        model.set_weights(weights)
        compile_model(model, steps_per_execution)
    history = model.fit(dataset(steps), epochs=1, verbose=0, shuffle=False)
    return model.get_weights(), history.history
