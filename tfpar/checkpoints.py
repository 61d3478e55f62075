"""Checkpoints that every worker takes part in and only the chief keeps.

Under a multi-worker strategy every worker must call `save` (variables may need a
collective), but only the chief writes to the real directory; the others write to a
temporary one that is removed straight away. Restore reads the newest checkpoint, after
checking that it was written by the same model: the chief writes the model's fingerprint
(class, every variable's path and shape) to checkpoints/model.json beside the first
checkpoint, and a checkpoint from another model or config is refused by name
(CheckpointMismatchError), not half-restored.

State that differs between worker processes (DiLoCo's replicas' own copies of the weights
and of the inner optimizer's state, tfpar.sync.diloco_checkpoint.WorkerCopies) is written by each
worker to its own file, `checkpoints/workers/<task>/ckpt-<step>`, before the chief's
checkpoint of that step (`PerWorker`), and read back by each worker when it is restored.

A ZeRO run (tfpar.zero) under a multi-worker strategy is saved one partition per worker:
each worker writes its replicas' slices of the optimizer state to its own file in the
checkpoint directory (which every worker must see), and the chief's checkpoint merges them
in (tfpar.zero.files); a restore reads only this worker's slices.

Example:
    >>> checkpoints = Checkpoints(workdir, is_chief, model=model, optimizer=optimizer)
    >>> step = checkpoints.restore()          # 0 when there is none
    >>> checkpoints.save(step)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading

import tensorflow as tf
from absl import logging

from tfpar import checkpoint_integrity
from tfpar.errors import CheckpointDamagedError, CheckpointMismatchError, WorkdirError
from tfpar.strategy.replicas import count_failed_workers
from tfpar.tensor_parallel.shards import whole_shape
from tfpar.zero import checkpoint as zero_checkpoint
from tfpar.zero import files as zero_files


def fingerprint(model) -> dict:
    """What must match for a checkpoint to restore into `model`: its class and the shape of
    every weight, in order (paths are kept for messages only: Keras numbers unnamed layers
    per process, so they are not compared). A tensor-parallel weight counts with its whole
    shape, as it is saved: a checkpoint restores into the model split any number of ways."""
    return {"class": type(model).__name__,
            "weights": [[v.path, [int(d) for d in whole_shape(v)]] for v in model.weights]}


def _differences(saved: dict, current: dict, limit: int = 3) -> list[str]:
    found = []
    if saved.get("class") != current["class"]:
        found.append(f"model {saved.get('class')}, now {current['class']}")
    old, new = saved.get("weights", []), current["weights"]
    if len(old) != len(new):
        found.append(f"{len(old)} weights, now {len(new)}")
    for (_, old_shape), (path, new_shape) in zip(old, new):
        if old_shape != new_shape:
            found.append(f"{path}: {old_shape}, now {new_shape}")
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


class Checkpoints:
    def __init__(self, workdir: str, is_chief: bool, max_to_keep: int = 3, **objects):
        self.is_chief = is_chief
        self.directory = os.path.join(workdir, "checkpoints")
        self.fingerprint = None
        if "model" in objects:
            self.fingerprint = fingerprint(objects["model"])
            # Keras 3 on TensorFlow gives tf.train.Checkpoint only the layers held directly in
            # attributes: layers in lists (a StagedModel's blocks, a Sequential's layers) are
            # left out, and were saved only through the optimizer's slot references, so
            # non-trainable state was lost. Every weight is named here, in model order.
            objects["model_weights"] = tf.train.Checkpoint(
                **{f"w{i}": v.value for i, v in enumerate(objects["model"].weights)})
        # state that differs between workers (DiLoCo's copies): one file per worker
        self.per_worker = PerWorker.find(objects, self.directory)
        # a ZeRO run across workers: each worker writes its own partitions (tfpar.zero.files)
        self.partitions = zero_files.WorkerPartitions.find(objects)
        if self.partitions is not None:
            objects["zero_partitions"] = self.partitions
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep)
        self.max_to_keep = max_to_keep
        self._fingerprint_path = os.path.join(self.directory, "model.json")
        self.restored: str | None = None  # the checkpoint `restore` read

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore(self) -> int:
        """Restores the newest whole checkpoint; returns its step (0 when there is none).

        A damaged checkpoint (a missing index or shard, a truncated or corrupted data file)
        is named in a warning and skipped for the next older one; when none is whole the run
        stops with CheckpointDamagedError instead of training from scratch over them.
        """
        latest = self.restored = self._newest_intact()
        if latest is None:
            return 0
        self._check_fingerprint(latest)
        try:
            with self._reading():
                self.checkpoint.restore(latest).expect_partial()
        except (ValueError, tf.errors.OpError) as e:  # e.g. a shape that changed
            raise CheckpointMismatchError(
                f"{latest} does not restore into this model ({str(e).splitlines()[0][:200]}). "
                "Use a fresh --workdir, or the config that wrote it.") from None
        step = int(latest.rsplit("-", 1)[-1])
        if self.per_worker is not None:
            self.per_worker.restore(step)
        logging.info("tfpar: resumed from %s (step %d).", latest, step)
        return step

    def _newest_intact(self) -> str | None:
        listed = list(reversed(self.manager.checkpoints))  # newest first
        chosen, damaged = checkpoint_integrity.newest_intact(listed)
        for prefix, problems in damaged.items():
            logging.warning("tfpar: checkpoint %s is damaged (%s); trying an older one.",
                            prefix, "; ".join(problems))
        if chosen is None and damaged:
            raise CheckpointDamagedError(
                f"No whole checkpoint in {self.directory}: " + "; ".join(
                    f"{os.path.basename(p)}: {'; '.join(found)}" for p, found in damaged.items())
                + ". Copy the checkpoints again from where they were written, or move the "
                "directory away to start from step 0.")
        return chosen

    def _check_fingerprint(self, latest: str) -> None:
        if self.fingerprint is None or not os.path.exists(self._fingerprint_path):
            return
        with open(self._fingerprint_path, encoding="utf-8") as f:
            saved = json.load(f)
        differences = _differences(saved, self.fingerprint)
        if differences:
            raise CheckpointMismatchError(
                f"{latest} was written by another model ({'; '.join(differences)}). Use a fresh "
                "--workdir for this model, or the config that wrote the checkpoint.")

    def save(self, step: int) -> str | None:
        """Writes checkpoint `step` (the chief keeps it); a full or read-only disk raises
        WorkdirError naming the directory, and leaves the previous checkpoint as it was."""
        try:
            return self._save(step)
        except WorkdirError:  # named already (a worker's partitions, an unshared workdir)
            raise
        except (OSError, tf.errors.OpError) as e:
            reason = getattr(e, "strerror", None) or str(getattr(e, "message", e)).splitlines()[0][:200]
            raise WorkdirError(
                f"Could not write checkpoint {step} to {self.directory} ({reason}). Free some space "
                f"or use another --workdir; the previous checkpoint ({self.latest}) is intact, and "
                "the run resumes from it.") from None

    def _reading(self):
        """A restore reads only this worker's partitions (tfpar.zero.checkpoint LOCAL)."""
        if self.partitions is None:
            return contextlib.nullcontext()
        return zero_checkpoint.saving(zero_checkpoint.LOCAL)

    def _save(self, step: int) -> str | None:
        with _writing():
            return self._save_all(step)

    def _save_all(self, step: int) -> str | None:
        if self.per_worker is not None:  # every worker its own file first; the chief's checkpoint
            self.per_worker.save(step, self.max_to_keep)  # names a step all files exist for
        if self.partitions is not None:  # every worker its partitions, then the chief merges
            return self.partitions.save(self.checkpoint, self.directory, step, self.is_chief,
                                        lambda: self._save_checkpoint(step))
        return self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> str | None:
        """The chief writes checkpoint `step`; the others write a scratch one, removed."""
        if self.is_chief:
            path = self.manager.save(checkpoint_number=step)
            if self.fingerprint is not None and not os.path.exists(self._fingerprint_path):
                with open(self._fingerprint_path + ".tmp", "w", encoding="utf-8") as f:
                    json.dump(self.fingerprint, f)
                os.replace(self._fingerprint_path + ".tmp", self._fingerprint_path)
            return path
        scratch = tempfile.mkdtemp(prefix="tfpar_ckpt_")
        try:
            tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(checkpoint_number=step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None


_WRITING = threading.local()


@contextlib.contextmanager
def _writing():
    _WRITING.depth = getattr(_WRITING, "depth", 0) + 1
    try:
        yield
    finally:
        _WRITING.depth -= 1


def written_by_checkpoints() -> bool:
    """Whether tfpar's `Checkpoints` is writing a checkpoint in this thread now (state that
    differs between workers is then written to each worker's own file, `PerWorker`); a
    variable whose value differs between workers refuses other writers by it."""
    return getattr(_WRITING, "depth", 0) > 0


class PerWorker:
    """Checkpoint objects whose values differ between worker processes (marked
    `PER_WORKER`, e.g. tfpar.sync.diloco_checkpoint.WorkerCopies): every worker writes them to its own
    file, `<checkpoints>/workers/<task>/ckpt-<step>`, before the chief's checkpoint of that
    step exists, and reads its own back when that checkpoint is restored. The workdir must
    be one every worker sees, or each worker's own at the same path.

    Example:
        >>> per_worker = PerWorker.find(objects, directory)   # takes them out of `objects`
        >>> per_worker.save(6); per_worker.restore(6)
    """

    def __init__(self, objects: dict, directory: str, strategy):
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.strategy = strategy
        resolver = strategy.cluster_resolver
        self.task = f"{resolver.task_type}-{resolver.task_id}"
        self.directory = os.path.join(directory, "workers", self.task)

    @classmethod
    def find(cls, objects: dict, directory: str) -> "PerWorker | None":
        mine = {k: objects.pop(k) for k in [k for k, v in objects.items() if getattr(v, "PER_WORKER", False)]}
        if not mine:
            return None
        return cls(mine, directory, next(iter(mine.values())).strategy)

    def prefix(self, step: int) -> str:
        return os.path.join(self.directory, f"ckpt-{step}")

    def save(self, step: int, keep: int) -> None:
        """This worker's file of `step`, then a barrier: no checkpoint of `step` is written
        unless every worker's file is (WorkdirError names the worker otherwise). Keeps this
        worker's newest `keep` + 1 files (the manager keeps `keep` checkpoints; one more in
        case the chief's save of `step` fails)."""
        failure = None
        try:
            tf.io.gfile.makedirs(self.directory)
            self.checkpoint.write(self.prefix(step))
        except (OSError, tf.errors.OpError) as e:
            failure = getattr(e, "strerror", None) or str(getattr(e, "message", e)).splitlines()[0][:200]
        failed = count_failed_workers(self.strategy, failure is not None)
        if failure is not None:
            raise WorkdirError(f"Could not write this worker's ({self.task}) own state of checkpoint {step} "
                               f"to {self.prefix(step)} ({failure}). Free some space or use another "
                               "--workdir; the previous checkpoint is intact.")
        if failed:
            raise WorkdirError(f"{failed} worker(s) could not write their own state of checkpoint {step} "
                               "(their own error names why); nothing was saved, the previous checkpoint "
                               "is intact.")
        self._keep_newest(keep + 1)

    def restore(self, step: int) -> None:
        prefix = self.prefix(step)
        if not tf.io.gfile.exists(prefix + ".index"):
            raise CheckpointDamagedError(
                f"Checkpoint {step} needs this worker's ({self.task}) own state, {prefix}, which is "
                "missing: each worker reads its own file from the same --workdir path. Give this "
                "worker the workdir it wrote, or move the checkpoints away to start from step 0.")
        self.checkpoint.read(prefix).assert_consumed()

    def _keep_newest(self, count: int) -> None:
        names = tf.io.gfile.listdir(self.directory)
        steps = sorted({int(n.split(".", 1)[0][5:]) for n in names
                        if n.startswith("ckpt-") and n.split(".", 1)[0][5:].isdigit()})
        old = set(steps[:-count])
        for name in names:
            stem = name.split(".", 1)[0]
            if stem.startswith("ckpt-") and stem[5:].isdigit() and int(stem[5:]) in old:
                tf.io.gfile.remove(os.path.join(self.directory, name))
