"""The tables of benchmarks/results/schedules/README.md, generated from the JSON files.

    python benchmarks/placement_report.py                  # rewrites every generated table
    python benchmarks/placement_report.py --check          # exit 1 if a table differs from its JSONs
    python benchmarks/placement_report.py --print wait_grid

That README holds the history of the layer-placement and pipeline-schedule results
(benchmarks/results/schedules/, benchmarks/results/gpu/schedules/, benchmarks/results/placement/).
A generated table sits between `<!-- table: NAME -->` and `<!-- /table -->`; everything else
there is prose written by hand. Every figure in a table is read from the JSON the table is
built from (paths relative to benchmarks/results/), written by benchmarks/placement.py or
benchmarks/zero_bubble_limit.py.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import readme_tables

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
README = os.path.join(RESULTS, "schedules", "README.md")
GRID_ORDER = ("gpipe", "1f1b", "interleaved", "zb-h1 (F=B=W)", "zb-h1", "zb-v (F=B=W)", "zb-v")
ZERO_BUBBLE = ("zb-h1", "zb-v")


@functools.lru_cache(maxsize=None)
def load(file: str) -> dict:
    with open(os.path.join(RESULTS, file)) as f:
        return json.load(f)


def _runs(file: str) -> list[dict]:
    runs = load(file)["runs"]
    return sorted(runs, key=lambda r: (r["stages"], r["micro_batches"], GRID_ORDER.index(r["schedule"])))


def _baseline(file: str, run: dict) -> dict | None:
    return next((r for r in load(file)["runs"] if r["schedule"] == "1f1b"
                 and (r["stages"], r["micro_batches"]) == (run["stages"], run["micro_batches"])), None)


def _label(schedule: str) -> str:
    return f"{schedule} (profiled)" if schedule in ZERO_BUBBLE else schedule


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.0f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:,.0f} KiB"


COLUMNS = {  # header -> value of one run of `file`
    "schedule": lambda f, r: _label(r["schedule"]),
    "S": lambda f, r: str(r["stages"]),
    "M": lambda f, r: str(r["micro_batches"]),
    "ms/step": lambda f, r: f"{r['step_ms']:,.1f}" if r["step_ms"] < 200 else f"{r['step_ms']:,.0f}",
    "bubble": lambda f, r: f"{r['bubble']:.3f}",
    "theory": lambda f, r: f"{r['bubble_theory']:.3f}",
    "replayed": lambda f, r: f"{r['bubble_simulated']:.3f}",
    "points off theory": lambda f, r: f"{100 * (r['bubble'] - r['bubble_theory']):+.1f}",
    "points off replay": lambda f, r: f"{100 * (r['bubble'] - r['bubble_simulated']):+.1f}",
    "of 1F1B's": lambda f, r: ("-" if r["schedule"] == "1f1b" or not _baseline(f, r)
                               else f"{r['bubble'] / _baseline(f, r)['bubble']:.2f}"),
    "peak activations": lambda f, r: _mib(r["activation_peak_bytes"]),
    "unit ms (F, B, W per device)": lambda f, r: "; ".join(
        f"d{d}: " + ", ".join(f"{r['unit_ms'].get(k + str(d), 0):.0f}" for k in "FBW")
        for d in range(r["stages"])) if r["stages"] == 2 else "",
    "busy device-s": lambda f, r: f"{sum(t[4] - t[3] for t in r['timings']):.2f}" if r.get("timings") else "",
    "alone faster": lambda f, r: ", ".join(f"{k} {v:.2f}x" for k, v in sorted(r.get("alone_speedup", {}).items())),
}


def runs_table(file: str, columns: list[str]) -> list[str]:
    """One row per run of `file`, in (S, M, schedule) order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in _runs(file):
        lines.append("| " + " | ".join(COLUMNS[c](file, run) for c in columns) + " |")
    return lines


