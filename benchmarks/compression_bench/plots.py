"""The printed table and the plot (loss against training seconds; bytes per worker)."""

from __future__ import annotations


def _cell(value, fmt: str, width: int) -> str:
    return ("-" if value is None else format(value, fmt)).rjust(width)


def print_table(rows: list[dict]) -> None:
    header = (f"{'run':<14} {'config':<18} {'B/step':>10} {'ratio':>6} {'whole':>6} {'link B/w':>10} {'step ms':>8} "
              f"{'comp ms':>8} {'Mbit/s':>7} {'val':>7} {'gap':>7} {'ttq s':>7} {'ttq/none':>8} {'x@1%':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        gap = r.get("gap_vs_none")
        print(f"{r['run']:<14} {r['config']:<18} {r['bytes_per_step']:>10,} {r['ratio']:>5.1f}x "
              f"{_cell(r.get('run_ratio'), '5.1f', 5)}x "
              f"{r['link_bytes_per_worker']:>10,.0f} {1000 * r['step_s']:>8.0f} {1000 * r['compute_s']:>8.0f} "
              f"{_cell(r['achieved_link_mbit_s'], '.0f', 7)} {r['final_val_loss']:>7.4f} "
              f"{_cell(None if gap is None else 100 * gap, '+.2f', 7)} {_cell(r['time_to_quality_s'], '.0f', 7)} "
              f"{_cell(r.get('time_to_quality_vs_none'), '.2f', 8)} {_cell(r.get('sooner_within_1pct'), '.2f', 6)}")


def _loss_panel(ax, results: dict, bytes_only) -> None:
    styles = ["-", "--", ":", "-."]
    for k, (run, configs) in enumerate((r, c) for r, c in results.items() if r not in bytes_only):
        for name, row in configs.items():
            seconds, losses = zip(*row["val_curve_wall"])
            ax.plot(seconds, losses, ls=styles[k % len(styles)], marker="o", ms=2, label=f"{run} {name}")
        none = configs.get("none")
        if none:
            ax.axhline(none["final_val_loss"], color="grey", lw=0.5)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0)
    ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.set_title("time to quality")
    ax.legend(fontsize=6, ncol=2)


def plot(results: dict, rows: list[dict], path: str, bytes_only=()) -> None:
    """Left: validation loss against training wall seconds, one curve per configuration and
    run (the time-to-quality plot; not for `bytes_only` runs). Right: bytes each worker
    transmits per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(16, 6))
    _loss_panel(ax_loss, results, bytes_only)
    labels = [f"{r['run']} {r['config']}" for r in rows]
    ax_bytes.barh(labels, [r["link_bytes_per_worker"] for r in rows], color="tab:blue")
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("bytes each worker transmits per step (traced graph, ring factors)")
    ax_bytes.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
