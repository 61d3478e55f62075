"""tfpar.launch: TF_CONFIG per task, prefixed output, group failure, signals, CPU pinning."""

import json
import os
import signal
import subprocess
import sys
import time

from procs import env, run_python

PRINT_TASK = (
    "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    "print('TASK', c['task']['type'], c['task']['index'], json.dumps(c['cluster']))"
)


def launch_cmd(*args):
    return ["-m", "tfpar.launch", *args]


def test_each_task_gets_its_tf_config_and_prefixed_output():
    result = run_python(launch_cmd("--workers", "2", "--", sys.executable, "-c", PRINT_TASK), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if " TASK " in line]
    assert sorted(line.split(" TASK ")[0] for line in lines) == ["[worker:0]", "[worker:1]"]
    clusters = {line.split(" ", 4)[-1] for line in lines}
    assert len(clusters) == 1  # every task sees the same cluster
    addresses = json.loads(clusters.pop())["worker"]
    assert len(set(addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)


def test_chief_workers_and_ps_jobs(tmp_path):
    """Every task prints its TF_CONFIG; the chief exits (which ends the group) only once
    the other three have said they printed, however slowly a machine starts processes."""
    code = (PRINT_TASK + "; import pathlib, time, sys; t = c['task']['type']; "
            "d = pathlib.Path(os.environ['READY_DIR']); "
            "(d / f\"{t}{c['task']['index']}\").touch() if t != 'chief' else None; "
            "deadline = time.monotonic() + 120\n"
            "while t == 'chief' and len(list(d.iterdir())) < 3 and time.monotonic() < deadline: "
            "time.sleep(0.05)\n"
            "time.sleep(0 if t == 'chief' else 300)")
    result = run_python(
        launch_cmd("--chief", "--workers", "2", "--ps", "1", "--", sys.executable, "-c", code),
        timeout=180, READY_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ps0", "worker0", "worker1"]
    for task in ("[chief:0] TASK chief 0", "[worker:0] TASK worker 0", "[worker:1] TASK worker 1",
                 "[ps:0] TASK ps 0"):
        assert task in result.stdout


def test_a_failing_task_stops_the_group_with_its_exit_code():
    code = ("import json, os, sys, time; i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
            "time.sleep(0.5); sys.exit(3) if i == 1 else time.sleep(120)")
    started = time.monotonic()
    result = run_python(launch_cmd("--workers", "2", "--", sys.executable, "-c", code), timeout=60)
    assert result.returncode == 3
    assert "worker:1 exited with code 3; stopping the group" in result.stdout
    assert time.monotonic() - started < 30


def test_a_failed_ps_worker_is_restarted_until_its_budget_is_spent():
    """In a ps cluster a dead worker is restarted (the coordinator carries on); once it has
    failed more often than --max-worker-restarts allows, the group stops with its code."""
    code = ("import json, os, sys, time; t = json.loads(os.environ['TF_CONFIG'])['task']['type']; "
            "print('START', t, flush=True); time.sleep(0.3); sys.exit(5) if t == 'worker' else time.sleep(120)")
    result = run_python(launch_cmd("--chief", "--workers", "1", "--ps", "1", "--max-worker-restarts",
                                   "2", "--", sys.executable, "-c", code), timeout=60)
    assert result.returncode == 5, result.stdout
    assert result.stdout.count("[worker:0] START worker") == 3
    assert "worker:0 exited with code 5; parameter-server training goes on without it. " \
           "Restarting it (2/2)." in result.stdout
    assert "worker:0 exited with code 5; stopping the group" in result.stdout
    assert result.stdout.count("[chief:0] START chief") == 1


def test_sigterm_is_passed_on_to_every_task():
    code = ("import signal, sys, time, json, os\n"
            "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            "def bye(*_):\n    print('GOT SIGTERM', flush=True); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\nprint('READY', flush=True)\ntime.sleep(120)\n")
    launcher = subprocess.Popen(
        [sys.executable, *launch_cmd("--workers", "2", "--", sys.executable, "-c", code)],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, "launcher ended early"
        ready += "READY" in line
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "[worker:0] GOT SIGTERM" in rest and "[worker:1] GOT SIGTERM" in rest


def test_cpu_pinning():
    code = "import os; print('CPUS', sorted(os.sched_getaffinity(0)))"
    result = run_python(launch_cmd("--workers", "2", "--cpus-per-worker", "1", "--",
                                   sys.executable, "-c", code), timeout=60)
    assert result.returncode == 0
    available = sorted(os.sched_getaffinity(0))
    assert f"[worker:0] CPUS [{available[0]}]" in result.stdout
    assert f"[worker:1] CPUS [{available[1 % len(available)]}]" in result.stdout


def test_usage_errors_are_clear():
    result = run_python(launch_cmd("--workers", "2"), timeout=30)
    assert result.returncode != 0 and "no command given" in result.stderr
    result = run_python(launch_cmd("--workers", "1", "--ps", "1", "--", "true"), timeout=30)
    assert result.returncode != 0 and "--ps needs --chief" in result.stderr
