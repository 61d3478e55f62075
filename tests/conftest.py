"""Test set-up: the CPU is split into 4 logical devices before TensorFlow starts.

Multi-replica strategies then run on one CPU (replicas share cores). Tests that need a
fresh TensorFlow (multi-worker, start-up errors) run in subprocesses; see `procs.py`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.strategy import runtime  # noqa: E402  (must run before TensorFlow starts)

LOGICAL_CPUS = 4
runtime.split_devices(LOGICAL_CPUS)
