"""Keras `fit` with a tfpar strategy: the same script on one device, a split CPU or a cluster.

    python examples/fit_quickstart.py                           # auto: one device here
    python examples/fit_quickstart.py --strategy=mirrored --virtual_devices=2
    tfpar-launch --workers 2 -- python examples/fit_quickstart.py --strategy=mwms

Trains a small transformer classifier (embedding, self-attention, MLP) to tell which
token opens a sequence, and prints the accuracy it reaches.
"""

import argparse

import tfpar

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--strategy", default="auto")
parser.add_argument("--virtual_devices", type=int, default=None)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

# The strategy comes first: nothing may touch TensorFlow's runtime before it.
strategy = tfpar.create_strategy(args.strategy, virtual_devices=args.virtual_devices)
info = tfpar.describe(strategy)
print(f"strategy: {info.kind}, {info.replicas} replica(s) on {info.num_workers} worker(s)")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

VOCAB, SEQ, CLASSES, BATCH = 64, 16, 8, 64
rng = np.random.RandomState(0)
x = rng.randint(0, VOCAB, size=(4096, SEQ)).astype("int32")
y = (x[:, 0] % CLASSES).astype("int32")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=0).batch(BATCH, drop_remainder=True)

with strategy.scope():
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 32)(inputs)
    h = h + keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(h, h)
    h = keras.layers.LayerNormalization()(h)
    h = h + keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(h))
    outputs = keras.layers.Dense(CLASSES)(h[:, 0])  # the first position, like a [CLS] token
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), steps_per_execution=8,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

history = model.fit(data, epochs=args.epochs, verbose=2 if info.is_chief else 0)
print(f"final: loss={history.history['loss'][-1]:.4f} accuracy={history.history['accuracy'][-1]:.4f}")
