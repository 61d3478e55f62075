"""Every touch of a private Keras or TensorFlow name in tfpar, each with its reason.

Keras 3 and TensorFlow offer no public way to do a few things tfpar needs (keep Keras's
optimizer from all-reducing gradients a second time, update a sharded variable, mend
Keras's TensorFlow trainer). Each such touch lives here, so that a new release breaks one
module, and each says why it exists. What a touch changes on a caller's object is undone
when tfpar is done with it (see `trainer_step`).

Touches:

- `TFOptimizer._all_reduce_sum_gradients` (Keras): the optimizer's own cross-replica sum
  inside `apply`. tfpar's loop has summed the gradients already (its aggregator: one
  all-reduce, or compression), so it is an identity while tfpar traces its step;
  `keras_fixes` wraps it to sum a sparse gradient's repeated rows after the all-reduce.
- `TFOptimizer._distributed_tf_update_step` (Keras): the update under a strategy goes
  through `strategy.extended.update`, which fails on a ShardedVariable (parameter-server
  variable partitioning); replaced while tfpar traces its step (`sharded_updates`).
- `TFOptimizer._backend_apply_gradients` (Keras): clip, weight decay, accumulation, EMA and
  update; tfpar.strategy.optimizer_update runs the all-reduce before it (a Keras fix).
- `BaseOptimizer._learning_rate`, `_exclude_from_weight_decay(_pattern)` (Keras): what an
  optimizer-carrying compressor copies from the user's Adam or SGD into the plain SGD that
  applies its step (`learning_rate_of`, `copy_weight_decay_exclusions`).
- `LossScaleOptimizer.inner_optimizer` (public attribute, no public "unwrap"): every touch
  above applies to the wrapper and to the optimizer it wraps (`optimizers_of`).
- `keras.src.backend.tensorflow.trainer` and `...optimizer` (Keras private modules): the
  targets of `tfpar.strategy.keras_fixes` (`trainer_module`, `optimizer_class`).
- `tensorflow.python.distribute.sharded_variable.ShardedVariable`: no public type to test
  a variable against (`is_sharded`).
- `tf.__internal__.tracking.Trackable`'s hooks `_serialize_to_tensors`,
  `_restore_from_tensors`, `_trackable_children`, `_lookup_dependency` and
  `_handle_deferred_dependencies` (TensorFlow's documented way to shape what a checkpoint
  holds; no public one): compression state is checkpointed replica by replica
  (`tfpar.compression.replica_state`, `Compression`).
- `CollectiveReplicaLauncher._all_gather`, `_next_instance_key`, `_get_ordering_token`,
  `_device`, `_options` and `gen_collective_ops.collective_reduce_scatter_v2` (TensorFlow):
  tf.distribute offers all_reduce and all_gather only (merge_calls, refused inside a
  `tf.cond` branch). tfpar.strategy.groups, the one owner of group collectives (ZeRO's
  partitions, tensor parallelism's groups, compression's all-to-all), gathers equal-sized
  tensors without the shape exchange `all_gather` adds, issues an all-to-all, and
  reduce-scatters with NCCL on GPUs, keyed and ordered like the launcher's own collectives
  (`launcher_all_gather_same_shape`, `launcher_all_to_all`, `launcher_reduce_scatter`;
  `launcher_all_reduce`, `launcher_batch_all_reduce`, `launcher_all_gather` call its
  public methods, callable inside a branch).
- `extended._collective_ops._launchers` / `extended._cross_device_ops._launchers`
  (TensorFlow): a strategy's own CollectiveReplicaLauncher per local replica, so a group
  collective over every replica joins the strategy's own group in the same order
  (`strategy_launchers`, `collective_launcher`).
- `DistributedVariable._get_on_device_or_primary` (TensorFlow): the copy of a mirrored
  variable on this replica's device. The sharded update writes the all-gathered weights,
  identical on every replica, into each replica's own copy from the replica context (inside
  a `tf.cond` where a merge_call cannot go): `local_component`.
- `cross_device_utils.CollectiveKeys` and `CollectiveReplicaLauncher` (TensorFlow): a
  strategy has one collective group (all its replicas); tensor parallelism needs groups of
  some of them (a tensor-parallel group, a data-parallel group; ZeRO partitions over the
  latter). TensorFlow's own launcher over a device subset, with its own group keys, issues
  the same CollectiveReduceV2 and CollectiveGatherV2 (instance keys assigned at call time,
  an ordering token per device): `group_launchers` (tfpar.strategy.groups.subsets). The
  strategy's communication options (`extended._communication_options`: the collective
  timeout) go with them.
- A MirroredVariable's `_serialize_to_tensors` / `_restore_from_tensors`, set on the
  instance (TensorFlow's checkpoint hooks; `trackable_has_serialize_to_tensor` reads the
  instance first): a tensor-parallel shard, whose copies differ on purpose, is checkpointed
  as its whole (unsplit) value and restored split (`set_checkpoint_hooks`).
- `keras.layers.Layer.add_weight`, replaced for the duration of a tensor-parallel build
  (`add_weight_replaced`), `keras.src.backend.common.name_scope.current_path`
  (`weight_path`): a layer's weight is created split at the one place Keras creates it,
  by its path, the way keras.distribution does on JAX (`Variable._initialize`); a split
  weight's Keras variable gets a subclass of its own class that reads and writes the whole
  value (`set_instance_class`), and an optimizer's slots are matched to the weight they
  were made from by recording `add_variable_from_reference` while it builds
  (`slots_by_reference`). MultiHeadAttention's `_dropout_layer` (`attention_dropout`):
  inside the split region it draws per rank.
- `tensorflow.python.training.saving.saveable_object.SaveSpec` with a callable: what a
  `_serialize_to_tensors` returns so that a value is computed only when a checkpoint is
  written (a restore builds the same specs and must not run a collective): `save_spec`.
- `RemoteValueImpl._error` (TensorFlow's ClusterCoordinator): a scheduled function's
  result is marked ready before it is copied to the chief, so a worker killed in between
  makes the chief's `fetch()` fail although the coordinator runs the function again
  elsewhere. A failed copy leaves `_error` unset; a failed function sets it
  (`remote_value_failed`, tfpar.loop.parameter_server).
- ZeRO's checkpoint and Keras-file touches (Keras's weight-decay decision, TensorFlow's
  checkpoint hooks on the caller's optimizer, sliced saveables, a per-worker write, a
  registered merge): listed with their reasons in the section at the end of this module.

Example:
    >>> with private_api.trainer_step(optimizer):   # while tracing tfpar's step
    ...     optimizer.apply(summed, variables)       # no second all-reduce, no Keras clip
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import keras

from tfpar.errors import TfparError

ALL_REDUCE = "_all_reduce_sum_gradients"
UPDATE_STEP = "_distributed_tf_update_step"
_MISSING = object()


class KerasFixError(TfparError, RuntimeError):
    """A private Keras/TensorFlow name tfpar relies on is missing or has changed."""


def trainer_module():
    """Keras's TensorFlow trainer module (`keras.src.backend.tensorflow.trainer`)."""
    from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel

    return trainer


