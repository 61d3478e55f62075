"""Every task of a `--chief --workers 1 --ps 2` cluster runs this; only the chief gets past
create_strategy. The chief shows that Keras fit is refused (pointing to the loop), then
trains with tfpar.Trainer, the embedding split over both ps tasks, and compares with the
same training on one device. With a single worker the scheduled steps run one after
another, so asynchronous training is sequential SGD: any difference would come from the
parameter-server path (sharded reads, sharded updates).
"""

import numpy as np

import tfpar
from tfpar.strategy import partitioner

strategy = tfpar.create_strategy("parameter_server", connect_timeout_s=60,
                                 variable_partitioner=partitioner(shards=2))
print(f"describe: {tfpar.describe(strategy)}", flush=True)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import fit_model  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402

try:
    fit_model.train(strategy, fit_model.initial_weights(), steps=1)
    print("PS_FIT: ran", flush=True)
except tfpar.UnsupportedStrategyError as e:
    print(f"PS_FIT: refused: {e}", flush=True)

STEPS, BATCH = 12, 16
x = np.random.RandomState(0).randint(0, 64, size=(STEPS * BATCH, 8)).astype(np.int32)
y = (x.sum(1) % 10).astype(np.int32)


def dataset():
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def build():
    model = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(64, 16),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
    return model, keras.optimizers.Adam(1e-2)


keras.utils.set_random_seed(0)
local_model, local_opt = build()
initial = local_model.get_weights()
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
local = Trainer(local_model, local_opt, loss, strategy=tf.distribute.get_strategy(), steps_per_loop=3)
local.fit(iter(dataset()), steps=STEPS)

with strategy.scope():
    model, opt = build()
    model.set_weights(initial)
embedding = model.layers[0].embeddings.value
shards = getattr(embedding, "variables", [embedding])
print("SHARDS", len(shards), sorted({v.device for v in shards}), flush=True)
trainer = Trainer(model, opt, loss, strategy=strategy, steps_per_loop=3)
logs = trainer.fit(trainer.per_worker_dataset(dataset), steps=STEPS)
final, expected = model.get_weights(), local_model.get_weights()
print("MOVED", max(float(np.max(np.abs(a - b))) for a, b in zip(expected, initial)), flush=True)
print("MAX_DIFF", max(float(np.max(np.abs(a - b))) for a, b in zip(final, expected)), flush=True)
print("LOSS", logs["loss"], flush=True)
