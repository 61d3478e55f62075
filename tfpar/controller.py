"""The one outer loop: global step, progress, summaries, eval, checkpoints, preemption.

Modelled on Orbit's Controller. Whatever runs the steps (tfpar's loop, or Keras `fit`
through `tfpar.callbacks.DriveController`) asks the controller how many steps to run
next (`plan`) and tells it after each run (`after_steps`). The controller cuts
`steps_per_loop` runs short so that every interval lands on its step: with
steps_per_loop=7 and checkpoint_every=200 the runs are 7, 7, ..., 4 (to 200), 7, ...

After each run, in this order: the non-finite stop (before anything could be saved), the
progress line and its summaries, the periodic evaluation, the checkpoint (every
`checkpoint_every` steps and at the end), the preemption save (every worker agrees on the
step, saves there, exits 75).

Example:
    >>> controller = Controller(total_steps=45, steps_per_loop=7, checkpoint_every=200,
    ...                         checkpoints=checkpoints)
    >>> controller.plan()
    [7, 7, 7, 7, 7, 7, 3]
    >>> controller.run(lambda n: trainer.train_steps(iterator, n))   # saves at step 45
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterable, Iterator

from absl import logging

from tfpar.errors import NonFiniteError


def plan(start: int, total: int, steps_per_loop: int, intervals: Iterable[int] = (),
         boundaries: Iterable[int] = ()) -> list[int]:
    """Step counts of each run from `start` to `total`: at most `steps_per_loop`, cut so
    that every multiple of each interval (0 = off) and every boundary ends a run.

    Example:
        >>> plan(0, 30, 7, intervals=(200,))
        [7, 7, 7, 7, 2]
    """
    intervals = [i for i in intervals if i > 0]
    stops = {b for b in boundaries if start < b < total}
    sizes, step = [], start
    while step < total:
        nxt = min([step + steps_per_loop, total] + [(step // i + 1) * i for i in intervals]
                  + [b for b in stops if b > step])
        sizes.append(nxt - step)
        step = nxt
    return sizes


class _Window:
    """Mean loss of the steps since the last report."""

    def __init__(self):
        self.total, self.steps = 0.0, 0

    def add(self, loss: float, steps: int) -> None:
        self.total, self.steps = self.total + loss * steps, self.steps + steps

    def take(self) -> float:
        mean = self.total / self.steps if self.steps else float("nan")
        self.total, self.steps = 0.0, 0
        return mean


class Controller:
    """Owns the global step and everything that happens between runs of steps.

    Args:
      total_steps: the step the run ends at.
      steps_per_loop: the longest run of steps between two calls of `after_steps`.
      start_step: the step to start from (a restored checkpoint's).
      log_every, eval_every, checkpoint_every: intervals in steps (0 = off). The progress
        line and the checkpoint also come at the end; the final evaluation is the caller's.
      checkpoints: a tfpar.checkpoints.Checkpoints (every worker calls save; the chief keeps).
      progress: a tfpar.callbacks.ProgressLine (prints and returns the measured values).
      writer: a tf.summary writer for train/ and eval/ scalars.
      evaluate: `evaluate() -> dict` of metrics, for eval_every.
      preemption: a tfpar.preemption.PreemptionWatch (None: no preemption save).
      stop_on_nonfinite: raise NonFiniteError when a run's loss is NaN/Inf (Keras fit; the
        loop checks its gradients itself).
      say: where the controller's own lines go (checkpoint, eval): the chief's output.
      say_everywhere: where the preemption line goes, on every worker (default: say).
      profile: a tfpar.profiling.ProfileWindow: its steps run one per call, each marked
        in the trace (whatever drives the steps wraps each run in `running`).
      stragglers: a tfpar.profiling.StragglerWatch, with `own_seconds() -> float` (this
        worker's own step time so far, tfpar.loop.Trainer.own_step_seconds): at each
        report every worker's own time per step is gathered, written as per-worker scalars
        and the slowest named in the progress line when it lags.
    """

    def __init__(self, *, total_steps: int, steps_per_loop: int, start_step: int = 0,
                 log_every: int = 0, eval_every: int = 0, checkpoint_every: int = 0,
                 checkpoints=None, progress=None, writer=None,
                 evaluate: Callable[[], dict] | None = None, preemption=None,
                 stop_on_nonfinite: bool = False, say: Callable[[str], None] = logging.info,
                 say_everywhere: Callable[[str], None] | None = None, profile=None, stragglers=None,
                 own_seconds: Callable[[], float | None] | None = None):
        if steps_per_loop < 1:
            raise ValueError(f"steps_per_loop must be >= 1, got {steps_per_loop}.")
        self.total_steps, self.steps_per_loop, self.step = total_steps, steps_per_loop, start_step
        self.log_every, self.eval_every, self.checkpoint_every = log_every, eval_every, checkpoint_every
        self.checkpoints, self.progress, self.writer = checkpoints, progress, writer
        self.evaluate, self.preemption, self.say = evaluate, preemption, say
        self.say_everywhere = say_everywhere or say
        self.stop_on_nonfinite = stop_on_nonfinite
        self.saved: list[int] = []  # the steps checkpointed by this controller
        self.evaluations: dict[int, dict] = {}
        self._window = _Window()
        self._last_saved = start_step if checkpoints is not None and start_step else None
        self.profile, self.profile_collectives = profile, None  # the driver sets the collectives
        self.stragglers, self.own_seconds = stragglers, own_seconds
        self._step_seconds: list[float] = []  # each step's time (a run's mean) since the report
        self._run_started = None
        self._own_at_report = 0.0
        self._reported_step = start_step
        self.last_values: dict = {}  # the last report's values (the progress line's and these)

    # -- what to run ------------------------------------------------------------------

    def plan(self, boundaries: Iterable[int] = ()) -> list[int]:
        """Run sizes from the current step to the end (see `plan`); `boundaries`: extra
        steps that must end a run (e.g. a compression warm-up's end)."""
        if self.profile is not None:
            boundaries = (*boundaries, *self.profile.boundaries())
        return plan(self.step, self.total_steps, self.steps_per_loop,
                    (self.log_every, self.eval_every, self.checkpoint_every), boundaries)

    def settle_steps(self) -> set[int]:
        """Steps after which the state must be settled (a checkpoint or an evaluation reads
        it): asynchronous runners drain their work there."""
        return {s for s in range(self.step + 1, self.total_steps + 1)
                if self._due(s, self.checkpoint_every) or self._due(s, self.eval_every)}

    def begin(self) -> None:
        """Starts the progress clock (whatever drives the steps calls it once, first)."""
        if self.progress is not None:
            self.progress.start(self.step)

    def run(self, run_steps: Callable[[int], float], boundaries: Iterable[int] = ()) -> None:
        """Drives `run_steps(n) -> mean loss of those n steps` to the end."""
        self.begin()
        for steps in self.plan(boundaries):
            with self.running(steps):
                loss = run_steps(steps)
            self.after_steps(steps, loss)

    # -- around each run --------------------------------------------------------------

    def begin_run(self, steps: int) -> None:
        """A run of `steps` steps from `self.step` starts (the step clock; a window's mark)."""
        if self.profile is not None:
            ended = self.profile.ended
            self.profile.before_run()  # after the window's last step: the profiler stops, the analysis
            if self.profile.ended and not ended and self.progress is not None:
                self.progress.pause_ends()  # is not training
            if steps == 1:
                self.profile.begin_step(self.step + 1)
        self._run_started = time.perf_counter()

    def end_run(self, steps: int) -> None:
        """That run ended (call before `after_steps`)."""
        if self._run_started is not None:
            self._step_seconds += [(time.perf_counter() - self._run_started) / steps] * steps
            self._run_started = None
        if self.profile is not None:
            self.profile.end_step(self.step + steps)

    @contextlib.contextmanager
    def running(self, steps: int) -> Iterator[None]:
        """`begin_run` and `end_run` around a run of `steps` steps (a failed run stops a
        profile window without its analysis)."""
        self.begin_run(steps)
        try:
            yield
        except BaseException:
            if self.profile is not None:
                self.profile.abandon()
            raise
        self.end_run(steps)

    # -- after each run ---------------------------------------------------------------

    def _due(self, step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def after_steps(self, steps: int, loss: float) -> None:
        """Called after `steps` more steps whose mean loss was `loss`."""
        self.step += steps
        done = self.step >= self.total_steps
        if self.stop_on_nonfinite and not math.isfinite(loss):
            raise NonFiniteError.at(
                f"{self.step} (or one of the {steps - 1} steps before it)" if steps > 1 else str(self.step),
                f"the loss is {loss}", "optimizer.clip_norm",
                "train with --config.mode=loop --config.train.nonfinite=skip")
        self._window.add(loss, steps)
        if self._due(self.step, self.log_every) or done:
            self._report()
        if self._due(self.step, self.eval_every) and not done and self.evaluate is not None:
            self._evaluate()
        if self._due(self.step, self.checkpoint_every) or done:
            self._save()
        if not done and self.preemption is not None and self.preemption.agreed():
            self._preempted()

    def _report(self) -> None:
        loss = self._window.take()
        if self.progress is None:
            return
        notes, measured = self._step_measures()
        values = {**self.progress.report(self.step, loss, **({"notes": notes} if notes else {})), **measured}
        self.last_values = values
        if self.writer is not None:
            with self.writer.as_default(step=self.step):
                import tensorflow as tf

                for key, value in values.items():
                    if key != "step":
                        tf.summary.scalar(f"train/{key}", value)

    def _step_measures(self) -> tuple[str, dict]:
        """(progress-line notes, scalars): step-time percentiles since the last report and,
        with stragglers, every worker's own time per step and the slowest one's lag."""
        from tfpar.profiling import stragglers  # pylint: disable=import-outside-toplevel

        measured, notes = {}, ""
        times, self._step_seconds = sorted(self._step_seconds), []
        if times:
            for q in (50, 90, 99):
                measured[f"step_ms_p{q}"] = 1e3 * times[min(len(times) - 1, int(q / 100 * len(times)))]
        if self.stragglers is not None and self.own_seconds is not None:
            own = self.own_seconds() or 0.0
            steps = max(self.step - self._reported_step, 1)
            per_worker = self.stragglers.gather(1e3 * (own - self._own_at_report) / steps)
            self._own_at_report = own
            measured.update({f"worker_{i}_own_step_ms": ms for i, ms in enumerate(per_worker)})
            slow = stragglers.slowest(per_worker)
            if slow is not None:
                measured.update(straggler=slow[0], straggler_lag_ms=slow[1])
                notes = f" | straggler worker {slow[0]} +{slow[1]:,.0f} ms"
        self._reported_step = self.step
        return notes, measured

    def _evaluate(self) -> None:
        results = self.evaluate()
        self.evaluations[self.step] = results
        self.say(f"eval at step {self.step}: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()))
        if self.writer is not None:
            import tensorflow as tf

            with self.writer.as_default(step=self.step):
                for key, value in results.items():
                    if isinstance(value, (int, float)):
                        tf.summary.scalar(f"eval/{key}", value)
        if self.progress is not None:
            self.progress.pause_ends()  # evaluation time is not training throughput

    def _save(self) -> None:
        if self.checkpoints is None or self._last_saved == self.step:
            return
        path = self.checkpoints.save(self.step)
        self._last_saved = self.step
        self.saved.append(self.step)
        if path:
            self.say(f"checkpoint: {path}")
        if self.progress is not None:
            self.progress.pause_ends()

    def _preempted(self) -> None:
        from tfpar.preemption import EXIT_PREEMPTED, Preempted

        path = None
        if self.checkpoints is not None and self._last_saved != self.step:
            path = self.checkpoints.save(self.step)
            self._last_saved = self.step
            self.saved.append(self.step)
        self.say_everywhere(f"preempted: saved step {self.step}{f' to {path}' if path else ''}; exiting with "
                 f"code {EXIT_PREEMPTED} (tfpar-launch --max-restarts resumes the run).")
        raise Preempted(self.step)

    def end(self) -> None:
        """Closes a profile window still open and flushes the summaries (call once
        training is over)."""
        if self.profile is not None:
            self.profile.close()
        if self.writer is not None:
            self.writer.flush()
