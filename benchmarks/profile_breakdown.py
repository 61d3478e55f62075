"""Benchmark: where gpt_tiny's step time goes, read from profiled windows, and what a
profiled window costs.

    sudo python benchmarks/profile_breakdown.py            # benchmarks/results/profile/

Runs the binary (configs/gpt_tiny.py, tfpar's loop, 2 workers) with
`--config.train.profile_steps=A,B` on
- loopback: 2 processes on this machine (tfpar-launch), and
- 2 namespace hosts joined by a link shaped to --rate (20 Mbit/s; root only),
each uncompressed and with --compressor (onebit_adam: the best gradient compressor at
20 Mbit/s in benchmarks/results/compression; its Adam warm-up ends before the window),
then the same loopback runs without profiling. Every row is one worker's mean step of the
window from its breakdown.json; the JSON keeps both workers' rows, the communication
log's per-kind bytes and bandwidth, MFU, and the profiling overhead:
- the window's steps against the median step outside it (the run's own percentiles), and
- the whole training time with and without the window (start, stop, trace analysis, the
  all-reduce probe and the FLOP count included).

Writes OUT/profile_breakdown.json and OUT/profile_breakdown.png (the breakdowns side by
side). Speed lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from hosts import _env  # noqa: E402  (benchmarks/hosts.py: the workers' environment)
from tfpar.profiling import report  # noqa: E402
from tfpar.testing.netns import Hosts  # noqa: E402

PORT = 23456


def _args(workdir: str, compression: str, steps: int, window: str | None, freeze: int) -> list[str]:
    args = ["-m", "tfpar.train", "--config=configs/gpt_tiny.py", f"--workdir={workdir}",
            "--config.mode=loop", "--config.strategy=multi_worker_mirrored",
            f"--config.compression={compression}", f"--config.train.steps={steps}",
            f"--config.train.log_every={steps // 2}", "--config.train.steps_per_loop=5",
            f"--config.train.checkpoint_every={steps}", "--config.train.eval_examples=64",
            "--config.sample.length=0", "--config.strategy_args.timeout_s=120"]
    if compression == "onebit_adam":
        args.append(f"--config.compression_args.freeze_step={freeze}")
    if window:
        args.append(f"--config.train.profile_steps={window}")
    return args


def _check(procs: list[subprocess.Popen], timeout: float) -> None:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a worker failed ({p.returncode}):\n{out[-3000:]}")


def _loopback(workdir: str, args: list[str], timeout: float) -> None:
    _check([subprocess.Popen([sys.executable, "-m", "tfpar.launch", "--workers", "2", "--",
                              sys.executable, *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)], timeout)


def _on_hosts(hosts: Hosts, args: list[str], timeout: float) -> None:
    def config(i):
        return json.dumps({"cluster": {"worker": [f"{a}:{PORT}" for a in hosts.addresses]},
                           "task": {"type": "worker", "index": i}})
    _check([hosts.popen(i, [sys.executable, *args], cwd=REPO, env=_env(TF_CONFIG=config(i)),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)], timeout)


def _rows(workdir: str, where: str, compression: str) -> list[dict]:
    with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    rows = []
    for worker in (0, 1):
        with open(os.path.join(workdir, "profile", f"worker_{worker}", "breakdown.json"), encoding="utf-8") as f:
            summary = json.load(f)
        rows.append({"where": where, "compression": compression, "worker": worker,
                     "mean_ms": {k: v * 1e3 for k, v in summary["mean"].items()},
                     "host_ms": [r["host_seconds"] * 1e3 for r in summary["per_step"]],
                     "bandwidth": summary["bandwidth"], "mfu": summary.get("mfu"),
                     "peak_tflops": summary.get("peak_tflops"), "profiler_seconds": summary["profiler_seconds"],
                     "train_seconds": results["train_seconds"], "step_ms_p50": results.get("step_ms_p50"),
                     "wire_bytes_per_step": results.get("wire_bytes_per_step")})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    tops = report.stack(ax, [r["mean_ms"] for r in rows], scale=1.0)
    for i, r in enumerate(rows):
        ax.text(i, tops[i], f"{r['mean_ms']['seconds']:,.0f} ms", ha="center", va="bottom", fontsize=7)
    report.save(fig, ax, [f"{r['where']}\n{r['compression']}\nw{r['worker']}" for r in rows],
                "ms per step (mean of the profiled window)",
                "gpt_tiny, 2 workers: where a step's time goes (tfpar's profile window)", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "profile"))
    parser.add_argument("--rate", default="20mbit")
    parser.add_argument("--compressor", default="onebit_adam")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", default="30,33")
    parser.add_argument("--freeze", type=int, default=10, help="onebit_adam's Adam warm-up steps")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows, overhead = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for compression in ("none", args.compressor):
            profiled, plain = os.path.join(tmp, f"loop_{compression}"), os.path.join(tmp, f"plain_{compression}")
            _loopback(profiled, _args(profiled, compression, args.steps, args.window, args.freeze), args.timeout)
            _loopback(plain, _args(plain, compression, args.steps, None, args.freeze), args.timeout)
            rows += _rows(profiled, "loopback", compression)
            with open(os.path.join(plain, "results.json"), encoding="utf-8") as f:
                without = json.load(f)
            window_ms = rows[-2]["mean_ms"]["seconds"]
            overhead.append({"compression": compression, "train_seconds_profiled": rows[-2]["train_seconds"],
                             "train_seconds_plain": without["train_seconds"],
                             "window_step_ms": window_ms, "plain_step_ms_p50": without.get("step_ms_p50"),
                             "window_over_plain_step": window_ms / without["step_ms_p50"]})
            print(json.dumps(overhead[-1]), flush=True)
        if Hosts.unavailable() is None:
            for compression in ("none", args.compressor):
                workdir = os.path.join(tmp, f"hosts_{compression}")
                with Hosts(2, rate=args.rate) as hosts:
                    _on_hosts(hosts, _args(workdir, compression, args.steps, args.window, args.freeze), args.timeout)
                rows += _rows(workdir, f"hosts {args.rate}", compression)
        else:
            print(f"namespace hosts skipped: {Hosts.unavailable()}", flush=True)
    for r in rows:
        parts = ", ".join(f"{k} {v:,.1f}" for k, v in r["mean_ms"].items() if v > 0.05)
        print(f"{r['where']:>16} {r['compression']:>12} w{r['worker']}: {parts}", flush=True)
    result = {"model": "gpt_tiny", "workers": 2, "window": args.window, "steps": args.steps,
              "rate": args.rate, "rows": rows, "overhead": overhead}
    with open(os.path.join(args.out, "profile_breakdown.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plot(rows, os.path.join(args.out, "profile_breakdown.png"))
    print(f"wrote {args.out}/profile_breakdown.json and .png", flush=True)


if __name__ == "__main__":
    main()
