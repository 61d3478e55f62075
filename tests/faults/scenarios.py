"""Fault scenarios: each injects one fault into a real run and reports what survived.

Used by the tests in this folder (which assert on the outcome) and by `run_suite.py`
(which prints the table). Every scenario returns a dict: fault, injected, survived,
steps_lost, data_lost, detail.

The multi-worker ones run `tfpar-launch --workers 2 --max-restarts 1 -- tfpar-train` on
the reverse task (multi_worker_mirrored, loopback) and compare the final checkpoint with
an uninterrupted run of the same config: equal weights mean the restart lost no step and
no data (a batch skipped or seen twice would change them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import procs  # noqa: E402

STEPS, EVERY, LOOP = 60, 20, 10


def train_command(workdir: str, mode: str = "loop", every: int = EVERY, loop: int = LOOP) -> list[str]:
    return [sys.executable, "-m", "tfpar.train", f"--config={procs.REPO / 'configs' / 'reverse_tiny.py'}",
            f"--workdir={workdir}", "--config.strategy=multi_worker_mirrored",
            "--config.strategy_args.timeout_s=60", f"--config.mode={mode}",
            f"--config.train.steps={STEPS}", f"--config.train.checkpoint_every={every}",
            f"--config.train.log_every={loop}", f"--config.train.steps_per_loop={loop}",
            "--config.train.eval_examples=100", "--config.optimizer.schedule=constant"]


def launch(workdir: str, mode: str, fault=None, timeout: float = 600,
           every: int = EVERY, loop: int = LOOP) -> tuple[int, str]:
    """Runs the two-worker job; `fault(pids, line)` is called on every output line and may
    signal a worker. Returns (exit code, output)."""
    command = [sys.executable, "-m", "tfpar.launch", "--workers", "2", "--max-restarts", "1", "--",
               *train_command(workdir, mode, every, loop)]
    launcher = subprocess.Popen(command, env=procs.env(), cwd=procs.REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    pids, lines, deadline = {}, [], time.monotonic() + timeout
    for line in launcher.stdout:
        lines.append(line)
        started = re.search(r"\[tfpar-launch\] (\w+:\d+) started \(pid (\d+)\)", line)
        if started:
            pids[started.group(1)] = int(started.group(2))
        if fault is not None:
            fault(pids, line)
        if time.monotonic() > deadline:
            launcher.kill()
            break
    return launcher.wait(), "".join(lines)


def checkpoint(workdir: str) -> tuple[str, dict]:
    import tensorflow as tf

    path = tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    names = [n for n in reader.get_variable_to_shape_map()
             if "save_counter" not in n and not n.startswith("_CHECKPOINTABLE")]
    return path, {n: reader.get_tensor(n) for n in names}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a)


def kill_worker(tmp: str, sig: int, mode: str = "loop", reference: dict | None = None,
                at: int = 30, every: int = EVERY, loop: int = LOOP) -> dict:
    """Sends `sig` to worker:1 once worker:0 has logged step `at` (the signal lands a call or
    two later: the output reaches the test through pipes). Checkpoints every `every` steps;
    the workers log and check for preemption every `loop` steps. `reference`: the final weights of an
    uninterrupted run with the same settings (run here when None)."""
    sent = {}

    def fault(pids, line):
        if not sent and re.search(rf"\[worker:0\] step {at}/", line) and "worker:1" in pids:
            os.kill(pids["worker:1"], sig)
            sent["at"] = at

    code, output = launch(os.path.join(tmp, "faulty"), mode, fault, every=every, loop=loop)
    if reference is None:
        ref_code, ref_output = launch(os.path.join(tmp, "straight"), mode, every=every, loop=loop)
        assert ref_code == 0, ref_output[-3000:]
        reference = checkpoint(os.path.join(tmp, "straight"))[1]
    before = output.split("restarting it")[0]  # what the first group did before it stopped
    trained = [int(n) for n in re.findall(r"\[worker:0\] step (\d+)/", before)]
    trained += [int(n) for n in re.findall(r"preempted: saved step (\d+)", before)]
    resumed = re.search(r"resuming from step (\d+)", output)
    path, weights = checkpoint(os.path.join(tmp, "faulty")) if code == 0 else (None, {})
    resumed_at = int(resumed.group(1)) if resumed else None
    survived = bool(code == 0 and sent and resumed and same_weights(weights, reference))
    saved = re.search(r"preempted: saved step (\d+)", before)
    name = signal.Signals(sig).name
    return {"fault": f"{name} to a worker ({mode} mode)", "injected": bool(sent),
            "survived": survived,
            "steps_lost": (max(trained) - resumed_at) if resumed_at is not None and trained else None,
            "data_lost": 0 if survived else None,
            "detail": f"exit {code}, resumed at step {resumed_at}, final {path}",
            "saved_at": int(saved.group(1)) if saved else None, "resumed_at": resumed_at,
            "output": output}


def orphaned_worker(tmp: str, timeout_s: int = 10) -> dict:
    """Two workers started by hand (no launcher to stop the group): worker:1 is SIGKILLed
    at step 30; worker:0 must fail on its next collective, quickly, with one clear line."""
    import json

    from tfpar.launch import cluster_spec

    cluster = cluster_spec(2)
    command = [c for c in train_command(os.path.join(tmp, "orphan"), "loop")
               if not c.startswith(("--config.strategy_args.timeout_s=", "--config.train.steps="))]
    command += [f"--config.strategy_args.timeout_s={timeout_s}", "--config.train.steps=400",
                "--config.train.checkpoint_every=200"]
    workers = [subprocess.Popen(command, env=procs.env(TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}})), cwd=procs.REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    seen = False
    while not seen:
        line = workers[0].stdout.readline()
        if not line:
            break
        seen = bool(re.search(r"step\s+30/", line))
    workers[1].kill()
    killed = time.monotonic()
    try:
        rest, _ = workers[0].communicate(timeout=timeout_s + 60)
        waited = time.monotonic() - killed
    except subprocess.TimeoutExpired:
        workers[0].kill()
        rest, waited = workers[0].communicate()[0], None
    workers[1].wait()
    return {"fault": "SIGKILL of a worker, no launcher", "injected": seen,
            "survived": waited is not None and workers[0].returncode != 0,
            "seconds_to_fail": waited, "output": rest}
