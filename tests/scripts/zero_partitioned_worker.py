"""One worker of the two-process partitioned-checkpoint test (multi_worker_mirrored, one
replica each; tests/test_zero_partitioned_checkpoints.py).

argv: WORKDIR. ZeRO-2 with AdamW (schedule, weight decay with an exclusion, global clip)
on a model whose sizes do not divide by 2, with a scalar weight:

1. UNINTERRUPTED: STEPS steps; the chief writes the weights to WORKDIR/uninterrupted.npz.
2. SAVED: SAVE_AT steps, then tfpar's Checkpoints saves to WORKDIR/run while the gather
   that would put a slot together raises (no worker may hold a whole slot); the chief
   writes WORKDIR/ranks.json (task -> rank: which file holds whose slices).
3. RESUMED: a fresh model, optimizer and Trainer restore it (each worker its own slices),
   the restored partitions equal the saved ones, and STEPS - SAVE_AT more steps equal 1.
4. FAILED: worker-1 cannot write its partitions: both workers raise WorkdirError, nothing
   is written. UNSHARED: worker-1 writes where the chief cannot see: the chief raises.
"""

import json
import os
import sys

import numpy as np

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 16


def mlp():
    """Sizes that do not divide by 2 or 4, and a scalar weight: one replica owns it whole,
    and a worker that owns none of it writes nothing of it."""
    import keras

    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x):
            return x * self.scale

    inputs = keras.Input((32,))
    x = keras.layers.Dense(37, activation="relu", name="p_dense")(inputs)
    x = keras.layers.LayerNormalization(name="p_norm")(x)
    x = keras.layers.Dense(21, activation="relu", name="p_dense_1")(Scale(name="p_scale")(x))
    return keras.Model(inputs, keras.layers.Dense(5, name="p_out")(x))


def adamw():
    import keras

    optimizer = keras.optimizers.AdamW(keras.optimizers.schedules.PolynomialDecay(0.02, 10, 0.002),
                                       weight_decay=0.1, global_clipnorm=0.5, epsilon=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["p_norm"])
    return optimizer


def initial_weights():
    import keras

    keras.utils.set_random_seed(0)
    return mlp().get_weights()


def dataset(start: int = 0):
    """The global batches of steps start..STEPS (the same in every process)."""
    import tensorflow as tf

    rng = np.random.RandomState(1)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 32)).astype("float32")
    y = np.abs(x[:, :5]).argmax(1).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).skip(start)


def trainer(strategy, shard: str, weights):
    import keras

    from tfpar.loop import Trainer

    with strategy.scope():
        model = mlp()
        model.set_weights(weights)
        optimizer = adamw()
    return model, Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, shard=shard, steps_per_loop=3)


def checkpoints(directory, is_chief, model, optimizer):
    from tfpar.checkpoints import Checkpoints

    return Checkpoints(directory, is_chief, model=model, optimizer=optimizer)


def main(workdir: str) -> None:
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
    info = tfpar.describe(strategy)
    import tensorflow as tf

    from tfpar.errors import WorkdirError
    from tfpar.zero import checkpoint as zero_checkpoint
    from tfpar.zero import files as zero_files

    weights, task = initial_weights(), strategy.cluster_resolver.task_id

    def barrier():
        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

    def run(model, trainer_, start, stop):
        trainer_.fit(strategy.experimental_distribute_dataset(dataset(start)), steps=stop, start_step=start)
        return model

    model, uninterrupted = trainer(strategy, "gradients", weights)
    final = run(model, uninterrupted, 0, STEPS).get_weights()
    if info.is_chief:
        np.savez(os.path.join(workdir, "uninterrupted.npz"), *final)
    print(f"UNINTERRUPTED moved={max(np.abs(a - b).max() for a, b in zip(final, weights)) > 1e-2}", flush=True)

    model, saved = trainer(strategy, "gradients", weights)
    run(model, saved, 0, SAVE_AT)
    gathered = []

    def refuse_whole(self, host=None):
        gathered.append(self.index)
        raise AssertionError("a whole slot was put together while saving")

    whole, zero_checkpoint.PartitionValue.whole = zero_checkpoint.PartitionValue.whole, refuse_whole
    try:
        checkpoints(os.path.join(workdir, "run"), info.is_chief, model, saved.optimizer).save(SAVE_AT)
    finally:
        zero_checkpoint.PartitionValue.whole = whole
    ranks = saved._sharded._ranks
    if info.is_chief:
        with open(os.path.join(workdir, "ranks.json"), "w", encoding="utf-8") as f:
            json.dump({"worker-0": ranks[0], "worker-1": ranks[1]}, f)
    barrier()
    print(f"SAVED gathered={gathered} rank={ranks[task]}", flush=True)

    model, resumed = trainer(strategy, "gradients", weights)
    step = checkpoints(os.path.join(workdir, "run"), info.is_chief, model, resumed.optimizer).restore()
    state = [zero_checkpoint._tf_variable(v) for v in resumed._sharded.state_variables()]
    before = [zero_checkpoint._tf_variable(v) for v in saved._sharded.state_variables()]
    same = all(np.array_equal(_own(a), _own(b)) for a, b in zip(state, before))
    after = run(model, resumed, SAVE_AT, STEPS).get_weights()
    equal = all(np.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(after, final))
    print(f"RESUMED step={step} state_equal={same} weights_equal={equal}", flush=True)

    def failing_write(saveables, prefix):
        raise OSError(28, "No space left on device")

    def prefix_elsewhere(original):  # this worker's files go where the chief does not look
        return lambda self, d, s, t: original(self, os.path.join(workdir, "private"), s, t)

    faults = (("FAILED", "failed", zero_files.private_api, "write_saveables", lambda original: failing_write),
              ("UNSHARED", "unshared", zero_files.WorkerPartitions, "prefix", prefix_elsewhere))
    for label, folder, owner, name, replacement in faults:  # worker 1 fails its part
        original = getattr(owner, name)
        if task == 1:
            setattr(owner, name, replacement(original))
        try:
            checkpoints(os.path.join(workdir, folder), info.is_chief, model, resumed.optimizer).save(STEPS)
            print(f"{label} raised=False", flush=True)
        except WorkdirError as e:
            print(f"{label} raised=True message={str(e)!r}", flush=True)
        finally:
            setattr(owner, name, original)
    barrier()


def _own(variable):
    return (variable.values[0] if hasattr(variable, "values") else variable).numpy()


if __name__ == "__main__":
    main(sys.argv[1])
