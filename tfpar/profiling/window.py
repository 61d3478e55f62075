"""Profile a window of steps: TensorFlow's profiler on for steps FIRST..LAST, each step
marked, and the breakdown read back from the trace when the window ends.

Every worker profiles itself into its own logdir (`WORKDIR/profile/worker_<i>`): one
profiler session per process, and workers on one host would otherwise overwrite each
other's `<hostname>.xplane.pb`. `tensorboard --logdir WORKDIR` shows them all in its
Profile tab (the `[profile]` extra installs the plugin). Off by default, and nothing of it
runs when off: no region, no profiler call, no change to the traced step (the marks are
host-side regions around each call).

Inside the window each step is its own call (the controller cuts its runs there), so the
trace has one mark per step; the run before the window is cut too, so that Keras fit
traces its one-step function before the profiler starts. The profiler starts as the step
before the window ends, so each profiled step's period on the host clock (from the end of
the call before to the end of its own) holds its call and what runs between calls, and no
profiler start: the breakdown's check (its parts against that period) is independent of
the marks it is cut at.

Example:
    >>> window = ProfileWindow(11, 14, "/tmp/run/profile/worker_0")
    >>> Controller(..., profile=window)          # or keras fit: callbacks=[ProfileSteps(...)]
"""

from __future__ import annotations

import os
import time
from typing import Callable

from tfpar.errors import ConfigError


def parse_steps(text: str) -> tuple[int, int] | None:
    """`"11,14"` -> (11, 14); `""` -> None (off). Raises ConfigError naming the key.

    Example:
        >>> parse_steps("11,14"), parse_steps("")
        ((11, 14), None)
    """
    if not text:
        return None
    try:
        first, last = (int(part) for part in str(text).split(","))
    except ValueError:
        raise ConfigError(f"config.train.profile_steps: {text!r} is not START,STOP (two step numbers, "
                          "e.g. --config.train.profile_steps=11,14).") from None
    if not 1 <= first <= last:
        raise ConfigError(f"config.train.profile_steps: {text!r} must have 1 <= START <= STOP "
                          "(the steps as the progress line numbers them, both profiled).")
    return first, last


class ProfileWindow:
    """Steps `first`..`last` (1-based, as the progress line counts them, both included)
    profiled into `logdir`; `on_end(window)` runs once the trace is written.

    Args:
      first, last: the profiled steps.
      logdir: this worker's profile directory.
      on_end: called with the window after the profiler stopped (every worker: it may run
        collectives, like the all-reduce measured beside the traced one).
      host_tracer_level: TensorFlow's (2: ops and regions; 3: also their shapes).
    """

    def __init__(self, first: int, last: int, logdir: str, *,
                 on_end: Callable[["ProfileWindow"], None] | None = None, host_tracer_level: int = 2):
        if not 1 <= first <= last:
            raise ConfigError(f"profile steps {first}..{last}: need 1 <= first <= last.")
        self.first, self.last, self.logdir = first, last, logdir
        self.on_end, self.host_tracer_level = on_end, host_tracer_level
        self.host_seconds: dict[int, float] = {}  # step -> its period on the host clock
        self.active = self.ended = False
        self._region = None
        self._last_end: float | None = None  # when the call before ended (host clock)
        self._stop_pending = False  # the last step ended: stop as the next run begins
        self.profiler_seconds = 0.0  # starting and stopping (writing) the profiler

    def boundaries(self) -> range:
        """Steps that must end a run: the step before the window runs alone (Keras traces its
        one-step function there), and each step in it."""
        return range(max(self.first - 2, 1), self.last + 1)

    def contains(self, step: int) -> bool:
        return self.first <= step <= self.last

    def _start(self) -> None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        started = time.perf_counter()
        os.makedirs(self.logdir, exist_ok=True)
        tf.profiler.experimental.start(self.logdir, tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=self.host_tracer_level, python_tracer_level=0, device_tracer_level=1))
        self.active = True
        self.profiler_seconds += time.perf_counter() - started

    def before_run(self) -> None:
        """Before any run: stops the profiler after the window's last step. Not at that
        step's end: the collective threads record their last events just after the call
        returns, and a stop there loses them (the last step's loss sum, now and then)."""
        if self._stop_pending:
            self._stop_pending = False
            self._stop()

    def begin_step(self, step: int) -> None:
        """Before step `step` runs (its call holds that one step inside the window)."""
        self.before_run()
        if not self.contains(step) or self.ended:
            return
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        if not self.active:  # the window starts the run: no step ended before it here
            self._start()
            self._last_end = None
        self._region = tf.profiler.experimental.Trace("train", step_num=step, _r=1)
        self._region.__enter__()

    def end_step(self, step: int) -> None:
        """After step `step` ran (call it for every step, in or out of the window): the one
        before the window starts the profiler, the last one stops it and calls on_end."""
        if self.ended or self._stop_pending:
            return
        if self._region is not None:
            self._region.__exit__(None, None, None)
            self._region = None
            now = time.perf_counter()
            if self._last_end is not None:
                self.host_seconds[step] = now - self._last_end
            if step >= self.last:
                self._stop_pending = True
                return
        elif step + 1 == self.first and not self.active:
            self._start()
        self._last_end = time.perf_counter()

    def _stop(self) -> None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        started = time.perf_counter()
        tf.profiler.experimental.stop()
        self.active, self.ended = False, True
        self.profiler_seconds += time.perf_counter() - started
        if self.on_end is not None:
            self.on_end(self)

    def close(self) -> None:
        """The run ended (after its window, or inside it): stop the profiler."""
        if self._stop_pending:
            self.before_run()
        elif self.active:
            if self._region is not None:
                self._region.__exit__(None, None, None)
                self._region = None
            self._stop()

    def abandon(self) -> None:
        """A step failed: stop the profiler (its trace is written) without the analysis,
        whose collectives the other workers would not join."""
        self._stop_pending = False
        if self.active:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel

            if self._region is not None:
                self._region.__exit__(None, None, None)
                self._region = None
            tf.profiler.experimental.stop()
            self.active, self.ended = False, True
