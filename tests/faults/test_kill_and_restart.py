"""Two workers, one signalled mid-run: the group restarts and ends where an unbroken run does.

SIGTERM (preemption): every worker saves at the same step and exits 75; the launcher
restarts the group, which resumes at that step. SIGKILL: the group stops, restarts, and
resumes from the last periodic checkpoint. Either way the final weights equal an
uninterrupted run's (same data, same order; CPU collectives are deterministic here).
"""

import re
import signal

import pytest

import scenarios


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    code, output = scenarios.launch(str(workdir), "loop")
    assert code == 0, output[-3000:]
    return scenarios.checkpoint(str(workdir))[1]


def test_sigterm_to_one_worker_saves_everywhere_and_resumes_at_that_step(tmp_path):
    # runs of 7 steps, checkpoints only at 60: the save lands on an odd step (21, 28, ...)
    result = scenarios.kill_worker(str(tmp_path), signal.SIGTERM, at=21, every=scenarios.STEPS, loop=7)
    output = result.pop("output")
    assert "[worker:1] preempted: saved step" in output and "[worker:0] preempted: saved step" in output
    assert "exited with code 75" in output and "restarting it (1/1)" in output
    assert result["survived"], (result, output[-4000:])
    assert result["steps_lost"] == 0 and result["resumed_at"] == result["saved_at"]
    assert 0 < result["saved_at"] < scenarios.STEPS and result["saved_at"] % 7 == 0


def test_sigkill_of_one_worker_restarts_from_the_last_checkpoint(tmp_path, reference):
    result = scenarios.kill_worker(str(tmp_path), signal.SIGKILL, reference=reference)
    output = result.pop("output")
    assert "exited with code -9" in output and "restarting it (1/1)" in output
    assert result["survived"], (result, output[-4000:])
    assert result["resumed_at"] in (20, 40)  # the periodic checkpoint before the kill landed
    assert result["steps_lost"] >= 0  # steps past the checkpoint are redone from it


def test_the_peer_of_a_killed_worker_fails_fast_with_one_clear_line(tmp_path):
    result = scenarios.orphaned_worker(str(tmp_path), timeout_s=10)
    output = result["output"]
    assert result["injected"] and result["seconds_to_fail"] is not None, output[-3000:]
    assert result["seconds_to_fail"] < 40  # never a hang: within the collective timeout + start-up
    # named with its address when TensorFlow's error names the task or its address
    assert re.search(r"tfpar-train: a peer of this worker( \(worker \d at [\d.]+:\d+\))? stopped "
                     r"answering \(", output), output[-3000:]
    assert "tfpar-launch --max-restarts K" in output and "Traceback" not in output


def test_sigterm_in_fit_mode_resumes_at_that_step(tmp_path):
    """Keras fit, runs of 7 steps: the save lands on an odd step; the restarted run starts
    its fit there (data from that step on) and ends where an unbroken fit run does."""
    result = scenarios.kill_worker(str(tmp_path), signal.SIGTERM, mode="fit", at=21,
                                   every=scenarios.STEPS, loop=7)
    output = result.pop("output")
    assert result["survived"] and result["steps_lost"] == 0, (result, output[-4000:])
    assert result["resumed_at"] == result["saved_at"] and 0 < result["saved_at"] < scenarios.STEPS
    assert result["saved_at"] % 7 == 0
