"""The combination matrix's cases, runs, references and verdicts (used by
tests/test_matrix.py in the pytest process and by tests/scripts/matrix_worker.py in the two
worker processes). See tests/test_matrix.py for what is promised and why each tolerance.

A `Run` is one training configuration: strategy x mode x precision x compressor x option
(plus the optimizer family, the global batch and the number of steps). Cases are Runs made
by all-pairs; references are Runs too (a plain-Keras one-device run, with or without the
compressor; a float32 twin; the same case without accumulation and a 2x batch, or without
EMA; the other mode; the other 2-replica strategy). `execute` trains a Run and returns
its Result; `verdict` compares a case with its reference and, recursively, checks that the
reference holds up itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import re
import time
import traceback
from typing import Callable

import numpy as np

# -- the axes --------------------------------------------------------------------------

STRATEGIES = ("default", "mirrored", "multi_worker_mirrored")
MODES = ("fit", "loop")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
COMPRESSORS = ("none", "fp16", "int8", "topk", "powersgd", "sign", "dgc", "onebit_adam", "dgc_adam")
OPTIONS = ("none", "global_clip", "clipnorm", "clipvalue", "accumulation", "ema", "weight_decay")
SHARDS = ("optimizer", "gradients")  # tfpar.Trainer(shard=...): loop cases only, see `shard_cases`

# The fast tier: all-pairs over these, in this process only (two-process runs are slow, as
# everywhere in tests/conftest.py); the compressors and options that exercise each
# reference class and each known trap.
FAST_STRATEGIES = ("default", "mirrored")
FAST_COMPRESSORS = ("none", "topk", "dgc", "onebit_adam")
FAST_OPTIONS = ("none", "global_clip", "accumulation", "ema")

# Compressors configured so that, in float32, they compute exactly what their optimizer
# computes (see `compression_for`): they get the one-device reference at 1e-5.
LOSSLESS = ("none", "dgc", "onebit_adam", "dgc_adam")
ADAM_COMPRESSORS = ("onebit_adam", "dgc_adam")

# -- the numbers -----------------------------------------------------------------------

BATCH, STEPS = 16, 4            # global batch, steps of every case (accumulation: 2 updates)
SEED = 0
LR_SGD, MOMENTUM = 0.1, 0.9
LR_ADAM, EPSILON = 0.01, 1e-3   # epsilon: see tests/test_matrix.py ("Adam's epsilon")
CLIP_GLOBAL, CLIP_NORM, CLIP_VALUE = 0.1, 0.05, 0.005  # all active on this model (checked)
ACCUMULATION = 2
EMA_MOMENTUM = 0.5              # 0.99 would leave 4 steps' EMA next to the initial weights
WEIGHT_DECAY = 0.5
FREEZE_STEP = 100               # onebit_adam / dgc_adam: the Adam warm-up covers every step run
EXACT_TOL = 1e-5                # rtol and atol, on every weight
# Compressors that round each sum they send: against a reference that rounds other sums
# (2 micro-batches against one 2x batch, one device against 2 replicas) the weights may
# differ by that rounding, at most 2^-11 of each gradient entry per sum: atol is raised to
# 2^-10 of how far the reference moved (fp16 measured 1.12e-5 of 4.26e-2 moved: 2.6e-4).
ROUNDING = {"fp16": 2.0 ** -10}
# Mixed precision against float32: |update - update_float32| / |update_float32| over all
# weights, for the first update (the scale check), each later one and the total of the 4
# steps; see tests/test_matrix.py for where each number comes from. "feedback" compressors
# drift apart after the first update (their error feedback carries every rounding on), so
# their later updates are held only through the total.
PRECISION_CLASS = {"int8": "rounding", "topk": "feedback", "sign": "feedback", "powersgd": "feedback"}
PRECISION_TOL = {  # (precision, class) -> (first update, later updates and the total)
    ("mixed_bfloat16", "stateless"): (0.10, 0.15), ("mixed_float16", "stateless"): (0.01, 0.15),
    ("mixed_bfloat16", "rounding"): (0.10, 0.15), ("mixed_float16", "rounding"): (0.05, 0.15),
    ("mixed_bfloat16", "feedback"): (0.30, 0.30), ("mixed_float16", "feedback"): (0.05, 0.15),
}
MOVED = 1e-3                    # a reference's weights move at least this far (max |w - w0|)

OPTION_KWARGS = {
    "none": {}, "global_clip": {"global_clipnorm": CLIP_GLOBAL}, "clipnorm": {"clipnorm": CLIP_NORM},
    "clipvalue": {"clipvalue": CLIP_VALUE}, "accumulation": {"gradient_accumulation_steps": ACCUMULATION},
    "ema": {"use_ema": True, "ema_momentum": EMA_MOMENTUM}, "weight_decay": {}, "decay_excluded": {},
}
# Not an all-pairs value (OPTIONS): AdamW's weight decay with the norm excluded by its layer's
# name, as a user writes it (`exclude_from_weight_decay(var_names=["layer_normalization"])`,
# matched against the variable's path), for the sharded and tensor-parallel cases.
DECAY_EXCLUDED = ["layer_normalization"]


def family_for(compressor: str, option: str) -> str:
    """The optimizer the user means: AdamW for weight decay, Adam for the Adam compressors,
    SGD with momentum otherwise (exact to 1e-5 across replica counts, see the docstring)."""
    if option in ("weight_decay", "decay_excluded"):
        return "adamw"
    return "adam" if compressor in ADAM_COMPRESSORS else "sgd"


@dataclasses.dataclass(frozen=True, order=True)
class Run:
    strategy: str       # STRATEGIES, or "plain": one device, a GradientTape loop, no tfpar
    mode: str           # MODES, or "tape" (plain)
    precision: str
    compressor: str
    option: str
    family: str = ""
    batch: int = BATCH
    steps: int = STEPS
    shard: str = "none"  # loop: Trainer(shard=...) (ZeRO-1 'optimizer', ZeRO-2 'gradients')
    tensor: int = 0      # 0: the classic MLP; T >= 1: the Megatron MLP of tfpar's exported layers, T ways
    distribution: str = ""  # "data" | "model" | "fsdp": the classic MLP built under a keras.distribution (see distribution_for)

    def __post_init__(self):
        if not self.family:
            object.__setattr__(self, "family", family_for(self.compressor, self.option))

    @property
    def key(self) -> str:
        parts = [self.strategy, self.mode, self.precision, self.compressor, self.option]
        if self.strategy == "plain":
            parts.append(self.family)
        if (self.batch, self.steps) != (BATCH, STEPS):
            parts.append(f"b{self.batch}x{self.steps}")
        if self.shard != "none":
            parts.append(f"shard={self.shard}")
        if self.tensor:
            parts.append(f"tensor={self.tensor}")
        if self.distribution:
            parts.append(f"distribution={self.distribution}")
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> "Run":
        parts = key.split("/")
        run = dict(zip(("strategy", "mode", "precision", "compressor", "option"), parts[:5]))
        for extra in parts[5:]:
            if extra.startswith("shard="):
                run["shard"] = extra[len("shard="):]
            elif extra.startswith("tensor="):
                run["tensor"] = int(extra[len("tensor="):])
            elif extra.startswith("distribution="):
                run["distribution"] = extra[len("distribution="):]
            elif extra.startswith("b") and "x" in extra:
                batch, steps = extra[1:].split("x")
                run.update(batch=int(batch), steps=int(steps))
            else:
                run["family"] = extra
        return cls(**run)

    def replace(self, **changes) -> "Run":
        return dataclasses.replace(self, **changes)

    @property
    def in_process(self) -> bool:
        return self.strategy != "multi_worker_mirrored"


# -- the cases ---------------------------------------------------------------------------

def _all_pairs(strategies, modes, precisions, compressors, options) -> list[Run]:
    from allpairspy import AllPairs

    axes = [list(strategies), list(modes), list(precisions), list(compressors), list(options)]
    return [Run(*row) for row in _balanced(axes, [list(row) for row in AllPairs(axes)])]


def _balanced(axes: list[list[str]], rows: list[list[str]]) -> list[list[str]]:
    """`rows` with the values no pair needs spread out. allpairspy fills those slots with
    the same values (39 of its 65 cases were multi_worker_mirrored/fit/mixed_bfloat16):
    a value is changed where every pair it was part of stays covered by another row and
    the sum of squared pair counts goes down, until nothing changes. Deterministic."""
    pairs: collections.Counter = collections.Counter()
    n = len(axes)

    def key(i, vi, j, vj):
        return (i, vi, j, vj) if i < j else (j, vj, i, vi)

    def count(row, sign):
        for i, j in itertools.combinations(range(n), 2):
            pairs[key(i, row[i], j, row[j])] += sign

    for row in rows:
        count(row, 1)
    for _ in range(10):
        changed = False
        for row in rows:
            for a in range(n):
                others, old = [b for b in range(n) if b != a], row[a]
                if any(pairs[key(a, old, b, row[b])] < 2 for b in others):
                    continue  # the only row with one of its pairs

                def cost(value):
                    return sum(2 * (pairs[key(a, value, b, row[b])] - pairs[key(a, old, b, row[b])]) + 2
                               for b in others)

                choices = [v for v in axes[a] if v != old and row[:a] + [v] + row[a + 1:] not in rows]
                best = min(choices, key=lambda v: (cost(v), axes[a].index(v)), default=None)
                if best is not None and cost(best) < 0:
                    count(row, -1)
                    row[a] = best
                    count(row, 1)
                    changed = True
        if not changed:
            break
    return rows


def fast_cases() -> list[Run]:
    """All-pairs over FAST_STRATEGIES x every mode and precision x FAST_COMPRESSORS x
    FAST_OPTIONS."""
    return _all_pairs(FAST_STRATEGIES, MODES, PRECISIONS, FAST_COMPRESSORS, FAST_OPTIONS)


def full_cases() -> list[Run]:
    """All-pairs over every axis, plus every compressor x every precision on 2 replicas in
    tfpar's loop with no option (where every compressor is meant to train), so that each
    of those 27 pairs is seen training, not only refused beside some option."""
    cases = _all_pairs(STRATEGIES, MODES, PRECISIONS, COMPRESSORS, OPTIONS)
    cases += [Run("mirrored", "loop", p, c, "none") for c in COMPRESSORS for p in PRECISIONS]
    return list(dict.fromkeys(cases))


# Sharded cases: every shard mode x precision x strategy with a global clip (the norm agreed
# across shards), and what sharding composes with or refuses; the fast tier takes two.
FAST_SHARD_CASES = [Run("mirrored", "loop", "mixed_float16", "none", "global_clip", shard="gradients"),
                    Run("mirrored", "loop", "float32", "topk", "none", shard="gradients")]


def shard_cases() -> list[Run]:
    """Every shard mode x precision x strategy (the loop, global clip), then compressors
    and options with each mode: fp16 in the reduce-scatter, topk's whole sum (ZeRO-1 only),
    onebit_adam's own Adam state (refused), EMA, Keras's accumulation (refused: the
    Trainer's accumulate= does it)."""
    cases = [Run(s, "loop", p, "none", "global_clip", shard=m) for s in STRATEGIES for p in PRECISIONS for m in SHARDS]
    cases += [Run("mirrored", "loop", "mixed_bfloat16", "fp16", "none", shard="gradients"),
              Run("mirrored", "loop", "float32", "topk", "none", shard="optimizer"),
              Run("mirrored", "loop", "float32", "onebit_adam", "none", shard="optimizer"),
              Run("mirrored", "loop", "float32", "none", "ema", shard="optimizer"),
              Run("mirrored", "loop", "float32", "none", "accumulation", shard="gradients")]
    cases += [Run(s, "loop", "float32", "none", "decay_excluded", shard=m)  # an exclusion by layer name
              for s in ("mirrored", "multi_worker_mirrored") for m in SHARDS]
    return list(dict.fromkeys(FAST_SHARD_CASES + cases))


# Tensor-parallel cases (T = 2, the Megatron MLP of tfpar's exported layers): every strategy
# with two replicas x precision (loop, global clip), every option on mirrored, and what
# tensor parallelism refuses (Keras fit, compression, sharding, one device); the fast tier
# takes one.
FAST_TENSOR_CASES = [Run("mirrored", "loop", "float32", "none", "global_clip", tensor=2)]


def tensor_cases() -> list[Run]:
    """T = 2 with each strategy of two replicas x precision, each option on mirrored, and
    the refusals."""
    cases = [Run(s, "loop", p, "none", "global_clip", tensor=2)
             for s in ("mirrored", "multi_worker_mirrored") for p in PRECISIONS]
    cases += [Run("mirrored", "loop", "float32", "none", o, tensor=2) for o in (*OPTIONS, "decay_excluded")]
    cases += [Run("mirrored", "fit", "float32", "none", "none", tensor=2),
              Run("mirrored", "loop", "float32", "topk", "none", tensor=2),
              Run("mirrored", "loop", "float32", "none", "global_clip", shard="optimizer", tensor=2),
              Run("default", "loop", "float32", "none", "none", tensor=2)]
    return list(dict.fromkeys(FAST_TENSOR_CASES + cases))


# keras.distribution cases (tfpar.distribution.enable(): Keras's own API, run through tfpar):
# the classic MLP built while a `DataParallel` over 2 devices, or a `ModelParallel` on a
# 1 x 2 mesh whose layout map splits hidden_1's columns and hidden_2's rows, is in effect
# (the norm between them takes whole features: tfpar gathers and splits again, see
# `distribution_for`); trained by `model.fit` and by `tfpar.Trainer` with a plain dataset,
# as a Keras user writes them. Strategy "mirrored": what tfpar runs both on, 2 replicas in
# this process. Each mode, precision and option that trains a split model, and what a split
# model refuses (compression, sharding). "fsdp": a 2 x 1 mesh whose map lays both kernels on
# "batch", as keras-hub's maps do: whole weights, the Trainer's ZeRO-2 by default (what ZeRO-2
# refuses, refused), fit's state whole.
FAST_DISTRIBUTION_CASES = [Run("mirrored", "fit", "float32", "none", "global_clip", distribution="model")]


def distribution_cases() -> list[Run]:
    """Both distributions x both modes (global clip), mixed precision, options, compressors."""
    cases = [Run("mirrored", m, "float32", "none", "global_clip", distribution=d)
             for d in ("data", "model") for m in MODES]
    cases += [Run("mirrored", "fit", "mixed_float16", "none", "none", distribution="data"),
              Run("mirrored", "fit", "float32", "topk", "none", distribution="data"),
              Run("mirrored", "loop", "float32", "topk", "none", distribution="data"),
              Run("mirrored", "fit", "mixed_bfloat16", "none", "none", distribution="model"),
              Run("mirrored", "loop", "mixed_float16", "none", "global_clip", distribution="model"),
              Run("mirrored", "fit", "float32", "none", "accumulation", distribution="model"),
              Run("mirrored", "fit", "float32", "none", "ema", distribution="model"),
              Run("mirrored", "loop", "float32", "none", "clipvalue", distribution="model"),
              Run("mirrored", "fit", "float32", "none", "decay_excluded", distribution="model"),
              Run("mirrored", "fit", "float32", "topk", "none", distribution="model"),
              Run("mirrored", "loop", "float32", "dgc", "none", distribution="model"),
              Run("mirrored", "loop", "float32", "none", "global_clip", shard="optimizer", distribution="model")]
    cases += [Run("mirrored", m, "float32", "none", "global_clip", distribution="fsdp") for m in MODES]
    cases += [Run("mirrored", "loop", "mixed_float16", "none", "none", distribution="fsdp"),
              Run("mirrored", "loop", "float32", "none", "accumulation", distribution="fsdp"),
              Run("mirrored", "loop", "float32", "topk", "none", distribution="fsdp")]
    return list(dict.fromkeys(FAST_DISTRIBUTION_CASES + cases))


_DISTRIBUTIONS: dict = {}  # kind -> the keras.distribution object (one per process: its strategy is made once)


def distribution_for(kind: str):
    """The keras.distribution a "data", "model" or "fsdp" run is built under, as the keras.io
    guide writes them (fsdp: as keras-hub's maps lay weights on the batch axis), over the
    first 2 devices."""
    import keras

    if kind not in _DISTRIBUTIONS:
        devices = keras.distribution.list_devices()[:2]
        if kind == "data":
            mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices)
            _DISTRIBUTIONS[kind] = keras.distribution.DataParallel(device_mesh=mesh)
        elif kind == "fsdp":  # keras-hub's style: kernels laid out on "batch" (ZeRO-2 in the Trainer)
            mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"], devices)
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map["hidden_1/kernel"] = ("batch", None)
            layout_map["hidden_2/kernel"] = (None, "batch")
            _DISTRIBUTIONS[kind] = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        else:
            mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map["hidden_1/kernel"] = (None, "model")   # column-parallel
            layout_map["hidden_1/bias"] = ("model",)
            layout_map["hidden_2/kernel"] = ("model", None)   # row-parallel
            _DISTRIBUTIONS[kind] = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    return _DISTRIBUTIONS[kind]


