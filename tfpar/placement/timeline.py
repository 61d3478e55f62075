"""The measured pipeline schedule as a picture: a Gantt chart and an animation of it.

The timings come from the pipeline itself (`Pipeline(record=True)`: `tf.timestamp()`
before and after every forward and backward unit, inside the graph), not from theory.
The bubble fraction is the share of stage-time not spent in any unit, between the first
start and the last end; beside it the theoretical (S - 1) / (M + S - 1).

Example:
    >>> pipe = Pipeline(model, plan, micro_batches=8, record=True)
    >>> ...  # one step
    >>> summary = timeline.draw(pipe.timings.numpy(), "gantt.png", gif="pipeline.gif")
"""

from __future__ import annotations

import numpy as np

FORWARD, BACKWARD = "#4C72B0", "#DD8452"


def summarize(timings: np.ndarray) -> dict:
    """Stages, micro-batches, makespan and busy stage-time (s), measured and theoretical
    bubble fraction."""
    stage, micro = timings[:, 0].astype(int), timings[:, 1].astype(int)
    start, end = timings[:, 3] - timings[:, 3].min(), timings[:, 4] - timings[:, 3].min()
    stages, micro_batches = stage.max() + 1, micro.max() + 1
    makespan = float(end.max())
    busy = float(np.sum(end - start))
    return {"stages": int(stages), "micro_batches": int(micro_batches), "makespan_s": makespan,
            "busy_s": busy,
            "bubble": 1.0 - busy / (stages * makespan) if makespan > 0 else 0.0,
            "bubble_theory": (stages - 1) / (micro_batches + stages - 1)}


def draw(timings: np.ndarray, png: str, gif: str | None = None, title: str = "") -> dict:
    """Writes the Gantt chart (and, with `gif`, an animation filling it in time order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import animation

    summary = summarize(timings)
    t0 = timings[:, 3].min()
    units = sorted(timings.tolist(), key=lambda u: u[3])
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * summary["stages"]))
    ax.set_xlim(0, summary["makespan_s"] * 1000 * 1.02)
    ax.set_ylim(-0.5, summary["stages"] - 0.5)
    ax.invert_yaxis()
    ax.set_yticks(range(summary["stages"]), [f"stage {s}" for s in range(summary["stages"])])
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} measured bubble {summary['bubble']:.0%} "
                 f"(theory {summary['bubble_theory']:.0%})".strip())
    bars = []
    for s, m, kind, start, end in units:
        color = BACKWARD if kind else FORWARD
        bar = ax.barh(int(s), (end - start) * 1000, left=(start - t0) * 1000, color=color,
                      edgecolor="white", height=0.8)[0]
        text = ax.text((start - t0 + (end - start) / 2) * 1000, int(s), f"{int(m)}",
                       ha="center", va="center", fontsize=7, color="white")
        bars.append((bar, text))
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=FORWARD, label="forward"),
                       plt.Rectangle((0, 0), 1, 1, color=BACKWARD, label="backward")],
              loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if gif:
        def show(frame):
            for i, (bar, text) in enumerate(bars):
                bar.set_visible(i < frame)
                text.set_visible(i < frame)
            return [x for pair in bars for x in pair]

        movie = animation.FuncAnimation(fig, show, frames=len(bars) + 1, interval=150, blit=False)
        movie.save(gif, writer=animation.PillowWriter(fps=6))
    plt.close(fig)
    return summary