def optimizer_class():
    """Keras's TensorFlow optimizer base class (`TFOptimizer`)."""
    from keras.src.backend.tensorflow import optimizer  # pylint: disable=import-outside-toplevel

    return optimizer.TFOptimizer


def optimizers_of(optimizer: keras.optimizers.Optimizer) -> list:
    """The optimizer, and the one it wraps if it is a LossScaleOptimizer (fp16)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]


def base_optimizer(optimizer: keras.optimizers.Optimizer):
    """The optimizer that holds the hyper-parameters (clipping): the wrapped one under fp16."""
    return optimizers_of(optimizer)[-1]


def is_loss_scaled(optimizer: keras.optimizers.Optimizer) -> bool:
    return len(optimizers_of(optimizer)) > 1


def is_sharded(variable) -> bool:
    """Whether `variable` is split over parameter servers (a ShardedVariable)."""
    from tensorflow.python.distribute import sharded_variable  # pylint: disable=import-outside-toplevel

    return isinstance(variable, sharded_variable.ShardedVariable)


def strategy_of_optimizer(optimizer: keras.optimizers.Optimizer):
    """The tf.distribute strategy a Keras TensorFlow optimizer was made under
    (`_distribution_strategy`: it creates its slots there, and fails deep inside `build`
    under another strategy's scope), or None for a Keras without the attribute."""
    return getattr(base_optimizer(optimizer), "_distribution_strategy", None)


def check_optimizer(optimizer: keras.optimizers.Optimizer, sharded_updates: bool = False) -> None:
    """Raises KerasFixError if this Keras's optimizer lacks what `trainer_step` replaces."""
    names = (ALL_REDUCE, UPDATE_STEP) if sharded_updates else (ALL_REDUCE,)
    for target in optimizers_of(optimizer):
        for name in names:
            if not callable(getattr(target, name, None)):
                raise KerasFixError(
                    f"{type(target).__name__} of Keras {keras.__version__} has no {name}; "
                    "tfpar.Trainer cannot keep it from reducing the gradients twice. Use a Keras "
                    "release in setup.py's range, or train with Keras fit.")


def _identity_reduce(grads_and_vars):
    return list(grads_and_vars)


def _sharded_update(target):
    """`_distributed_tf_update_step` that updates a ShardedVariable directly: the update
    reads its whole value and `ShardedVariable.assign*` writes each slice to its server."""

    def update(distribution, grads_and_vars, learning_rate):
        for grad, var in grads_and_vars:
            if is_sharded(var):
                target.update_step(grad, var, learning_rate)
            else:
                distribution.extended.update(
                    var, lambda v, g, lr: target.update_step(g, v, lr),
                    args=(grad, learning_rate), group=False)

    return update


@contextlib.contextmanager
def optimizer_attribute(target, name: str, value) -> Iterator[None]:
    """Sets `target.name` within the block; restores the instance's own value after."""
    saved = vars(target).get(name, _MISSING)
    setattr(target, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(target, name)
        else:
            setattr(target, name, saved)


@contextlib.contextmanager
def trainer_step(optimizer: keras.optimizers.Optimizer, sharded_updates: bool = False) -> Iterator[None]:
    """While tfpar's loop traces its step: no all-reduce inside `apply` (the aggregator
    summed already; Keras then clips the sum), and with `sharded_updates` the
    parameter-server update path. Everything is restored on exit, so the same optimizer
    then synchronises under `model.fit` as before.

    Enter it from the cross-replica context (around `strategy.run`): MirroredStrategy runs
    replicas in threads that must all see the same optimizer.
    """
    with contextlib.ExitStack() as stack:
        for target in optimizers_of(optimizer):
            stack.enter_context(optimizer_attribute(target, ALL_REDUCE, _identity_reduce))
            if sharded_updates:
                stack.enter_context(optimizer_attribute(target, UPDATE_STEP, _sharded_update(target)))
        yield


# -- TensorFlow names other modules touch (kept here so one module holds them all) ---

def runtime_started() -> bool:
    """Whether TensorFlow's eager context exists (`context()._context_handle`): there is no
    public query, and calling any public API would start the runtime."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    return context.context()._context_handle is not None  # pylint: disable=protected-access


def function_library(graph) -> dict:
    """Name -> function of a FuncGraph's nested functions (`graph._functions`): the only way
    to walk from a traced step into the functions it calls (wire-byte accounting)."""
    return dict(graph._functions)  # pylint: disable=protected-access


def inbound_nodes(layer) -> list:
    """A Keras layer's inbound nodes (`layer._inbound_nodes`): Keras has no public graph walk
    to tell a chain-shaped functional model from one that branches."""
    return list(layer._inbound_nodes)  # pylint: disable=protected-access


@contextlib.contextmanager
def collective_key_base(strategy_class, base: int) -> Iterator[None]:
    """`MirroredStrategy._collective_key_base`: TensorFlow's own hook to give a second
    strategy in one process its own collective group keys (otherwise both use group 1)."""
    saved = strategy_class._collective_key_base  # pylint: disable=protected-access
    strategy_class._collective_key_base = base  # pylint: disable=protected-access
    try:
        yield
    finally:
        strategy_class._collective_key_base = saved  # pylint: disable=protected-access


_SUMMED = threading.local()  # per replica thread: the optimizers whose gradients are summed already


@contextlib.contextmanager
def summed_in_this_thread(optimizer) -> Iterator[None]:
    """Within the block, in this thread only, `optimizer`'s (and its wrapped one's)
    all-reduce is an identity (`is_summed_in_this_thread`). MirroredStrategy runs its
    replicas in threads that share one optimizer object: an attribute swapped in one
    replica's thread would be read by another replica still before its sum."""
    held = _SUMMED.__dict__.setdefault("ids", set())
    added = {id(o) for o in optimizers_of(optimizer)} - held
    held.update(added)
    try:
        yield
    finally:
        held.difference_update(added)


def is_summed_in_this_thread(optimizer) -> bool:
    return id(optimizer) in _SUMMED.__dict__.get("ids", ())


def unless_summed(target, all_reduce):
    """`all_reduce`, or the identity where `target` is summed already in this thread."""
    def all_reduce_once(grads_and_vars):
        if is_summed_in_this_thread(target):
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)
    return all_reduce_once