def all_cases() -> tuple[list[Run], set[Run]]:
    """(every case of both tiers in order, the fast tier's cases)."""
    fast = fast_cases() + FAST_SHARD_CASES + FAST_TENSOR_CASES + FAST_DISTRIBUTION_CASES
    everything = fast + full_cases() + shard_cases() + tensor_cases() + distribution_cases()
    return list(dict.fromkeys(everything)), set(fast)


# -- references ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
    run: Run
    kind: str        # exact | precision | plain_compressed | relation | ema_relation | fit_vs_loop | cross_strategy | unsharded | unsplit
    why: str
    case: Run | None = None  # precision: the mixed-precision case (its tolerance)

    @property
    def precision_class(self) -> str:
        return PRECISION_CLASS.get(self.case.compressor, "stateless")

    @property
    def limits(self) -> tuple[float, float]:
        """precision: relative tolerance of (the first update, later updates and the total)."""
        return PRECISION_TOL[(self.case.precision, self.precision_class)]

    @property
    def tolerance(self) -> str:
        if self.kind == "precision":
            first, later = self.limits
            what = "the total" if self.precision_class == "feedback" else "each later update and the total"
            return f"first update within {first:.0%}, {what} within {later:.0%}"
        return f"{EXACT_TOL:g} (rtol and atol, every weight)"


