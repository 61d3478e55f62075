"""Benchmark: what sharded data parallelism (ZeRO-1/2, Trainer(shard=...)) saves and costs.

    python benchmarks/sharding.py --out=benchmarks/results/sharding     # JSON + PNG

1. Bytes per replica on gpt_small (6 blocks of 384, 256-token windows, AdamW as in
   configs/gpt_small.py, 2 micro-batches a step) for shard none / optimizer / gradients at 2
   and 4 replicas: parameters, the gradient buffer a step holds and the optimizer state,
   read from the variables each Trainer created on each device and from its traced step
   (nothing is trained); the bytes each replica hands to collectives per step and what its
   links carry (ring all-reduce 2(R-1)/R, all-to-all (R-1)/R, all-gather (R-1)x).
2. The widest gpt (depth 12, 1024-token windows, heads of 64) whose weights, gradients and
   optimizer state fit a per-device budget, from the bytes per parameter counted in 1 and
   the parameter count of the GPT class (counted from built models: exact, quadratic in
   the width); also with the gradients of the micro-batch being computed on top (4 B per
   parameter in every mode). Activations are not counted.
3. Step time sharded / unsharded on gpt_tiny under mirrored (2 logical CPUs) and two
   worker processes (one CPU each): the three modes run alternately in one process,
   `--rounds` times, and the JSON keeps every round and the medians (a shared 2-core VM
   drifts; the load average is recorded).

Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
WORKER = "--worker" in sys.argv

from tfpar.strategy import runtime  # noqa: E402

if not WORKER:
    runtime.split_devices(4)  # before TensorFlow starts: mirrored on 2 or 4 logical CPUs

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar.compression import accounting  # noqa: E402
from tfpar import zero  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.models import GPT  # noqa: E402
from tfpar.recipes import SmoothedSparseCrossentropy  # noqa: E402

MODES = ("none", "optimizer", "gradients")
SMALL = dict(vocab_size=256, max_len=256, dim=384, depth=6, heads=6)
TINY = dict(vocab_size=256, max_len=128, dim=128, depth=2, heads=4)
WIDE = dict(vocab_size=256, max_len=1024, depth=12)  # the widest-model search (heads of 64)
BUDGETS_GIB = (16, 80)
MIB = 2 ** 20


def adamw():
    schedule = keras.optimizers.schedules.CosineDecay(0.0, 20_000, warmup_target=1e-3, warmup_steps=1000)
    return keras.optimizers.AdamW(schedule, weight_decay=0.1, global_clipnorm=1.0)


def trainer(strategy, shape: dict, mode: str, accumulate: int = 2):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = GPT(**shape)
        optimizer = adamw()
    return Trainer(model, optimizer, SmoothedSparseCrossentropy(), strategy=strategy, shard=mode,
                   accumulate=accumulate, steps_per_loop=10)


def tokens(strategy, shape: dict, global_batch: int, batches: int = 64):
    rng = np.random.RandomState(0)
    x = rng.randint(0, shape["vocab_size"], size=(global_batch * batches, shape["max_len"])).astype("int32")
    y = np.roll(x, -1, axis=1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch, drop_remainder=True)
    return strategy.experimental_distribute_dataset(data)


# -- 1. bytes ---------------------------------------------------------------------------

def bytes_report(replicas: int) -> dict:
    strategy = tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])
    rows = {}
    for mode in MODES:
        t = trainer(strategy, SMALL, mode)
        step = t.traced_step(tokens(strategy, SMALL, 2 * replicas, batches=4))
        held = zero.state_bytes(t)
        rows[mode] = {
            "parameters": held["parameters"], "optimizer_state": held["optimizer_state"],
            "parameter_shard": held.get("parameter_shard", 0),
            "gradients": zero.held_gradient_bytes(step),
            "handed_per_step": accounting.bytes_per_replica(step, in_loops_only=True),
            "handed_gradients_per_step": accounting.bytes_per_replica(step, in_loops_only=True, checks=False),
            "link_per_step": accounting.link_bytes_per_worker(step, replicas, checks=False),
            "check_per_step": accounting.bytes_in_scope(accounting.collectives(step)),
            "collectives": sorted({c.type for c in accounting.collectives(step, checks=False)}),
            "parameter_count": t.model.count_params()}
        if mode != "none":
            rows[mode]["layout"] = t._sharded.layout.describe()  # pylint: disable=protected-access
        print(replicas, mode, json.dumps({k: v for k, v in rows[mode].items() if k != "layout"}), flush=True)
    return rows


# -- 2. the widest gpt ------------------------------------------------------------------

def parameter_count() -> tuple[float, float, float]:
    """a, b, c of params(dim) = a dim^2 + b dim + c for WIDE, from three built models."""
    dims = (64, 128, 192)
    counts = [GPT(dim=d, heads=d // 64, **WIDE).count_params() for d in dims]
    return tuple(np.polyfit(dims, counts, 2))


def widest(bytes_per_parameter: float, budget: float, fit) -> int:
    a, b, c = fit
    dim = 64
    while (a * (dim + 64) ** 2 + b * (dim + 64) + c) * bytes_per_parameter <= budget:
        dim += 64
    return dim


def widest_report(measured: dict) -> dict:
    fit = parameter_count()
    found = {"parameter_fit": fit, "depth": WIDE["depth"], "max_len": WIDE["max_len"], "rows": []}
    for replicas, rows in measured.items():
        count = rows["none"]["parameter_count"]
        for mode, row in rows.items():
            per_param = (row["parameters"] + row["gradients"] + row["optimizer_state"] + row["parameter_shard"]) / count
            for budget in BUDGETS_GIB:
                dim = widest(per_param, budget * 2 ** 30, fit)
                # + the gradients of the micro-batch being computed (4 B/param, every mode: the
                # backward pass returns them together, before any is summed or scattered)
                peak = widest(per_param + 4, budget * 2 ** 30, fit)
                found["rows"].append({"replicas": replicas, "mode": mode, "bytes_per_parameter": per_param,
                                      "budget_gib": budget, "widest_dim": dim,
                                      "parameters": int(np.polyval(fit, dim)),
                                      "widest_dim_with_backward_gradients": peak,
                                      "parameters_with_backward_gradients": int(np.polyval(fit, peak))})
    return found


# -- 3. step time -----------------------------------------------------------------------

def timed_rounds(strategy, rounds: int, warmup: int, steps: int) -> list[dict]:
    trainers = {mode: trainer(strategy, TINY, mode, accumulate=1) for mode in MODES}
    iterators = {mode: iter(tokens(strategy, TINY, 16)) for mode in MODES}
    for mode in MODES:
        trainers[mode].train_steps(iterators[mode], warmup)
    found = []
    for r in range(rounds):
        row = {}
        for mode in MODES[r % 3:] + MODES[:r % 3]:  # each mode first in turn
            started = time.perf_counter()
            trainers[mode].train_steps(iterators[mode], steps)
            row[f"{mode}_s_per_step"] = (time.perf_counter() - started) / steps
        for mode in MODES[1:]:
            row[f"{mode}_over_none"] = row[f"{mode}_s_per_step"] / row["none_s_per_step"]
        row["load_average"] = os.getloadavg()[0]
        found.append(row)
        print(json.dumps(row), flush=True)
    return found


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def two_workers(args) -> list[dict]:
    """The same rounds in two processes (tfpar.launch): the chief's rounds."""
    command = [sys.executable, "-m", "tfpar.launch", "--workers", "2", "--", sys.executable, __file__,
               "--worker", f"--rounds={args.rounds}", f"--warmup={args.warmup}", f"--steps={args.steps}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    lines = [line.split("ROUND ", 1)[1] for line in done.stdout.splitlines() if "[worker:0] ROUND " in line]
    if done.returncode or not lines:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return [json.loads(line) for line in lines]


def worker(args) -> None:
    strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=120)
    for row in timed_rounds(strategy, args.rounds, args.warmup, args.steps):
        print("ROUND " + json.dumps(row), flush=True)