def replace_all_reduce(optimizer: keras.optimizers.Optimizer, all_reduce) -> None:
    """Makes `all_reduce(grads_and_vars)` the cross-replica sum inside `optimizer.apply`
    (and its LossScaleOptimizer's inner one), for good: `compress_fit` sends fit's
    gradients through the compressor there instead of Keras's own all-reduce
    (tensor parallelism under keras.distribution, its own sums)."""
    for target in optimizers_of(optimizer):
        if not hasattr(target, ALL_REDUCE):
            raise KerasFixError(f"This Keras version's optimizer has no {ALL_REDUCE} (Keras "
                                f"{keras.__version__}); compressed fit cannot hook into it.")
        setattr(target, ALL_REDUCE, unless_summed(target, all_reduce))


def add_control_input(op, dependency) -> None:
    """`Operation._add_control_input`: TensorFlow's only way to add a control edge to an op
    after it was made. The zero-bubble pipeline holds a weight-gradient (W) unit's ops back
    until the unit before it on the device has run; the ops are created by one
    `tape.gradient` call, so a `tf.control_dependencies` block cannot reach them."""
    op._add_control_input(dependency)  # pylint: disable=protected-access


def strategy_launchers(strategy) -> list:
    """The strategy's own `CollectiveReplicaLauncher`s, one per local replica in the order
    of its devices (`extended._collective_ops._launchers`, or `_cross_device_ops` for a
    MirroredStrategy with collective all-reduce); [] where it has none."""
    extended = strategy.extended
    ops = getattr(extended, "_collective_ops", None) or getattr(extended, "_cross_device_ops", None)
    return list(getattr(ops, "_launchers", None) or [])


