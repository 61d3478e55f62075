"""The training config: its defaults, and the checks that name a bad key at start.

Config files in configs/ start from `base_config()` and change what they need; the binary
overrides any field with `--config.train.steps=2000` style flags. The dict is locked, so
a misspelt key fails at start ("Key 'stepz' does not exist").

Config files are Python code and run when loaded: load only files you trust.

Example:
    >>> config = base_config(); config.train.steps = 100
    >>> validate(config)
"""

from __future__ import annotations

import ml_collections

from tfpar.errors import ConfigError  # noqa: F401  (re-exported: tfpar.config.ConfigError)
from tfpar.parallel_config import parallel_block, validate_parallel


MODES = ("fit", "loop")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
SCHEDULES = ("cosine", "constant")


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "fit"                      # fit: Keras fit + injected strategy; loop: tfpar.Trainer
    c.strategy = "auto"
    c.strategy_args = ml_collections.ConfigDict(dict(
        virtual_devices=0, all_reduce="auto", num_packs=1, tpu="", timeout_s=0.0,
        connect_timeout_s=60.0,
        # parameter_server: split large variables over the ps tasks (0 = off), either in
        # a fixed number of shards or in shards of at least this many bytes.
        partition_shards=0, partition_min_bytes=0))
    c.precision = "float32"             # or mixed_bfloat16 / mixed_float16
    # Gradient compression (fit and loop): none | fp16 | bf16 | int8 | topk | powersgd | sign
    # | dgc (optimizer sgd: its momentum and clip_norm move into dgc) | onebit_adam | dgc_adam
    # (loop; optimizer adamw: its betas, epsilon and clip_norm move into the compressor)
    # | auto (times the link and the compute at start, picks what reaches quality soonest; loop).
    c.compression = "none"
    c.compression_args = ml_collections.ConfigDict(dict(
        ratio=0.01,             # topk / dgc / dgc_adam: fraction of entries sent
        rank=4,                 # powersgd: rank of the approximation
        min_size=1024,          # tensors with fewer elements go uncompressed
        warmup_steps=0,         # first steps uncompressed (loop mode only)
        warmup_compression="none",  # those steps (onebit_adam: its Adam warm-up) in float32 (none) or fp16 / bf16
        overrides="",           # "regex=name,regex=name" over variable paths, first match wins
        skip="",                # regexes (comma-separated) replacing the default skip list; none: skip nothing
        reset_on_restore=False,  # True: error-feedback state is not checkpointed
        embeddings=False,       # also compress the embeddings
        momentum=ml_collections.config_dict.placeholder(float),  # dgc_adam (unset: 0): its local
                                # velocity's momentum (dgc takes optimizer.momentum)
        clip_norm=0.0,          # refused: clipping is optimizer.clip_norm for every compressor
        masking=True,           # dgc / dgc_adam: momentum-factor masking
        sparsity_warmup_steps=0,  # dgc: density ramp 25% -> ratio over these steps
        stages=4,               # dgc: stages of that ramp
        rank_schedule="",       # powersgd: "8@0,4@300" (steps after warmup_steps)
        factor_dtype="float32",  # powersgd: P and Q in float32 or bfloat16 (half the bytes; not on GPUs)
        freeze_step=100,        # onebit_adam / dgc_adam: Adam warm-up steps before compressed momentum
        exchange_every=1,       # onebit_adam: send the 1-bit momentum every K-th step (K x fewer bytes)
        auto_total_steps=0,     # auto: the run's length (0: train.steps; its powersgd starts after 10%)
        auto_quality_steps=0))  # auto: the uncompressed steps whose loss is the goal (0: the run's length)
    c.seed = 0
    c.model = "gpt"                     # a name of tfpar.models.MODELS: gpt | encoder | vit
    c.model_args = ml_collections.ConfigDict(dict(dim=128, depth=2, heads=4, mlp_ratio=4, dropout=0.0))
    c.data = ml_collections.ConfigDict(dict(
        name="corpus", files="", seq_len=128, data_dir="", augment=False))  # names: tfpar.data.NAMES
    c.train = ml_collections.ConfigDict(dict(
        steps=600, batch_size=32, steps_per_loop=10, log_every=50, checkpoint_every=200,
        eval_every=0,                   # evaluate every N steps during training (0: at the end only)
        eval_batch_size=64, eval_examples=0, xla=True,
        accumulate=1,                   # loop: micro-batches (of batch_size) summed per optimizer step
        nonfinite="stop",               # tfpar.loop.nonfinite.POLICIES: stop (name the step) | skip (loop) | ignore
        profile_steps="",               # "START,STOP": TensorBoard profile of those steps, every worker, and
                                        # their breakdown (WORKDIR/profile; tfpar.profiling). "": off, no cost
        stragglers=True,                # loop, 2+ workers: each worker's own step time gathered at each
                                        # report; the slowest named when it lags (two timestamps a step)
        mfu=False))                     # count FLOPs and the peak at start: MFU in the line and TensorBoard
                                        # (on by itself with profile_steps)
    c.optimizer = ml_collections.ConfigDict(dict(
        name="adamw", learning_rate=3e-3, warmup_steps=60, schedule="cosine", min_lr_ratio=0.1,
        weight_decay=0.01,              # decoupled, every optimizer (0: none)
        momentum=0.9,                   # sgd (nesterov when > 0)
        beta_1=0.9, beta_2=0.98, epsilon=1e-7,  # adamw, lamb
        clip_norm=1.0,                  # the global norm of the mean gradient (0: off), every path
        label_smoothing=0.0))
    c.sample = ml_collections.ConfigDict(dict(prompt="def ", length=200, temperature=0.7))
    c.parallel = parallel_block()       # pipeline stages, tensor, shard: tfpar.parallel_config
    return c


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Locks the config so that an override of a key that does not exist fails."""
    config.lock()
    return config


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}: {message}")


def validate(config) -> None:
    """Raises ConfigError naming the first key whose value cannot work."""
    _validate_run(config)
    _validate_compression(config)
    _validate_model(config)
    _validate_data(config)
    _validate_train(config)
    _validate_optimizer(config.optimizer)
    validate_parallel(config)


def _validate_run(config) -> None:
    """mode, strategy, strategy_args, precision."""
    from tfpar.strategy.factory import normalize_name

    _require(config.mode in MODES, "mode", f"{config.mode!r} is not one of {', '.join(MODES)}.")
    try:
        normalize_name(config.strategy)
    except ValueError as e:
        raise ConfigError(f"config.strategy: {e}") from None
    sa = config.strategy_args
    _require(sa.partition_shards >= 0 and sa.partition_min_bytes >= 0, "strategy_args.partition_shards",
             "partition_shards and partition_min_bytes must be >= 0 (0 = off).")
    _require(not (sa.partition_shards and sa.partition_min_bytes), "strategy_args.partition_shards",
             "set partition_shards or partition_min_bytes, not both.")
    _require(config.precision in PRECISIONS, "precision",
             f"{config.precision!r} is not one of {', '.join(PRECISIONS)}.")


def _validate_compression(config) -> None:
    """compression, compression_args (each compressor checks its own, see check_config)."""
    from tfpar.compression import NAMES, check_config
    from tfpar.compression.onebit_adam import max_exchange_every
    from tfpar.compression.policy import WARMUP_COMPRESSORS
    from tfpar.compression.powersgd import FACTOR_DTYPES

    _require(config.compression in NAMES, "compression",
             f"{config.compression!r} is not one of {', '.join(NAMES)}.")
    problem = check_config(config)
    _require(problem is None, "compression", str(problem))
    ca = config.compression_args
    _require(0 < ca.ratio <= 1, "compression_args.ratio", f"must be in (0, 1], got {ca.ratio}.")
    _require(ca.rank >= 1, "compression_args.rank", f"must be >= 1, got {ca.rank}.")
    _require(ca.factor_dtype in FACTOR_DTYPES, "compression_args.factor_dtype",
             f"{ca.factor_dtype!r} is not one of {', '.join(FACTOR_DTYPES)}.")
    sends_factors = config.compression == "powersgd" or "powersgd" in ca.overrides.lower()
    _require(ca.factor_dtype == "float32" or sends_factors,
             "compression_args.factor_dtype",
             f"is PowerSGD's wire dtype; {config.compression} sends no PowerSGD factors.")
    _require(ca.min_size >= 0 and ca.warmup_steps >= 0, "compression_args.min_size",
             "min_size and warmup_steps must be >= 0.")
    _require(not (ca.warmup_steps and config.mode == "fit"), "compression_args.warmup_steps",
             "warm-up steps need --config.mode=loop (Keras fit traces one train step).")
    start = str(ca.warmup_compression).lower()
    adam_start = config.compression in ("onebit_adam", "dgc_adam")  # their Adam warm-up is the start
    _require(start in WARMUP_COMPRESSORS, "compression_args.warmup_compression",
             f"{ca.warmup_compression!r} is not one of {', '.join(WARMUP_COMPRESSORS)} (the start "
             "sends every tensor dense).")
    _require(start == "none" or ca.warmup_steps or adam_start,
             "compression_args.warmup_compression",
             "compresses the uncompressed start: give it --config.compression_args.warmup_steps > 0.")
    _require(not (ca.warmup_steps and adam_start), "compression_args.warmup_steps",
             f"does not apply to {config.compression}: its Adam warm-up is the uncompressed start; "
             "set its length with --config.compression_args.freeze_step.")
    _require(not (ca.sparsity_warmup_steps and config.compression != "dgc"), "compression_args.sparsity_warmup_steps",
             f"is dgc's density ramp; {config.compression} has none (dgc_adam sends `ratio` from freeze_step on).")
    _require(ca.exchange_every >= 1, "compression_args.exchange_every",
             f"must be >= 1 (1: exchange the momentum every step), got {ca.exchange_every}.")
    most = max_exchange_every()
    _require(ca.exchange_every <= most, "compression_args.exchange_every",
             f"must be <= {most} = 1 / (1 - beta_1) for onebit_adam's beta_1 = 0.9 (past it the held "
             f"momentum flips sign every exchange), got {ca.exchange_every}.")
    _require(ca.exchange_every == 1 or config.compression == "onebit_adam", "compression_args.exchange_every",
             f"applies to onebit_adam only (its momentum is what waits between exchanges), not "
             f"{config.compression}.")
    own_start = config.compression in ("dgc", "auto") or (config.compression == "none" and not ca.overrides)
    _require(start == "none" or not own_start, "compression_args.warmup_compression",
             f"applies to fp16/bf16/int8/topk/powersgd/sign/onebit_adam/dgc_adam (or overrides), not "
             f"{config.compression} (dgc and auto start their own way; none has no start).")
    _refuse_unread_arguments(config.compression, ca)


OVERRIDABLE = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "sign")  # take compression_args.overrides
# compression_args that only some compressors read (an override naming one counts). Others
# would ignore a value set for them; these are refused instead. The checks above name the rest.
ARGUMENT_READERS = {"ratio": ("topk", "dgc", "dgc_adam"), "rank": ("powersgd",), "rank_schedule": ("powersgd",),
                    "momentum": ("dgc_adam",), "masking": ("dgc", "dgc_adam"), "stages": ("dgc",),
                    "freeze_step": ("onebit_adam", "dgc_adam")}
# optimizer keys that only some optimizers read (a value set for another is refused)
OPTIMIZER_READERS = {"momentum": ("sgd",), "beta_1": ("adamw", "lamb"), "beta_2": ("adamw", "lamb"),
                     "epsilon": ("adamw", "lamb")}


def _refuse_unread_arguments(compression: str, args) -> None:
    """E.g. --config.compression=topk --config.compression_args.rank=8: rank is PowerSGD's."""
    from tfpar.compression import CompressionError, override_items

    try:  # the others refuse overrides (or drop them: auto)
        overrides = override_items(args.overrides) if compression in OVERRIDABLE else []
    except CompressionError:
        overrides = []  # a malformed item: from_config names it at build
    chosen = {compression, *(name.lower() for _, name in overrides)}
    defaults = base_config().compression_args
    _require(args.clip_norm == defaults.clip_norm, "compression_args.clip_norm",
             "clipping is --config.optimizer.clip_norm for every compressor (the global norm of the "
             f"mean gradient, in every phase): drop compression_args.clip_norm={args.clip_norm} and set "
             f"--config.optimizer.clip_norm={args.clip_norm}.")
    for key, readers in ARGUMENT_READERS.items():
        _require(args[key] == defaults[key] or bool(chosen & set(readers)), f"compression_args.{key}",
                 f"is read by {', '.join(readers)} only; {compression} would ignore {args[key]!r}: "
                 f"drop it, or choose one of those (or name one in compression_args.overrides).")
    _require(not (args.rank_schedule and args.rank != defaults.rank), "compression_args.rank",
             f"is ignored when rank_schedule is set ({args.rank_schedule!r}): drop rank, or the schedule.")


