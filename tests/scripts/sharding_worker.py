"""One worker of the two-process sharding test (multi_worker_mirrored, one replica each).

argv: WORKDIR. For AdamW under mixed_float16 (a LossScaleOptimizer), SGD with momentum
under mixed_bfloat16 and LAMB in float32, all clipped, 2 micro-batches a step: the unsharded loop, then shard='optimizer' and
shard='gradients' from the same weights; prints one SHARD line per case and mode (equal
to the unsharded weights to 1e-5, and moved). Then the sharded AdamW checkpoint through
tfpar's Checkpoints (every worker writes its own partitions, the chief merges them:
tfpar.zero.files) against the unsharded one, and a fresh sharded Trainer that restores it:
one CKPT line.
"""

import os
import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
info = tfpar.describe(strategy)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.checkpoints import Checkpoints  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402

STEPS, ACCUMULATE, GLOBAL_BATCH = 3, 2, 16


def mlp():
    inputs = keras.Input((32,))
    x = keras.layers.Dense(37, activation="relu", name="w_dense")(inputs)
    x = keras.layers.LayerNormalization(name="w_norm")(x)
    return keras.Model(inputs, keras.layers.Dense(5, name="w_out")(x))


def data():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS * ACCUMULATE, 32)).astype("float32")
    y = np.abs(x[:, :5]).argmax(1).astype("int32")
    return strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))


OPTIMIZERS = {
    "adamw-fp16": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5), initial_scale=2.0 ** 20,
        dynamic_growth_steps=2),
    "sgd-bf16": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.2),
    "lamb": lambda: keras.optimizers.Lamb(0.02, weight_decay=0.01, global_clipnorm=1.0),
}

keras.utils.set_random_seed(0)
INITIAL = mlp().get_weights()


def train(case, shard):
    policy = {"fp16": "mixed_float16", "bf16": "mixed_bfloat16"}.get(case.rsplit("-", 1)[-1], "float32")
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope():
            model = mlp()
            model.set_weights(INITIAL)
            optimizer = OPTIMIZERS[case]()
        trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, accumulate=ACCUMULATE, steps_per_loop=2, shard=shard)
        trainer.fit(data(), steps=STEPS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, trainer


def close(a, b) -> bool:
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, b))


def checkpoint(model, trainer, directory) -> dict:
    items = {"optimizer": trainer.optimizer, **trainer.checkpoint_items()}
    Checkpoints(directory, info.is_chief, model=model, **items).save(STEPS)
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # the chief has written it
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(directory, "checkpoints")))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith("optimizer/")}


runs = {}
for case in OPTIMIZERS:
    plain, _ = runs[(case, "none")] = train(case, "none")
    for mode in ("optimizer", "gradients"):
        model, _ = runs[(case, mode)] = train(case, mode)
        print(f"SHARD {case} {mode} equal={close(model.get_weights(), plain.get_weights())} "
              f"moved={not close(model.get_weights(), INITIAL)}", flush=True)

workdir = sys.argv[1]
unsharded = checkpoint(*runs[("adamw-fp16", "none")], os.path.join(workdir, "plain"))
sharded = checkpoint(*runs[("adamw-fp16", "gradients")], os.path.join(workdir, "sharded"))
equal = unsharded.keys() == sharded.keys() and all(
    np.allclose(sharded[k], v, rtol=1e-5, atol=1e-5) for k, v in unsharded.items())
_, saved_trainer = runs[("adamw-fp16", "gradients")]
keras.mixed_precision.set_global_policy("mixed_float16")
with strategy.scope():
    fresh_model = mlp()
    fresh = Trainer(fresh_model, OPTIMIZERS["adamw-fp16"](), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    strategy=strategy, shard="gradients")
keras.mixed_precision.set_global_policy("float32")
step = Checkpoints(os.path.join(workdir, "sharded"), info.is_chief, model=fresh_model,
                   **{"optimizer": fresh.optimizer, **fresh.checkpoint_items()}).restore()


def own_copy(variable) -> np.ndarray:
    """This worker's copy of a (mirrored or per-replica) variable."""
    variable = variable.value if isinstance(variable, keras.Variable) else variable
    return (variable.values[0] if hasattr(variable, "values") else variable).numpy()


restored = step == STEPS and all(np.array_equal(own_copy(a), own_copy(b)) for a, b in zip(
    fresh._sharded.state_variables(), saved_trainer._sharded.state_variables()))
print(f"CKPT slots_equal={equal} restored={restored}", flush=True)