def collective_launcher(context):
    """This replica's `CollectiveReplicaLauncher` (`extended._collective_ops._launchers`):
    the group key, instance keys and ordering token of the strategy's own collectives, so an
    all-to-all issued by tfpar joins the same group in the same order (there is no public
    all-to-all in tf.distribute)."""
    launchers = strategy_launchers(context.strategy)
    if not launchers:
        return None
    return launchers[context._replica_id]  # pylint: disable=protected-access  (local index)


def launcher_all_to_all(launcher, tensor):
    """CollectiveAllToAllV2 with `launcher`'s group, next instance key and ordering token."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import collective_ops  # pylint: disable=import-outside-toplevel

    # pylint: disable=protected-access
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            tensor, launcher._group_size, launcher._group_key, launcher._next_instance_key(),
            communication_hint=launcher._options.implementation.value,
            timeout=launcher._options.timeout_seconds,
            ordering_token=launcher._get_ordering_token())


def launcher_all_gather(launcher, tensor, axis: int = 0):
    """`launcher.all_gather` along `axis`: the ops the strategy's own all_gather issues (a
    shape exchange, then CollectiveGatherV2), without its merge_call, which MirroredStrategy
    refuses inside a tf.cond branch."""
    return launcher.all_gather(tensor, axis)


def launcher_all_gather_same_shape(launcher, tensor):
    """CollectiveGatherV2 along axis 0 of a tensor with the same static shape on every
    replica: the launcher's own gather without the shape exchange and padding of its public
    `all_gather` (one collective, not two); callable inside a tf.cond branch."""
    return launcher._all_gather(tensor, None)  # pylint: disable=protected-access


def launcher_all_reduce(launcher, tensor):
    """The launcher's SUM all-reduce (CollectiveReduceV2): callable inside a tf.cond branch."""
    return launcher.all_reduce(tensor)


def launcher_batch_all_reduce(launcher, tensors: list) -> list:
    """The launcher's packed SUM all-reduce of `tensors` (one CollectiveReduceV2 of their
    concatenation, in a tf.function): each tensor's sum, in order."""
    return launcher.batch_all_reduce([list(tensors)])


