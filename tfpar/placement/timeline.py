"""The measured pipeline schedule as a picture: Gantt charts and an animation of them.

The timings come from the pipeline itself (`Pipeline(record=True)`: `tf.timestamp()`
before and after every unit, inside the graph), not from theory: rows of device,
micro-batch, kind (0 forward, 1 backward or zb's B, 2 zb's W), start, end and stage group
(older 5-column timings, without the group, are read too). The bubble fraction is the
share of device-time not spent in any unit between the first start and the last end;
beside it the schedule's theory (`Pipeline.bubble_theory()`; (S - 1) / (M + S - 1) if not
given).

Example:
    >>> pipe = Pipeline(model, plan, micro_batches=8, record=True)
    >>> ...  # one step, returning pipe.timings
    >>> summary = timeline.draw(timings, "gantt.png", gif="pipeline.gif")
    >>> timeline.animate({"1f1b": t1, "zb-h1": t2}, "schedules.gif")   # side by side
"""

from __future__ import annotations

import numpy as np

FORWARD, BACKWARD, WEIGHTS = "#4C72B0", "#DD8452", "#55A868"
COLORS = (FORWARD, BACKWARD, WEIGHTS)
NAMES = ("forward", "backward (B)", "weight gradient (W)")


def summarize(timings: np.ndarray, theory: float | None = None) -> dict:
    """Devices ("stages"), micro-batches, makespan and busy device-time (s), measured and
    theoretical bubble fraction, and busy time per unit kind."""
    timings = np.asarray(timings, dtype=np.float64)
    device, micro, kind = (timings[:, i].astype(int) for i in range(3))
    start, end = timings[:, 3] - timings[:, 3].min(), timings[:, 4] - timings[:, 3].min()
    stages, micro_batches = device.max() + 1, micro.max() + 1
    makespan = float(end.max())
    busy = float(np.sum(end - start))
    if theory is None:
        theory = (stages - 1) / (micro_batches + stages - 1)
    return {"stages": int(stages), "micro_batches": int(micro_batches), "makespan_s": makespan,
            "busy_s": busy, "bubble": float(1.0 - busy / (stages * makespan)) if makespan > 0 else 0.0,
            "bubble_theory": float(theory),
            "busy_by_kind_s": {NAMES[k].split(" ")[0]: float(np.sum((end - start)[kind == k]))
                               for k in sorted(set(kind.tolist()))}}


def unit_times(timings: np.ndarray) -> dict:
    """Median seconds of each unit kind on each device, {("F", d): s, ("B", d): s, ("W", d):
    s}, from recorded timings (a schedule without W units gets W = 0: its B is the whole
    backward). Feed them to `Pipeline(..., schedule="zb-h1", unit_times=...)`.

    Example:
        >>> timeline.unit_times([[0, 0, 0, 0.0, 0.5, 0], [0, 0, 1, 0.5, 1.0, 0]])
        {('F', 0): 0.5, ('B', 0): 0.5, ('W', 0): 0.0}
    """
    timings = np.asarray(timings, dtype=np.float64)
    found: dict = {}
    for d, _, k, start, end, *_ in timings:
        found.setdefault(("FBW"[int(k)], int(d)), []).append(end - start)
    times = {key: float(np.median(v)) for key, v in found.items()}
    for d in {int(d) for d in timings[:, 0]}:
        times.setdefault(("W", d), 0.0)
        times.setdefault(("B", d), 0.0)
    return times


def alone_speedup(timings: np.ndarray, alone: float = 0.25, together: float = 0.75) -> dict:
    """How much faster a unit runs while no other device is busy: per unit kind and device
    ("F0", "B1", ...), the median duration of its units that overlapped other devices' units
    for at least `together` of their time, over the median of those that did for at most
    `alone` (kinds with none of either are left out).

    Logical devices that share cores are not independent: a device alone may spread its
    independent ops over every core, so the units of a warm-up or cool-down, the bubble's
    edges, run faster than the schedule's replay at median unit times assumes.

    Example:
        >>> timeline.alone_speedup(timings)      # {'F0': 1.8, 'B1': 1.3, ...}
    """
    timings = np.asarray(timings, dtype=np.float64)
    others = {d: timings[timings[:, 0] != d][:, 3:5] for d in set(timings[:, 0].tolist())}
    durations: dict = {}
    for d, _, k, start, end, *_ in timings:
        share = _covered(others[d], start, end) / (end - start) if end > start else 0.0
        kind = "alone" if share <= alone else "together" if share >= together else None
        if kind:
            durations.setdefault(f"{'FBW'[int(k)]}{int(d)}", {}).setdefault(kind, []).append(end - start)
    return {key: float(np.median(found["together"]) / np.median(found["alone"]))
            for key, found in sorted(durations.items())
            if found.get("alone") and found.get("together") and np.median(found["alone"]) > 0}


