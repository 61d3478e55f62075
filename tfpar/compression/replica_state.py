"""Per-replica compression state, checkpointed replica by replica.

Error-feedback residuals, DGC's velocities, PowerSGD's Q and the Adam paths' moments are
variables with one copy per replica (ON_READ). TensorFlow checkpoints such a variable as
one value (its mean over replicas), which loses what each replica owes. Here each one is
checkpointed whole: its values stacked along a new leading axis, [R, ...] in global
replica order (gathered across workers: every worker saves, so every worker reaches the
gather), and a restore under the same replica count gives every replica its own row back,
bit for bit.

Under another replica count each variable follows the rule it was created with (`rejoin`):

- SUM: the model is owed the sum over replicas (error-feedback residuals, DGC's
  accumulations and local velocities): every new replica gets total / R_new.
- MEAN: each replica's value estimates the whole and the model gets their mean (dgc_adam's
  accumulation and velocity): every new replica gets the mean.
- SAME: identical on every replica (PowerSGD's Q, Adam's m and v, counters): row 0, exact.
- THIS_COUNT: meaningful under this replica count only: another count is refused by name.

Compression checkpoints a ReplicaState (one ReplicaValue per state variable) in place of
the variables themselves; it reads a checkpoint from before (one mean per variable) by that
older rule.

Example:
    >>> residual = per_replica(tf.zeros([4]), "residual", SUM)
    >>> state = ReplicaState(compression)    # children: a ReplicaValue per state variable
    >>> state.refresh()                      # after build: a deferred restore lands now
"""

from __future__ import annotations

from typing import Callable, Iterator

import tensorflow as tf
from absl import logging

from tfpar.compression.compressors import CompressionError
from tfpar.strategy import private_api

SUM, MEAN, SAME, THIS_COUNT = "sum", "mean", "same", "this_count"
REJOIN_RULES = (SUM, MEAN, SAME, THIS_COUNT)
_RULE = "_tfpar_rejoin"  # the attribute that carries a variable's rule


def per_replica(initial: tf.Tensor, name: str, rejoin: str) -> tf.Variable:
    """A variable with one copy per replica, checkpointed per replica; `rejoin` (SUM, MEAN,
    SAME or THIS_COUNT) says what a restore under another replica count gives each replica.

    Example:
        >>> q = per_replica(tf.random.normal([64, 4]), "q", SAME)
    """
    if rejoin not in REJOIN_RULES:
        raise ValueError(f"rejoin {rejoin!r} is not one of {', '.join(REJOIN_RULES)}.")
    variable = tf.Variable(initial, trainable=False, name=name,
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.MEAN)
    setattr(variable, _RULE, rejoin)
    return variable


def _components(variable: tf.Variable) -> tuple[list[int], list[tf.Variable]]:
    """(global replica ids, this worker's copies in the same order); one copy, id 0, for a
    variable made outside a strategy."""
    if not isinstance(variable, tf.distribute.DistributedValues):
        return [0], [variable]
    ids: list[int] = []

    def note(context):  # called once per local replica, in local order
        ids.append(context.replica_id_in_sync_group)
        return tf.constant(0)

    variable.distribute_strategy.experimental_distribute_values_from_function(note)
    return ids, list(variable.values)


def components(variable: tf.Variable) -> tuple[list[int], list[tf.Variable]]:
    """(global replica ids, this worker's copies of `variable` in the same order)."""
    return _components(variable)


def stacked(variable: tf.Variable) -> tf.Tensor:
    """Every replica's value, [R, ...] in global replica order, where this worker holds
    every replica (see `gathered` for the others).

    Example:
        >>> stacked(residual).shape      # [2, 64, 64] under MirroredStrategy on 2 devices
    """
    ids, copies = _components(variable)
    by_id = dict(zip(ids, copies))
    return tf.stack([tf.convert_to_tensor(by_id[i]) for i in range(len(copies))])


def gathered(variable: tf.Variable) -> Callable[[], tf.Tensor]:
    """A function (traced once) that all-gathers every replica's value, [R, ...] in global
    replica order, across workers: a collective, so every worker must call it."""
    strategy = variable.distribute_strategy

    def gather():  # rows in the collective's rank order, put in replica order by their ids
        context = tf.distribute.get_replica_context()
        ids = context.all_gather(tf.reshape(context.replica_id_in_sync_group, [1]), axis=0)
        rows = context.all_gather(tf.convert_to_tensor(variable)[None], axis=0)  # this replica's copy
        return tf.gather(rows, tf.argsort(ids))

    return tf.function(lambda: strategy.experimental_local_results(strategy.run(gather))[0])


def _rejoined(saved: tf.Tensor, replicas: int, rule: str, name: str) -> tf.Tensor:
    """One replica's value when `saved` ([R_saved, ...]) came from another replica count."""
    if rule == SUM:
        return tf.reduce_sum(saved, 0) / replicas
    if rule == MEAN:
        return tf.reduce_mean(saved, 0)
    if rule == SAME:
        return saved[0]
    raise CompressionError(_refusal(name, saved.shape[0], replicas))


