"""What zb-h1 could reach at the unit times the schedules benchmark measured: a model of the limit.

    python benchmarks/zero_bubble_limit.py    # reads and writes benchmarks/results/schedules/

Takes the profiled zb-h1 row at S = 2 (the largest M) of `placement.json`: each device's
measured F, B and W per micro-batch. Replays (`schedules.simulate`, no executor gaps) the
zb-h1 order built for those times and 1F1B at the same times, three ways:
- as measured: the plan's real split of the work between the two devices;
- balanced: each device's units scaled so both do the same work a step, keeping each
  device's own F : B : W ratio (what a cut fine enough to balance would give on this CPU);
- GPU-like (in units of F, not seconds): balanced, with F = B = W on both devices (the
  first device's B is its activation chain back to the embedding's output), the ratio the
  zero-bubble paper assumes.
The least zb-h1 / 1F1B bubble ratio each way is what no order can beat at those times.
"""

from __future__ import annotations

import argparse
import json
import os

from tfpar.placement import schedules


def work(durations: dict, device: int) -> float:
    """One micro-batch's F + B + W on `device`."""
    return sum(v for (_, d), v in durations.items() if d == device)


def replay(durations: dict, micro_batches: int) -> dict:
    """zb-h1 (ordered for `durations`) and 1F1B replayed at `durations`; their bubbles."""
    zb = schedules.order("zb-h1", 2, 2, micro_batches, durations)
    zb_bubble = schedules.bubble(schedules.simulate(zb, 2, durations, split_backward=True), 2)
    one = schedules.order("1f1b", 2, 2, micro_batches)
    one_bubble = schedules.bubble(schedules.simulate(one, 2, durations), 2)
    return {"work_per_device": [micro_batches * work(durations, d) for d in (0, 1)],
            "zb-h1": zb_bubble, "1f1b": one_bubble, "ratio": zb_bubble / one_bubble}


def balanced(durations: dict) -> dict:
    """Each device's units scaled to the same total, its own F : B : W kept."""
    totals = {d: work(durations, d) for d in (0, 1)}
    mean = sum(totals.values()) / 2
    return {(k, d): v * mean / totals[d] for (k, d), v in durations.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/schedules")
    args = parser.parse_args()
    with open(os.path.join(args.results, "placement.json")) as f:
        runs = json.load(f)["runs"]
    rows = [r for r in runs if r["schedule"] == "zb-h1" and r["stages"] == 2]
    if not rows:
        parser.error(f"{args.results}/placement.json has no profiled zb-h1 run at S=2 (the replay "
                     "models two devices): run benchmarks/placement.py with --stages=2 and zb-h1 in "
                     "--schedules first.")
    row = max(rows, key=lambda r: r["micro_batches"])
    m = row["micro_batches"]
    measured = {(name[0], int(name[1:])): max(ms / 1000, 1e-9) for name, ms in row["unit_ms"].items()}
    gpu_like = {(k, d): 1.0 for k in "FBW" for d in (0, 1)}
    result = {"source": f"zb-h1 S=2 M={m} in placement.json", "unit_ms": row["unit_ms"],
              "measured_bubbles": {"zb-h1": row["bubble"]},
              "as_measured": replay(measured, m), "balanced": replay(balanced(measured), m),
              "gpu_like": replay(gpu_like, m)}
    one = next(r for r in runs if (r["schedule"], r["stages"], r["micro_batches"]) == ("1f1b", 2, m))
    result["measured_bubbles"]["1f1b"] = one["bubble"]
    with open(os.path.join(args.results, "zero_bubble_limit.json"), "w") as f:
        json.dump(result, f, indent=2)
    for way in ("as_measured", "balanced", "gpu_like"):
        r = result[way]
        print(f"{way:12s} work/device {r['work_per_device'][0]:.3f} / {r['work_per_device'][1]:.3f}, "
              f"zb-h1 {r['zb-h1']:.3f}, 1f1b {r['1f1b']:.3f}, least ratio {r['ratio']:.2f}")


if __name__ == "__main__":
    main()
