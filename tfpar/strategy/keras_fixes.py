"""The small, version-guarded fixes Keras 3 needs to run `fit` under a tf.distribute strategy.

`create_strategy` applies them (`apply_and_report`); `apply()` is idempotent and `revert()`
undoes them (tests use it to show each fix is still needed). Each fix is scoped to the one
call it mends. They apply all or nothing: before anything is changed, every fix checks
that its target exists with the signature and the inner names it relies on
(`problems()`); if one cannot apply, none is, and `create_strategy` says once which fix,
which Keras, and what still works. The private names live in `private_api`.

1. MultiWorkerMirroredStrategy fails at the first batch (keras#20585), twice over.
   a) `TensorFlowTrainer._maybe_symbolic_build` builds the model from one batch and gets
      it with `strategy.reduce("MEAN", batch)`, handing the whole nested batch to one
      reduction; the multi-worker strategy does not map over nests ("Attempt to convert
      a value (PerReplica...) with an unsupported type"). Building needs shapes only, so
      the fix makes that one `reduce` return the first local replica's value of each
      leaf: no cross-worker traffic, same shapes as before.
   b) The step's logs (scalar loss and metrics) are then reduced with
      `strategy.reduce("MEAN", v, axis=0)`, which fails on a scalar ("Invalid reduction
      dimension 0 for input with 0 dimensions"). The fix reduces scalars with
      axis=None (the mean over replicas, which is what the other strategies compute).

2. MirroredStrategy with `steps_per_execution > 1` fails ("You must feed a value for
   placeholder tensor ... while/cond/Placeholder"). Keras wraps its per-step function
   (`one_step_on_data`) in a nested `tf.function` and calls it from inside a
   `tf.while_loop`/`tf.cond`; with several replicas the mirrored replica threads trace
   that nested function against the loop's placeholders. The fix leaves the per-step
   function unwrapped (the outer multi-step `tf.function` still compiles everything into
   one graph). That wrapper also carried `jit_compile`: Keras resolves only
   `jit_compile="auto"` (to False under any strategy), so an explicit `jit_compile=True`
   is dropped here with 2+ replicas, silently (tfpar-train passes False there, and under
   TPUStrategy, and says so: `tfpar.train.fit_jit_compile`).
   A Keras that renames that closure is refused at `apply()`, and at trace time if it
   slipped through, never skipped.

3. ParameterServerStrategy is not supported by Keras 3 `fit` (keras#18624): `fit`,
   `evaluate` and `predict` raise UnsupportedStrategyError pointing to tfpar's loop
   instead of failing deep inside Keras.

4. The optimizer update sums first (tfpar.strategy.optimizer_update). Keras clips, decays
   and updates before its own all-reduce, and squares a sparse gradient's rows before
   they are summed: under a strategy `global_clipnorm`/`clipnorm`/`clipvalue` see each
   replica's share (1.5e-2 to 8e-2 off one device on 2 replicas), a repeated embedding row
   is clipped and squared in parts (on one device too: one step of Adam(0.1) with two equal
   slices of a row moves it 0.1414, not 0.1), and `gradient_accumulation_steps` and
   `use_ema` fail under MirroredStrategy ("`merge_call` called while defining a new
   graph"). The fix makes `_backend_apply_gradients` all-reduce first (through the
   optimizer's own `_all_reduce_sum_gradients`, so compress_fit's compression takes its
   place), sum every sparse gradient per unique index, then run Keras's own clip, decay and
   update; accumulation's and EMA's conds run in the cross-replica context. Turn the row
   summing off with `set_sum_sparse_rows(False)` (before the model's first `fit`); tfpar's
   loop has its own switch, `Trainer(sum_sparse_rows=False)`. See docs/keras_fixes.md.

Example:
    >>> from tfpar.strategy import keras_fixes
    >>> keras_fixes.apply_and_report().applied
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import keras
import tensorflow as tf
from absl import logging

from tfpar.strategy import optimizer_update, private_api, trainer_fixes

_ORIGINALS: dict[tuple[object, str], object] = {}
_REPORTED: set = set()

#: Keras releases the fixes were written for and tested on (3.5 - 3.15); setup.py says the same.
TESTED_KERAS = ((3, 5), (3, 16))
STILL_WORKS = ("Keras fit on one device and tfpar's own loop (tfpar.Trainer, "
               "--config.mode=loop) on every strategy still work; Keras fit under "
               "multi_worker_mirrored, under mirrored with steps_per_execution > 1, "
               "clipping, gradient accumulation and EMA under several replicas, and "
               "Adam-family optimizers on embedding gradients in fit are not mended.")


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def is_affected() -> bool:
    """True for the Keras releases these fixes are written for and tested on."""
    low, high = TESTED_KERAS
    return low <= keras_version() < high


def is_applied() -> bool:
    return bool(_ORIGINALS)


sum_repeated_rows = optimizer_update.sum_repeated_rows


def set_sum_sparse_rows(enabled: bool) -> None:
    """Repeated sparse rows summed before the optimizer (default) or not (Keras's own
    behaviour), for steps traced from now on."""
    optimizer_update.SUM_SPARSE_ROWS[0] = bool(enabled)


@dataclasses.dataclass(frozen=True)
class Status:
    """Whether the fixes are applied, on which Keras, and if not, why."""

    applied: bool
    keras: str
    problems: tuple[str, ...] = ()

    def message(self) -> str:
        if self.applied:
            return f"Keras {self.keras}: all {len(_FIXES)} fixes applied."
        why = "; ".join(self.problems)
        return (f"tfpar's Keras fixes are not applied on Keras {self.keras} ({why}). "
                f"{STILL_WORKS} Install a Keras in setup.py's range (keras>="
                f"{TESTED_KERAS[0][0]}.{TESTED_KERAS[0][1]},<{TESTED_KERAS[1][0]}."
                f"{TESTED_KERAS[1][1]}) to get them back.")


def problems() -> list[str]:
    """Why each fix that cannot apply on this Keras cannot ('fix: reason'); [] if all can."""
    if not is_affected():
        low, high = TESTED_KERAS
        return [f"Keras {keras.__version__} is outside the tested releases "
                f"{low[0]}.{low[1]} - {high[0]}.{high[1] - 1}"]
    try:
        fixes = _FIXES
    except NameError:  # pragma: no cover - the targets failed to import
        return ["Keras's TensorFlow trainer or optimizer module moved"]
    found = []
    for fix in fixes:
        reason = fix.problem()
        if reason:
            found.append(f"{fix.name}: {reason}")
    return found


def status() -> Status:
    return Status(is_applied(), keras.__version__, () if is_applied() else tuple(problems()))


def apply() -> bool:
    """Installs every fix, or none if any cannot apply; returns whether they are active."""
    if is_applied() or problems():
        return is_applied()
    for fix in _FIXES:
        owner = fix.owner()
        original = getattr(owner, fix.attribute)
        _ORIGINALS[(owner, fix.attribute)] = original
        setattr(owner, fix.attribute, fix.make(original))
    return True


def apply_and_report() -> Status:
    """`apply()`, and one warning per process if the fixes cannot apply (which fix, why,
    what still works). `create_strategy` calls it."""
    apply()
    result = status()
    if not result.applied and result.problems not in _REPORTED:
        _REPORTED.add(result.problems)
        logging.warning("%s", result.message())
    return result


def revert() -> None:
    """Restores Keras's own methods (for tests that show a fix is needed)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()


