"""Data: the stdlib corpus, the tasks, TFDS offline, sharding, and exact distributed eval."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfpar
from tfpar import data as data_lib
from tfpar.data import corpus, pipeline
from tfpar.data.source import Shard, Source
from tfpar.errors import DataError
from tfpar.evaluation import evaluate


def test_corpus_is_the_stdlib_split_by_file_deterministically():
    files = corpus.stdlib_files()
    assert len(files) > 300 and files == sorted(files) == corpus.stdlib_files()
    assert not any(f"{os.sep}test{os.sep}" in f or "site-packages" in f for f in files)
    train, validation = corpus.split_by_file(files)
    assert set(train).isdisjoint(validation) and len(train) + len(validation) == len(files)
    assert len(validation) == len(files[corpus.VALIDATION_EVERY // 2 :: corpus.VALIDATION_EVERY])
    splits = corpus.text_corpus(seq_len=64)
    x, y = next(iter(splits.train.build(training=False)))
    np.testing.assert_array_equal(x[1:], y[:-1])  # next-byte prediction
    assert splits.info["vocab_size"] == 256 and splits.validation.num_examples > 1000


def test_user_files_glob(tmp_path):
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 100)
    splits = data_lib.load("corpus", seq_len=16, files=str(tmp_path / "*.txt"))
    assert splits.info["files"] == 4 and splits.info["validation_files"] == 1
    with pytest.raises(DataError, match="matches 0 file"):
        data_lib.load("corpus", seq_len=16, files=str(tmp_path / "*.nothing"))


def test_reverse_and_majority_tasks():
    splits = data_lib.reverse_task(length=5, symbols=7, train_size=10, validation_size=10)
    x, y, w = (np.asarray(t) for t in next(iter(splits.validation.build(training=False))))
    prompt = x[:5]
    np.testing.assert_array_equal(y[5:], prompt[::-1])
    np.testing.assert_array_equal(w, [0] * 5 + [1] * 5)
    majority = data_lib.majority_task(length=9, symbols=3, train_size=10, validation_size=50)
    for x, label in majority.validation.build(training=False):
        counts = np.bincount(np.asarray(x)[1:] - 2, minlength=3)
        assert int(label) == int(np.argmax(counts))


def test_unknown_data_name_and_indivisible_batch_are_refused():
    with pytest.raises(DataError, match="Unknown data.name"):
        data_lib.load("imagenet")
    with pytest.raises(DataError, match="does not divide over 4 replicas.*batch_size=32"):
        data_lib.per_replica_batch_size(34, 4)


def test_file_sharding_when_every_pipeline_gets_files_else_data():
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1)
    assert pipeline.choose_shard(Source("s", None, num_files=3), context) == Shard(2, 1, True)
    assert pipeline.choose_shard(Source("s", None, num_files=1), context) == Shard(2, 1, False)
    assert pipeline.choose_shard(Source("s", None), tf.distribute.InputContext()) == Shard()


def test_resume_position_skips_exactly_the_consumed_batches():
    splits = data_lib.reverse_task(train_size=64, validation_size=8)
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    full = iter(data_lib.distribute_train(strategy, splits.train, 8))
    batches = [next(full) for _ in range(5)]
    resumed = next(iter(data_lib.distribute_train(strategy, splits.train, 8, start_step=3)))
    for a, b in zip(strategy.experimental_local_results(batches[3][0]),
                    strategy.experimental_local_results(resumed[0])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_eval_counts_every_example_exactly_once(replicas):
    """1,000 examples, global batch 96: the last batch is padded and masked."""
    x = np.arange(1000, dtype=np.int32).reshape(1000, 1)
    y = (np.arange(1000) % 3).astype(np.int32)
    source = Source("ids", lambda shard, training: tf.data.Dataset.from_tensor_slices((x, y)),
                    num_examples=1000)
    strategy = tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Rescaling(1 / 1000.0),
                                  keras.layers.Dense(3)])
        model.layers[-1].set_weights([np.array([[1.0, -2.0, 3.0]]), np.array([0.1, 0.2, -0.3])])
    dataset, steps = data_lib.distribute_eval(strategy, source, 96)
    assert steps == 11
    results = evaluate(model, strategy, dataset, steps)
    assert results["examples"] == 1000
    logits = model(x.astype(np.float32))
    expected = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    np.testing.assert_allclose(results["loss"], float(np.mean(expected)), rtol=1e-5)
    accuracy = np.mean(np.argmax(np.asarray(logits), -1) == y)
    np.testing.assert_allclose(results["accuracy"], accuracy, rtol=1e-6)


class TinyShapes(tfds.core.GeneratorBasedBuilder):
    """A 12x12 image dataset built on disk by the test: a bright square, left or right."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(12, 12, 3)),
            "label": tfds.features.ClassLabel(names=["left", "right"]),
        }))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 40), "test": self._generate_examples(1, 10)}

    def _generate_examples(self, seed, count):
        rng = np.random.RandomState(seed)
        for i in range(count):
            label = int(rng.randint(2))
            image = np.zeros((12, 12, 3), np.uint8)
            image[3:9, (1 if label == 0 else 6):(5 if label == 0 else 10)] = 255
            yield i, {"image": image, "label": label}


def test_tfds_dataset_built_on_disk_loads_through_the_user_path(tmp_path):
    TinyShapes(data_dir=str(tmp_path)).download_and_prepare()
    splits = data_lib.load("tfds:tiny_shapes", data_dir=str(tmp_path))
    assert splits.info == {"kind": "image", "image_size": 12, "channels": 3, "num_classes": 2}
    images = [(np.asarray(x), int(y)) for x, y in splits.validation.build(training=False)]
    assert len(images) == 10 and images[0][0].dtype == np.float32 and images[0][0].max() == 1.0
    halves = [list(splits.validation.build(Shard(2, i, by_file=False), training=False)) for i in (0, 1)]
    assert len(halves[0]) + len(halves[1]) == 10
    with pytest.raises(DataError, match="no dataset 'tfds:no_such_set'"):
        data_lib.load("tfds:no_such_set", data_dir=str(tmp_path))


def test_each_parameter_server_worker_starts_at_its_own_offset():
    """worker_train_fn: batches of the asked size from the endless shuffled stream, each
    worker (each call: a worker, or a restarted one) at its own offset into it."""
    splits = data_lib.load("task:reverse", seed=0)
    make = pipeline.worker_train_fn(splits.train, batch_size=8)
    first = [next(iter(make()))[0].numpy() for _ in range(3)]
    assert all(b.shape[0] == 8 for b in first)
    assert len({b.tobytes() for b in first}) > 1  # not every worker on the same batches
