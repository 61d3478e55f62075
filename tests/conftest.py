"""Test set-up: the CPU is split into 4 logical devices before TensorFlow starts.

Multi-replica strategies then run on one CPU (replicas share cores). Tests that need a
fresh TensorFlow (multi-worker, start-up errors) run in subprocesses; see `procs.py`.

Two tiers: `python -m pytest` runs everything (CI, .ci/run); `python -m pytest -m "not
slow"` is the fast tier for everyday work. A test is slow when it is marked `slow` or
`multiprocess` in its file, or listed in SLOW below (measured with `--durations` on 2
shared cores: each takes more than ~20 s there), so the list lives in one place.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.strategy import runtime  # noqa: E402  (must run before TensorFlow starts)

LOGICAL_CPUS = 4
runtime.split_devices(LOGICAL_CPUS)

# Files whose every test is slow, then single tests (node ids without parameters).
SLOW_FILES = (
    "tests/faults/test_kill_and_restart.py",   # two-worker jobs killed and restarted
    "tests/test_notebooks.py",                 # runs the Colab notebooks end to end
    "tests/test_configs.py",                   # every config file, a few steps each
)
SLOW = (
    "tests/test_train_binary.py::test_reverse_task_reaches_100_percent_and_writes_the_workdir",
    "tests/test_train_binary.py::test_resume_at_an_odd_step_continues_with_the_same_weights",
    "tests/test_loop.py::test_mixed_precision_trains_the_reverse_task_to_100_percent",
    "tests/test_compression.py::test_compressed_runs_learn_the_task_like_the_uncompressed_one",
    "tests/faults/test_checkpoint_faults.py::test_a_kill_while_saving_leaves_the_previous_checkpoint_restorable",
)


def pytest_collection_modifyitems(config, items):
    """Marks the slow tests (see the module docstring) without editing their files."""
    for item in items:
        path = os.path.relpath(str(item.path), str(config.rootpath)).replace(os.sep, "/")
        node = f"{path}::{item.originalname}"
        if (item.get_closest_marker("multiprocess") or path in SLOW_FILES or node in SLOW):
            item.add_marker(pytest.mark.slow)
