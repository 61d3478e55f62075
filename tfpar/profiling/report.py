"""The breakdown of a profiled window: per step, per worker, written and drawn.

`analyse` reads one worker's trace back (tfpar.profiling.trace) and returns what
results.json holds under "profile": each step's parts (compute, collectives by kind,
input, idle), the host clock's time of the same steps, the communication log (each
collective's bytes and time, as DeepSpeed's comms logger), the bus bandwidth achieved per
kind, and FLOPs with MFU when the peak is known. `draw` stacks every worker's steps in
one picture.

Example:
    >>> summary = analyse(window, worker=0, group_size=2, graph_collectives=counted)
    >>> print("\n".join(lines(summary)))
"""

from __future__ import annotations

import collections
import json
import os
import statistics
from typing import Sequence

from tfpar.profiling import trace

# nccl-tests' busbw over algbw (what the fastest link carries, per byte of the payload);
# tfpar.compression.accounting.LINK_FACTORS counts a link's bytes per byte handed over instead
BUSBW_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                 "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                 "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


def _bytes_by_name(graph_collectives) -> dict[str, int | None]:
    """Graph op name -> bytes one replica hands over (tfpar.compression.accounting)."""
    return {c.name: c.bytes for c in graph_collectives or ()}


def comm_log(steps: Sequence[trace.Step], graph_collectives=None) -> list[dict]:
    """One row per collective that ran in a profiled step: its step, graph name, kind,
    bytes (counted from the traced step's graph; None for a collective outside the step
    function, such as the preemption agreement, for one whose size depends on the data,
    or without the graph: Keras fit) and milliseconds. A row's `in_step` tells whether it
    belongs to the step's own function call (the call most of the step's collectives
    share; without the graph, most of all of them)."""
    sizes = _bytes_by_name(graph_collectives)
    rows = []
    for step in steps:
        named = [(kind, e, trace.graph_name(e.op_name, sizes)) for kind, e in step.collectives]
        calls = collections.Counter(e.stats.get("step_id") for _, e, name in named if name in sizes or not sizes)
        own = calls.most_common(1)[0][0] if calls else None  # the step function's call
        for kind, e, name in sorted(named, key=lambda item: item[1].start):
            in_step = (name in sizes or not sizes) and e.stats.get("step_id") == own
            rows.append({"step": step.number, "name": name, "kind": kind,
                         "bytes": sizes.get(name) if in_step else None, "ms": e.duration / 1e9,
                         "in_step": in_step, "start_ms": (e.start - step.start) / 1e9})
    return rows


def bandwidth(rows: Sequence[dict], group_size: int) -> dict[str, dict]:
    """Per kind: bytes and seconds per step, algbw and busbw in GB/s (bytes over the time
    the collectives were in flight; busbw scales algbw by the ring's link factor). Without
    counted bytes (Keras fit) the bandwidths are None."""
    steps = {r["step"] for r in rows} or {0}
    found = {}
    for kind in trace.KINDS:
        mine = [r for r in rows if r["kind"] == kind and r["in_step"]]
        if not mine:
            continue
        sent, seconds = sum(r["bytes"] or 0 for r in mine), sum(r["ms"] for r in mine) / 1e3
        algbw = sent / seconds / 1e9 if seconds and sent else None
        found[kind] = {"bytes_per_step": sent / len(steps), "seconds_per_step": seconds / len(steps),
                       "count_per_step": len(mine) / len(steps), "algbw_gbs": algbw,
                       "busbw_gbs": algbw * BUSBW_FACTORS[kind](group_size) if group_size > 1 and algbw else None}
    return found