def plain(run: Run, compressor: str = "none") -> Run:
    """The ground truth: one device, Keras's own optimizer in a GradientTape loop, float32,
    the same option and optimizer family; with `compressor`, its Compression takes the
    all-reduce's place between the gradients and `apply_gradients`."""
    return Run("plain", "tape", "float32", compressor, run.option, run.family, run.batch, run.steps,
               tensor=min(run.tensor, 1))


def reference_for(run: Run) -> Reference | None:
    """What `run` must equal, and why that is an honest reference (None: ground truth)."""
    if run.strategy == "plain":
        return None
    if run.shard != "none":
        return Reference(run.replace(shard="none"), "unsharded",
                         "the same case unsharded (Keras's own update on the whole variables)")
    if run.tensor > 1 and run.precision == "float32":  # mixed precision: against its float32 twin first
        return Reference(run.replace(tensor=1), "unsplit",
                         "the unsplit twin (degree 1: the same layers, whole weights)")
    if run.precision != "float32":
        if run.strategy == "multi_worker_mirrored":  # 2 replicas too, in this process
            return Reference(run.replace(precision="float32", strategy="mirrored"), "precision",
                             "the same case in float32 on mirrored", run)
        return Reference(run.replace(precision="float32"), "precision", "the same case in float32", run)
    if run.compressor in LOSSLESS:
        return Reference(plain(run), "exact", "one device, plain Keras, no compression")
    if run.option == "accumulation":
        return Reference(run.replace(option="none", family=family_for(run.compressor, "none"),
                                     batch=run.batch * ACCUMULATION, steps=run.steps // ACCUMULATION),
                         "relation", f"no accumulation, a {ACCUMULATION}x batch, the same compressor")
    if run.strategy == "default":
        return Reference(plain(run, run.compressor), "plain_compressed",
                         "one device, plain Keras with the compressor in the all-reduce's place")
    if run.option == "ema":
        return Reference(run.replace(option="none"), "ema_relation",
                         f"the EMA (momentum {EMA_MOMENTUM}) of the same case's steps without EMA")
    if run.mode == "fit":
        return Reference(run.replace(mode="loop"), "fit_vs_loop", "tfpar's loop, the same compressor")
    if run.strategy == "mirrored":
        return Reference(run.replace(mode="fit"), "fit_vs_loop", "Keras fit, the same compressor")
    return Reference(run.replace(strategy="mirrored"), "cross_strategy",
                     "mirrored (2 replicas too), the same compressor")


def needed(cases) -> list[Run]:
    """Every Run the verdicts of `cases` read: the cases and their references, recursively."""
    seen: dict[Run, None] = {}
    todo = list(cases)
    while todo:
        run = todo.pop()
        if run in seen:
            continue
        seen[run] = None
        ref = reference_for(run)
        if ref is not None:
            todo.append(ref.run)
    return sorted(seen)


# -- building a run (the one place that knows today's compressor API) -------------------

# dgc, onebit_adam and dgc_adam compute the optimizer's step themselves. True: they adopt
# the user's own optimizer (tfpar.compression.adopted, from commit 5530650 on): its momentum,
# Adam's betas and epsilon and a global clip move into the compressor, a plain SGD applies
# the step. False: the API of commit 5fabe9a and before, where the user wrote Keras SGD
# without momentum and handed the momentum, epsilon and a global clip to the compressor.
ADOPTS_USERS_OPTIMIZER = True
STEP_COMPRESSORS = ("dgc", "onebit_adam", "dgc_adam")


def user_optimizer(run: Run):
    """The optimizer the user writes for this case (what they would use without tfpar)."""
    import keras

    options = OPTION_KWARGS[run.option]
    if run.family == "adamw":
        optimizer = keras.optimizers.AdamW(LR_ADAM, weight_decay=WEIGHT_DECAY, epsilon=EPSILON, **options)
        if run.option == "decay_excluded":
            optimizer.exclude_from_weight_decay(var_names=DECAY_EXCLUDED)
        return optimizer
    if run.family == "adam":
        return keras.optimizers.Adam(LR_ADAM, epsilon=EPSILON, **options)
    return keras.optimizers.SGD(LR_SGD, momentum=MOMENTUM, **options)


def build_training(run: Run):
    """(Keras optimizer, compression or None) this case trains with: the user's optimizer,
    or, before the compressors adopted it, what the user had to write instead."""
    import keras

    from tfpar import compression as C

    name = run.compressor
    if ADOPTS_USERS_OPTIMIZER or name not in STEP_COMPRESSORS:
        return user_optimizer(run), compression_for(name)
    options = dict(OPTION_KWARGS[run.option])
    if name == "dgc":
        if run.family != "sgd":  # not something dgc can express: the user's optimizer as is
            return user_optimizer(run), C.Compression(C.DGC(ratio=1.0, momentum=MOMENTUM))
        return (keras.optimizers.SGD(LR_SGD, momentum=0.0, **options),
                C.Compression(C.DGC(ratio=1.0, momentum=MOMENTUM)))
    clip = options.pop("global_clipnorm", 0.0)
    decay = WEIGHT_DECAY if run.family == "adamw" else None
    cls = C.OneBitAdam if name == "onebit_adam" else C.DGCAdam
    return (keras.optimizers.SGD(LR_ADAM, momentum=0.0, weight_decay=decay, **options),
            cls(freeze_step=FREEZE_STEP, epsilon=EPSILON, clip_norm=clip))


def compression_for(name: str):
    """The compressor of a case, configured as tests/test_matrix.py says (dgc, onebit_adam and
    dgc_adam take their hyper-parameters from the user's optimizer)."""
    from tfpar import compression as C

    return {
        "none": None, "fp16": C.FP16(), "int8": C.Int8(seed=1), "topk": C.TopK(0.1),
        "powersgd": C.PowerSGD(rank=2), "sign": C.Sign(), "dgc": C.DGC(ratio=1.0),
        "onebit_adam": C.OneBitAdam(freeze_step=FREEZE_STEP), "dgc_adam": C.DGCAdam(freeze_step=FREEZE_STEP),
    }[name]


# -- the model and the data ----------------------------------------------------------------

def mlp(tensor: int = 0):
    """tests/test_compression.py's MLP: dense layers only, so every gradient is dense. With
    `tensor` = 0 (the classic MLP), its Dense layers are named for the layout map of
    `distribution_for`. With `tensor` = T >= 1, its two hidden layers are a Megatron pair of tfpar's exported layers
    (column-parallel, then row-parallel), T ways (the norm after them: it needs whole
    features); the same 6,660 weights."""
    import keras

    inputs = keras.Input((32,))
    if tensor:
        from tfpar import tensor_parallel as tp

        x = tp.ColumnParallelLinear(64, degree=tensor, activation="relu", name="up")(inputs)
        x = tp.RowParallelLinear(64, degree=tensor, activation="relu", name="down")(x)
        x = keras.layers.LayerNormalization()(x)
        return keras.Model(inputs, keras.layers.Dense(4)(x))
    x = keras.layers.Dense(64, activation="relu", name="hidden_1")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dense(64, activation="relu", name="hidden_2")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="logits")(x))


