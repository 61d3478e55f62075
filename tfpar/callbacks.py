"""The progress line, and Keras `fit` driving tfpar's Controller.

`ProgressLine` formats what a report measured (loss, throughput, bytes on the wire,
learning rate, ETA). `keras_fit` runs `model.fit` in the runs the Controller plans, with
one adapter callback (`DriveController`), the one place where Keras's (epoch, batch)
becomes the global step.

Example:
    >>> controller = Controller(total_steps=600, steps_per_loop=10, log_every=50,
    ...                         progress=ProgressLine(600, units_per_step=4096))
    >>> keras_fit(model, controller, lambda step: distribute_train(..., start_step=step))
"""

from __future__ import annotations

import math
import time
from typing import Callable

import keras
import tensorflow as tf
from absl import logging


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


class ProgressLine:
    """`step N/TOTAL | loss | tok/s | wire | lr | ETA`, one line per report.

    Args:
      total_steps: the run's last step. units_per_step, unit: throughput (e.g. 4096, "tok").
      learning_rate: `() -> float`, the current learning rate (None: not shown).
      wire: bytes per replica per step and ratio to float32 (None: nothing all-reduced).
      say: where the line goes (None: nowhere; the values are still measured).
    """

    def __init__(self, total_steps: int, units_per_step: int = 1, unit: str = "ex",
                 learning_rate: Callable[[], float] | None = None, wire: dict | None = None,
                 say: Callable[[str], None] | None = logging.info):
        self.total_steps, self.units_per_step, self.unit = total_steps, units_per_step, unit
        self.learning_rate, self.wire, self.say = learning_rate, wire, say
        self.last: dict = {}
        self._t0 = self._window_t = None
        self._first = self._window_step = 0

    def start(self, step: int) -> None:
        self._t0 = self._window_t = time.perf_counter()
        self._first = self._window_step = step

    def pause_ends(self) -> None:
        """What ran since the last report was not training (a save, an evaluation): the
        throughput window restarts here."""
        self._window_t = time.perf_counter()

    def report(self, step: int, loss: float) -> dict:
        """Measures the window since the last report; prints the line; returns the values."""
        if self._t0 is None:
            self.start(step)
        now = time.perf_counter()
        seconds, steps = max(now - self._window_t, 1e-9), step - self._window_step
        rate = steps * self.units_per_step / seconds
        per_step = (now - self._t0) / max(step - self._first, 1)
        values = {"step": step, "loss": loss, f"{self.unit}_per_s": rate}
        if self.learning_rate is not None:
            values["learning_rate"] = self.learning_rate()
        wire = ""
        if self.wire:
            values.update(wire_bytes_per_s=self.wire["bytes_per_step"] * steps / seconds,
                          compression_ratio=self.wire["ratio"])
            wire = f" | wire {_size(values['wire_bytes_per_s'])}/s ({self.wire['ratio']:.0f}x)"
        self.last, self._window_t, self._window_step = values, now, step
        if self.say is not None:
            lr = f" | lr {values['learning_rate']:.2e}" if "learning_rate" in values else ""
            self.say(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | loss {loss:.4f} | "
                     f"{rate:,.0f} {self.unit}/s{wire}{lr} | "
                     f"ETA {_duration(per_step * (self.total_steps - step))}")
        return values


class DriveController(keras.callbacks.Callback):
    """Keras fit -> Controller: the one place (epoch, batch) becomes the global step.

    Keras reports the last batch index of each execution (`steps_per_execution` steps)
    and the loss averaged since the epoch began; this turns both into "n more steps, with
    this mean loss" for `controller.after_steps`.
    """

    def __init__(self, controller, first_step: int, steps_per_epoch: int):
        super().__init__()
        self.controller, self.first_step, self.steps_per_epoch = controller, first_step, steps_per_epoch
        self._epoch, self._done, self._mean = 0, 0, 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._done, self._mean = epoch, 0, 0.0  # Keras resets its mean here

    def on_train_batch_end(self, batch, logs=None):
        done, mean = batch + 1, float((logs or {}).get("loss", "nan"))
        step = self.first_step + self._epoch * self.steps_per_epoch + done
        loss = (mean * done - self._mean * self._done) / max(done - self._done, 1)
        self._done, self._mean = done, mean
        self.controller.after_steps(step - self.controller.step, loss)


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """[7, 7, 4, 7] -> [(7, 2), (4, 1), (7, 1)]: consecutive runs of equal size."""
    runs: list[tuple[int, int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1] = (size, runs[-1][1] + 1)
        else:
            runs.append((size, 1))
    return runs


def _use_execution_size(model: keras.Model, size: int, functions: dict) -> None:
    """Sets Keras's steps_per_execution to `size`, keeping one traced train function per
    size (Keras traces its loop for a fixed number of steps; `fit` reuses a set one)."""
    if model.steps_per_execution == size:
        return
    functions[model.steps_per_execution] = model.train_function
    model.steps_per_execution = size
    model.train_function = functions.get(size)


def keras_fit(model: keras.Model, controller, dataset_at: Callable[[int], object]) -> None:
    """Trains with `model.fit` from `controller.step` to the end, in the controller's runs.

    Every stretch of equal-sized runs is one `fit` call of one epoch whose execution is
    that size; `dataset_at(step)` gives the data from that step on (exact resume).
    """
    functions: dict = {}
    compiled = model.steps_per_execution
    controller.begin()
    try:
        for size, count in _runs(controller.plan()):
            _use_execution_size(model, size, functions)
            first = controller.step
            model.fit(dataset_at(first), epochs=1, steps_per_epoch=size * count, verbose=0, shuffle=False,
                      callbacks=[DriveController(controller, first, size * count)])
    finally:
        _use_execution_size(model, compiled, functions)