def analyse(window, *, worker: int, group_size: int, graph_collectives=None,
            flops_per_step: float | None = None, peak_flops: float | None = None) -> dict:
    """The summary of `window` on this worker (see the module docstring)."""
    files = trace.xplane_files(window.logdir)
    if not files:
        raise trace.ProfileError(f"No profile was written under {window.logdir}: the profiler "
                                 "did not run (is another profiler session active in this process?).")
    steps = [s for s in trace.read_steps(files[-1]) if window.contains(s.number)]
    rows = comm_log(steps, graph_collectives)
    per_step = []
    for step in steps:
        parts = trace.breakdown(step)
        per_step.append({"step": step.number, "seconds": step.seconds,
                         "host_seconds": window.host_seconds.get(step.number), **parts})
    mean = {part: statistics.fmean(s[part] for s in per_step) for part in ("seconds", *trace.PARTS)} \
        if per_step else {}
    summary = {"worker": worker, "steps": [window.first, window.last], "logdir": window.logdir,
               "xplane": files[-1], "per_step": per_step, "mean": mean, "comm_log": rows,
               "bandwidth": bandwidth(rows, group_size), "group_size": group_size,
               "profiler_seconds": window.profiler_seconds}
    if flops_per_step and mean.get("seconds"):
        summary["flops_per_step"] = flops_per_step
        summary["achieved_tflops"] = flops_per_step / mean["seconds"] / 1e12
        if peak_flops:
            summary["peak_tflops"] = peak_flops / 1e12
            summary["mfu"] = flops_per_step / mean["seconds"] / peak_flops
    return summary


def write(summary: dict) -> str:
    """Writes `breakdown.json` into the window's logdir; returns its path."""
    path = os.path.join(summary["logdir"], "breakdown.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return path


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def lines(summary: dict) -> list[str]:
    """What the end of a profiled window prints."""
    mean = summary["mean"]
    if not mean:
        return [f"profile: no marked step of {summary['steps']} in {summary['xplane']}"]
    total = mean["seconds"] or 1e-12
    parts = " | ".join(f"{part} {_ms(mean[part])} ({mean[part] / total:.0%})"
                       for part in trace.PARTS if mean[part] > 0.0005 * total)
    first, last = summary["steps"]
    out = [f"profile: steps {first}-{last}, worker {summary['worker']}: {_ms(total)} a step = {parts}"]
    for kind, b in summary["bandwidth"].items():
        if b["algbw_gbs"] is None:
            out.append(f"profile: {kind} {b['count_per_step']:g} call(s) a step, {_ms(b['seconds_per_step'])} in "
                       "flight (bytes are counted in tfpar's loop, --config.mode=loop)")
            continue
        line = (f"profile: {kind} {b['bytes_per_step']:,.0f} bytes a step in {b['count_per_step']:g} call(s), "
                f"{_ms(b['seconds_per_step'])} in flight: algbw {b['algbw_gbs']:.3f} GB/s, "
                f"busbw {b['busbw_gbs'] or 0:.3f} GB/s")
        if "measured_busbw_gbs" in b:
            line += f" (tfpar-check's all-reduce of that size now: busbw {b['measured_busbw_gbs']:.3f} GB/s)"
        out.append(line)
    if "mfu" in summary:
        out.append(f"profile: {summary['flops_per_step'] / 1e9:,.2f} GFLOP a step, "
                   f"{summary['achieved_tflops']:.3f} TFLOP/s = MFU {summary['mfu']:.1%} of "
                   f"{summary['peak_tflops']:.3f} TFLOP/s ({summary.get('peak_source', 'peak')})")
    out.append(f"profile: trace in {summary['logdir']} (tensorboard --logdir of the workdir, Profile tab)")
    return out


def stack(ax, bars: Sequence[dict], scale: float = 1e3) -> list[float]:
    """Stacks each bar's PARTS (seconds x `scale`) on `ax`, skipping parts that are ~0 in
    every bar; returns the bars' tops."""
    bottom = [0.0] * len(bars)
    for part in trace.PARTS:
        heights = [bar[part] * scale for bar in bars]
        if any(h > 1e-4 * scale for h in heights):
            ax.bar(range(len(bars)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
    return bottom


def save(fig, ax, labels: Sequence[str], ylabel: str, title: str, path: str) -> str:
    """Labels, legend and the PNG at `path` (closes `fig`)."""
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    ax.set_xticks(range(len(labels)), list(labels), fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(summaries: Sequence[dict], path: str) -> str:
    """One stacked bar per (worker, step): its parts in PARTS order, the host clock's step
    time marked on it. Returns `path`."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    bars = [(f"w{s['worker']}\n{row['step']}", row) for s in summaries for row in s["per_step"]]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * len(bars) + 2), 4))
    stack(ax, [row for _, row in bars])
    hosts = [row.get("host_seconds") for _, row in bars]
    if all(h is not None for h in hosts):
        ax.plot(range(len(bars)), [h * 1e3 for h in hosts], "k_", markersize=14, label="host clock")
    return save(fig, ax, [label for label, _ in bars], "ms", "where each profiled step's time went (worker, step)",
                path)