def initial_weights(tensor: bool = False) -> list[np.ndarray]:
    """Every run's initial weights (the classic MLP, or the Megatron one: whole values)."""
    import keras

    keras.utils.set_random_seed(SEED)
    return mlp(1 if tensor else 0).get_weights()


def dataset(batch: int, steps: int):
    """The same BATCH * STEPS examples for every run, batched by `batch`."""
    import tensorflow as tf

    rng = np.random.RandomState(1)
    x = rng.normal(size=(BATCH * STEPS, 32)).astype("float32")
    y = (np.abs(x[:, :4]).argmax(1)).astype("int32")
    assert batch * steps == len(x)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- executing a run ---------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    key: str
    outcome: str                 # trained | refused | crashed | refused_late
    message: str = ""
    error: str = ""              # exception type
    summary: str = ""            # crashed: where, and the innermost error's first words
    seconds: float = 0.0
    initial: np.ndarray | None = None
    steps: list = dataclasses.field(default_factory=list)  # flat weights after each step
    final: np.ndarray | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "outcome": self.outcome, "message": self.message,
                "error": self.error, "summary": self.summary, "seconds": round(self.seconds, 2)}


def flat(weights) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])


def execute(run: Run, strategy, weights: list[np.ndarray]) -> Result:
    """Trains `run` under `strategy` from `weights`; never raises."""
    import keras
    import tensorflow as tf

    from tfpar.errors import TfparError

    start, stage, recorded = time.perf_counter(), "start", []
    result = Result(run.key, "trained", initial=flat(weights))
    try:
        keras.mixed_precision.set_global_policy(run.precision)
        tf.random.set_seed(SEED)  # int8's stochastic rounding: the same noise in every run
        if run.strategy == "plain":
            stage = "train"
            result.steps, result.final = _plain(run, weights)
        else:
            train = _start(run, strategy, weights)
            stage = "train"
            result.steps, result.final = train(recorded)
    except TfparError as e:  # before the first step: at start, or by fit before its first batch
        early = stage == "start" or not recorded
        result.outcome = "refused" if early else "refused_late"
        result.message, result.error = str(e), type(e).__name__
    except Exception as e:  # pylint: disable=broad-except  (anything else is a failure)
        result.outcome = "crashed"
        result.error = type(e).__name__
        inner = innermost(str(e))
        named = inner if re.match(r"\w+: ", inner) else f"{type(e).__name__}: {inner}"
        result.summary = f"in {stage}: {named}"
        result.message = f"{e}\n{traceback.format_exc(limit=-4)}"
    finally:
        keras.mixed_precision.set_global_policy("float32")
        if run.distribution:
            import tfpar

            keras.distribution.set_distribution(None)
            tfpar.distribution.disable()
        result.seconds = time.perf_counter() - start
    return result