# -- output -------------------------------------------------------------------------------

def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    labels, bottom = [], []
    parts = [("parameters", "parameters"), ("parameter_shard", "parameter shard"),
             ("gradients", "gradients held"), ("optimizer_state", "optimizer state")]
    bars = [(r, m, row) for r, rows in results["bytes"].items() for m, row in rows.items()]
    bottom = np.zeros(len(bars))
    for key, label in parts:
        values = np.array([row[key] / MIB for _, _, row in bars])
        left.bar(range(len(bars)), values, bottom=bottom, label=label)
        bottom += values
    labels = [f"{m}\nR={r}" for r, m, _ in bars]
    left.set_xticks(range(len(bars)), labels, fontsize=8)
    left.set_ylabel("MiB per replica")
    left.set_title("gpt_small, AdamW: bytes per replica (counted)")
    left.legend(fontsize=8)
    cases = [(name, mode) for name in results["time"] for mode in MODES[1:]]
    ratios = [results["time"][name]["median"][f"{mode}_over_none"] for name, mode in cases]
    right.bar(range(len(cases)), ratios, color=["tab:orange", "tab:green"] * len(results["time"]))
    right.axhline(1.15, color="red", linestyle="--", label="goal 1.15x")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(cases)), [f"{m}\n{n}" for n, m in cases], fontsize=8)
    right.set_ylabel("step time / unsharded (median)")
    right.set_title("gpt_tiny step time, 2 shared CPU cores")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/sharding")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-time", action="store_true", help="bytes and widths only")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    results = {"model": {"bytes": "gpt_small", "time": "gpt_tiny"}, "gpt_small": SMALL, "gpt_tiny": TINY,
               "optimizer": "AdamW(cosine warm-up, weight_decay=0.1, global_clipnorm=1.0)",
               "accumulate_for_bytes": 2, "cpu_count": os.cpu_count(), "tensorflow": tf.__version__,
               "keras": keras.__version__}
    results["bytes"] = {replicas: bytes_report(replicas) for replicas in (2, 4)}
    results["widest"] = widest_report(results["bytes"])
    if not args.skip_time:
        mirrored = timed_rounds(tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"]),
                                args.rounds, args.warmup, args.steps)
        workers = two_workers(args)
        results["time"] = {"mirrored_2cpu": {"rounds": mirrored, "median": medians(mirrored)},
                           "two_workers": {"rounds": workers, "median": medians(workers)}}
        results["time_setup"] = {"global_batch": 16, "seq_len": TINY["max_len"], "steps_per_round": args.steps,
                                 "warmup_steps": args.warmup, "rounds": args.rounds}
    with open(os.path.join(args.out, "sharding.json"), "w") as f:
        json.dump(results, f, indent=2)
    if "time" in results:
        plot(results, os.path.join(args.out, "sharding.png"))


if __name__ == "__main__":
    main()
