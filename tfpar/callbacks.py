"""The progress line, and Keras `fit` driving tfpar's Controller.

`ProgressLine` formats what a report measured (loss, throughput, bytes on the wire in
each phase of a compression schedule, learning rate, ETA). `keras_fit` runs `model.fit`
in the runs the Controller plans, with one adapter callback (`DriveController`), the one
place where Keras's (epoch, batch) becomes the global step.

Example:
    >>> controller = Controller(total_steps=600, steps_per_loop=10, log_every=50,
    ...                         progress=ProgressLine(600, units_per_step=4096))
    >>> keras_fit(model, controller, lambda step: distribute_train(..., start_step=step))
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

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


@dataclasses.dataclass(frozen=True)
class WirePhase:
    """What one replica hands to collectives per step from `first_step` on, until the next
    phase's first step (e.g. a float32 warm-up, then the compressed steps)."""

    name: str
    first_step: int
    bytes_per_step: int
    fp32_bytes_per_step: int

    @property
    def ratio(self) -> float:
        """Float32 bytes per byte sent."""
        return _ratio(self.fp32_bytes_per_step, self.bytes_per_step)


def _ratio(fp32_bytes: float, sent: float) -> float:
    return fp32_bytes / sent if sent else math.inf


def _times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def wire_between(phases: Sequence[WirePhase], first: int, end: int) -> tuple[int, int, list[str]]:
    """(bytes sent, float32 bytes, names of the phases) of steps `first` .. `end - 1`, each
    phase weighed by its steps there. `phases` are in step order; the first one also
    covers any step before its `first_step`."""
    sent = fp32 = 0
    names = []
    for index, phase in enumerate(phases):
        lo = phase.first_step if index else -math.inf
        hi = phases[index + 1].first_step if index + 1 < len(phases) else math.inf
        steps = max(0, int(min(end, hi) - max(first, lo)))
        if steps:
            sent, fp32 = sent + steps * phase.bytes_per_step, fp32 + steps * phase.fp32_bytes_per_step
            names.append(phase.name)
    return sent, fp32, names


def wire_start_line(phases: Sequence[WirePhase], compression: str, total_steps: int) -> str:
    """The start line: each phase with its first step, bytes per replica per step and ratio,
    and the average over the steps to `total_steps` when there are several."""
    if len(phases) == 1:
        return (f"wire: {phases[0].bytes_per_step:,} bytes per replica per step, "
                f"{phases[0].ratio:.1f}x fewer than float32 ({compression})")
    sent, fp32, _ = wire_between(phases, phases[0].first_step, total_steps)
    listed = ", ".join(f"{p.name} {p.bytes_per_step:,} B ({_times(p.ratio)}) from step {p.first_step}"
                       for p in phases)
    return f"wire: per replica per step, {listed}; run average {_times(_ratio(fp32, sent))} ({compression})"


class ProgressLine:
    """`step N/TOTAL | loss | tok/s | wire | lr | ETA`, one line per report.

    The wire part is the window's bytes per second (per replica) and its ratio to float32;
    with several phases it names the phase (`wire warmup 1.9 MB/s (1.0x)`, a window across
    a boundary `wire warmup->compressed ...`, its steps in each phase weighed); the line at
    the last step adds the run's bytes sent and average ratio (`| run 4.2 MB sent (2.4x)`).

    Args:
      total_steps: the run's last step. units_per_step, unit: throughput (e.g. 4096, "tok").
      learning_rate: `() -> float`, the current learning rate (None: not shown).
      wire: the run's `WirePhase`s in step order (None or empty: nothing all-reduced).
      say: where the line goes (None: nowhere; the values are still measured).
      round_steps: DiLoCo's H: the line names the rounds done (`round 12/60`).
      flops_per_step, peak_flops: a worker's FLOPs per step and its device's peak FLOP/s
        (tfpar.profiling.peak): the line shows MFU, the values hold `mfu`.
    """

    def __init__(self, total_steps: int, units_per_step: int = 1, unit: str = "ex",
                 learning_rate: Callable[[], float] | None = None,
                 wire: Sequence[WirePhase] | None = None,
                 say: Callable[[str], None] | None = logging.info, round_steps: int | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None):
        self.total_steps, self.units_per_step, self.unit = total_steps, units_per_step, unit
        self.round_steps = round_steps
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.learning_rate, self.wire, self.say = learning_rate, list(wire or ()), say
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

    def report(self, step: int, loss: float, notes: str = "") -> dict:
        """Measures the window since the last report; prints the line (`notes` before its
        ETA); returns the values."""
        if self._t0 is None:
            self.start(step)
        now = time.perf_counter()
        seconds, steps = max(now - self._window_t, 1e-9), step - self._window_step
        rate = steps * self.units_per_step / seconds
        per_step = (now - self._t0) / max(step - self._first, 1)
        values = {"step": step, "loss": loss, f"{self.unit}_per_s": rate}
        if self.learning_rate is not None:
            values["learning_rate"] = self.learning_rate()
        wire = self._wire(step, seconds, values) if self.wire else ""
        if self.round_steps:
            values["rounds"] = step // self.round_steps
            wire += f" | round {values['rounds']}/{self.total_steps // self.round_steps}"
        if self.flops_per_step and self.peak_flops and steps:
            values["mfu"] = self.flops_per_step * steps / seconds / self.peak_flops
            wire += f" | MFU {values['mfu']:.1%}"
        wire += notes
        self.last, self._window_t, self._window_step = values, now, step
        if self.say is not None:
            lr = f" | lr {values['learning_rate']:.2e}" if "learning_rate" in values else ""
            self.say(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | loss {loss:.4f} | "
                     f"{rate:,.0f} {self.unit}/s{wire}{lr} | "
                     f"ETA {_duration(per_step * (self.total_steps - step))}")
        return values

    def _wire(self, step: int, seconds: float, values: dict) -> str:
        """Adds the window's and the run's bytes to `values`; returns the line's wire part."""
        steps = step - self._window_step
        last = step - 1 if steps else step  # the window's last step
        phase = max(i for i, p in enumerate(self.wire) if i == 0 or p.first_step <= last)
        sent, fp32, names = wire_between(self.wire, self._window_step, step)
        ratio = _ratio(fp32, sent) if sent else self.wire[phase].ratio
        run_sent, run_fp32, _ = wire_between(self.wire, self._first, step)
        values.update(wire_bytes_per_s=sent / seconds, compression_ratio=ratio, wire_phase=phase,
                      wire_bytes_per_step=sent / max(steps, 1), wire_bytes_sent=run_sent,
                      run_compression_ratio=_ratio(run_fp32, run_sent) if run_sent else ratio)
        name = f" {'->'.join(names or [self.wire[phase].name])}" if len(self.wire) > 1 else ""
        text = f" | wire{name} {_size(values['wire_bytes_per_s'])}/s ({_times(ratio)})"
        if step >= self.total_steps:
            text += f" | run {_size(run_sent)} sent ({_times(values['run_compression_ratio'])})"
        return text