def _refusal(name: str, saved: int | None, replicas: int) -> str:
    """The refusal of count-bound state from `saved` replicas (None: not known here)."""
    written = f"with {saved} replicas" if saved is not None else "under another replica count"
    again = f"{saved} replicas" if saved is not None else "the replica count that wrote it"
    return (f"Compression state {name!r} was checkpointed {written} and means nothing under "
            f"{replicas}: resume with {again}, or restore without the compression state "
            "(Compression(..., reset_on_restore=True), --config.compression_args."
            "reset_on_restore=True) so that it starts at zero.")


class ReplicaValue(tf.__internal__.tracking.Trackable):
    """One per-replica variable in a checkpoint, as its stacked rows (see module docstring)."""

    def __init__(self, variable: tf.Variable, name: str, say: Callable[[int, int], None]):
        self.variable, self.name, self._say = variable, name, say
        self.rule, self._gather = getattr(variable, _RULE, None), None
        if self.rule is None:
            raise CompressionError(f"Compression state {name!r} was made without a restore rule: "
                                   "create it with tfpar.compression.replica_state.per_replica.")

    def _serialize_to_tensors(self) -> dict:
        """The rows, computed only when a checkpoint is written: a restore calls this too
        (to build its specs), and must neither gather (a collective every worker would have
        to reach) nor stack R copies of the state."""
        first = self.variable.values[0] if isinstance(self.variable, tf.distribute.DistributedValues) else self.variable
        host = tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
            device_type="CPU", device_index=0).to_string()
        return {"per_replica": private_api.save_spec(lambda: self._rows(host), self.variable.dtype, host)}

    def _rows(self, host: str) -> tf.Tensor:
        """Every replica's value, [R, ...] in global replica order, on this worker's host."""
        variable = self.variable
        with tf.device(host):
            if not isinstance(variable, tf.distribute.DistributedValues):
                return tf.convert_to_tensor(variable)[None]
            if len(variable.values) == variable.distribute_strategy.num_replicas_in_sync:
                return stacked(variable)  # every replica here: no collective
        if self._gather is None:
            self._gather = gathered(variable)
        return self._gather()

    def _restore_from_tensors(self, restored_tensors: dict):
        saved = restored_tensors["per_replica"]
        ids, copies = _components(self.variable)
        replicas = (self.variable.distribute_strategy.num_replicas_in_sync
                    if isinstance(self.variable, tf.distribute.DistributedValues) else 1)
        rows = saved.shape[0] if saved.shape.rank else None
        if rows is not None and rows != replicas:
            self._say(rows, replicas)
        assigned = [copy.assign(self._row(saved, index, rows, replicas)) for index, copy in zip(ids, copies)]
        return tf.group(assigned)

    def _row(self, saved: tf.Tensor, index: int, rows, replicas: int) -> tf.Tensor:
        """Replica `index`'s value: its own row when the count is the same."""
        if rows == replicas:
            return saved[index]
        if rows is not None:
            return _rejoined(saved, replicas, self.rule, self.name)
        # a traced restore (several tasks): the saved count is known only when it runs
        same = tf.equal(tf.shape(saved)[0], replicas)
        if self.rule == THIS_COUNT:
            check = tf.debugging.Assert(same, [_refusal(self.name, None, replicas)])
            with tf.control_dependencies([check]):
                return tf.identity(saved[index])
        return tf.cond(same, lambda: saved[index], lambda: _rejoined(saved, replicas, self.rule, self.name))


def _legacy_children(trackable) -> dict:
    legacy = getattr(trackable, "legacy_children", None)
    return legacy() if legacy is not None else trackable._trackable_children(save_type="checkpoint")  # pylint: disable=protected-access


def state_by_path(owner, prefix: str = "") -> Iterator[tuple[str, tf.Variable]]:
    """(path, variable) for every variable under `owner`, by its attribute path."""
    for name, child in _legacy_children(owner).items():
        path = f"{prefix}{name}"
        if isinstance(child, tf.Variable):
            yield path, child
        else:
            yield from state_by_path(child, path + "/")


class ReplicaState(tf.__internal__.tracking.Trackable):
    """The checkpoint child that holds `owner`'s per-replica variables, one ReplicaValue
    each, named by attribute path. `refresh()` after the owner builds its state: a restore
    that ran before (deferred) then lands in the new variables."""

    def __init__(self, owner):
        self._maybe_initialize_trackable()
        self._owner, self._values, self._said = owner, {}, set()

    def refresh(self) -> None:
        """Wraps variables the owner has made since; restores any deferred checkpoint values."""
        for path, variable in state_by_path(self._owner):
            known = self._values.get(path)
            if known is None or known.variable is not variable:
                self._values[path] = ReplicaValue(variable, path, self._say)
                self._handle_deferred_dependencies(path, self._values[path])

    def _say(self, saved: int, replicas: int) -> None:
        if (saved, replicas) not in self._said:
            self._said.add((saved, replicas))
            logging.warning(
                "tfpar: compression state was checkpointed with %d replicas, this run has %d: "
                "error feedback owed as a sum is split evenly (total / %d each), estimates of the "
                "whole take their mean, shared state (PowerSGD's Q, Adam's moments) restores exactly.",
                saved, replicas, replicas)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        self.refresh()
        return dict(self._values)
