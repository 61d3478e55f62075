"""The caller's own optimizer object, once a Trainer shards it, stands for the partitioned state.

The Trainer never builds the optimizer it is given (it builds a copy on the partitions,
tfpar.zero.optimizer), so that object alone would save only its step counter. `stand_in`
makes it save and load the partitioned state in Keras's own layout, on every path a user
takes:

- `tf.train.Checkpoint(model=model, optimizer=optimizer)` (and a model whose `optimizer`
  it is): the optimizer's checkpoint children are the partitioned view's
  (tfpar.zero.checkpoint), the keys an unsharded, built Keras optimizer writes. A restore
  called before the Trainer existed (TensorFlow defers what has nowhere to go yet) lands
  when the partitioned state is made; a restore after goes straight in.
- Keras files (`model.save("x.keras")`, `save_weights`, `load_weights`): Keras calls
  `optimizer.save_own_variables(store)` / `load_own_variables(store)`; they write and
  read the list an unsharded, built optimizer writes (its counter, its rate, every slot
  whole, in `optimizer.variables` order), so the file is the unsharded run's. A slot is
  put together to be written (an `.h5` entry is one array; across workers an all-gather
  that every worker's save reaches).
- An optimizer that is built already (`keras.models.load_model` builds it and loads its
  state; or it trained before), or that an earlier Trainer sharded, hands its state over
  to the new partitions: each replica takes its chunk.
- `exclude_from_weight_decay` after the Trainer is made raises, as Keras raises once an
  optimizer is built: which variables decay is fixed in the traced step.

Example:
    >>> trainer = tfpar.Trainer(model, model.optimizer, loss, strategy=strategy, shard="optimizer")
    >>> tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(path)   # the partitions
    >>> model.save("run.keras")                                              # as unsharded
"""

from __future__ import annotations

import warnings

import keras

from tfpar.errors import ShardingError
from tfpar.strategy import private_api
from tfpar.tensor_parallel import shards
from tfpar.zero import checkpoint as zero_checkpoint

STANDS_FOR = "_tfpar_zero_state"  # the attribute that holds the partitioned state's entries


def stand_in(shard, view) -> None:
    """The caller's optimizer (`shard.optimizer`, and under fp16 the one it wraps) saves,
    restores and loads the partitioned state `view` (see module docstring)."""
    outer, base = shard.optimizer, shard.base
    private_api.hand_over_deferred(outer, view)  # before the redirection: its own children
    private_api.checkpoint_as(outer, view)
    if shard.loss_scaled:
        private_api.checkpoint_as(base, zero_checkpoint.inner_view(view, shard))
    entries = keras_variables(shard, view)
    _set(outer, STANDS_FOR, entries[outer])  # a later Trainer with this optimizer takes it over
    _set(outer, "save_own_variables", lambda store: save_own_variables(entries[outer], store))
    _set(outer, "load_own_variables", lambda store: load_own_variables(outer, entries[outer], store))
    if shard.loss_scaled:  # Keras writes the wrapped optimizer under its own path too
        _set(base, "save_own_variables", lambda store: save_own_variables(entries[base], store))
        _set(base, "load_own_variables", lambda store: load_own_variables(base, entries[base], store))
    _set(base, "exclude_from_weight_decay", _late_exclusion(base))


def _set(optimizer, name: str, function) -> None:
    object.__setattr__(optimizer, name, function)  # not tracked: Keras's __setattr__ bypassed


def keras_variables(shard, view) -> dict:
    """{optimizer object: its `variables` as a built, unsharded Keras optimizer lists them}:
    a PartitionValue for each slot made from a piece, a variable for everything else."""
    base = shard.base
    inner = list(base.variables[:shard.own_variables]) + zero_checkpoint.slots(view, shard)
    if not shard.loss_scaled:
        return {base: inner}
    outer = shard.optimizer  # its own counter (and rate), then what LossScaleOptimizer.build adds
    own = list(outer.variables)[:len(outer.variables) - len(base.variables)]  # unbuilt: counter, rate
    own = [v for v in own if v is not getattr(outer, "step_counter", None) and v is not getattr(outer, "dynamic_scale", None)]
    return {base: inner, outer: own + [shard.counter, shard.scale] + inner}