class DriveController(keras.callbacks.Callback):
    """Keras fit -> Controller: the one place (epoch, batch) becomes the global step.

    Keras reports the last batch index of each execution (`steps_per_execution` steps)
    and the loss averaged since the epoch began; this turns both into "n more steps, with
    this mean loss" for `controller.after_steps`.
    """

    def __init__(self, controller, first_step: int, steps_per_epoch: int, run_steps: int = 1):
        super().__init__()
        self.controller, self.first_step, self.steps_per_epoch = controller, first_step, steps_per_epoch
        self.run_steps = run_steps  # steps per execution: the controller's run
        self._epoch, self._done, self._mean = 0, 0, 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._done, self._mean = epoch, 0, 0.0  # Keras resets its mean here

    def on_train_batch_begin(self, batch, logs=None):
        self.controller.begin_run(self.run_steps)

    def on_train_batch_end(self, batch, logs=None):
        done, mean = batch + 1, float((logs or {}).get("loss", "nan"))
        step = self.first_step + self._epoch * self.steps_per_epoch + done
        loss = (mean * done - self._mean * self._done) / max(done - self._done, 1)
        self._done, self._mean = done, mean
        self.controller.end_run(step - self.controller.step)
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
                      callbacks=[DriveController(controller, first, size * count, size)])
    finally:
        _use_execution_size(model, compiled, functions)


def wire_phases(info, model, compression, trainer, train_data, asynchronous, start: int,
                total: int, name: str) -> list | None:
    """The phases on the wire (tfpar.callbacks.WirePhase) of the steps this run trains,
    `start` to `total` (none left: the last step's), bytes per replica per step: counted
    from the traced step of each distinct phase (loop: the traces training uses; with a
    stateful compressor that includes the 4-byte finiteness flag, `check_bytes_per_step`),
    or the compressor's analytic sizes (fit: one phase, whose step Keras traces; the loop's
    tests show that the gradients' counted bytes equal them)."""
    from tfpar.compression import accounting  # pylint: disable=import-outside-toplevel

    if asynchronous or (info.replicas == 1 and info.num_workers == 1):
        return None  # nothing is all-reduced
    if trainer is None:
        dense = accounting.fp32_bytes(model.trainable_variables)
        sent = (sum(compression.payload_bytes(model.trainable_variables).values())
                if compression is not None else dense)
        return [WirePhase(name, start, sent, dense)]

    def label(phase) -> str:  # None (one phase), "warmup", ("compressed", rank or density)
        if not isinstance(phase, tuple):
            return name if phase is None else str(phase)
        return f"{phase[0]}({', '.join(f'{p:.3g}' if isinstance(p, float) else str(p) for p in phase[1:])})"

    # One iterator for every phase: each new iterator of the data reshuffles it (a shuffle's
    # seed generator), so the data a run trains on must not depend on how many phases it has.
    aggregator, iterator, counted, phases = trainer.aggregator, iter(train_data), {}, []
    firsts = [min(start, total - 1)] + sorted(b for b in aggregator.boundaries() if start < b < total)
    for first, phase in ((first, aggregator.phase(first)) for first in firsts):
        if phase not in counted:  # one trace per distinct phase: the one its steps run
            counted[phase] = trainer.wire_bytes(iterator, step=first)
        if not phases or phases[-1].name != label(phase):
            phases.append(WirePhase(label(phase), first, counted[phase]["bytes_per_step"],
                                    counted[phase]["fp32_bytes_per_step"]))
    return phases
