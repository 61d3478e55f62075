"""Turn a config into the things training needs: model, optimizer, schedule, loss, augmentation.

Example:
    >>> model = build_model(config, splits.info)
    >>> optimizer = build_optimizer(config.optimizer, total_steps=config.train.steps)
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.models import MODELS

OPTIMIZERS = ("adamw", "sgd", "lamb")


def build_model(config, data_info: dict) -> keras.Model:
    """The model family `config.model` with `config.model_args`, sized to the data."""
    cls = MODELS[config.model]
    args = dict(config.model_args)
    for key in ("vocab_size", "max_len", "num_classes", "image_size", "channels"):
        if key in data_info and key in cls.__init__.__code__.co_varnames:
            args[key] = data_info[key]
    return cls(**args)


def build_schedule(opt, total_steps: int):
    """Linear warm-up to `learning_rate`, then cosine decay to `min_lr_ratio` of it."""
    if opt.schedule == "constant":
        return opt.learning_rate
    warmup = min(opt.warmup_steps, max(total_steps - 1, 0))
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else opt.learning_rate,
        decay_steps=max(total_steps - warmup, 1),
        alpha=opt.min_lr_ratio,
        warmup_target=opt.learning_rate if warmup else None,
        warmup_steps=warmup,
    )


def build_optimizer(opt, total_steps: int) -> keras.optimizers.Optimizer:
    """AdamW, SGD with momentum, or LAMB (for the large global batches of data parallelism),
    each with decoupled weight decay and clipping by the global norm of the mean gradient."""
    lr = build_schedule(opt, total_steps)
    common = {"weight_decay": opt.weight_decay or None}
    if opt.clip_norm:
        common["global_clipnorm"] = opt.clip_norm
    betas = {"beta_1": opt.beta_1, "beta_2": opt.beta_2, "epsilon": opt.epsilon}
    if opt.name == "adamw":  # AdamW wants a float, 0.0 included
        return keras.optimizers.AdamW(lr, **betas, **{**common, "weight_decay": opt.weight_decay})
    if opt.name == "sgd":
        return keras.optimizers.SGD(lr, momentum=opt.momentum, nesterov=opt.momentum > 0, **common)
    if opt.name == "lamb":
        return keras.optimizers.Lamb(lr, **betas, **common)
    raise ValueError(f"optimizer.name={opt.name!r}: choose one of {', '.join(OPTIMIZERS)}.")


class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Sparse categorical cross-entropy from logits, with optional label smoothing."""

    def __init__(self, label_smoothing: float = 0.0, name="smoothed_sparse_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        y_pred = keras.ops.cast(y_pred, "float32")
        if not self.label_smoothing:
            return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        classes = keras.ops.shape(y_pred)[-1]
        one_hot = keras.ops.one_hot(keras.ops.cast(y_true, "int32"), classes)
        return keras.losses.categorical_crossentropy(
            one_hot, y_pred, from_logits=True, label_smoothing=self.label_smoothing)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


def image_augmentation(image_size: int, padding: int = 4, flip: bool = True, crop: bool = True):
    """ViT training augmentation: random crop (after padding) and horizontal flip."""

    def augment(image, label):
        if crop:
            image = tf.image.resize_with_crop_or_pad(image, image_size + 2 * padding, image_size + 2 * padding)
            image = tf.image.random_crop(image, [image_size, image_size, image.shape[-1]])
        if flip:
            image = tf.image.random_flip_left_right(image)
        return image, label

    return augment
