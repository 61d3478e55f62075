"""Checkpoints that every worker takes part in and only the chief keeps.

Under a multi-worker strategy every worker must call `save` (variables may need a
collective), but only the chief writes to the real directory; the others write to a
temporary one that is removed straight away. Restore reads the newest checkpoint.

Example:
    >>> checkpoints = Checkpoints(workdir, is_chief, model=model, optimizer=optimizer)
    >>> step = checkpoints.restore()          # 0 when there is none
    >>> checkpoints.save(step)
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging


class Checkpoints:
    def __init__(self, workdir: str, is_chief: bool, max_to_keep: int = 3, **objects):
        self.is_chief = is_chief
        self.directory = os.path.join(workdir, "checkpoints")
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore(self) -> int:
        """Restores the newest checkpoint; returns its step (0 when there is none)."""
        latest = self.latest
        if latest is None:
            return 0
        self.checkpoint.restore(latest).expect_partial()
        step = int(latest.rsplit("-", 1)[-1])
        logging.info("tfpar: resumed from %s (step %d).", latest, step)
        return step

    def save(self, step: int) -> str | None:
        if self.is_chief:
            return self.manager.save(checkpoint_number=step)
        scratch = tempfile.mkdtemp(prefix="tfpar_ckpt_")
        try:
            tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(checkpoint_number=step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None