def _validate_model(config) -> None:
    from tfpar.models import MODELS

    _require(config.model in MODELS, "model", f"{config.model!r} is not one of {', '.join(MODELS)}.")
    fields = _model_fields(config.model)
    for key in config.model_args:
        _require(key in fields, f"model_args.{key}",
                 f"{config.model} has no field {key!r}; its fields are {', '.join(sorted(fields))}.")
    for key in ("dim", "depth", "heads"):
        if key in config.model_args:
            _require(config.model_args[key] > 0, f"model_args.{key}", "must be positive.")
    if "dim" in config.model_args and "heads" in config.model_args:
        _require(config.model_args.dim % config.model_args.heads == 0, "model_args.heads",
                 f"dim {config.model_args.dim} is not divisible by heads {config.model_args.heads}.")


def _validate_data(config) -> None:
    from tfpar.data import check_name
    from tfpar.errors import DataError

    try:
        check_name(config.data.name)
    except DataError as e:
        raise ConfigError(f"config.data.name: {e}") from None
    _require(config.data.seq_len > 1, "data.seq_len", "must be at least 2.")


def _validate_train(config) -> None:
    """Any steps and intervals work together: the controller cuts runs at every interval."""
    from tfpar.loop.nonfinite import POLICIES

    t = config.train
    for key in ("steps", "batch_size", "steps_per_loop", "log_every", "checkpoint_every", "eval_batch_size"):
        _require(isinstance(t[key], int) and t[key] > 0, f"train.{key}", f"must be a positive integer, got {t[key]!r}.")
    _require(isinstance(t.eval_every, int) and t.eval_every >= 0, "train.eval_every",
             f"must be an integer >= 0 (0: evaluate at the end only), got {t.eval_every!r}.")
    _require(t.eval_examples >= 0, "train.eval_examples", "must be >= 0 (0 evaluates them all).")
    _require(t.nonfinite in POLICIES, "train.nonfinite",
             f"{t.nonfinite!r} is not one of {', '.join(POLICIES)}.")
    _require(isinstance(t.accumulate, int) and t.accumulate >= 1, "train.accumulate",
             f"must be a positive integer (1: none), got {t.accumulate!r}.")
    _require(t.accumulate == 1 or config.mode == "loop", "train.accumulate",
             "micro-batches per step need tfpar's loop: add --config.mode=loop (in Keras fit, "
             "a larger --config.train.batch_size is the same update).")
    _require(not (t.nonfinite == "skip" and config.mode == "fit"), "train.nonfinite",
             "skip needs tfpar's loop (Keras fit cannot skip one update): add --config.mode=loop, "
             "or use stop.")
    from tfpar.profiling.window import parse_steps

    window = parse_steps(t.profile_steps)
    _require(window is None or window[1] <= t.steps, "train.profile_steps",
             f"{t.profile_steps!r} ends after the run's last step ({t.steps}).")
    _require(window is None or config.strategy != "parameter_server", "train.profile_steps",
             "parameter_server runs its steps on the workers through a coordinator, where the chief "
             "cannot mark them: profile its workers with tf.profiler.experimental.client.trace, or "
             "profile a synchronous strategy.")