def _covered(spans: np.ndarray, start: float, end: float) -> float:
    """Seconds of [start, end] inside the union of `spans` ([[start, end], ...])."""
    covered, reach = 0.0, start
    for a, b in sorted(spans.tolist()):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered, reach = covered + b - a, b
    return covered


def _bars(ax, timings: np.ndarray, t0: float, scale: float = 1000.0) -> list:
    """One bar per unit (label: micro-batch, and chunk for interleaved groups), in start
    order; returns [(bar, text, start, end)]."""
    groups_per_device = {}
    for row in timings:
        groups_per_device.setdefault(int(row[0]), set()).add(int(row[5]) if len(row) > 5 else 0)
    chunked = any(len(g) > 1 for g in groups_per_device.values())
    drawn = []
    for row in sorted(timings.tolist(), key=lambda u: u[3]):
        d, m, kind, start, end = row[:5]
        chunk = sorted(groups_per_device[int(d)]).index(int(row[5])) if len(row) > 5 else 0
        bar = ax.barh(int(d), (end - start) * scale, left=(start - t0) * scale, color=COLORS[int(kind)],
                      alpha=1.0 if chunk == 0 else 0.6, edgecolor="white", height=0.8)[0]
        label = f"{int(m)}" + (f"'{chunk}" if chunked else "")
        text = ax.text((start - t0 + (end - start) / 2) * scale, int(d), label, ha="center",
                       va="center", fontsize=6, color="white")
        drawn.append((bar, text, (start - t0) * scale, (end - t0) * scale))
    return drawn


def _axes(ax, stages: int, makespan_ms: float, title: str, kinds) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlim(0, makespan_ms * 1.02)
    ax.set_ylim(-0.5, stages - 0.5)
    ax.invert_yaxis()
    ax.set_yticks(range(stages), [f"device {s}" for s in range(stages)])
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[k], label=NAMES[k]) for k in kinds],
              loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)


def draw(timings: np.ndarray, png: str, gif: str | None = None, title: str = "",
         theory: float | None = None) -> dict:
    """Writes the Gantt chart (and, with `gif`, an animation filling it in time order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timings = np.asarray(timings, dtype=np.float64)
    summary = summarize(timings, theory)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * summary["stages"]))
    _axes(ax, summary["stages"], summary["makespan_s"] * 1000,
          f"{title} measured bubble {summary['bubble']:.0%} (theory {summary['bubble_theory']:.0%})".strip(),
          sorted(set(timings[:, 2].astype(int).tolist())))
    ax.set_xlabel("time (ms)")
    bars = _bars(ax, timings, timings[:, 3].min())
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if gif:
        _play(fig, [bars], summary["makespan_s"] * 1000, gif)
    plt.close(fig)
    return summary


def _play(fig, bar_sets, makespan_ms: float, gif: str, frames: int = 24) -> None:
    """Animates time sweeping from 0 to the makespan: each bar appears, growing, as its unit
    runs (the same clock for every chart in the figure)."""
    from matplotlib import animation

    def show(frame):
        now = makespan_ms * frame / frames
        for bars in bar_sets:
            for bar, text, start, end in bars:
                bar.set_visible(start < now)
                bar.set_width(max(0.0, min(now, end) - start))
                text.set_visible(now >= end)
        return []

    movie = animation.FuncAnimation(fig, show, frames=frames + 1, interval=160, blit=False)
    movie.save(gif, writer=animation.PillowWriter(fps=6), dpi=72)


def animate(runs: dict, gif: str, title: str = "", theories: dict | None = None) -> dict:
    """One GIF playing several measured schedules side by side on one clock (one chart per
    schedule, stacked); returns {name: summary}.

    Example:
        >>> timeline.animate({"1f1b": t1, "interleaved": t2, "zb-h1": t3}, "schedules.gif")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: np.asarray(t, dtype=np.float64) for name, t in runs.items()}
    summaries = {name: summarize(t, (theories or {}).get(name)) for name, t in runs.items()}
    longest = max(s["makespan_s"] for s in summaries.values()) * 1000
    stages = max(s["stages"] for s in summaries.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.4 + (0.45 * stages + 0.5) * len(runs)),
                             sharex=True, squeeze=False)
    bar_sets = []
    for ax, (name, timings) in zip(axes[:, 0], runs.items()):
        s = summaries[name]
        _axes(ax, s["stages"], longest, f"{name}: {s['makespan_s'] * 1000:.0f} ms, bubble "
              f"{s['bubble']:.0%} (theory {s['bubble_theory']:.0%})",
              sorted(set(timings[:, 2].astype(int).tolist())))
        bar_sets.append(_bars(ax, timings, timings[:, 3].min()))
    axes[-1, 0].set_xlabel("time (ms), measured")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _play(fig, bar_sets, longest, gif)
    plt.close(fig)
    return summaries
