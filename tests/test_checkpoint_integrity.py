"""A damaged checkpoint is found before the restore touches a variable."""

import os

import numpy as np
import pytest

import tensorflow as tf

from tfpar.checkpoint_integrity import newest_intact, problems


def _three_checkpoints(directory):
    v = tf.Variable(tf.random.normal([64, 64], seed=1))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(directory), 5)
    for step in (1, 2, 3):
        v.assign_add(tf.ones_like(v))
        manager.save(checkpoint_number=step)
    return [str(directory / f"ckpt-{s}") for s in (3, 2, 1)]


def _data(prefix):
    return prefix + ".data-00000-of-00001"


def test_truncated_corrupted_and_index_less_checkpoints_are_named_and_skipped(tmp_path):
    newest_first = _three_checkpoints(tmp_path)
    assert newest_intact(newest_first) == (newest_first[0], {})

    os.truncate(_data(newest_first[0]), os.path.getsize(_data(newest_first[0])) // 2)  # a partial copy
    chosen, damaged = newest_intact(newest_first)
    assert chosen == newest_first[1]
    assert list(damaged) == [newest_first[0]] and _data(newest_first[0]) in damaged[newest_first[0]][0]

    raw = bytearray(open(_data(newest_first[1]), "rb").read())
    raw[100:110] = b"\xff" * 10  # flipped bytes: the tensor's checksum no longer matches
    open(_data(newest_first[1]), "wb").write(bytes(raw))
    chosen, damaged = newest_intact(newest_first)
    assert chosen == newest_first[2] and "Checksum" in damaged[newest_first[1]][0]

    os.remove(newest_first[2] + ".index")
    chosen, damaged = newest_intact(newest_first)
    assert chosen is None and damaged[newest_first[2]] == [f"{newest_first[2]}.index is missing"]


def test_a_missing_data_shard_is_named(tmp_path):
    prefix = _three_checkpoints(tmp_path)[0]
    os.remove(_data(prefix))
    assert problems(prefix) == [f"{_data(prefix)} is missing"]


def _truncate(prefix):
    path = _data(prefix)
    os.truncate(path, os.path.getsize(path) // 2)


def test_checkpoints_restore_the_newest_whole_one_and_name_the_damaged(tmp_path, caplog):
    import keras

    from tfpar.checkpoints import Checkpoints
    from tfpar.errors import CheckpointDamagedError

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    checkpoints = Checkpoints(str(tmp_path), is_chief=True, model=model)
    saved = {}
    for step in (10, 20):
        model.layers[0].kernel.assign(tf.fill([4, 3], float(step)))
        checkpoints.save(step)
        saved[step] = model.layers[0].kernel.numpy()
    _truncate(str(tmp_path / "checkpoints" / "ckpt-20"))  # a partial copy of the newest

    model.layers[0].kernel.assign(tf.zeros([4, 3]))
    fresh = Checkpoints(str(tmp_path), is_chief=True, model=model)
    with caplog.at_level("WARNING"):
        assert fresh.restore() == 10
    assert "ckpt-20 is damaged" in caplog.text and "ckpt-20.data-00000-of-00001" in caplog.text
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), saved[10])

    _truncate(str(tmp_path / "checkpoints" / "ckpt-10"))
    with pytest.raises(CheckpointDamagedError, match="No whole checkpoint in .*ckpt-20.*ckpt-10"):
        Checkpoints(str(tmp_path), is_chief=True, model=model).restore()


@pytest.mark.slow
def test_the_binary_resumes_past_a_damaged_checkpoint_or_stops_in_one_line(tmp_path):
    from procs import run_python

    def train(steps):
        return run_python(["-m", "tfpar.train", "--config=configs/reverse_tiny.py",
                           f"--config.train.steps={steps}", "--config.train.checkpoint_every=10",
                           "--config.train.steps_per_loop=5", "--config.train.log_every=10",
                           "--config.train.eval_batch_size=100", f"--workdir={tmp_path}"], timeout=300)

    assert train(20).returncode == 0
    _truncate(str(tmp_path / "checkpoints" / "ckpt-20"))
    resumed = train(30)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "ckpt-20 is damaged" in output and "ckpt-10" in output
    assert (tmp_path / "checkpoints" / "ckpt-30.index").exists()

    for step in (10, 20, 30):
        if (tmp_path / "checkpoints" / f"ckpt-{step}.index").exists():
            _truncate(str(tmp_path / "checkpoints" / f"ckpt-{step}"))
    stopped = train(40)
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("tfpar-train:")]
    assert stopped.returncode == 2 and len(lines) == 1 and "No whole checkpoint" in lines[0], stopped.stderr[-3000:]