# -- what each fix needs to find ------------------------------------------------------

def _nested_code_names(function) -> set[str]:
    """Names of the functions defined inside `function` (its closures), recursively; a
    `functools.wraps` wrapper (tfpar.distribution's, say) is read through to Keras's own."""
    names, stack = set(), [getattr(inspect.unwrap(function), "__code__", None)]
    while stack:
        code = stack.pop()
        for const in code.co_consts if code is not None else ():
            if inspect.iscode(const):
                names.add(const.co_name)
                stack.append(const)
    return names


def _uses(function, *names: str) -> bool:
    """Whether `function`'s code (closures included) refers to every one of `names`; a
    `functools.wraps` wrapper is read through to the function it wraps."""
    found, stack = set(), [getattr(inspect.unwrap(function), "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        found.update(code.co_names)
        found.update(code.co_freevars)
        stack.extend(c for c in code.co_consts if inspect.iscode(c))
    return set(names) <= found


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix: `owner().attribute` is replaced by `make(original)`."""

    name: str
    owner: Callable[[], object]
    attribute: str
    make: Callable
    parameters: tuple[str, ...] | None = None  # expected parameter names (None: any)
    requires: Callable[[object], str | None] = lambda target: None  # more checks

    def problem(self) -> str | None:
        """Why this fix cannot apply here, or None."""
        try:
            owner = self.owner()
        except (ImportError, AttributeError) as e:
            return f"its owner is gone ({e})"
        # Once applied, the checks read Keras's own function, not tfpar's wrapper.
        target = _ORIGINALS.get((owner, self.attribute), getattr(owner, self.attribute, None))
        where = f"{getattr(owner, '__name__', owner)}.{self.attribute}"
        if not callable(target):
            return f"{where} is missing (renamed or moved)"
        if self.parameters is not None:
            try:
                found = tuple(inspect.signature(target).parameters)
            except (TypeError, ValueError):
                found = None
            if found != self.parameters:
                return f"{where} takes {found}, not {self.parameters}"
        return self.requires(target)


# -- the targets, and what each fix relies on inside them ------------------------------

def _trainer_module():
    return private_api.trainer_module()


def _trainer_class():
    return _trainer_module().TensorFlowTrainer


def _needs_strategy_reduce(target) -> str | None:
    if not _uses(_trainer_class().__init__, "_distribute_strategy"):
        return "TensorFlowTrainer no longer keeps _distribute_strategy"
    if not _uses(target, "reduce"):
        return "it no longer calls strategy.reduce"
    return None


def _needs_multi_worker_check(target) -> str | None:  # pylint: disable=unused-argument
    if not callable(getattr(_trainer_module(), "_collective_all_reduce_multi_worker", None)):
        return "_collective_all_reduce_multi_worker is missing"
    return None


def _needs_step_closure(target) -> str | None:
    if trainer_fixes.STEP_CLOSURE not in _nested_code_names(target):
        return f"its per-step closure {trainer_fixes.STEP_CLOSURE!r} was renamed"
    if getattr(_trainer_module(), "tf", None) is not tf or not _uses(target, "tf", "function"):
        return "it no longer wraps its step with the module's tf.function"
    return None


def _needs_update_names(target) -> str | None:
    update = getattr(private_api.optimizer_class(), "_backend_update_step", None)
    if update is None or not _uses(update, private_api.ALL_REDUCE):
        return f"_backend_update_step no longer calls {private_api.ALL_REDUCE}"
    missing = [name for name in optimizer_update.KERAS_NAMES[1:-2] if not _uses_anywhere(name)]
    if missing or not _uses(target, "_clip_gradients", "_backend_update_step", "use_ema"):
        return f"_backend_apply_gradients no longer uses {', '.join(missing) or '_clip_gradients'}"
    return None


def _uses_anywhere(name: str) -> bool:
    """Whether Keras's optimizer classes refer to `name` (an attribute the fix reads)."""
    from keras.src.optimizers import base_optimizer  # pylint: disable=import-outside-toplevel

    classes = (base_optimizer.BaseOptimizer, private_api.optimizer_class())
    return any(hasattr(c, name) or any(_uses(f, name) for f in vars(c).values() if callable(f))
               for c in classes)


_FIXES = (
    Fix("symbolic build under multi_worker_mirrored (keras#20585)", _trainer_class,
        "_maybe_symbolic_build", trainer_fixes.fix_symbolic_build, ("self", "iterator", "data_batch"),
        _needs_strategy_reduce),
    Fix("scalar logs under multi_worker_mirrored (keras#20585)", _trainer_module,
        "reduce_per_replica", trainer_fixes.fix_reduce_per_replica, ("values", "strategy", "reduction"),
        _needs_multi_worker_check),
    Fix("steps_per_execution > 1 under mirrored", _trainer_class, "_make_function",
        trainer_fixes.fix_make_function, ("self", "step_function"), _needs_step_closure),
    Fix("fit under parameter_server refused clearly (keras#18624)", _trainer_class, "fit",
        trainer_fixes.refuse_parameter_server),
    Fix("evaluate under parameter_server refused clearly", _trainer_class, "evaluate",
        trainer_fixes.refuse_parameter_server),
    Fix("predict under parameter_server refused clearly", _trainer_class, "predict",
        trainer_fixes.refuse_parameter_server),
    Fix("optimizer update after the all-reduce (clipping, accumulation, EMA, sparse rows)",
        private_api.optimizer_class, "_backend_apply_gradients", optimizer_update.make_apply_gradients,
        ("self", "grads", "trainable_variables"), _needs_update_names),
    Fix("the optimizer's own all-reduce skipped where the update summed already (per replica thread)",
        private_api.optimizer_class, private_api.ALL_REDUCE, optimizer_update.make_all_reduce,
        ("self", "grads_and_vars")),
)