def launcher_uses_nccl(launcher) -> bool:
    """Whether the launcher's collectives run on NCCL (GPUs)."""
    from tensorflow.python.distribute import collective_util  # pylint: disable=import-outside-toplevel

    nccl = collective_util.CommunicationImplementation.NCCL
    return launcher._options.implementation == nccl and "GPU" in launcher._device.upper()  # pylint: disable=protected-access


def launcher_reduce_scatter(launcher, tensor):
    """CollectiveReduceScatterV2 (SUM) of a flat tensor of R x C elements: this replica gets
    the sum of chunk `rank` ([C]). TensorFlow registers it for NCCL only (on CPU: "did not
    find collective implementation undef"): call it where `launcher_uses_nccl`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import gen_collective_ops  # pylint: disable=import-outside-toplevel

    # pylint: disable=protected-access
    token = launcher._get_ordering_token()
    with tf.device(launcher._device):
        return gen_collective_ops.collective_reduce_scatter_v2(
            tensor, group_size=launcher._group_size, group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(), ordering_token=[token] if token is not None else [],
            merge_op="Add", final_op="Id", communication_hint="nccl",
            timeout_seconds=launcher._options.timeout_seconds or 0)


# -- groups of a strategy's replicas (tfpar.strategy.groups) -------------------------

_GROUP_KEYS = []  # one CollectiveKeys for every subset group (tfpar.strategy.groups) in this process


def group_launchers(groups, local_devices, strategy=None) -> list[dict]:
    """One TensorFlow CollectiveReplicaLauncher per local member of each group.

    `groups`: lists of device names in rank order, every group of the run (also those with
    no member here: every worker numbers the groups alike, so their keys agree);
    `local_devices`: this worker's devices. Returns, per group, {local device: launcher}.

    Example:
        >>> tp, = group_launchers([["/cpu:0", "/cpu:1"]], ["/cpu:0", "/cpu:1"])
        >>> tp["/cpu:0"].all_reduce(x)       # in replica 0's context; replica 1 does the same
    """
    from tensorflow.python.distribute import collective_util, cross_device_utils  # pylint: disable=import-outside-toplevel

    if not _GROUP_KEYS:  # far above the strategies' own keys (10_000 per strategy)
        _GROUP_KEYS.append(cross_device_utils.CollectiveKeys(group_key_start=1_000_000_000))
    keys = _GROUP_KEYS[0]
    options = getattr(getattr(strategy, "extended", None), "_communication_options", None)
    options = options or collective_util.Options()
    local = set(local_devices)
    found = []
    for members in groups:
        key = keys.get_group_key(list(members))
        found.append({d: cross_device_utils.CollectiveReplicaLauncher(key, len(members), keys, d, options)
                      for d in members if d in local})
    return found


def local_component(variable):
    """This replica's own copy of a mirrored variable (replica context), to assign directly;
    the variable itself where it has one copy."""
    if isinstance(variable, keras.Variable):
        variable = variable.value  # its tf.Variable
    own = getattr(variable, "_get_on_device_or_primary", None)
    return variable if own is None else own()


def learning_rate_of(optimizer):
    """The optimizer's learning rate as it was given: a float or its schedule object
    (`optimizer.learning_rate` is the current value only)."""
    rate = base_optimizer(optimizer)._learning_rate  # pylint: disable=protected-access
    return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else float(
        keras.ops.convert_to_numpy(rate))


def copy_weight_decay_exclusions(source, target) -> None:
    """What `source.exclude_from_weight_decay(...)` excluded, excluded on `target` too."""
    names = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")
    for name in names:
        if hasattr(base_optimizer(source), name):
            setattr(target, name, getattr(base_optimizer(source), name))


__all__ = ["KerasFixError", "add_control_input", "copy_weight_decay_exclusions", "learning_rate_of",
           "optimizer_attribute", "replace_all_reduce", "collective_launcher", "group_launchers",
           "launcher_all_to_all", "launcher_all_gather", "launcher_all_gather_same_shape",
           "launcher_all_reduce", "launcher_batch_all_reduce", "strategy_launchers",
           "launcher_reduce_scatter", "launcher_uses_nccl", "local_component", "base_optimizer", "check_optimizer", "collective_key_base",
           "function_library", "inbound_nodes", "is_loss_scaled", "is_sharded",
           "optimizer_class", "optimizers_of", "runtime_started", "trainer_module",
           "trainer_step"]


def save_spec(make: Callable[[], "tf.Tensor"], dtype: "tf.DType", device: str):
    """A checkpoint value that `make()` computes when a checkpoint is written, not when a
    restore builds its specs (a restore calls `_serialize_to_tensors` too)."""
    from tensorflow.python.training.saving import saveable_object  # pylint: disable=import-outside-toplevel

    return saveable_object.SaveSpec(make, "", "", dtype=dtype, device=device)



# -- tensor parallelism: whole-value checkpoints of split weights ------------------

def set_checkpoint_hooks(variable, serialize, restore) -> None:
    """Makes `serialize()` / `restore(tensors)` what a checkpoint calls for this variable
    (a tf.Variable, e.g. a MirroredVariable) instead of its class's own saving."""
    variable._serialize_to_tensors = serialize  # pylint: disable=protected-access
    variable._restore_from_tensors = restore  # pylint: disable=protected-access


