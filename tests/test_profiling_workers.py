"""Profiles of real workers: two processes on loopback (one slowed on purpose) and two
namespace hosts on a 20 Mbit/s link, through the binary's code (tests/scripts/profile_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from procs import REPO, SCRIPTS, env, launch
from tfpar.profiling import trace
from tfpar.testing.netns import Hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _breakdowns(workdir) -> list[dict]:
    return [json.loads((workdir / "profile" / f"worker_{i}" / "breakdown.json").read_text()) for i in (0, 1)]


def _static_bytes(summary: dict, step: int) -> int:
    return sum(r["bytes"] for r in summary["comm_log"] if r["step"] == step and r["in_step"] and r["bytes"])


def test_two_workers_profile_their_window_and_the_slowed_one_is_named(tmp_path):
    from xprof.convert import raw_to_tool_data  # the Profile tab's own loader ([profile] extra)

    workdir = tmp_path / "run"
    result = launch(2, "profile_worker.py", str(workdir), "--slow-worker=1", "--sleep=0.15", timeout=400)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    results = json.loads((workdir / "results.json").read_text())

    # every worker's own profile, loadable by TensorBoard's profile plugin, with the
    # profiled steps' marks and their gradients' all-reduce
    for worker in (0, 1):
        files = trace.xplane_files(str(workdir / "profile" / f"worker_{worker}"))
        assert len(files) == 1
        data, content_type = raw_to_tool_data.xspace_to_tool_data(files, "trace_viewer", {"use_saved_result": False})
        text = data if isinstance(data, str) else data.decode()
        assert content_type == "application/json" and "CollectiveReduceV2" in text and '"train"' in text
    breakdowns = _breakdowns(workdir)
    for summary in breakdowns:
        assert [row["step"] for row in summary["per_step"]] == [10, 11, 12, 13]
        for row in summary["per_step"]:  # the parts add up to the host clock's step time
            parts = sum(row[part] for part in trace.PARTS)
            assert parts == pytest.approx(row["host_seconds"], rel=0.05), row
            # the communication log's bytes are the traced step's counted bytes: the
            # gradients (the wire line's) and the call's 4-byte loss sum
            assert _static_bytes(summary, row["step"]) == results["wire_bytes_per_step"] + 4
    fast, slow = (b["mean"] for b in breakdowns)
    assert fast["all_reduce"] > slow["all_reduce"] + 0.08  # worker 0 waits ~150 ms for worker 1
    assert "[worker:0] profile: steps 10-13, worker 0:" in out and "all_reduce 1,915,908 bytes a step" in out
    assert (workdir / "profile" / "breakdown.png").stat().st_size > 5000
    assert results["profile"]["steps"] == [10, 13] and results["profile"]["mean"]["seconds"] > 0

    # the straggler: worker 1's own part of each step is ~150 ms longer, named in the line
    assert "| straggler worker 1 +" in out and results["straggler"] == 1
    assert results["straggler_lag_ms"] > 50

    # TensorBoard's scalars: throughput, MFU, wire, step-time percentiles, each worker's own step
    tags = _scalar_tags(workdir / "tensorboard")
    assert {"train/tok_per_s", "train/mfu", "train/wire_bytes_per_s", "train/step_ms_p50", "train/step_ms_p90",
            "train/step_ms_p99", "train/worker_0_own_step_ms", "train/worker_1_own_step_ms",
            "train/straggler_lag_ms"} <= tags


def _scalar_tags(directory) -> set[str]:
    import tensorflow as tf

    return {value.tag for path in directory.glob("events.out.tfevents.*")
            for event in tf.compat.v1.train.summary_iterator(str(path)) for value in event.summary.value}


@pytest.mark.skipif(Hosts.unavailable() is not None, reason=Hosts.unavailable() or "")
def test_on_a_20_mbit_link_the_all_reduce_dominates_the_step(tmp_path):
    workdir = tmp_path / "run"
    with Hosts(2, rate="20mbit") as hosts:
        config = lambda i: json.dumps({"cluster": {"worker": [f"{a}:23456" for a in hosts.addresses]},  # noqa: E731
                                       "task": {"type": "worker", "index": i}})
        procs = [hosts.popen(i, [sys.executable, str(SCRIPTS / "profile_worker.py"), str(workdir),
                                 "--steps=6", "--profile=4,5"], cwd=REPO, env=env(TF_CONFIG=config(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-2000:]
    for summary in _breakdowns(workdir):
        mean = summary["mean"]  # 1.9 MB each way at 20 Mbit/s: ~1.5 s against ~0.2 s of compute
        assert mean["all_reduce"] > 0.6 * mean["seconds"] and mean["all_reduce"] > mean["compute"], mean
