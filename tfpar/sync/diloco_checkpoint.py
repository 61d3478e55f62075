"""How DiLoCo's state is checkpointed: every replica's own copy of the weights and of the
inner optimizer's state (they differ during a round), the anchor, and refusals where a
checkpoint would keep the wrong copy.

In one process each mirrored variable is written with all its copies (`keep_copies`:
`REPLICA_COPIES` beside the `VARIABLE_VALUE` every restore reads). Across worker processes
each worker writes its own replicas' copies to a file of its own (`WorkerCopies`, saved by
tfpar.checkpoints.Checkpoints), and any other writer is refused (`refuse_other_writers`).

Example:
    >>> keep_copies(model.trainable_variables[0].value)   # under a DiLoCo Trainer's strategy
    >>> tf.train.Checkpoint(anchor=Tracked(sync.anchors)).write(path)
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

import tensorflow as tf

from tfpar.errors import SyncError
from tfpar.strategy import private_api

REPLICA_COPIES = "REPLICA_COPIES"


def keep_copies(variable) -> None:
    """Checkpoint hooks that save and restore every local copy of a mirrored variable."""
    from tfpar.tensor_parallel.shards import copies  # pylint: disable=import-outside-toplevel

    local = [c for _, c in copies(variable)]
    if len(local) < 2:
        return
    host = tf.DeviceSpec.from_string(local[0].device).replace(device_type="CPU", device_index=0).to_string()

    def serialize():  # computed only when written: a restore calls this too
        return {"VARIABLE_VALUE": private_api.save_spec(lambda: local[0].read_value(), variable.dtype, host),
                REPLICA_COPIES: private_api.save_spec(lambda: tf.stack([c.read_value() for c in local]),
                                                      variable.dtype, host)}

    def restore(restored: dict):
        stacked = restored[REPLICA_COPIES]
        return tf.group([copy.assign(stacked[r]) for r, copy in enumerate(local)])

    private_api.set_checkpoint_hooks(variable, serialize, restore)


def refuse_other_writers(variable) -> None:
    """Across worker processes a DiLoCo variable differs between workers, and a checkpoint
    written by another writer than tfpar's `Checkpoints` (a user's tf.train.Checkpoint)
    would keep one worker's copy, which a restore gives to all: refused by name when it is
    written. A restore assigns every local copy, as TensorFlow's own would."""
    from tfpar.checkpoints import written_by_checkpoints  # pylint: disable=import-outside-toplevel
    from tfpar.tensor_parallel.shards import copies  # pylint: disable=import-outside-toplevel

    local = [c for _, c in copies(variable)]
    host = tf.DeviceSpec.from_string(local[0].device).replace(device_type="CPU", device_index=0).to_string()
    name = getattr(variable, "name", "a variable")

    def value():
        if not written_by_checkpoints():
            raise SyncError(
                f"DiLoCo across worker processes: {name} holds a different value on each worker, and "
                "this checkpoint would keep one worker's, which a restore gives to every worker (a "
                "different run, silently). Save with tfpar.checkpoints.Checkpoints(workdir, is_chief, "
                "model=..., optimizer=..., **trainer.checkpoint_items()), which writes each worker's own "
                "copies to its own file; to export the shared model, call Keras's model.save_weights "
                "inside `with trainer.shared_weights():`.")
        return local[0].read_value()

    def serialize():
        return {"VARIABLE_VALUE": private_api.save_spec(value, variable.dtype, host)}

    def restore(restored: dict):
        return tf.group([copy.assign(restored["VARIABLE_VALUE"]) for copy in local])

    private_api.set_checkpoint_hooks(variable, serialize, restore)


class Tracked(tf.Module):
    """Some of DiLoCo's variables (the anchor, the remainders) as one checkpointable object."""

    def __init__(self, anchors, name: str = "diloco_anchor"):
        super().__init__(name=name)
        self.variables_list = list(anchors)


