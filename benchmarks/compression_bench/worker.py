"""One worker process (TF_CONFIG from the environment): trains every configuration in turn.

Each configuration gets a fresh model and optimizer, seeded alike, on the same data order,
so TensorFlow and the cluster start once per link. Per configuration: bytes of the last
phase's traced step, the run's average ratio, the compute time of one step, the
validation loss every --eval-every steps and the step times.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import statistics
import time

from .configs import DILOCO, REPO, compression_for, flags, optimizer_config, plans, run_config, steps_for


def _compute_time(trainer, batch, repeats: int = 5) -> float:
    """Median seconds of forward + backward alone on one local batch (no collectives)."""
    import tensorflow as tf

    x, y = batch[0], batch[1]
    trainable = [tf.convert_to_tensor(v.value) for v in trainer.model.trainable_variables]
    others = [tf.convert_to_tensor(v.value) for v in trainer.model.non_trainable_variables]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        loss, _, _ = trainer._compute(  # pylint: disable=protected-access
            trainable, others, tf.constant(1.0), x, y, None)
        float(loss)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _mean_analytic_bytes(compression, variables, steps: int) -> float:
    """Analytic bytes per replica per step averaged over the whole run: the uncompressed
    start and every stage of a rank or density schedule at what it sends ("ratio" is the
    last phase's alone)."""
    per_phase, total = {}, 0.0
    for step in range(steps):
        phase = compression.phase(step)
        if phase not in per_phase:
            per_phase[phase] = _phase_bytes(compression, variables, phase)
        total += per_phase[phase]
    return total / steps


def _phase_bytes(compression, variables, phase) -> float:
    """compression.payload_bytes of `phase`, summed."""
    return sum(compression.payload_bytes(variables, phase).values())


def _wire(trainer, compression, train_data, replicas: int, steps: int) -> dict:
    """Bytes of the last phase's step: handed to collectives and transmitted per worker."""
    from tfpar.compression import accounting

    phase = compression.phase(steps - 1) if compression is not None else None  # the last one
    step = trainer.traced_step(train_data, phase)
    variables = trainer.model.trainable_variables
    dense = accounting.fp32_bytes(variables)
    sent = accounting.bytes_per_replica(step, in_loops_only=True)
    link = accounting.link_bytes_per_worker(step, replicas)
    sync = trainer._sync  # pylint: disable=protected-access
    if sync is not None:  # DiLoCo: its outer step's all-reduce, spread over its round
        sent += sync.bytes_per_round() / sync.inner_steps
        link += sum(accounting.link_bytes_per_worker(outer, replicas, in_loops_only=False)
                    for outer in sync.traced_exchanges()) / sync.inner_steps
    return {"bytes_per_step": sent, "fp32_bytes_per_step": dense, "ratio": dense / sent,
            "link_bytes_per_worker": link,
            # of bytes_per_step: the replicas' agreement that every gradient is finite (4 bytes
            # with a stateful compressor); analytic_bytes_per_step is the gradients' alone
            "check_bytes_per_step": accounting.bytes_in_scope(accounting.collectives(step)),
            "analytic_bytes_per_step": sum(compression.payload_bytes(variables, phase).values())
            if compression is not None else dense, "phase": str(phase),
            "run_ratio": dense / _mean_analytic_bytes(compression, variables, steps)
            if compression is not None else 1.0}


def _build(name, args, config, splits, strategy, steps):
    """Model, the optimizer the binary would give `name`, its compression, the Trainer."""
    import keras

    from tfpar import recipes
    from tfpar.loop import Trainer

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = recipes.build_model(config, splits.info)
        optimizer = recipes.build_optimizer(optimizer_config(config, name), steps)
    compression = compression_for(name, args.bytes_at_step or steps,
                                  args.batch // strategy.num_replicas_in_sync * config.data.seq_len)
    sync = None
    if name in DILOCO:  # as the binary makes it from its flags
        from tfpar import run_parallel

        sync = run_parallel.sync(run_config(config, name))
    trainer = Trainer(model, optimizer, recipes.SmoothedSparseCrossentropy(0.0), strategy=strategy,
                      steps_per_loop=args.steps_per_loop, compression=compression, sync=sync)
    return model, compression, trainer


def _train(name, args, trainer, train_data, steps, evaluate, say) -> dict:
    """Trains `steps`, evaluating every --eval-every; the curve, losses and step times."""
    iterator = iter(train_data)
    curve = [[0, 0.0, evaluate()]]  # step, training seconds, val loss
    per_step, train_losses, step, train_s = [], [], 0, 0.0
    while step < steps:
        n = min(args.steps_per_loop, steps - step)
        t0 = time.perf_counter()
        train_losses.append(trainer.train_steps(iterator, n))
        per_step.append((time.perf_counter() - t0) / n)
        train_s += per_step[-1] * n
        step += n
        if step % args.eval_every == 0 or step == steps:
            curve.append([step, train_s, evaluate()])
            say(f"{name}: step {step} train {train_losses[-1]:.4f} val {curve[-1][2]:.4f} "
                f"step {1000 * per_step[-1]:.0f} ms")
    return {"curve": curve, "per_step": per_step, "train_losses": train_losses, "train_s": train_s}


def train_one(name, args, config, splits, strategy, eval_data, eval_steps, say) -> dict:
    """One configuration's row (see the module docstring)."""
    from tfpar import data as data_lib
    from tfpar.evaluation import evaluate

    started, steps = time.perf_counter(), steps_for(name, args)
    model, compression, trainer = _build(name, args, config, splits, strategy, steps)
    train_data = data_lib.distribute_train(strategy, splits.train, args.batch)
    wire = _wire(trainer, compression, train_data, strategy.num_replicas_in_sync, args.bytes_at_step or steps)
    if getattr(compression, "decision", None):
        wire["auto_decision"] = compression.decision
        say(f"{name}: picked {compression.decision}")
    local = next(iter(splits.train.build(training=False).batch(
        args.batch // strategy.num_replicas_in_sync, drop_remainder=True)))
    compute_s = _compute_time(trainer, local)
    sync = trainer._sync  # pylint: disable=protected-access

    def validation_loss() -> float:  # DiLoCo: the shared (outer) weights
        with sync.shared_weights() if sync is not None else contextlib.nullcontext():
            return evaluate(model, strategy, eval_data, eval_steps)["loss"]

    run = _train(name, args, trainer, train_data, steps, validation_loss, say)
    curve, per_step = run["curve"], run["per_step"]
    timed = per_step[args.warmup_calls:]  # sittings() refused runs too short to time
    # DiLoCo's calls differ (an outer all-reduce ends some): the mean, not the median
    median = statistics.mean(timed) if sync is not None else statistics.median(timed)
    collective_s = max(median - compute_s, 0.0)
    return {**wire, "optimizer": optimizer_config(config, name).to_dict(), "binary_flags": flags(name),
            "step_time_s": median, "step_times_s": per_step, "compute_s": compute_s,
            "collective_s": collective_s,
            "achieved_link_mbit_s": wire["link_bytes_per_worker"] * 8 / collective_s / 1e6 if collective_s else None,
            "val_loss": [[s, l] for s, _, l in curve], "val_curve_wall": [[w, l] for _, w, l in curve],
            "final_val_loss": curve[-1][2], "train_loss": run["train_losses"], "train_s": run["train_s"],
            "wall_s": time.perf_counter() - started}


def worker(args) -> None:
    """Trains every configuration of args.configs; worker `i` writes args.result_file ({task}: i)."""
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=args.connect_timeout)
    info = tfpar.describe(strategy)  # first: nothing may touch TensorFlow before the strategy

    from tfpar import data as data_lib
    from tfpar import recipes

    def say(message):
        print(f"[w{info.task_index}] {message}", flush=True)

    config = runpy.run_path(os.path.join(REPO, "configs", f"{args.model}.py"))["get_config"]()
    for name in args.configs:  # a configuration the binary would refuse fails here, before any training
        run_config(config, name)
    splits = data_lib.load("corpus", seq_len=config.data.seq_len, seed=0)
    eval_data, eval_steps = data_lib.distribute_eval(strategy, splits.validation, args.eval_batch,
                                                     limit=args.eval_examples)
    say(f"{info.kind}, {info.replicas} replicas, {info.num_workers} workers; {args.model}; eval "
        f"{args.eval_examples} examples in {eval_steps} steps")
    results, extra = {}, None
    for name in args.configs:
        results[name] = row = train_one(name, args, config, splits, strategy, eval_data, eval_steps, say)
        if extra is None:
            with strategy.scope():
                extra = plans(recipes.build_model(config, splits.info).trainable_variables)
        say(f"{name}: {row['bytes_per_step']:,} B/step ({row['ratio']:.1f}x), link "
            f"{row['link_bytes_per_worker']:,.0f} B/worker, median step {1000 * row['step_time_s']:.0f} ms "
            f"(compute {1000 * row['compute_s']:.0f} ms), val {row['final_val_loss']:.4f}")
        with open(args.result_file.replace("{task}", str(info.task_index)), "w") as f:
            json.dump({"task_index": info.task_index, "results": results, **extra}, f, indent=1)
