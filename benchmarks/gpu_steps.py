"""Benchmark: what each compressor costs per training step on a GPU, under `mirrored`.

    python benchmarks/gpu_steps.py --out=bench_out            # bench_out/gpu_steps.json

For each configuration of benchmarks/compression.py named in --configs, one Trainer step of
gpt_wide (384 wide, 8 sequences of 64 tokens per replica) under `mirrored` over
--replicas devices. With one replica no collective runs, so a compressed step minus the
uncompressed one is the compressor's own work per step: encode, decode, error feedback.
With two replicas the step adds the all-reduce (or the payload gathers) between them.

On a machine with one GPU, two replicas are two logical GPUs on it (the script splits it
in 2 before TensorFlow starts) joined by `hierarchical_copy`: NCCL refuses two ranks
on one device, so the collective here is device-to-device copies in the GPU's memory,
not NCCL over NVLink. Without a GPU the same script runs on logical CPUs (a smoke run).
Each configuration is timed after its warm-up phases (uncompressed start, frozen
variance, sparsity ramp): `--skip` steps and one untimed call of `--steps` steps first
(in the first GPU run, without it, a trace fell into the first timed round of dgc,
onebit_adam and the PowerSGD rank schedule), then the median of `--rounds` timings of `--steps` steps. dgc and onebit_adam
bring their own optimizers (momentum SGD; Adam's moments kept in the compressor), so
their difference to `none` (AdamW) is not the compressor's cost alone. Speed lives here, never in tests.

`--budget-s`: seconds from the start of the process after which no configuration starts
that could not finish (judged by the longest one so far); those rows say "skipped". The
JSON is written after every row, so a run cut short keeps what it measured
(benchmarks/gpu_check.sh gives this table its share of a lent machine's call this way).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time

PROCESS_START = time.monotonic()  # --budget-s counts TensorFlow's import too
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

from tfpar.strategy import runtime  # noqa: E402

LOGICAL = 2  # replicas beyond one are logical devices of the first GPU (or of the CPU)
DEVICES = runtime.split_devices(LOGICAL, gpu_memory_mb=16 << 10)

import compression as bench  # noqa: E402  (benchmarks/compression.py: its configurations)

import tfpar  # noqa: E402
from tfpar import recipes  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402

CONFIGS = ("none", "fp16", "int8", "topk(0.01)", "powersgd(4)", "sign", "dgc(0.01)", "onebit_adam",
           "powersgd(4)+start120+16-8-4")


def strategy_for(replicas: int):
    devices = runtime.local_compute_devices()[:replicas]
    all_reduce = "hierarchical_copy" if "GPU" in devices[0].upper() else "auto"
    return tfpar.create_strategy("mirrored", devices=devices, all_reduce=all_reduce), all_reduce


def time_config(name: str, strategy, config, splits, args) -> dict:
    import keras

    from tfpar import data as data_lib

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = recipes.build_model(config, splits.info)
        optimizer = recipes.build_optimizer(bench.optimizer_config(config, name), args.skip + 1000)
    replica_batch = config.train.batch_size
    compression = bench.compression_for(name, args.skip + 1000, replica_batch * config.data.seq_len)
    trainer = Trainer(model, optimizer, recipes.SmoothedSparseCrossentropy(0.0), strategy=strategy,
                      steps_per_loop=args.steps, compression=compression)
    iterator = iter(data_lib.distribute_train(strategy, splits.train,
                                              replica_batch * strategy.num_replicas_in_sync))
    started = time.perf_counter()
    trainer.train_steps(iterator, args.skip)  # traces, then runs past every warm-up phase
    first_s = time.perf_counter() - started
    trainer.train_steps(iterator, args.steps)  # untimed: a phase change may trace once more
    timings = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        loss = trainer.train_steps(iterator, args.steps)
        timings.append((time.perf_counter() - t0) / args.steps)
    return {"ms_per_step": 1000 * statistics.median(timings), "ms_per_step_rounds": [1000 * t for t in timings],
            "first_call_s": first_s, "loss": float(loss)}


def timed_row(name: str, strategy, config, splits, args) -> tuple[dict, float]:
    """One configuration's row (or its error: the rest still run) and the seconds it took."""
    started = time.monotonic()
    try:
        row = time_config(name, strategy, config, splits, args)
    except Exception as e:  # pylint: disable=broad-except
        row = {"error": f"{type(e).__name__}: {e}"[:500]}
    return row, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--model", default="gpt_wide")
    parser.add_argument("--skip", type=int, default=130, help="steps before timing (warm-up phases)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=0,
                        help="start no configuration after this many seconds of the process that "
                             "would not finish in them (0: no limit)")
    args = parser.parse_args()
    replicas = [int(r) for r in args.replicas.split(",")]
    if max(replicas) > LOGICAL or min(replicas) < 1 or args.rounds < 1 or args.steps < 1:
        parser.error(f"--replicas takes 1 to {LOGICAL} (the logical devices made here); "
                     "--rounds and --steps at least 1")
    os.makedirs(args.out, exist_ok=True)

    from tfpar import data as data_lib

    config = runpy.run_path(os.path.join(bench.REPO, "configs", f"{args.model}.py"))["get_config"]()
    splits = data_lib.text_corpus(config.data.seq_len)
    gpus = tf.config.list_physical_devices("GPU")
    rows: list = []
    result = {"device": gpus[0].name if gpus else "CPU", "devices": DEVICES,
                        "tensorflow": tf.__version__, "model": args.model,
                        "replica_batch": config.train.batch_size, "seq_len": config.data.seq_len,
                        "skip": args.skip, "steps": args.steps, "rounds": args.rounds,
                        "budget_s": args.budget_s, "rows": rows}
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        result["gpu"] = details
    longest = 0.0  # seconds of the longest configuration so far: what the next may take
    for count in replicas:
        strategy, all_reduce = strategy_for(count)
        base = None
        for name in args.configs.split(","):
            if args.budget_s and time.monotonic() - PROCESS_START + longest > args.budget_s:
                row = {"skipped": f"--budget-s {args.budget_s:g}: would not finish in time"}
            else:
                row, seconds = timed_row(name, strategy, config, splits, args)
                longest = max(longest, seconds)
            row.update(config=name, replicas=count, all_reduce=all_reduce)
            if name == "none" and "ms_per_step" in row:
                base = row["ms_per_step"]
            if base is not None and "ms_per_step" in row:
                row["overhead_ms"] = row["ms_per_step"] - base
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ms_per_step_rounds"}), flush=True)
            with open(os.path.join(args.out, "gpu_steps.json"), "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
