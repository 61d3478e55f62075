"""Asynchronous parameter-server training with tfpar.Trainer and the ClusterCoordinator."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from procs import REPO, env, launch

pytestmark = pytest.mark.multiprocess


def test_one_worker_with_sharded_embedding_equals_one_device():
    result = launch(1, "ps_equivalence.py", launch_args=("--chief", "--ps", "2"))
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "[chief:0] describe: StrategyInfo(kind='parameter_server', replicas=1, num_workers=1" in out
    assert "[chief:0] PS_FIT: refused: Keras 3 `model.fit` does not support ParameterServerStrategy" in out
    assert ("[chief:0] SHARDS 2 ['/job:ps/replica:0/task:0/device:CPU:0', "
            "'/job:ps/replica:0/task:1/device:CPU:0']") in out
    moved = float(re.search(r"MOVED (\S+)", out).group(1))
    diff = float(re.search(r"MAX_DIFF (\S+)", out).group(1))
    assert moved > 1e-2 and diff < 1e-5, (moved, diff)


def test_two_workers_learn_the_task_and_survive_a_killed_worker(tmp_path):
    """`tfpar-launch --chief --workers 2 --ps 1`: worker 1 is SIGKILLed at step 100; the
    coordinator runs its steps on worker 0, the launcher restarts it, the run finishes."""
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "tfpar.launch", "--chief", "--workers", "2", "--ps", "1", "--",
               sys.executable, "-m", "tfpar.train", "--config=configs/reverse_tiny.py",
               "--config.strategy=parameter_server", "--config.mode=loop",
               "--config.train.steps=800", "--config.train.checkpoint_every=400",
               f"--workdir={workdir}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env(), cwd=REPO)
    lines, worker_pid, killed = [], None, False
    try:
        for line in process.stdout:
            lines.append(line)
            found = re.search(r"^\[worker:1\] tfpar: worker\[1\] serving at \S+ \(pid (\d+)\)", line)
            if found and worker_pid is None:
                worker_pid = int(found.group(1))
            if not killed and line.startswith("[chief:0] step 100/800"):
                os.kill(worker_pid, signal.SIGKILL)
                killed = True
        code = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    out = "".join(lines)
    assert killed and code == 0, out[-4000:]
    assert "[tfpar-launch] worker:1 exited with code -9; parameter-server training goes on" in out
    assert out.count("[worker:1] tfpar: worker[1] serving") == 2  # came back
    assert "[chief:0] step 800/800" in out
    results = json.loads((workdir / "results.json").read_text())
    assert results["exact"] >= 0.99 and results["examples"] == 1000, results
    assert (workdir / "checkpoints" / "ckpt-800.index").exists()
