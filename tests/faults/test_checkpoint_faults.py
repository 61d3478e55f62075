"""Checkpoints survive a kill mid-save, and restore under another replica count."""

import json

import keras
import numpy as np
import tensorflow as tf

import procs
import tfpar
from tfpar.checkpoints import Checkpoints
from tfpar.models.gpt import GPT


def test_a_kill_while_saving_leaves_the_previous_checkpoint_restorable(tmp_path):
    result = procs.run_python([str(procs.SCRIPTS / "kill_in_save.py"), str(tmp_path)])
    assert result.returncode == -9 and "not reached" not in result.stdout, result.stderr[-2000:]
    saved = json.loads(result.stdout.strip().splitlines()[-1])["sum"]
    assert list((tmp_path / "checkpoints").glob("ckpt-20*"))  # its files were written...
    model = GPT(vocab_size=32, max_len=8, dim=32, depth=1, heads=2)
    assert Checkpoints(str(tmp_path), True, model=model).restore() == 10  # ...but never named
    np.testing.assert_allclose(float(sum(tf.reduce_sum(w) for w in model.weights)), saved, rtol=1e-6)


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def build(strategy):
    with strategy.scope():
        model = GPT(vocab_size=32, max_len=8, dim=32, depth=1, heads=2)
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def test_a_checkpoint_from_two_replicas_restores_under_four_and_under_one_device(tmp_path):
    from tfpar.loop import Trainer

    x = np.random.RandomState(0).randint(0, 32, size=(8, 8)).astype("int32")
    data = tf.data.Dataset.from_tensors((x, np.roll(x, -1, axis=1))).repeat()
    two = mirrored(2)
    model, optimizer = build(two)
    Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            strategy=two).fit(two.experimental_distribute_dataset(data), steps=3)
    Checkpoints(str(tmp_path), True, model=model, optimizer=optimizer).save(3)
    for strategy in (mirrored(4), tf.distribute.get_strategy()):
        other, other_optimizer = build(strategy)
        step = Checkpoints(str(tmp_path), True, model=other, optimizer=other_optimizer).restore()
        assert step == 3 and int(np.asarray(other_optimizer.iterations.value)) == 3
        for a, b in zip(other.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(other_optimizer.variables, optimizer.variables):  # Adam's moments too
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