def _validate_optimizer(o) -> None:
    from tfpar.recipes import OPTIMIZERS

    _require(o.name in OPTIMIZERS, "optimizer.name", f"{o.name!r} is not one of {', '.join(OPTIMIZERS)}.")
    _require(o.learning_rate > 0, "optimizer.learning_rate", "must be positive.")
    _require(o.schedule in SCHEDULES, "optimizer.schedule", f"{o.schedule!r} is not one of {', '.join(SCHEDULES)}.")
    _require(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0.")
    _require(o.clip_norm >= 0, "optimizer.clip_norm", "must be >= 0 (0 turns clipping off).")
    _require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0 (0: none).")
    _require(0 <= o.label_smoothing < 1, "optimizer.label_smoothing", "must be in [0, 1).")
    defaults = base_config().optimizer
    for key, readers in OPTIMIZER_READERS.items():
        _require(o[key] == defaults[key] or o.name in readers, f"optimizer.{key}",
                 f"is read by {', '.join(readers)} only; {o.name} would ignore {o[key]!r}: drop it, "
                 f"or choose --config.optimizer.name={readers[0]}.")


def _model_fields(model: str) -> set[str]:
    """The keyword arguments of the model class (its config fields)."""
    import inspect

    from tfpar.models import MODELS

    parameters = inspect.signature(MODELS[model].__init__).parameters.items()
    return {name for name, p in parameters if name not in ("self", "name")
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
