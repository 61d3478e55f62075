"""Runs every fault of the suite and prints the table: fault, injected, survived, steps
lost, data lost.

    python tests/faults/run_suite.py            # about 15 minutes on 2 cores (root: network faults)

The two multi-worker faults are run here directly (their numbers are measured: the step
the worker was hit at, the step the run resumed from, the final weights against an
uninterrupted run). The in-process faults are the tests of this folder and of
tests/test_parameter_server.py, run with pytest; their rows say what each test asserts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scenarios  # noqa: E402

# test id -> (fault, injected, steps lost, data lost) for the in-process faults
IN_PROCESS = {
    "tests/faults/test_nonfinite.py::test_a_nan_step_stops_the_run_naming_the_step":
        ("NaN loss at step 3, policy stop", "NaN sample weights in batch 3",
         "0 (stops before any save)", "0"),
    "tests/faults/test_nonfinite.py::test_skip_leaves_out_exactly_the_bad_update":
        ("NaN loss at step 3, policy skip (1 and 2 replicas)", "NaN sample weights in batch 3",
         "0 (that update only)", "the bad batch, by design"),
    "tests/faults/test_checkpoint_faults.py::test_a_kill_while_saving_leaves_the_previous_checkpoint_restorable":
        ("SIGKILL while checkpoint 20 is written", "kill before the state file names it",
         "steps since checkpoint 10", "0"),
    "tests/faults/test_checkpoint_faults.py::test_a_checkpoint_from_two_replicas_restores_under_four_and_under_one_device":
        ("restore under another replica count", "2 replicas -> 4, -> one device", "0", "0"),
    "tests/faults/test_refusals.py::test_a_full_disk_is_refused_by_name_and_the_previous_checkpoint_restores":
        ("disk full at a checkpoint", "tmpfs filled before checkpoint 20",
         "steps since checkpoint 10", "0"),
    "tests/test_parameter_server.py::test_two_workers_learn_the_task_and_survive_a_killed_worker":
        ("SIGKILL of a parameter-server worker", "worker killed at step 100",
         "0 (the chief reschedules)", "that worker's in-flight steps are redone"),
}
# network faults between namespace hosts (root only; skipped elsewhere, and then "NO" below).
# Time to detect a dead host and to resume: benchmarks/hosts.py --parts=faults (docs/faults.md)
NETWORK = {
    "tests/test_hosts.py::test_200ms_latency_and_1pct_loss_give_the_clean_links_weights":
        ("200 ms per direction and 1% loss on every link, whole run", "userspace wire (no netem)",
         "0", "0 (same weights as a clean link)"),
    "tests/test_hosts.py::test_a_link_down_for_20s_ends_with_the_uninterrupted_weights":
        ("a link down for 20 s mid-run", "host 1's switch port down after ckpt-20",
         "steps since ckpt-20 if the group failed", "0 (uninterrupted run's weights)"),
    "tests/test_hosts.py::test_a_host_gone_for_good_stops_its_peer_in_time_and_the_rest_resume":
        ("a host gone for good", "host 1's cable pulled after ckpt-100",
         "steps since ckpt-100", "0 (the rest resume alone)"),
    "tests/test_hosts.py::test_a_stranger_sending_garbage_to_a_worker_does_not_disturb_training":
        ("a stranger sends garbage to a worker's port", "64 KiB random + HTTP/2 preface every 50 ms",
         "0", "0 (undisturbed weights)"),
}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        code, output = scenarios.launch(f"{tmp}/straight", "loop")
        reference = scenarios.checkpoint(f"{tmp}/straight")[1] if code == 0 else {}
        for sig, at in ((signal.SIGTERM, 20), (signal.SIGKILL, 30)):  # same checkpoints as the reference
            result = scenarios.kill_worker(f"{tmp}/{sig.name}", sig, reference=reference, at=at)
            rows.append((result["fault"], "yes" if result["injected"] else "no",
                         "yes" if result["survived"] else "NO", str(result["steps_lost"]),
                         str(result["data_lost"]), result["detail"]))
        orphan = scenarios.orphaned_worker(tmp)
        seconds = orphan["seconds_to_fail"]
        rows.append((orphan["fault"], "yes" if orphan["injected"] else "no",
                     "yes (failed fast, no hang)" if orphan["survived"] else "NO",
                     "n/a (restart the group)", "0",
                     f"the peer exited {seconds:.1f} s after the kill" if seconds else "hung"))
    tests = {**IN_PROCESS, **NETWORK}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests],
                         cwd=HERE.parents[1], capture_output=True, text=True)
    for test, (fault, injected, steps, data) in tests.items():
        passed = f"PASSED {test}" in run.stdout or any(
            line.startswith(f"PASSED {test}[") for line in run.stdout.splitlines())
        rows.append((fault, injected, "yes" if passed else "NO", steps, data, test.split("::")[1]))
    header = ("fault", "injected", "survived", "steps lost", "data lost", "evidence")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.exit(0 if all(r[2] == "yes" for r in rows) else 1)


if __name__ == "__main__":
    main()
