"""benchmarks/gpu_check.sh fits a lent GPU machine (at most 10 minutes and 8 returned files a
call): its plan (a dry run, nothing runs) and its stop when there is no GPU to check. Only what
runs without a GPU is tested here; the GPU numbers live in benchmarks/results/gpu."""

import os
import re
import subprocess
import sys

import pytest

from procs import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
PARTS = ("check", "mirrored", "steps", "schedules")


def gpu_check(*args, timeout=120, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("PARTS", "BUDGET_S", "OUT")}
    environ.update(PY=sys.executable, **env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=environ, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def plan(*args, **env) -> tuple[list[str], int]:
    """The files a call would return, and its time budget in seconds (from --dry-run)."""
    done = gpu_check("--dry-run", *args, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    files = re.search(r"^files \((\d+) of at most 8\): (.*)$", done.stdout, re.M)
    budget = re.search(r"at most (\d+) s \(", done.stdout)
    assert files and budget, done.stdout
    names = files.group(2).split()
    assert int(files.group(1)) == len(names)
    return names, int(budget.group(1))


def test_the_default_call_returns_four_files_within_six_minutes():
    names, budget = plan()
    assert names == ["log.txt", "check.json", "gpu_steps.json", "schedules.tgz"]
    assert budget <= 6 * 60


@pytest.mark.parametrize("part", PARTS)
def test_every_part_fits_a_call_of_its_own(part):
    names, budget = plan(PARTS=part)
    assert len(names) == 2 and budget <= 9.5 * 60
    assert plan(part) == (names, budget)  # parts as arguments, the same as PARTS


def test_a_plan_that_cannot_fit_one_call_is_refused_before_anything_runs():
    assert plan(PARTS=" ".join(PARTS))[1] <= 9.5 * 60
    for env, said in (({"PARTS": "check nccl"}, "unknown part 'nccl'"),
                      ({"BUDGET_S": "900"}, "give the parts separate calls")):
        done = gpu_check("--dry-run", **env)
        assert done.returncode == 2 and said in done.stderr


def fake_nvidia_smi(folder, lines: str, code: int = 0) -> str:
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '%s' '{lines}'\nexit {code}\n")
    tool.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_no_gpu_listed_stops_before_any_part(tmp_path):
    out = tmp_path / "out"
    done = gpu_check(OUT=str(out), PATH=fake_nvidia_smi(tmp_path, "No devices were found\n", 6))
    assert done.returncode == 3 and "nvidia-smi lists no GPU. Nothing was run." in done.stdout
    assert sorted(os.listdir(out)) == ["log.txt"]


def test_a_gpu_tensorflow_cannot_see_stops_before_any_part(tmp_path):
    """A CUDA library that does not load: TensorFlow runs on the CPU without a word."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees a GPU here")
    out = tmp_path / "out"
    done = gpu_check(OUT=str(out), timeout=90,
                     PATH=fake_nvidia_smi(tmp_path, "NVIDIA H200, 143771 MiB, 580.159.04\n"))
    assert done.returncode == 4, done.stdout[-3000:]
    assert "TensorFlow sees no GPU although nvidia-smi shows one" in done.stdout
    assert "Nothing was run" in done.stdout and sorted(os.listdir(out)) == ["log.txt"]


def test_the_bundle_parts_fit_a_call_beside_the_working_tree():
    """A call carries the working tree and one part, 64 MiB in all: 54 MiB parts fitted the
    8 MiB tree of the first run, not today's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_bundle  # pylint: disable=import-outside-toplevel

    tree = gpu_bundle.tree_mib(str(REPO))
    part = gpu_bundle.part_mib_for(tree)
    assert 0 < part and tree + part <= 63
    assert gpu_bundle.upload_plan(615, 44, 17.7).startswith("615 MB in 14 parts of 44 MiB: 14 upload calls")
