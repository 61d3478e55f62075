"""A damaged checkpoint is found before the restore touches a variable."""

import os

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