def grid_table(file: str) -> list[str]:
    """One row per (S, M), one column per schedule: bubble measured / theory (zb: / replayed)."""
    schedules = [s for s in GRID_ORDER if "(F=B=W)" not in s and any(r["schedule"] == s for r in load(file)["runs"])]
    lines = ["| S, M | " + " | ".join(schedules) + " |", "|---|" + "---|" * len(schedules)]
    cells: dict = {}
    for r in load(file)["runs"]:
        reference = r["bubble_simulated"] if r["schedule"] in ZERO_BUBBLE else r["bubble_theory"]
        cells[(r["stages"], r["micro_batches"], r["schedule"])] = f"{r['bubble']:.3f} / {reference:.3f}"
    for s, m in sorted({(r["stages"], r["micro_batches"]) for r in load(file)["runs"]}):
        lines.append(f"| {s}, {m} | " + " | ".join(cells.get((s, m, x), "") for x in schedules) + " |")
    return lines


def limit_table(files: list[str]) -> list[str]:
    """zero_bubble_limit.json: the least zb-h1 / 1F1B bubble ratio of the replayed orders."""
    lines = ["| JSON | measured zb-h1 / 1f1b | replayed as measured | devices balanced | GPU-like (F = B = W) | work per device, s (as measured) |",
             "|---|---|---|---|---|---|"]
    for file in files:
        z = load(file)
        measured = z["measured_bubbles"]["zb-h1"] / z["measured_bubbles"]["1f1b"]
        work = ", ".join(f"{w:.2f}" for w in z["as_measured"]["work_per_device"])
        lines.append(f"| `{file}` | {measured:.2f} | {z['as_measured']['ratio']:.2f} | "
                     f"{z['balanced']['ratio']:.2f} | {z['gpu_like']['ratio']:.2f} | {work} |")
    return lines


def gpipe_sweep(file: str) -> list[str]:
    lines = ["| S | M | s/step | bubble | theory | speed-up vs M = 1 | largest stage's share of parameters |",
             "|---|---|---|---|---|---|---|"]
    for r in load(file)["runs"]:
        lines.append(f"| {r['stages']} | {r['micro_batches']} | {r['step_s']:.3f} | {r['bubble']:.3f} | "
                     f"{r['bubble_theory']:.3f} | {r['speedup_vs_m1']:.2f} | {r['largest_stage_share']:.2f} |")
    return lines


FULL = ["schedule", "S", "M", "ms/step", "bubble", "theory", "replayed", "of 1F1B's", "peak activations"]
S2 = ["unit ms (F, B, W per device)"]
TABLES = {  # name -> its lines
    "wait_grid": lambda: runs_table("schedules/wait_grid/placement.json", [
        "schedule", "S", "M", "ms/step", "bubble", "theory", "points off theory", "replayed", "of 1F1B's"]),
    "deep_wide_t2": lambda: runs_table("schedules/deep_wide_t2/placement.json",
                                       FULL + S2 + ["busy device-s", "alone faster"]),
    "deep_wide_grid": lambda: grid_table("schedules/deep_wide_grid/placement.json"),
    "deep_wide_grid_full": lambda: runs_table("schedules/deep_wide_grid/placement.json", FULL),
    "deep_wide": lambda: runs_table("schedules/deep_wide/placement.json",
                                    FULL + S2 + ["busy device-s", "alone faster"]),
    "deep_wide_s4": lambda: runs_table("schedules/deep_wide_s4/placement.json", FULL + ["alone faster"]),
    "deep_wide_m4": lambda: grid_table("schedules/deep_wide_m4/placement.json"),
    "wide_short": lambda: runs_table("schedules/wide_short/placement.json", FULL + S2),
    "dim256": lambda: runs_table("schedules/placement.json", FULL),
    "noise_dim256": lambda: runs_table("schedules/s2_m8_dim256_batch128.json", FULL),
    "noise_dim512": lambda: runs_table("schedules/s2_m8_dim512.json", FULL),
    "limit": lambda: limit_table([
        "schedules/zero_bubble_limit.json", "schedules/wide_short/zero_bubble_limit.json",
        "schedules/deep_wide/zero_bubble_limit.json", "schedules/deep_wide_t2/zero_bubble_limit.json"]),
    "gpipe_sweep": lambda: gpipe_sweep("placement/placement.json"),
    "gpu": lambda: runs_table("gpu/schedules/placement.json", [
        "schedule", "ms/step", "bubble", "theory", "replayed", "of 1F1B's", "peak activations", "alone faster"]),
}
def main() -> int:
    return readme_tables.main(README, TABLES, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