def _shape(entry) -> tuple:
    """The shape an entry is saved with: a split weight's slot (a PartitionValue, or a
    tensor-parallel optimizer's shard) whole."""
    if isinstance(entry, zero_checkpoint.PartitionValue):
        return entry.shape
    return tuple(shards.whole_shape(entry))


def _value(entry):
    if isinstance(entry, zero_checkpoint.PartitionValue):
        return entry.whole().numpy()
    return keras.ops.convert_to_numpy(entry)


def save_own_variables(entries: list, store) -> None:
    """Keras's `save_own_variables`: `store[str(i)]` for each entry, every slot whole."""
    for i, entry in enumerate(entries):
        store[str(i)] = _value(entry)


def load_own_variables(optimizer, entries: list, store) -> None:
    """Keras's `load_own_variables`: each replica takes its chunk of every slot. A store of
    another length is skipped with Keras's own warning, as Keras skips it."""
    if len(store.keys()) != len(entries):
        warnings.warn(f"Skipping variable loading for optimizer '{optimizer.name}', because it has "
                      f"{len(entries)} variables whereas the saved optimizer has {len(store.keys())} "
                      "variables. ", stacklevel=2)
        return
    for i, entry in enumerate(entries):
        _assign(entry, store[str(i)])


def _late_exclusion(optimizer):
    def refuse(var_list=None, var_names=None):
        del var_list, var_names
        raise ShardingError(
            f"{type(optimizer).__name__}.exclude_from_weight_decay() after tfpar.Trainer(shard=...) "
            "was made with it: the Trainer built this optimizer's partitions and fixed which "
            "variables decay (Keras allows it only before an optimizer is built). Call "
            "exclude_from_weight_decay before making the Trainer.")
    return refuse


def take_built_state(shard, view) -> None:
    """The state the caller's optimizer holds already goes to the new partitions (each
    replica its chunk of every slot; the counters, fp16's loss scale): an optimizer that
    is built (it trained, or keras.models.load_model built and loaded it), or one that an
    earlier Trainer sharded (it stands for that Trainer's partitions)."""
    outer, base = shard.optimizer, shard.base
    mine = keras_variables(shard, view)[outer]
    earlier = getattr(outer, STANDS_FOR, None)
    if earlier is not None:
        _check_shapes(outer, earlier, mine, "was sharded by an earlier Trainer for")
        for entry, value in zip(mine, earlier):
            _assign(entry, _value(value))
        return
    if not base.built:
        return
    inner = keras_variables(shard, view)[base]
    _check_shapes(base, list(base.variables), inner, "was built on")
    for entry, variable in zip(inner[shard.own_variables:], list(base.variables)[shard.own_variables:]):
        _assign(entry, keras.ops.convert_to_numpy(variable))
    if shard.loss_scaled and outer.built:
        shard.scale.assign(outer.dynamic_scale)
        shard.counter.assign(outer.step_counter)


def _assign(entry, value) -> None:
    if isinstance(entry, zero_checkpoint.PartitionValue):
        entry.assign_whole(value)
    else:
        entry.assign(value)


def _check_shapes(optimizer, theirs: list, mine: list, what: str) -> None:
    if [_shape(e) for e in theirs] != [_shape(e) for e in mine]:
        raise ShardingError(
            f"{type(optimizer).__name__} {what} other variables than this model's trainable "
            f"variables ({len(theirs)} optimizer variables, this Trainer needs {len(mine)}, or "
            "their shapes differ): the sharded update cannot tell which slot is whose. Give "
            "the Trainer a fresh optimizer (or one built on model.trainable_variables, in their order).")
