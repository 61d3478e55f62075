"""Config -> optimizer, schedule, loss and augmentation."""

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from tfpar import recipes
from tfpar.config import base_config


def optimizer_config(**changes):
    config = base_config().optimizer
    config.update(changes)
    return config


@pytest.mark.parametrize("name,cls", [("adamw", keras.optimizers.AdamW), ("sgd", keras.optimizers.SGD),
                                      ("lamb", keras.optimizers.Lamb)])
def test_each_optimizer(name, cls):
    optimizer = recipes.build_optimizer(optimizer_config(name=name), total_steps=100)
    assert isinstance(optimizer, cls) and optimizer.global_clipnorm == 1.0
    if name == "sgd":
        assert optimizer.momentum == 0.9


def test_warmup_then_cosine_schedule():
    schedule = recipes.build_schedule(optimizer_config(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
    values = [float(schedule(step)) for step in (0, 5, 10, 60, 110)]
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.55, 0.1], atol=1e-6)
    assert recipes.build_schedule(optimizer_config(schedule="constant", learning_rate=0.3), 10) == 0.3


def test_label_smoothing_matches_the_dense_formula():
    logits = tf.constant([[2.0, 0.5, -1.0]])
    labels = tf.constant([0])
    smoothed = recipes.SmoothedSparseCrossentropy(0.1)(labels, logits)
    target = np.array([[0.9 + 0.1 / 3, 0.1 / 3, 0.1 / 3]])
    expected = -(target * tf.nn.log_softmax(logits)).numpy().sum()
    np.testing.assert_allclose(float(smoothed), expected, rtol=1e-6)
    plain = recipes.SmoothedSparseCrossentropy(0.0)(labels, logits)
    np.testing.assert_allclose(float(plain), -tf.nn.log_softmax(logits)[0, 0].numpy(), rtol=1e-6)
    copy = recipes.SmoothedSparseCrossentropy.from_config(recipes.SmoothedSparseCrossentropy(0.1).get_config())
    np.testing.assert_allclose(float(copy(labels, logits)), float(smoothed), rtol=1e-6)  # a saved model's loss


def test_image_augmentation_crops_and_flips():
    image = tf.reshape(tf.range(8 * 8 * 3, dtype=tf.float32), (8, 8, 3))
    flip_only = recipes.image_augmentation(8, crop=False)
    seen = {bool(tf.reduce_all(flip_only(image, 0)[0] == image)) for _ in range(20)}
    assert seen == {True, False}  # sometimes flipped, sometimes not
    cropped, label = recipes.image_augmentation(8, padding=2, flip=False)(image, 3)
    assert cropped.shape == (8, 8, 3) and label == 3


def test_model_is_sized_by_the_data():
    config = base_config()
    config.model_args = ml_collections.ConfigDict(dict(dim=16, depth=1, heads=2))
    model = recipes.build_model(config, {"vocab_size": 12, "max_len": 10, "kind": "lm"})
    assert model.config.vocab_size == 12 and model.config.max_len == 10
