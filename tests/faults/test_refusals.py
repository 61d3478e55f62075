"""Bad input met at start: each refused with one message that names the fix."""

import os

import keras
import pytest
import tensorflow as tf

from tfpar import config as config_lib
from tfpar.checkpoints import Checkpoints
from tfpar.data import pipeline
from tfpar.data.source import Source
from tfpar.errors import CheckpointMismatchError, DataError
from tfpar.models.gpt import GPT


def gpt(dim):
    return GPT(vocab_size=32, max_len=8, dim=dim, depth=1, heads=2)


def save(workdir, model):
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    Checkpoints(str(workdir), True, model=model, optimizer=optimizer).save(10)


def test_a_checkpoint_from_another_model_is_refused_by_name(tmp_path):
    save(tmp_path, gpt(32))
    other = Checkpoints(str(tmp_path), True, model=gpt(64), optimizer=keras.optimizers.Adam())
    with pytest.raises(CheckpointMismatchError, match=r"written by another model \(.*embeddings: \[32, 32\], now "
                                                      r"\[32, 64\].*Use a fresh --workdir"):
        other.restore()
    same = Checkpoints(str(tmp_path), True, model=gpt(32), optimizer=keras.optimizers.Adam())
    assert same.restore() == 10  # the same model (a second instance) restores


def test_a_checkpoint_without_fingerprint_still_fails_clearly(tmp_path):
    save(tmp_path, gpt(32))
    (tmp_path / "checkpoints" / "model.json").unlink()  # e.g. written before fingerprints
    other = Checkpoints(str(tmp_path), True, model=gpt(64))
    with pytest.raises(CheckpointMismatchError, match="does not restore into this model"):
        other.restore()


def test_a_dataset_smaller_than_one_global_batch_is_refused():
    tiny = Source("tiny", lambda shard, training: tf.data.Dataset.range(10), num_examples=10)
    with pytest.raises(DataError, match="tiny has 10 training examples, fewer than one global batch "
                                        "of 16.*batch_size \\(at most 10\\)"):
        pipeline.distribute_train(tf.distribute.get_strategy(), tiny, 16)


def test_nonfinite_policy_keys():
    config = config_lib.base_config()
    config.train.nonfinite = "skip"  # fit mode
    with pytest.raises(config_lib.ConfigError, match="config.train.nonfinite: skip needs tfpar's loop"):
        config_lib.validate(config)
    config.mode = "loop"
    config_lib.validate(config)
    config.train.nonfinite = "halt"
    with pytest.raises(config_lib.ConfigError, match="'halt' is not one of stop, skip, ignore"):
        config_lib.validate(config)


def test_a_full_disk_is_refused_by_name_and_the_previous_checkpoint_restores(tmp_path):
    import subprocess

    from tfpar.errors import WorkdirError

    disk = tmp_path / "small_disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:  # root without CAP_SYS_ADMIN (an unprivileged container)
        pytest.skip(f"mount -t tmpfs failed as root: {mounted.stderr.strip()}")
    try:
        model = gpt(32)
        checkpoints = Checkpoints(str(disk), True, model=model)
        checkpoints.save(10)
        with open(disk / "filler", "wb", buffering=0) as f:  # the disk fills up (logs, ...)
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        with pytest.raises(WorkdirError, match=r"Could not write checkpoint 20 to .*small_disk/checkpoints "
                                               r"\(.*\)\. Free some space or use another --workdir; the "
                                               r"previous checkpoint \(.*ckpt-10\) is intact"):
            checkpoints.save(20)
        (disk / "filler").unlink()
        assert Checkpoints(str(disk), True, model=gpt(32)).restore() == 10
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_saved_model_with_code_in_it_is_refused_by_keras_safe_mode(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Lambda(lambda x: x * 2)])
    model.save(tmp_path / "lambda.keras")
    with pytest.raises(ValueError, match="safe_mode"):
        keras.models.load_model(tmp_path / "lambda.keras")
