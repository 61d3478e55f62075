"""What tfpar-train adds for `config.train.profile_steps`, `train.stragglers` and MFU.

Example:
    >>> window = profile_window(config, info, workdir, start, say, ...)   # None when off
    >>> draw_workers(workdir)           # WORKDIR/profile/breakdown.png, every worker found
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

from tfpar.profiling import report
from tfpar.profiling.window import ProfileWindow, parse_steps


def worker_rank(strategy, info) -> int:
    """This process's place among the workers, 0..N-1: a chief is 0 and worker i is i + 1
    beside it (TF_CONFIG numbers each task type from 0)."""
    if info.task_type == "chief":
        return 0
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return (info.task_index or 0) + (1 if "chief" in spec else 0)


def logdir(workdir: str, worker: int) -> str:
    """A worker's own profile directory (one profiler session per process; workers on one
    host would overwrite each other's `<hostname>.xplane.pb` in a shared one)."""
    return os.path.join(workdir, "profile", f"worker_{worker}")


def profile_window(config, info, strategy, workdir: str, start: int, say: Callable[[str], None],
                   collectives: Callable[[], list | None], flops_per_step: float | None,
                   peak: tuple[float | None, str], keep: dict) -> ProfileWindow | None:
    """The window of `config.train.profile_steps` (None: off, or already passed when the
    run resumed after it). When it ends every worker analyses its own trace, measures an
    all-reduce of the step's size beside it (tfpar-check's probe), writes breakdown.json
    and says the breakdown (the chief); the chief's summary goes into `keep["profile"]`."""
    steps = parse_steps(config.train.profile_steps)
    if steps is None:
        return None
    first, last = steps
    if start >= last:
        say(f"tfpar: profile_steps {first}-{last}: not profiled, the run resumed at step {start}.")
        return None
    if start + 1 >= first:  # the first call after a restore traces its function: not profiled
        if start + 2 > last:
            say(f"tfpar: profile_steps {first}-{last}: not profiled, the run resumed at step {start} "
                "(its first step traces the step function).")
            return None
        say(f"tfpar: profile_steps {first}-{last}: from step {start + 2}; step {start + 1}, the first "
            f"after {'the restore' if start else 'the start'}, traces the step function.")
        first = start + 2
    worker = worker_rank(strategy, info)

    def on_end(window: ProfileWindow) -> None:
        counted = collectives()
        probe = _all_reduce_probe(strategy, counted)  # first: every worker joins it, come what may
        try:
            summary = report.analyse(window, worker=worker, group_size=info.replicas,
                                     graph_collectives=counted, flops_per_step=flops_per_step,
                                     peak_flops=peak[0])
        except Exception as error:  # pylint: disable=broad-except  (training goes on, said)
            say(f"profile: the trace in {window.logdir} could not be read back ({type(error).__name__}: "
                f"{error}); training goes on without the breakdown.")
            return
        summary["peak_source"] = peak[1]
        if probe and "all_reduce" in summary["bandwidth"]:
            summary["bandwidth"]["all_reduce"].update(probe)
        report.write(summary)
        for line in report.lines(summary):
            say(line)
        keep["profile"] = {k: v for k, v in summary.items() if k != "comm_log"}

    return ProfileWindow(first, last, logdir(workdir, worker), on_end=on_end)


def _all_reduce_probe(strategy, counted) -> dict | None:
    """tfpar-check's all-reduce of the step's largest all-reduce, timed now, to set beside
    the achieved one. Every worker runs it with the size read from the traced graph, the
    same everywhere (a size read from each worker's trace could differ: a collective
    mismatch)."""
    from tfpar.check_probes import all_reduce_table  # pylint: disable=import-outside-toplevel
    from tfpar.profiling.trace import COLLECTIVE_KINDS  # pylint: disable=import-outside-toplevel

    sizes = [c.bytes for c in counted or () if c.bytes and COLLECTIVE_KINDS.get(c.type) == "all_reduce"]
    if not sizes or strategy.num_replicas_in_sync < 2:
        return None
    row = all_reduce_table(strategy, [max(sizes)], iterations=5)[0]
    return {"measured_busbw_gbs": row["busbw_gbs"], "measured_time_us": row["time_us"],
            "measured_bytes": row["bytes"]}


def draw_workers(workdir: str) -> str | None:
    """WORKDIR/profile/breakdown.png from every worker's breakdown.json found there."""
    found = sorted(glob.glob(os.path.join(workdir, "profile", "worker_*", "breakdown.json")))
    if not found:
        return None
    summaries = []
    for path in found:
        with open(path, encoding="utf-8") as f:
            summaries.append(json.load(f))
    return report.draw(sorted(summaries, key=lambda s: s["worker"]),
                       os.path.join(workdir, "profile", "breakdown.png"))


def flops_and_peak(config, model, sample, replicas_here: int, device: str) -> tuple[float | None, tuple]:
    """(FLOPs a step on this worker, (peak FLOP/s of its devices, its source)) for MFU.
    `sample`: one micro-batch of one replica (a step runs `parallel.microbatches` x
    `train.accumulate` of them per replica). The peak: a GPU's or TPU's rate times this
    worker's replicas; a CPU's timed matmul as it is (its logical devices share the cores
    it was timed on)."""
    from tfpar.profiling import peak  # pylint: disable=import-outside-toplevel

    passes = config.train.accumulate * config.parallel.microbatches
    flops = peak.step_flops(model, sample, replicas_here, passes)
    rate, source = peak.device_peak(device, config.precision)
    if rate and "CPU" not in device.upper() and replicas_here > 1:
        rate, source = rate * replicas_here, f"{source}, x {replicas_here} devices"
    return flops, (rate, source)
