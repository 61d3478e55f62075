"""One training run from a config: strategy, data, model, optimizer, compression, the outer
loop (Keras fit or tfpar's loop), the final evaluation and a text sample. `tfpar-train`
(tfpar.train) parses the flags and calls `train_and_evaluate`.

Example:
    >>> config = runpy.run_path("configs/gpt_tiny.py")["get_config"]()
    >>> results = train_and_evaluate(config, "/tmp/run")      # resumes from /tmp/run if it can
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Callable

from tfpar import run_parallel
from tfpar.config import ConfigError


def _say(message: str) -> None:
    print(message, flush=True)


def _create_strategy(config):
    import tfpar
    from tfpar.strategy import partitioner

    args = config.strategy_args
    return tfpar.create_strategy(
        config.strategy,
        virtual_devices=args.virtual_devices or None,
        all_reduce=args.all_reduce,
        num_packs=args.num_packs,
        tpu=args.tpu or None,
        timeout_s=args.timeout_s or None,
        connect_timeout_s=args.connect_timeout_s,
        variable_partitioner=partitioner(args.partition_shards, args.partition_min_bytes),
    )


def compression_for(run: _Run, model):
    from tfpar import compression as compression_lib
    from tfpar import data as data_lib

    config = run.config
    if run.asynchronous and config.compression != "none":
        raise ConfigError("config.compression: parameter_server has no all-reduce to compress "
                          "(each worker sends its own gradients). Use multi_worker_mirrored, or "
                          "--config.compression=none.")
    args = dict(config.compression_args)
    if config.compression.lower() == "auto":  # its prediction needs the run's length and size
        args["auto_total_steps"] = args["auto_total_steps"] or config.train.steps
        args["auto_tokens"] = (data_lib.per_replica_batch_size(config.train.batch_size, run.info.replicas)
                               * _positions(model, run.splits.info))
    return compression_lib.from_config(config.compression, **args)


def _positions(model, info: dict) -> int:
    """Rows one example puts through the model's matrices: its tokens, or its image patches."""
    if info["kind"] == "image":
        return (model.config.image_size // model.config.patch_size) ** 2
    return info["max_len"]


@dataclasses.dataclass
class _Run:
    """What the steps of one training run share."""

    config: Any
    workdir: str
    strategy: Any
    info: Any
    splits: Any
    say: Callable[[str], None]
    asynchronous: bool
    model: Any = None
    optimizer: Any = None
    compression: Any = None
    trainer: Any = None
    checkpoints: Any = None
    augment: Any = None
    eval_data: Any = None
    measured: dict = dataclasses.field(default_factory=dict)  # the profile window's summary

    @property
    def corpus(self) -> bool:
        return self.splits.info["kind"] == "lm" and self.config.data.name == "corpus"

    @property
    def unit(self) -> str:
        return "tok" if self.corpus else "ex"


def setup(config, workdir: str) -> _Run:
    """Strategy first (before anything touches TensorFlow), then the checks and the data."""
    import keras

    import tfpar
    from tfpar import data as data_lib

    strategy = _create_strategy(config)
    info = tfpar.describe(strategy)
    say = _say if info.is_chief else (lambda message: None)
    say(f"tfpar: {info.kind}, {info.replicas} replica(s), {info.num_workers} worker(s); "
        f"workdir {workdir}")
    if config.precision != "float32":
        keras.mixed_precision.set_global_policy(config.precision)
    keras.utils.set_random_seed(config.seed)
    asynchronous = info.kind == "parameter_server"
    if asynchronous and config.mode != "loop":
        raise ConfigError("config.mode: parameter_server trains with tfpar's own loop (Keras fit "
                          "does not support it, keras#18624). Add --config.mode=loop.")
    t = config.train
    run_parallel.check_devices(config, strategy, info)
    replicas = run_parallel.data_replicas(config, info)  # those that see different batches
    rows = data_lib.per_replica_batch_size(t.batch_size, replicas)
    if rows % config.parallel.microbatches:
        raise ConfigError(f"config.parallel.microbatches: {config.parallel.microbatches} does not divide "
                          f"the {rows} rows each pipeline gets per step (train.batch_size "
                          f"{t.batch_size} over {replicas} pipeline(s)): use a divisor of {rows}.")
    if not asynchronous:  # checked now, not after training (the ps chief evaluates alone)
        data_lib.per_replica_batch_size(t.eval_batch_size, replicas)
    splits = data_lib.load(config.data.name, seq_len=config.data.seq_len, files=config.data.files or None,
                           data_dir=config.data.data_dir or None, seed=config.seed)
    return _Run(config, workdir, strategy, info, splits, say, asynchronous)


def fit_jit_compile(xla: bool, kind: str, replicas: int) -> tuple[bool, str | None]:
    """What `train.xla` gives Keras fit's `jit_compile`, and the line that says so when
    the config asked for XLA and does not get it (None otherwise).

    Keras 3.15 resolves only "auto" (off under any strategy); an explicit True stays on
    and jit-compiles Keras's whole step, `strategy.run` included. Under TPUStrategy that
    is an XLA function on the host around the TPU program (keras#19448: NotFoundError),
    and the TPU compiles every step with XLA anyway; with 2+ replicas tfpar's
    steps_per_execution fix leaves that step unwrapped, which dropped a True silently.

    Example:
        >>> fit_jit_compile(True, "tpu", 1)[0], fit_jit_compile(True, "default", 1)
        (False, (True, None))
    """
    if not xla:
        return False, None
    if kind == "tpu":
        return False, ("tfpar: train.xla=True: Keras fit compiles without jit_compile under "
                       "TPUStrategy: the TPU compiles every step with XLA already, and "
                       "jit_compile=True would wrap strategy.run in an XLA function on the host "
                       "(keras#19448).")
    if replicas > 1:
        return False, (f"tfpar: train.xla=True: Keras fit compiles without jit_compile on "
                       f"{replicas} replicas (its step wraps strategy.run, which XLA does not "
                       "compile across devices); --config.mode=loop jit-compiles each replica's "
                       "forward + backward.")
    return True, None


def _build_model(run: _Run):
    """(model, compression, stage plan): the model built where config.parallel puts it
    (a pipeline's devices, split over tensor-parallel groups, or the strategy's scope)."""
    import keras

    import tfpar
    from tfpar import recipes
    from tfpar.compression import compress_fit

    config, t = run.config, run.config.train
    jit, jit_note = fit_jit_compile(t.xla, run.info.kind, run.info.replicas)
    if jit_note and config.mode == "fit":
        run.say(jit_note)
    stage_plan = None
    if config.parallel.stages > 1:  # balanced on a throwaway copy; the model starts from the seed
        stage_plan = run_parallel.plan(config, run.strategy, run.splits.info, _sample_inputs(run))
        keras.utils.set_random_seed(config.seed)
    with run_parallel.build_scope(config, run.strategy, stage_plan) as strategy:
        model = run_parallel.build_model(config, run.splits.info)
        model.compile(optimizer=recipes.build_optimizer(config.optimizer, t.steps),
                      loss=recipes.SmoothedSparseCrossentropy(config.optimizer.label_smoothing),
                      steps_per_execution=t.steps_per_loop, jit_compile=jit)
        compression = compression_for(run, model)
        if config.mode == "fit":
            if compression is not None:  # dgc: its SGD's momentum moves in, a plain SGD applies
                compress_fit(model, compression)
            model.optimizer.build(model.trainable_variables)  # fp16: a LossScaleOptimizer
    if strategy is not run.strategy:  # a pipeline trains under its plan's strategy
        run.strategy, run.info = strategy, tfpar.describe(strategy)
    return model, compression, stage_plan


def _sample_inputs(run: _Run):
    """One micro-batch of training inputs (to balance a pipeline by flops or seconds)."""
    t, p = run.config.train, run.config.parallel
    rows = max(t.batch_size // run_parallel.data_replicas(run.config, run.info) // p.microbatches, 1)
    return next(iter(run.splits.train.build(training=True).batch(rows).take(1)))[0]


def build(run: _Run) -> None:
    """Model, optimizer, compression, Trainer (loop mode) and checkpoints, restored."""
    from tfpar import recipes
    from tfpar.checkpoints import Checkpoints
    from tfpar.compression import Auto
    from tfpar.loop import Trainer

    config, t = run.config, run.config.train
    model, compression, stage_plan = _build_model(run)
    optimizer = model.optimizer
    state = compression.checkpoint_items() if compression is not None else {}
    if config.mode == "loop":  # onebit_adam, dgc_adam, dgc: the Trainer's optimizer applies their step
        if isinstance(compression, Auto):  # a resumed run keeps its decision: restored before build
            Checkpoints(run.workdir, run.info.is_chief, **compression.checkpoint_items()).restore()
        run.trainer = Trainer(model, optimizer, model.loss, run.strategy, steps_per_loop=t.steps_per_loop,
                              accumulate=t.accumulate, compression=compression, nonfinite=t.nonfinite,
                              xla=None if t.xla else False, shard=config.parallel.shard,
                              placement=run_parallel.pipeline(config, model, stage_plan),
                              sync=run_parallel.sync(config),
                              step_timer=run.config.train.stragglers and run.info.num_workers > 1)
        optimizer = run.trainer.optimizer
        state = {**state, **{k: v for k, v in run.trainer.checkpoint_items().items() if k.startswith("diloco_")}}
    # shard: the sharded optimizer state, in Keras's layout, in place of the optimizer
    saved = run.trainer.checkpoint_items()["optimizer"] if config.parallel.shard != "none" else optimizer
    run.checkpoints = Checkpoints(run.workdir, run.info.is_chief, model=model, optimizer=saved, **state)
    run.model, run.optimizer, run.compression = model, optimizer, compression
    run.say(f"model: {model.name}, {model.count_params():,} parameters, stages: "
            f"{', '.join(name for name, _ in model.stages())}")
    for line in filter(None, [run_parallel.describe(config, stage_plan), getattr(model, "tfpar_parallel_line", None),
                              stage_plan and stage_plan.table()]):
        run.say(line)
    if config.data.augment and run.splits.info.get("kind") == "image":
        run.augment = recipes.image_augmentation(run.splits.info["image_size"])


def _train_data(run: _Run, step: int):
    """The training data from `step` on (parameter_server: each worker its own order)."""
    from tfpar import data as data_lib

    t = run.config.train
    if run.asynchronous:  # the weights and step are resumed, the order is new
        return run.trainer.per_worker_dataset(
            data_lib.worker_train_fn(run.splits.train, t.batch_size, run.augment))
    return data_lib.distribute_train(run.strategy, run.splits.train, t.batch_size,
                                     start_step=step * t.accumulate, augment=run.augment,
                                     tensor_parallel=run.config.parallel.tensor)


def _evaluate(run: _Run) -> dict:
    """Exact eval over the validation set (parameter_server: the chief alone)."""
    import tensorflow as tf

    from tfpar import data as data_lib
    from tfpar.evaluation import evaluate

    eval_strategy = tf.distribute.get_strategy() if run.asynchronous else run.strategy
    if run.eval_data is None:
        t = run.config.train
        run.eval_data = data_lib.distribute_eval(eval_strategy, run.splits.validation,
                                                 t.eval_batch_size, limit=t.eval_examples,
                                                 tensor_parallel=run.config.parallel.tensor)
    data, steps = run.eval_data
    if run.trainer is not None:
        results = run.trainer.evaluate(data, steps)
        return {**results, "weights": "shared"} if run.config.parallel.sync != "none" else results
    return evaluate(run.model, eval_strategy, data, steps, xla=run.config.train.xla)


def _flops_and_peak(run: _Run) -> tuple[float | None, tuple]:
    """(FLOPs a step on this worker, (peak FLOP/s, source)) when MFU is asked or profiled."""
    from tfpar.profiling import binary

    t = run.config.train
    if not (t.mfu or t.profile_steps):
        return None, (None, "")
    here = max(len(run.info.devices), 1) if run.info.replicas > 1 else 1
    return binary.flops_and_peak(run.config, run.model, _sample_inputs(run), here, run.info.devices[0])


def _controller(run: _Run, start: int, wire: list | None, writer):
    from tfpar import preemption
    from tfpar.callbacks import ProgressLine, current_learning_rate
    from tfpar.controller import Controller
    from tfpar.profiling import StragglerWatch, binary

    t = run.config.train
    flops, peak = _flops_and_peak(run)
    units = t.batch_size * t.accumulate * (run.config.data.seq_len if run.corpus else 1)
    progress = ProgressLine(t.steps, units, run.unit, lambda: current_learning_rate(run.optimizer),
                            wire=wire, say=run.say if run.info.is_chief else None,
                            round_steps=run.config.parallel.inner_steps if run.config.parallel.sync != "none" else None,
                            flops_per_step=flops, peak_flops=peak[0])
    # ps: a dead worker is restarted while the chief goes on; no coordinated save needed
    watch = None if run.asynchronous else preemption.PreemptionWatch(run.strategy)
    timed = run.trainer is not None and run.trainer.own_step_seconds() is not None
    controller = Controller(
        total_steps=t.steps, steps_per_loop=t.steps_per_loop, start_step=start,
        log_every=t.log_every, eval_every=t.eval_every, checkpoint_every=t.checkpoint_every,
        checkpoints=run.checkpoints, progress=progress, writer=writer,
        evaluate=lambda: _evaluate(run), preemption=watch, say=run.say, say_everywhere=_say,
        stop_on_nonfinite=run.trainer is None and t.nonfinite == "stop",  # the loop checks itself
        stragglers=StragglerWatch(run.strategy, run.info.num_workers, binary.worker_rank(run.strategy, run.info))
        if timed else None,
        own_seconds=run.trainer.own_step_seconds if timed else None)
    controller.profile = binary.profile_window(
        run.config, run.info, run.strategy, run.workdir, start, run.say,
        lambda: controller.profile_collectives and controller.profile_collectives(), flops, peak, run.measured)
    return controller


def _exchange_name(config) -> str:
    """What crosses the wire, for the wire lines: the compression, or DiLoCo's rounds."""
    p = config.parallel
    if p.sync == "diloco":
        overlapped = f", each beside the next {p.overlap_steps} steps" if p.overlap_steps else ""
        if p.fragments > 1:
            overlapped = f" (1/{p.fragments} of the model every {p.inner_steps / p.fragments:g}){overlapped}"
        if p.outer_compression == "none":
            return f"diloco({p.inner_steps}), outer all-reduce every {p.inner_steps} steps{overlapped}"
        collective = "all-reduce" if p.outer_compression == "fp16" else "all-gather"
        return (f"diloco({p.inner_steps}, {p.outer_compression}), outer {p.outer_compression} "
                f"{collective} every {p.inner_steps} steps{overlapped}")
    return config.compression


def _summary_writer(run: _Run):
    import tensorflow as tf

    directory = os.path.join(run.workdir, "tensorboard") if run.info.is_chief else tempfile.mkdtemp()
    return tf.summary.create_file_writer(directory)


def _results(run: _Run, train_seconds: float, progress_last: dict, wire: list | None, writer) -> dict:
    """The final eval, written to TensorBoard, results.json and the output."""
    import tensorflow as tf

    from tfpar import data as data_lib

    t, unit = run.config.train, run.unit
    results = _evaluate(run)
    results.update(step=t.steps, train_seconds=train_seconds,
                   throughput=progress_last.get(f"{unit}_per_s"), throughput_unit=f"{unit}/s")
    if wire:  # over the steps this run trained (none: the last step's phase)
        ratio = progress_last.get("run_compression_ratio", wire[-1].ratio)
        results.update(compression=run.config.compression, compression_ratio=ratio,
                       wire_bytes_per_step=round(wire[-1].fp32_bytes_per_step / ratio),
                       wire_bytes_sent=progress_last.get("wire_bytes_sent", 0))
    if run.config.parallel.sync != "none":  # DiLoCo: its rounds (each one outer all-reduce)
        h = run.config.parallel.inner_steps
        results.update(sync=run.config.parallel.sync, inner_steps=h, rounds=t.steps // h,
                       outer_compression=run.config.parallel.outer_compression,
                       overlap_steps=run.config.parallel.overlap_steps, fragments=run.config.parallel.fragments)
    if run.corpus:
        results["unigram_baseline"] = data_lib.unigram_entropy(run.splits.validation)
    for key in ("mfu", "step_ms_p50", "step_ms_p90", "step_ms_p99", "straggler", "straggler_lag_ms"):
        if key in progress_last:
            results[key] = progress_last[key]
    results.update(run.measured)
    with writer.as_default(step=t.steps):
        for key in ("loss", "perplexity", "accuracy", "exact"):
            tf.summary.scalar(f"eval/{key}", results[key])
    writer.flush()
    run.say("eval: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in results.items() if not isinstance(v, dict)))
    if run.info.is_chief:
        with open(os.path.join(run.workdir, "results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


def _sample(run: _Run) -> None:
    from tfpar.sampling import generate

    s = run.config.sample
    if not run.corpus or s.length <= 0:
        return
    with run.trainer.shared_weights() if run.trainer is not None else contextlib.nullcontext():
        text = generate(run_parallel.sampling_model(run.config, run.model), s.prompt, s.length,
                        run.config.data.seq_len, s.temperature, seed=run.config.seed)
    run.say("sample:\n" + text)
    if run.info.is_chief:
        with open(os.path.join(run.workdir, "sample.txt"), "w", encoding="utf-8") as f:
            f.write(text)


def train_and_evaluate(config, workdir: str) -> dict:
    """Trains (Keras fit or tfpar's loop) under the configured strategy, resuming from the
    newest checkpoint in `workdir`; returns the final eval results.

    Example:
        >>> train_and_evaluate(runpy.run_path("configs/gpt_tiny.py")["get_config"](), "/tmp/run")
    """
    from tfpar.callbacks import keras_fit, wire_phases, wire_start_line

    run = setup(config, workdir)
    build(run)
    start = run.checkpoints.restore()
    if start:
        run.say(f"resuming from step {start} ({run.checkpoints.restored})")
    train_data = _train_data(run, start)
    writer = _summary_writer(run)
    exchange = _exchange_name(config)
    wire = wire_phases(run.info, run.model, run.compression, run.trainer, train_data, run.asynchronous,
                       start, config.train.steps, exchange)
    if wire:
        run.say(wire_start_line(wire, exchange, config.train.steps))
    controller = _controller(run, start, wire, writer)
    started = time.perf_counter()
    if start < config.train.steps and run.trainer is not None:
        run.trainer.fit(train_data, config.train.steps, start_step=start, controller=controller)
    elif start < config.train.steps:
        keras_fit(run.model, controller,
                  lambda step: train_data if step == start else _train_data(run, step))
    controller.end()
    if controller.profile is not None and run.info.is_chief:
        from tfpar.profiling import binary

        picture = binary.draw_workers(workdir)
        if picture:
            run.say(f"profile: breakdown of every worker found: {picture}")
    results = _results(run, time.perf_counter() - started, controller.last_values, wire, writer)
    _sample(run)
    return results
