"""What runs: sittings (link, worker count, configurations, steps), from the command line
or from a named suite.

--suite=time_to_quality is the time-to-quality benchmark in one command (gpt_wide, 8 sequences,
root): none and the best compressor on 100 Mbit/s, none and auto on 1 Gbit/s, bytes at 2
and 4 workers on loopback. Everything a sitting does not name comes from the command line.
"""

from __future__ import annotations

import argparse

from .configs import CONFIGS

BEST_ON_A_SLOW_LINK = "powersgd(4)+fp16start120+16-8-4"
SUITES = {
    "time_to_quality": {
        "model": "gpt_wide", "batch": 8,
        "sittings": [
            # time to quality where compression matters: none for 600 steps, the best
            # compressor given 900 (its cheaper steps buy more of them)
            dict(link="100mbit", workers=2, configs=f"none,{BEST_ON_A_SLOW_LINK}", steps=600,
                 compressed_steps=900, eval_every=50),
            # a fast link: auto must not cost more than 5%
            dict(link="1gbit", workers=2, configs="none,auto", steps=600, eval_every=100),
            # bytes per worker at 2 and 4 workers, counted from the traced step of each
            # compressor's last phase in a 600-step run (40 steps trained: bytes, and the
            # loopback step timed over the 2 calls after the 2 warm-up calls)
            *(dict(link="loopback", workers=w, configs=f"none,onebit_adam,{BEST_ON_A_SLOW_LINK},dgc(0.001)",
                   steps=40, eval_every=40, bytes_at_step=600) for w in (2, 4)),
        ],
    },
}


def untimed(sitting: argparse.Namespace) -> str:
    """Why `sitting` would time no step (its runs make no tf.function call after the
    --warmup-calls left out), or ''."""
    lengths = {sitting.steps, sitting.compressed_steps or sitting.steps}
    calls = min(-(-n // sitting.steps_per_loop) for n in lengths)
    if calls > sitting.warmup_calls:
        return ""
    return (f"{sitting.link}, {sitting.workers} workers: {min(lengths)} steps are {calls} call(s) of "
            f"--steps-per-loop={sitting.steps_per_loop}, all left out of the timing by "
            f"--warmup-calls={sitting.warmup_calls}: give at least "
            f"{(sitting.warmup_calls + 1) * sitting.steps_per_loop} steps")


def sittings(args) -> list[argparse.Namespace]:
    """What runs, one Namespace per (link, worker count): the command line's --links x
    --workers with its --configs and steps, or --suite's list (each sitting's own configs,
    steps and evaluation; everything else from the command line)."""
    if not args.suite:
        links = [link.strip() for link in args.links.split(",") if link.strip()]
        return [argparse.Namespace(**{**vars(args), "link": link, "workers": int(w)})
                for link in links for w in args.workers.split(",")]
    out = []
    for sitting in SUITES[args.suite]["sittings"]:  # each checked by untimed() in main
        configs = sitting["configs"].split(",")
        unknown = [c for c in configs if c not in CONFIGS]
        if unknown:
            raise SystemExit(f"suite {args.suite}: unknown configs {unknown}")
        out.append(argparse.Namespace(**{**vars(args), "compressed_steps": 0, "bytes_at_step": 0,
                                         **sitting, "configs": configs}))
    return out
