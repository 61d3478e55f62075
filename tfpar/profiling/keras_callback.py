"""The profile window as a Keras callback, for a `model.fit` that tfpar does not drive.

tfpar-train and `tfpar.loop.Trainer.fit(controller=...)` take the window through their
Controller (`config.train.profile_steps`), which cuts its runs so each profiled step is
one call. A plain `model.fit` gets the same marks, trace and breakdown from this callback
when each of its calls is one step (`steps_per_execution=1`).

Example:
    >>> model.fit(data, epochs=1, steps_per_epoch=50,
    ...           callbacks=[ProfileSteps(11, 14, "/tmp/run/profile/worker_0")])
    >>> callback.summary["mean"]         # {'seconds': 0.17, 'compute': 0.15, ...}
"""

from __future__ import annotations

from typing import Callable

import keras

from tfpar.profiling import report
from tfpar.profiling.trace import ProfileError
from tfpar.profiling.window import ProfileWindow


class ProfileSteps(keras.callbacks.Callback):
    """Profiles fit's steps `first`..`last` (1-based, counted over epochs) into `logdir`,
    then writes `breakdown.json` and `breakdown.png` there and says the breakdown.

    Args:
      first, last: the profiled steps, both included.
      logdir: where the trace goes (one per worker: e.g. WORKDIR/profile/worker_<i>).
      group_size: replicas in the collectives' group (for bus bandwidth; default: the
        strategy's replicas).
      say: where the breakdown's lines go (None: nowhere; `summary` still holds it).
    """

    def __init__(self, first: int, last: int, logdir: str, *, group_size: int | None = None,
                 say: Callable[[str], None] | None = print):
        super().__init__()
        self.window = ProfileWindow(first, last, logdir, on_end=self._analyse)
        self.group_size, self.say = group_size, say
        self.summary: dict | None = None
        self._step = 0

    def on_train_begin(self, logs=None):
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ProfileError(
                f"ProfileSteps marks one step per call, and this model runs {self.model.steps_per_execution} "
                "steps per call: compile with steps_per_execution=1, or train with tfpar-train "
                "(--config.train.profile_steps=START,STOP), whose runs are cut at the window.")

    def on_train_batch_begin(self, batch, logs=None):
        self.window.begin_step(self._step + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        self.window.end_step(self._step)  # every step: the one before the window starts the profiler

    def on_train_end(self, logs=None):
        self.window.close()

    def _analyse(self, window: ProfileWindow) -> None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        strategy = self.model.distribute_strategy if hasattr(self.model, "distribute_strategy") \
            else tf.distribute.get_strategy()
        group = self.group_size or strategy.num_replicas_in_sync
        self.summary = report.analyse(window, worker=0, group_size=group)
        report.write(self.summary)
        report.draw([self.summary], window.logdir + "/breakdown.png")
        for line in report.lines(self.summary) if self.say else ():
            self.say(line)
