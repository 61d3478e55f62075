"""Keras callbacks of the training binary: progress line, TensorBoard summaries, checkpoints.

Example:
    >>> progress = Progress(total_steps=600, start_step=0, units_per_step=4096, unit="tok")
    >>> model.fit(..., callbacks=[progress, Summaries(writer, progress), Checkpointing(...)])
"""

from __future__ import annotations

import math
import sys
import time

import keras
import tensorflow as tf


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _size(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def current_learning_rate(optimizer) -> float:
    lr = optimizer.learning_rate
    value = lr(optimizer.iterations) if callable(lr) else lr
    return float(tf.convert_to_tensor(value))  # a Keras variable may hold a MirroredVariable


class Progress(keras.callbacks.Callback):
    """Every `log_every` steps: step, loss, throughput, learning rate, ETA (chief only)."""

    def __init__(self, total_steps: int, start_step: int, steps_per_epoch: int, log_every: int,
                 units_per_step: int, unit: str = "tok", verbose: bool = True, out=None,
                 wire: dict | None = None):
        super().__init__()
        self.wire = wire  # bytes per replica per step and ratio to float32 (None: no all-reduce)
        self.total_steps, self.step, self.steps_per_epoch = total_steps, start_step, steps_per_epoch
        self.log_every, self.units_per_step, self.unit = log_every, units_per_step, unit
        self.verbose, self.out = verbose, out or sys.stdout
        self.last = {}
        self.offset = 0  # steps of this epoch done before a restart (set by train.py, until epoch end)

    def on_train_begin(self, logs=None):
        self._t0, self._start = time.perf_counter(), self.step
        self._window_t, self._window_step = self._t0, self.step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = epoch * self.steps_per_epoch
        self._mean_at, self._mean = 0, 0.0   # Keras logs the loss averaged since epoch start

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the last batch index of each execution (steps_per_execution).
        self.step = self._epoch_start + batch + 1
        if self.step % self.log_every == 0 or self.step == self.total_steps:
            self.report(logs or {})

    def _window_loss(self, epoch_mean: float) -> float:
        """Mean loss of the steps since the last report, from Keras's running epoch mean."""
        done = self.step - self._epoch_start - self.offset  # the steps Keras's mean covers
        window = (epoch_mean * done - self._mean * self._mean_at) / max(done - self._mean_at, 1)
        self._mean_at, self._mean = done, epoch_mean
        return window

    def report(self, logs):
        now = time.perf_counter()
        steps = self.step - self._window_step
        rate = steps * self.units_per_step / max(now - self._window_t, 1e-9)
        per_step = (now - self._t0) / max(self.step - self._start, 1)
        eta = per_step * (self.total_steps - self.step)
        self.last = {"step": self.step, "loss": self._window_loss(float(logs.get("loss", "nan"))),
                     f"{self.unit}_per_s": rate,
                     "learning_rate": current_learning_rate(self.model.optimizer)}
        wire = ""
        if self.wire:
            per_s = self.wire["bytes_per_step"] * steps / max(now - self._window_t, 1e-9)
            self.last.update(wire_bytes_per_s=per_s, compression_ratio=self.wire["ratio"])
            wire = f" | wire {_size(per_s)}/s ({self.wire['ratio']:.0f}x)"
        self._window_t, self._window_step = now, self.step
        if self.verbose:
            width = len(str(self.total_steps))
            print(f"step {self.step:>{width}}/{self.total_steps} | loss {self.last['loss']:.4f} | "
                  f"{rate:,.0f} {self.unit}/s{wire} | lr {self.last['learning_rate']:.2e} | "
                  f"ETA {_duration(eta)}", file=self.out, flush=True)


class Summaries(keras.callbacks.Callback):
    """Writes what Progress measured to TensorBoard at each report."""

    def __init__(self, writer, progress: Progress):
        super().__init__()
        self.writer, self.progress, self._written = writer, progress, -1

    def on_train_batch_end(self, batch, logs=None):
        last = self.progress.last
        if last and last["step"] != self._written:
            with self.writer.as_default(step=last["step"]):
                tf.summary.scalar("train/loss", last["loss"])
                tf.summary.scalar("train/learning_rate", last["learning_rate"])
                tf.summary.scalar(f"train/{self.progress.unit}_per_s", last[f"{self.progress.unit}_per_s"])
                if "wire_bytes_per_s" in last:
                    tf.summary.scalar("train/wire_bytes_per_s", last["wire_bytes_per_s"])
                    tf.summary.scalar("train/compression_ratio", last["compression_ratio"])
            self._written = last["step"]

    def on_train_end(self, logs=None):
        self.writer.flush()


class StepCallback(keras.callbacks.Callback):
    """Base: knows the run's step at each batch end (epoch * steps_per_epoch + batch + 1)."""

    def __init__(self, steps_per_epoch: int):
        super().__init__()
        self.steps_per_epoch, self._epoch = steps_per_epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def step(self, batch: int) -> int:
        return self._epoch * self.steps_per_epoch + batch + 1


class StopOnNonFinite(StepCallback):
    """Keras fit: raises NonFiniteError as soon as the logged loss is NaN or Inf, before
    Checkpointing (later in the list) could save the broken state.

    Keras's own TerminateOnNaN stops quietly; this names the step and the fix.
    """

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            from tfpar.errors import NonFiniteError

            raise NonFiniteError.at(
                f"{self.step(batch)} (or one of the steps_per_loop steps before it)",
                f"the loss is {float(loss)}", "optimizer.clip_norm",
                "train with --config.mode=loop --config.train.nonfinite=skip")


class Checkpointing(keras.callbacks.Callback):
    """Saves a checkpoint at the end of every epoch (= every checkpoint_every steps)."""

    def __init__(self, checkpoints, steps_per_epoch: int, say=print):
        super().__init__()
        self.checkpoints, self.steps_per_epoch, self.say = checkpoints, steps_per_epoch, say

    def on_epoch_end(self, epoch, logs=None):
        step = (epoch + 1) * self.steps_per_epoch
        path = self.checkpoints.save(step)
        if path:
            self.say(f"checkpoint: {path}")


class Shifted(keras.callbacks.Callback):
    """Runs `callback` in a fit call that finishes an epoch begun before a restart: this
    call's epoch 0, batch b are the run's epoch `epoch`, batch `offset + b`.

    Example:
        >>> model.fit(data, epochs=1, steps_per_epoch=spe - offset,
        ...           callbacks=[Shifted(c, epoch, offset) for c in callbacks])
    """

    def __init__(self, callback: keras.callbacks.Callback, epoch: int, offset: int):
        super().__init__()
        self.callback, self.epoch, self.offset = callback, epoch, offset

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.callback.on_epoch_begin(self.epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.callback.on_train_batch_end(self.offset + batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.callback.on_epoch_end(self.epoch, logs)

    def on_train_end(self, logs=None):
        self.callback.on_train_end(logs)