class WorkerCopies(tf.__internal__.tracking.Trackable):
    """This worker's replicas' own copies of some mirrored variables (DiLoCo's weights and
    inner optimizer state across worker processes), as one checkpointable object that each
    worker writes to a file of its own: tfpar.checkpoints.Checkpoints finds it by
    `PER_WORKER` and saves it beside the chief's checkpoint, per worker, at the same step.

    Example:
        >>> copies = WorkerCopies(model.trainable_variables, strategy)
        >>> tf.train.Checkpoint(copies=copies).write("/shared/run/checkpoints/workers/worker-1/ckpt-6")
    """

    PER_WORKER = True

    def __init__(self, variables: Sequence, strategy: tf.distribute.Strategy):
        from tfpar.tensor_parallel.shards import copies  # pylint: disable=import-outside-toplevel

        self.strategy = strategy
        self._locals = [[c for _, c in copies(getattr(v, "value", v))] for v in variables]
        for variable in variables:
            refuse_other_writers(getattr(variable, "value", variable))

    def _serialize_to_tensors(self):
        return {f"copies_{i}": tf.stack([c.read_value() for c in local]) for i, local in enumerate(self._locals)}

    def _restore_from_tensors(self, restored_tensors):
        return tf.group([copy.assign(restored_tensors[f"copies_{i}"][r])
                         for i, local in enumerate(self._locals) for r, copy in enumerate(local)])


class OutsideChanges:
    """Notices DiLoCo's weights changing outside the Trainer without the anchor (a restore
    of a checkpoint that lacks `trainer.checkpoint_items()`, Keras's `load_weights`, an
    assign), which would make the next outer step's delta `anchor - weights` wrong.

    `note()` records a fingerprint of every local copy (a sum and a sum of squares each, in
    float64) where the Trainer leaves the weights; `check()` where it takes them up again:
    - unchanged, or changed by a restore that restored the anchor too: fine;
    - changed with every replica's copy equal and no step taken since the Trainer was made
      (weights loaded into a fresh Trainer): the anchor, the outer optimizer's slots and
      the remainders start over from them, as a Trainer made after the load would;
    - anything else (a DiLoCo checkpoint restored without its anchor, weights changed after
      training began): refused by name.

    Example:
        >>> watch = OutsideChanges(model.trainable_variables, sync.anchors, restart=sync.restart)
        >>> watch.note()                         # the Trainer leaves the weights
        >>> model.load_weights("pretrained.weights.h5")
        >>> watch.check(trained=False)           # a fresh Trainer: DiLoCo starts from them
    """

    def __init__(self, variables: Sequence, anchors: Sequence, restart: Callable[[], None]):
        from tfpar.tensor_parallel.shards import copies  # pylint: disable=import-outside-toplevel

        self._locals = [[c for _, c in copies(getattr(v, "value", v))] for v in variables]
        self._restart = restart
        self._seen: np.ndarray | None = None
        self.weights_restored = self.anchor_restored = False
        for anchor in anchors:
            private_api.on_restore(getattr(anchor, "value", anchor), self._anchor_restored)
        self._fingerprint = tf.function(self._fingerprint_fn)

    def weights_restored_by_checkpoint(self) -> None:
        self.weights_restored = True

    def _anchor_restored(self) -> None:
        self.anchor_restored = True

    def _fingerprint_fn(self):
        sums = []
        for local in self._locals:
            for copy in local:
                value = tf.cast(copy.read_value(), tf.float64)
                sums += [tf.reduce_sum(value), tf.reduce_sum(tf.square(value))]
        return tf.stack(sums)

    def note(self) -> None:
        self._seen = self._fingerprint().numpy()
        self.weights_restored = self.anchor_restored = False

    def check(self, trained: bool) -> None:
        if self._seen is None:
            return
        now = self._fingerprint().numpy()
        changed = not np.allclose(now, self._seen, rtol=1e-12, atol=0.0)
        if self.anchor_restored or not (changed or self.weights_restored):
            self._seen = now
            self.weights_restored = self.anchor_restored = False
            return
        equal = all(np.array_equal(local[0].numpy(), copy.numpy()) for local in self._locals for copy in local[1:])
        if not trained and not self.weights_restored and equal:
            self._restart()
            self.note()
            return
        how = ("a checkpoint restored the model's weights without DiLoCo's anchor" if self.weights_restored
               else "the model's weights changed outside the Trainer (a load_weights, set_weights or assign) "
                    "after it trained")
        raise SyncError(
            f"DiLoCo: {how}. The next outer step would take the weights' delta from the old anchor (the "
            "shared weights at the round's start): a different run, silently. Restore DiLoCo's state with "
            "them: tf.train.Checkpoint(model=..., optimizer=..., **trainer.checkpoint_items()) or "
            "tfpar.checkpoints.Checkpoints(workdir, is_chief, model=..., optimizer=..., "
            "**trainer.checkpoint_items()); or load the weights into a fresh Trainer (before its first "
            "step), which starts DiLoCo from them.")