def innermost(message: str, limit: int = 300) -> str:
    """The innermost error of a (TensorFlow "in user code:") message: from its last
    "SomeError: ..." line on, escapes and blank space squeezed."""
    message = re.sub(r"\x1b\[[0-9;]*m|\[1m|\[0m", "", message)
    lines = message.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*\w*(Error|Exception)\w*: \S", line)]
    text = " ".join(" ".join(lines[starts[-1]:] if starts else lines).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _start(run: Run, strategy, weights) -> Callable[[], tuple[list, np.ndarray]]:
    """Everything before the first step (where a refusal belongs); returns the training."""
    import keras

    from tfpar.compression import compress_fit
    from tfpar.data.pipeline import same_batch_for_groups
    from tfpar.loop import Trainer

    if run.distribution:  # as a Keras user writes it: no strategy, the distribution in effect
        import tfpar

        tfpar.distribution.enable()
        keras.distribution.set_distribution(distribution_for(run.distribution))
        strategy = tfpar.distribution.current_plan().strategy
    with contextlib.nullcontext() if run.distribution else strategy.scope():
        model = mlp(run.tensor)
        model.set_weights(weights)  # a split model takes the whole weights (and splits them)
        optimizer, compression = build_training(run)
        if run.mode == "fit":
            model.compile(optimizer=optimizer, loss=loss())  # fp16: Keras wraps it (LossScaleOptimizer)
            if compression is not None:
                compress_fit(model, compression)
        elif run.precision == "mixed_float16":  # as model.compile does for fit
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    trainer = None
    if run.mode == "loop":
        trainer = Trainer(model, optimizer, loss(), strategy=None if run.distribution else strategy,
                          compression=compression,  # under a distribution, unnamed: as its layout map says
                          shard=None if run.distribution and run.shard == "none" else run.shard)

    def train(steps: list):
        """Trains; `steps` collects the weights after each step (it stays empty when the
        first step never ran)."""
        record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(
            flat(model.get_weights())))
        data = dataset(run.batch, run.steps)
        if trainer is None:
            model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[record])
        elif run.distribution:  # a plain dataset: the Trainer distributes it as the model's strategy needs
            trainer.fit(data, steps=run.steps, callbacks=[record])
        elif run.tensor > 1:  # T = all replicas: every replica the whole batch
            trainer.fit(strategy.distribute_datasets_from_function(lambda context: same_batch_for_groups(
                data, context.num_replicas_in_sync // context.num_input_pipelines)), steps=run.steps,
                callbacks=[record])
        else:
            trainer.fit(strategy.experimental_distribute_dataset(data), steps=run.steps, callbacks=[record])
        return steps, flat(model.get_weights())

    return train


def _plain(run: Run, weights):
    """Keras alone: one device, GradientTape, `apply_gradients`, and at the end what `fit`
    does at the end (`finalize_variable_values`: EMA weights into the model)."""
    import tensorflow as tf

    from tfpar.compression import Compression

    model = mlp(run.tensor)
    model.set_weights(weights)
    optimizer, loss_fn, steps = user_optimizer(run), loss(), []
    variables = model.trainable_variables
    compression = compression_for(run.compressor)
    if compression is not None:  # one replica: what it sends is what comes back
        compression = compression if isinstance(compression, Compression) else Compression(compression)
        compression.build(variables)
        aggregate = tf.function(lambda grads: compression(grads, variables))
    for x, y in dataset(run.batch, run.steps):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, variables)
        if compression is not None:
            grads = aggregate(grads)
        optimizer.apply_gradients(zip(grads, variables))
        steps.append(flat(model.get_weights()))
    optimizer.finalize_variable_values(model.trainable_variables)
    return steps, flat(model.get_weights())


# -- verdicts ------------------------------------------------------------------------------

# A refusal says what to do: an imperative, or a concrete call, option or config flag.
FIX_WORDS = re.compile(r"\b(use|with|pass|set|leave|add|drop|remove|instead|choose|call|turn|give)\b"
                       r"|--config\.\w|\b\w+\(|\b\w+=", re.I)


def names_of(run: Run) -> dict[str, tuple[str, ...]]:
    """What a refusal may name, per axis: it must name at least one (and a fix)."""
    option = {"global_clip": ("global_clipnorm", "clip"), "clipnorm": ("clipnorm",),
              "clipvalue": ("clipvalue",), "accumulation": ("gradient_accumulation", "accumulat"),
              "ema": ("ema",), "weight_decay": ("weight_decay", "adamw"),
              "decay_excluded": ("weight_decay", "adamw", "exclude"), "none": ()}[run.option]
    return {
        "compressor": () if run.compressor == "none" else (run.compressor, run.compressor.replace("_", "-")),
        "option": option,
        "precision": {"float32": (), "mixed_bfloat16": ("bfloat16", "bf16", "mixed"),
                      "mixed_float16": ("float16", "fp16", "loss scale", "lossscale", "mixed")}[run.precision],
        "strategy": {"default": (), "mirrored": ("mirrored",),
                     "multi_worker_mirrored": ("multi_worker", "multi-worker")}[run.strategy],
        "mode": {"fit": ("fit",), "loop": ("trainer", "loop")}[run.mode],
        "optimizer": {"sgd": ("sgd",), "adam": ("adam",), "adamw": ("adamw", "adam")}[run.family],
        "shard": () if run.shard == "none" else ("shard",),
        "tensor": ("tensor", "split") if run.tensor > 1 or run.distribution == "model" else (),
        "distribution": {"": (), "data": ("dataparallel", "distribution"),
                         "model": ("modelparallel", "distribution", "layout"),
                         "fsdp": ("modelparallel", "distribution", "layout", "batch", "shard")}[run.distribution],
    }


@dataclasses.dataclass
class Verdict:
    outcome: str          # equal | refused | FAIL
    reference: str        # what it was compared with (or the refusal's gist)
    tolerance: str
    detail: str           # numbers, or the message
    root: str = ""        # FAIL: the run where it fails (this case, or a reference upstream)
    cause: str = ""       # FAIL: what fails there

    @property
    def passed(self) -> bool:
        return self.outcome in ("equal", "refused")


def _gist(message: str, limit: int = 160) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def compare(case: Result, ref: Result, reference: Reference, compressor: str = "none") -> tuple[bool, str]:
    """(within tolerance, the numbers); `compressor`: the case's (see ROUNDING)."""
    for result in (case, ref):
        if not np.isfinite(result.final).all() or not all(np.isfinite(s).all() for s in result.steps):
            return False, f"non-finite weights in {result.key}"
    moved = np.abs(ref.final - ref.initial).max()
    if moved < MOVED:
        return False, f"the reference moved only {moved:.2e} (< {MOVED:g}): nothing to compare"
    if reference.kind == "precision":
        first_tol, later_tol = reference.limits
        if len(case.steps) != len(ref.steps):
            return False, f"{len(case.steps)} steps recorded, the reference {len(ref.steps)}"
        errors = []  # (step, each step's update against the float32 one), where either moved
        for k, (a1, b1) in enumerate(zip(case.steps, ref.steps)):
            a0, b0 = (case.initial, ref.initial) if k == 0 else (case.steps[k - 1], ref.steps[k - 1])
            a, b = a1 - a0, b1 - b0
            if np.abs(a).max() > 0 or np.abs(b).max() > 0:
                errors.append((k + 1, np.linalg.norm(a - b) / np.linalg.norm(b) if np.abs(b).max() > 0 else np.inf))
        (step, first), later = errors[0], max((e for _, e in errors[1:]), default=0.0)
        a, b = case.final - case.initial, ref.final - ref.initial
        total = np.linalg.norm(a - b) / np.linalg.norm(b)
        held = total if reference.precision_class == "feedback" else max(later, total)
        return first <= first_tol and held <= later_tol, (
            f"update {step} off by {first:.2%}, later ones by up to {later:.2%}, the total by {total:.2%}")
    expected = ref.final
    if reference.kind == "ema_relation":  # the steps as without EMA, the EMA of them at the end
        if len(case.steps) != len(ref.steps):
            return False, f"{len(case.steps)} steps recorded, the run without EMA {len(ref.steps)}"
        excess = max((np.abs(a - b) / (EXACT_TOL + EXACT_TOL * np.abs(b))).max() for a, b in zip(case.steps, ref.steps))
        if excess > 1.0:
            return False, f"the steps differ from the run without EMA ({excess:.2g}x the tolerance)"
        expected = ema_of(ref.steps)
    gap = np.abs(case.final - expected)
    atol = max(EXACT_TOL, ROUNDING.get(compressor, 0.0) * moved)
    excess = (gap / (atol + EXACT_TOL * np.abs(expected))).max()
    allowance = f", {compressor}'s rounding: atol {atol:.2g}" if atol > EXACT_TOL else ""
    return excess <= 1.0, f"max |w - w_ref| {gap.max():.2e} ({excess:.2g}x the tolerance; moved {moved:.2e}{allowance})"


def ema_of(steps: list) -> np.ndarray:
    """Keras's EMA of the weights after each step: the first step's weights, then
    average <- m * average + (1 - m) * weights (BaseOptimizer._update_model_variables_moving_average)."""
    average = steps[0]
    for weights in steps[1:]:
        average = EMA_MOMENTUM * average + (1 - EMA_MOMENTUM) * weights
    return average


def verdict(run: Run, results: dict[str, Result], _visiting: frozenset = frozenset()) -> Verdict:
    """The case's outcome: equal (to its reference, which holds up itself), refused (at
    start, naming the combination and a fix), or FAIL."""
    result = results[run.key]
    reference = reference_for(run)

    def fail(described: str, tolerance: str, cause: str) -> Verdict:
        return Verdict("FAIL", described, tolerance, cause, run.key, cause)

    if result.outcome == "refused":
        names = names_of(run)
        named = sorted(axis for axis, words in names.items() if any(w in result.message.lower() for w in words))
        if not named or not FIX_WORDS.search(result.message):
            return fail("", "", f"refused without naming the combination or a fix ({result.error}): "
                        f"{_gist(result.message, 300)}")
        return Verdict("refused", _gist(result.message), "", f"{result.error}; names {', '.join(named)}")
    if result.outcome == "refused_late":
        return fail("", "", f"refused after training started ({result.error}): {_gist(result.message, 300)}")
    if result.outcome == "crashed":
        return fail("", "", f"crashed {result.summary or _gist(result.message, 300)}")
    if reference is None:
        return Verdict("equal", "(ground truth)", "", "")
    tolerance = reference.tolerance
    described = f"{reference.why} ({reference.run.key})"
    ref = results[reference.run.key]
    if ref.outcome != "trained":
        return fail(described, tolerance, f"no reference: {reference.run.key} was {ref.outcome} "
                    f"({ref.error}): {ref.summary or _gist(ref.message, 300)}")
    ok, numbers = compare(result, ref, reference, run.compressor)
    if reference.run not in _visiting and reference_for(reference.run) is not None:
        upstream = verdict(reference.run, results, _visiting | {run})
        if upstream.outcome != "equal":  # then this comparison proves nothing
            return Verdict("FAIL", described, tolerance,
                           f"{numbers}, but its reference fails: {upstream.root}: {upstream.cause}",
                           upstream.root, upstream.cause)
    if not ok:
        if reference.kind in ("fit_vs_loop", "cross_strategy"):  # neither side is the truth
            return Verdict("FAIL", described, tolerance, f"mismatch: {numbers}",
                           f"{run.key} vs {reference.run.key}", f"the two disagree: {numbers}")
        return fail(described, tolerance, f"mismatch: {numbers}")
    return Verdict("equal", described, tolerance, numbers)
