"""From the runs' results to rows, time to quality and the goals each suite checks.

Goals per run and configuration: at least 40x fewer bytes, time to quality at most a third
of none's, validation loss within 2% of none's at equal steps (1% for DGC's top-k), auto at
most 5% slower to quality than none, each worker's link bytes at 4 workers within 10%
of 2 workers', and DiLoCo within 1% of none's final loss at least 8x sooner than none.
"""

from __future__ import annotations

import re

from .configs import CONFIGS

GOAL_KINDS = ("topk", "dgc", "dgc_adam", "powersgd", "onebit_adam")  # the goal's families
GOAL_MAX_RANK = 4  # PowerSGD "at rank <= 4"
GOAL_RATIO, GOAL_SPEEDUP, GOAL_GAP = 40.0, 3.0, 0.02
GOAL_GAP_DGC = 0.01  # DGC's top-k (dgc, dgc_adam) within 1% of none
GOAL_AUTO_SLOWER = 0.05  # auto at most 5% slower to quality than none (at 1 Gbit/s)
GOAL_DILOCO_SOONER, GOAL_DILOCO_SLACK = 8.0, 0.01  # DiLoCo: within 1% of none's loss, 8x sooner


def time_to_quality(results: dict) -> dict:
    """Per run: training seconds until the val loss first reaches the uncompressed run's final
    val loss on the same link and worker count (None: never within the run); also until it
    first comes within 1% of it (`time_within_1pct_s`, DiLoCo's goal)."""
    out = {}
    for run, rows in results.items():
        target = rows.get("none", {}).get("final_val_loss")
        for name, row in rows.items():
            reached = [w for w, l in row["val_curve_wall"] if target is not None and l <= target + 1e-9]
            row["time_to_quality_s"] = reached[0] if reached else None
            near = [w for w, l in row["val_curve_wall"]
                    if target is not None and l <= target * (1 + GOAL_DILOCO_SLACK) + 1e-9]
            row["time_within_1pct_s"] = near[0] if near else None
            base = rows.get("none", {}).get("train_s")
            if reached and base:
                out.setdefault(run, {})[name] = reached[0] / base  # fraction of uncompressed time
    return out


def powersgd_arithmetic(rank: int = 4) -> dict:
    """gpt_tiny's matrices (128 wide) at `rank`: floats sent against float32 (its JSON only)."""
    shapes = {"mlp up/down (128x512)": (128, 512), "attention q/k/v (128x[4x32])": (128, 128),
              "head project (128x256)": (128, 256), "token embedding (256x128)": (256, 128)}
    return {label: {"fp32_floats": n * m, "sent_floats": rank * (n + m), "ratio": n * m / (rank * (n + m))}
            for label, (n, m) in shapes.items()}


def _row(run: str, name: str, r: dict, none: dict | None) -> dict:
    row = {"run": run, "config": name, "bytes_per_step": r["bytes_per_step"], "ratio": r["ratio"],
           "run_ratio": r.get("run_ratio"),  # older JSONs have none
           "link_bytes_per_worker": r["link_bytes_per_worker"], "step_s": r["step_time_s"],
           "compute_s": r["compute_s"], "collective_s": r["collective_s"],
           "achieved_link_mbit_s": r["achieved_link_mbit_s"], "final_val_loss": r["final_val_loss"],
           "time_to_quality_s": r.get("time_to_quality_s"), "train_s": r["train_s"],
           "time_within_1pct_s": r.get("time_within_1pct_s"),
           "phase": r.get("phase", "")}  # the last step's: which rank PowerSGD ended at
    if none:
        row["speedup"] = none["step_time_s"] / r["step_time_s"]
        row["gap_vs_none"] = (r["final_val_loss"] - none["final_val_loss"]) / none["final_val_loss"]
        if row["time_to_quality_s"] is not None:
            row["time_to_quality_vs_none"] = row["time_to_quality_s"] / none["train_s"]
        if row["time_within_1pct_s"]:
            row["sooner_within_1pct"] = none["train_s"] / row["time_within_1pct_s"]
    return row


def table(results: dict, bytes_only=()) -> list[dict]:
    """One row per (run = link and worker count, configuration); runs in `bytes_only`
    trained a few steps, so their rows carry no speed-up or loss gap."""
    return [_row(run, name, r, configs.get("none") if run not in bytes_only else None)
            for run, configs in results.items() for name, r in configs.items()]


def is_goal_config(name: str, phase: str = "") -> bool:
    """Whether the goal speaks of this configuration: DGC/top-k, 1-bit Adam, and PowerSGD at
    rank <= 4 at the run's last step (`phase`, as the JSON records it: "('compressed', 4)"
    for a rank schedule's stage; a run that ended before its rank-4 stage is not scored)."""
    kind, args, _ = CONFIGS.get(name, (None, {}, False))
    if kind not in GOAL_KINDS:
        return False
    if kind != "powersgd":
        return True
    stage = re.search(r"'compressed', (\d+)", phase)
    if stage:
        return int(stage.group(1)) <= GOAL_MAX_RANK
    return "warmup" not in phase and not args.get("rank_schedule") and args.get("rank", 4) <= GOAL_MAX_RANK


def _scored(row: dict, equal_steps) -> dict:
    out = {f"bytes>={GOAL_RATIO:g}x": row["ratio"] >= GOAL_RATIO,
           "time_to_quality<=1/3": None if row.get("time_to_quality_vs_none") is None
           else row["time_to_quality_vs_none"] <= 1 / 3}
    if equal_steps if isinstance(equal_steps, bool) else row["run"] in equal_steps:
        allowed = GOAL_GAP_DGC if row["config"].startswith("dgc") else GOAL_GAP
        # one-sided: ending below none's loss is not a miss
        out[f"val_loss_within_{allowed:.0%}"] = row.get("gap_vs_none", 1) <= allowed
    return out


def _worker_scaling(rows: list[dict], out: dict) -> None:
    """4 workers' link bytes within 10% of 2 workers'."""
    by_run = {}
    for row in rows:
        by_run.setdefault((row["run"].rsplit("_w", 1)[0], row["config"]), {})[row["run"]] = row["link_bytes_per_worker"]
    for (link, name), runs in by_run.items():
        w2, w4 = runs.get(f"{link}_w2"), runs.get(f"{link}_w4")
        if w2 and w4:
            out.setdefault(f"{link}/{name}", {})["link_bytes_w4_within_10%_of_w2"] = w4 <= 1.1 * w2


def goals(rows: list[dict], equal_steps=True, bytes_only=()) -> dict:
    """The goals per run and configuration: the loss gap only in runs where every
    configuration ran the same steps (`equal_steps`: True, False or the set of such runs);
    runs in `bytes_only` trained a few steps and count only for bytes."""
    out = {}
    for row in rows:
        if row["run"] in bytes_only:
            continue
        if row["config"].startswith("auto"):
            ttq = row.get("time_to_quality_vs_none")
            out[f"{row['run']}/auto"] = {f"time_to_quality<={1 + GOAL_AUTO_SLOWER:g}x_none":
                                         None if ttq is None else ttq <= 1 + GOAL_AUTO_SLOWER}
        if is_goal_config(row["config"], row.get("phase", "")):
            out[f"{row['run']}/{row['config']}"] = _scored(row, equal_steps)
        if row["config"].startswith("diloco"):
            sooner = row.get("sooner_within_1pct")
            out[f"{row['run']}/{row['config']}"] = {
                f"within_1%_{GOAL_DILOCO_SOONER:g}x_sooner": None if sooner is None else sooner >= GOAL_DILOCO_SOONER}
    _worker_scaling(rows, out)
    return out