def on_restore(variable, callback) -> None:
    """Calls `callback()` whenever a checkpoint restores `variable`, which it then restores
    as it did before (its class's own restore, or hooks set earlier)."""
    original = variable._restore_from_tensors  # pylint: disable=protected-access

    def restore(restored):
        callback()
        return original(restored)

    variable._restore_from_tensors = restore  # pylint: disable=protected-access


# -- tensor parallelism: split weights inside Keras's own layers ---------------------

def weight_path(layer, name: str) -> str:
    """The path (`variable.path`) Keras will give the weight `name` that `layer` is about
    to create: its current name scope (`keras.src.backend.common.name_scope.current_path`,
    no public reader) plus the layer's own scope, as `Layer.add_weight` enters it."""
    from keras.src import backend  # pylint: disable=import-outside-toplevel
    from keras.src.backend.common.name_scope import current_path  # pylint: disable=import-outside-toplevel

    with backend.name_scope(layer.name, caller=layer):
        return f"{current_path()}/{name}".lstrip("/")


@contextlib.contextmanager
def add_weight_replaced(replacement) -> Iterator[None]:
    """`keras.layers.Layer.add_weight` is `replacement(original, layer, *args, **kwargs)`
    within the block, for every layer (one being built inside another's build included):
    where a weight is created is the one place tfpar can create it split instead (Keras's
    own hook, `Variable._initialize` -> `distribution_lib.distribute_variable`, runs on JAX
    only). Restored on exit; blocks do not nest."""
    original = keras.layers.Layer.add_weight

    def add_weight(layer, *args, **kwargs):
        return replacement(original, layer, *args, **kwargs)

    keras.layers.Layer.add_weight = add_weight
    try:
        yield
    finally:
        keras.layers.Layer.add_weight = original


def set_instance_class(instance, cls) -> None:
    """`instance.__class__ = cls`: a split weight's Keras variable becomes a subclass of
    its own class that reads and writes the whole value outside the replicas (the weight
    APIs call `numpy()`, `np.asarray` and `assign` on the variable itself)."""
    instance.__class__ = cls


def slots_by_reference(optimizer, variables) -> list:
    """Builds `optimizer` (and the one a LossScaleOptimizer wraps) on `variables` and
    returns (slot, the variable it was made from) for every slot made by
    `add_variable_from_reference` (recorded on the instance while it builds): what a slot
    belongs to, from Keras itself, not from its name."""
    made = []
    targets = optimizers_of(optimizer)

    def recording(target):
        original = target.add_variable_from_reference

        def record(reference, *args, **kwargs):
            slot = original(reference, *args, **kwargs)
            made.append((slot, reference))
            return slot
        return record

    for target in targets:
        object.__setattr__(target, "add_variable_from_reference", recording(target))
    try:
        optimizer.build(variables)
    finally:
        for target in targets:
            object.__delattr__(target, "add_variable_from_reference")
    return made


def attention_dropout(attention):
    """The Dropout a Keras MultiHeadAttention applies to its attention probabilities
    (`_dropout_layer`, made in its build; no public accessor): inside a tensor-parallel
    split region it draws its mask per rank (tfpar.tensor_parallel.random)."""
    return attention._dropout_layer  # pylint: disable=protected-access


