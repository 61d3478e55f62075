"""The command line: parse, run every sitting, write OUT/NAME.json and OUT/NAME.png."""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time

from . import cluster, goals, plots
from .configs import CONFIGS, HERE
from .suites import SUITES, sittings, untimed
from .worker import worker


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--model", default="gpt_tiny", help="a config in configs/: gpt_tiny or gpt_wide")
    p.add_argument("--links", default="loopback,100mbit", help="loopback and/or tc rates (100mbit, 1gbit)")
    p.add_argument("--workers", default="2", help="worker counts, e.g. 2,4")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compressed-steps", type=int, default=0,
                   help="run length of every compressor (default: --steps)")
    p.add_argument("--reference", help="a JSON of an earlier run whose `none` rows stand in for "
                   "this run's (same model, links, workers and --steps): none is not rerun")
    p.add_argument("--steps-per-loop", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-examples", type=int, default=512)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="global batch (gpt_wide: use 8)")
    p.add_argument("--warmup-calls", type=int, default=2, help="tf.function calls left out of the timing")
    p.add_argument("--delay", default="1ms", help="netem delay on every worker's link")
    p.add_argument("--probe-mb", type=int, default=20, help="MB of the TCP check of each link")
    p.add_argument("--name", default="compression", help="OUT/NAME.json and OUT/NAME.png")
    p.add_argument("--connect-timeout", type=float, default=120.0)
    p.add_argument("--suite", choices=sorted(SUITES), help="run a named set of sittings (model, "
                   "links, workers, configurations, steps) in one command: time_to_quality, 33 minutes (root)")
    p.add_argument("--bytes-at-step", type=int, default=0, help="count bytes as in a run of this "
                   "many steps (its last phase) while training only --steps: a bytes-only sitting")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p


def _parse(description: str) -> tuple[argparse.Namespace, dict | None]:
    """The arguments, checked; the --reference JSON (None without one)."""
    p = parser(description)
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if args.worker:
        return args, None
    if args.suite:
        if args.reference:
            p.error("--suite trains every none it compares against: leave out --reference")
        args.model, args.batch = SUITES[args.suite]["model"], SUITES[args.suite]["batch"]
        if args.name == "compression":
            args.name = args.suite
    reference = None
    if args.reference:
        with open(args.reference) as f:
            reference = json.load(f)
        if reference["model"] != args.model or reference["steps"] != args.steps:
            p.error(f"--reference {args.reference} ran {reference['model']} for {reference['steps']} "
                    f"steps; this run is {args.model} for {args.steps}")
        for key, mine in (("global_batch", args.batch), ("eval_examples", args.eval_examples)):
            if reference.get(key) != mine:  # another batch is another run: its none compares nothing
                p.error(f"--reference {args.reference} ran {key}={reference.get(key)}; this run has {mine}: "
                        f"give --{key.replace('global_', '').replace('_', '-')}={reference.get(key)}")
        args.configs = [c for c in args.configs if c != "none"]
    elif "none" not in args.configs:
        args.configs.insert(0, "none")  # time to quality is measured against it
    too_short = [why for why in map(untimed, sittings(args)) if why]
    if too_short:
        p.error("; ".join(too_short))
    return args, reference


def _run_all(args, reference: dict | None, workdir: str) -> dict:
    """Every sitting; {results, meta, extra, equal_steps, bytes_only}."""
    results, meta, extra = {}, {"links": {}}, {}
    equal_steps, bytes_only = set(), set()
    for sitting in sittings(args):
        key = f"{sitting.link}_w{sitting.workers}"
        t0 = time.perf_counter()
        chief = cluster.run_link(sitting.link, sitting.workers, sitting, workdir, meta["links"])
        results[key] = chief["results"]
        if reference is not None:
            results[key] = {"none": {**reference["results"][key]["none"], "from": args.reference},
                            **chief["results"]}
        extra = {"plans": chief["plans"], "analytic_everything_compressed": chief["analytic_everything_compressed"]}
        meta[f"{key}_wall_s"] = time.perf_counter() - t0
        meta.setdefault("sittings", {})[key] = {k: getattr(sitting, k) for k in (
            "configs", "steps", "compressed_steps", "eval_every", "bytes_at_step")}
        if sitting.bytes_at_step:
            bytes_only.add(key)
        elif not sitting.compressed_steps or sitting.compressed_steps == sitting.steps:
            equal_steps.add(key)
    return {"results": results, "meta": meta, "extra": extra, "equal_steps": equal_steps, "bytes_only": bytes_only}


def _commit() -> str:
    """The repository's commit, with "+dirty" where tfpar/ differs from it."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", "../tfpar") else "")


def _write(args, run: dict, started: float) -> None:
    """Prints the table and the goals; writes OUT/NAME.json and OUT/NAME.png."""
    results, bytes_only = run["results"], run["bytes_only"]
    ttq = goals.time_to_quality({k: v for k, v in results.items() if k not in bytes_only})
    rows = goals.table(results, bytes_only)
    plots.print_table(rows)
    verdict = goals.goals(rows, equal_steps=run["equal_steps"], bytes_only=bytes_only)
    print(json.dumps(verdict, indent=1))
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"model": args.model, "suite": args.suite,
                   "workers": sorted({int(k.rsplit("_w", 1)[1]) for k in results}), "strategy": "multi_worker_mirrored",
                   "global_batch": args.batch,  # a suite's steps are per sitting: "sittings"
                   "steps": None if args.suite else args.steps,
                   "compressed_steps": None if args.suite else args.compressed_steps or args.steps,
                   "reference": args.reference, "steps_per_loop": args.steps_per_loop,
                   "commit": run["commit"], "date": run["date"],
                   "eval_every": None if args.suite else args.eval_every, "eval_examples": args.eval_examples,
                   "warmup_calls_excluded": args.warmup_calls,
                   "goals": {"ratio": goals.GOAL_RATIO, "val_loss_gap": goals.GOAL_GAP, "met": verdict},
                   "time_to_quality_vs_none": ttq, "table": rows,
                   **({"powersgd_rank4_arithmetic": goals.powersgd_arithmetic(4)} if args.model == "gpt_tiny" else {}),
                   **run["extra"], **run["meta"],
                   "results": results, "total_wall_s": time.perf_counter() - started}, f, indent=2)
    plots.plot(results, rows, os.path.join(args.out, f"{args.name}.png"), bytes_only)
    print(f"wrote {args.out}/{args.name}.json and {args.name}.png "
          f"({time.perf_counter() - started:.0f} s)", flush=True)


def main(description: str = "gradient compression benchmark") -> None:
    args, reference = _parse(description)
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tfpar_compression_")
    print(f"logs and per-worker results in {workdir}", flush=True)
    started = time.perf_counter()

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    stamp = {"commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S")}  # of the code that runs
    _write(args, {**_run_all(args, reference, workdir), **stamp}, started)