# -- ZeRO (tfpar.zero): the partitioned optimizer state in checkpoints and Keras files --
#
# Touches, each with its reason (tfpar.zero.checkpoint, tfpar.zero.own_optimizer,
# tfpar.zero.files):
#
# - `BaseOptimizer._use_weight_decay` (Keras): Keras's own decision whether a variable is
#   decayed (by identity, `_var_key`, and by pattern). Keras's TensorFlow backend asks it
#   with the tf.Variable (its `.name` is the variable's path, "block/layer_norm/gamma:0");
#   asked with a keras.Variable it would match the short name ("gamma") instead, so an
#   exclusion by layer name would be missed: `uses_weight_decay`.
# - `Trackable._trackable_children`, `_lookup_dependency`, `_handle_deferred_dependencies`
#   (TensorFlow's checkpoint hooks, set on the caller's optimizer object): the optimizer
#   the Trainer never builds checkpoints and restores the partitioned state in its place,
#   and a restore called before the Trainer existed (deferred by TensorFlow) lands in it
#   (`checkpoint_as`, `hand_over_deferred`).
# - `saveable_object.SaveableObject` / `SaveSpec` and `_gather_saveables_for_checkpoint`
#   (TensorFlow's legacy saveable path, the one ShardedVariable's partitions use): several
#   slices of one checkpoint key, each restored with its own spec. The newer
#   `_serialize_to_tensors` path keeps only the first slice of a key when it restores
#   (TrackableSaveable.restore zips one tensor per local name): `slices_saveable`.
# - `graph_view.ObjectGraphView.breadth_first_traversal`, `trackable_utils.checkpoint_key`
#   and `functional_saver.MultiDeviceSaver` (TensorFlow): a worker writes only its own
#   partitions, under the keys the chief's checkpoint gives them (`checkpoint_keys`,
#   `write_saveables`).
# - `saved_model.registration.register_checkpoint_saver` (TensorFlow's hook for "a custom
#   Variable class that splits the variable across different objects and devices"): the
#   chief's save merges every worker's partition file into its checkpoint, in the same
#   MergeV2Checkpoints that merges its own shards (`register_merge_saver`).


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether Keras's TensorFlow optimizer decays `variable` (a keras.Variable or
    tf.Variable): `_use_weight_decay` asked with the tf.Variable, as Keras asks it.

    Example:
        >>> optimizer.exclude_from_weight_decay(var_names=["layer_norm"])
        >>> uses_weight_decay(optimizer, block.layer_norm.gamma)     # False
    """
    if base_optimizer(optimizer).weight_decay is None:
        return False
    tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
    return bool(base_optimizer(optimizer)._use_weight_decay(tf_variable))  # pylint: disable=protected-access


def checkpoint_as(trackable, view) -> None:
    """`trackable` (e.g. the caller's optimizer) saves and restores `view`'s children in
    place of its own in object-based checkpoints (SavedModel export keeps its own)."""
    own_children = trackable._trackable_children  # pylint: disable=protected-access
    checkpoint = "checkpoint"

    def children(save_type=checkpoint, **kwargs):
        if str(getattr(save_type, "value", save_type)) != checkpoint:
            return own_children(save_type, **kwargs)
        return view._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access

    def lookup(name, cached_dependencies=None):
        if cached_dependencies is not None:
            return cached_dependencies.get(name)
        return view._lookup_dependency(name)  # pylint: disable=protected-access

    object.__setattr__(trackable, "_trackable_children", children)
    object.__setattr__(trackable, "_lookup_dependency", lookup)


def hand_over_deferred(source, target) -> None:
    """Restorations TensorFlow deferred on `source` and its descendants (a checkpoint
    restored before they had these children) land in `target`'s children of the same
    names, recursively. Call before `checkpoint_as(source, target)`."""
    for name, child in target._trackable_children().items():  # pylint: disable=protected-access
        existing = source._lookup_dependency(name)  # pylint: disable=protected-access
        source._handle_deferred_dependencies(name, child)  # pylint: disable=protected-access
        if existing is not None and existing is not child and not hasattr(child, "assign"):
            hand_over_deferred(existing, child)


class _Slices:
    """Made on first use (TensorFlow imported): a SaveableObject whose specs are slices of
    one key and whose restore calls `restore(tensors)` with the slices in spec order."""
    kind = None

    @classmethod
    def make(cls, name, specs, restore):
        if cls.kind is None:
            from tensorflow.python.training.saving import saveable_object  # pylint: disable=import-outside-toplevel

            class SliceSaveable(saveable_object.SaveableObject):
                def __init__(self, name, specs, restore):
                    super().__init__(None, specs, name)
                    self._restore = restore

                def restore(self, restored_tensors, restored_shapes):
                    del restored_shapes
                    return self._restore(list(restored_tensors))

            cls.kind = SliceSaveable
        return cls.kind(name, specs, restore)


def slices_saveable(name: str, parts: list, restore: Callable):
    """A checkpoint saveable of key `name` made of slices: `parts` is a list of
    (make, slice_spec, dtype, device), `make()` the slice's value, computed only when a
    checkpoint is written (None: nothing is written for it); `restore(tensors)` gets the
    restored slices in the same order. Return a list of these from a factory in
    `_gather_saveables_for_checkpoint`.

    Example:
        >>> slices_saveable(key, [(lambda: v[:2], "4 0,2", tf.float32, "/cpu:0")], assign)
    """
    from tensorflow.python.training.saving import saveable_object  # pylint: disable=import-outside-toplevel

    specs = [saveable_object.SaveSpec(make, spec, name, dtype=dtype, device=device)
             for make, spec, dtype, device in parts]
    return _Slices.make(name, specs, restore)


def checkpoint_keys(root, select: Callable, attribute: str) -> dict:
    """{trackable: its checkpoint key for `attribute`} for every trackable under `root`
    for which `select(trackable)` holds, named as TensorFlow names them (shortest path)."""
    from tensorflow.python.checkpoint import graph_view  # pylint: disable=import-outside-toplevel
    from tensorflow.python.trackable import trackable_utils  # pylint: disable=import-outside-toplevel

    _, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
    return {trackable: trackable_utils.checkpoint_key(trackable_utils.object_path_to_string(path), attribute)
            for trackable, path in paths.items() if select(trackable)}


def write_saveables(saveables: list, prefix: str) -> None:
    """Writes `saveables` (and nothing else: no object graph) as a V2 checkpoint at
    `prefix`, with TensorFlow's own saver (per-device shards, then merged)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.checkpoint import functional_saver  # pylint: disable=import-outside-toplevel

    functional_saver.MultiDeviceSaver.from_saveables(saveables).save(tf.constant(prefix))


def register_merge_saver(name: str, predicate: Callable, prefixes: Callable) -> None:
    """Registers (once per process) a checkpoint saver for the trackables `predicate`
    accepts: when a checkpoint that holds one is written, `prefixes(trackables)` (V2
    checkpoint prefixes already on disk) are merged into it by the save's own
    MergeV2Checkpoints, which moves their data files in and deletes their directories.
    Its restore does nothing (the merged keys restore by themselves)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.saved_model import registration  # pylint: disable=import-outside-toplevel

    def save_fn(trackables, file_prefix):
        del file_prefix
        return [tf.constant(p) for p in prefixes(list(trackables.values()))]

    def restore_fn(trackables, merged_prefix):
        del trackables, merged_prefix

    try:
        registration.register_checkpoint_saver(package="tfpar", name=name, predicate=predicate,
                                               save_fn=save_fn, restore_fn=restore_fn,
                                               strict_predicate_restore=False)
    except ValueError as e:  # registered already (a module imported twice)
        if "already registered" not in str(e).lower():
            raise


def layer_kernel(layer):
    """A Dense or EinsumDense layer's kernel variable (`_kernel`): the `kernel` property
    refuses until the layer is built, and a layer's bias is created inside its build, right
    after its kernel (tfpar.tensor_parallel.styles: the bias follows the kernel's split)."""
    return getattr(layer, "_kernel", None)


def in_symbolic_scope() -> bool:
    """Whether Keras is tracing for shapes only (`SymbolicScope`: building a functional model,
    `compute_output_spec`), where a split layer computes no numbers and calls no collective."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope as symbolic  # pylint: disable=import-outside-toplevel

    return symbolic()


def remote_value_failed(value) -> bool:
    """Whether a ClusterCoordinator RemoteValue holds its function's own error (set by the
    coordinator: the function failed for good), not merely a copy that could not reach
    the chief."""
    return getattr(value, "_error", None) is not None
