"""Helpers that run Python in fresh processes (a new TensorFlow runtime each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def env(**extra: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    base.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    base.update(extra)
    return base


def run_python(args: list[str], timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """Runs `python ARGS` with the repo importable; returns the completed process."""
    return subprocess.run(
        [sys.executable, *args], env=env(**extra_env), capture_output=True, text=True,
        timeout=timeout, cwd=REPO,
    )


def launch(workers: int, script: str, *script_args: str, timeout: float = 300,
           launch_args: tuple[str, ...] = (), **extra_env: str) -> subprocess.CompletedProcess:
    """Runs tests/scripts/SCRIPT under `python -m tfpar.launch --workers N`."""
    return run_python(
        ["-m", "tfpar.launch", "--workers", str(workers), *launch_args, "--",
         sys.executable, str(SCRIPTS / script), *script_args],
        timeout=timeout, **extra_env,
    )


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 right now."""
    import socket

    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def train_in_process(argv: list[str], monkeypatch) -> None:
    """Runs tfpar-train's main with `argv` (ARGV[0] first) in this process, from the repo."""
    from absl import flags

    from tfpar import train

    monkeypatch.setattr("sys.argv", argv)  # ml_collections finds the --config.* overrides in sys.argv
    monkeypatch.chdir(REPO)
    for name in [name for name in flags.FLAGS if name.startswith("config.")]:
        delattr(flags.FLAGS, name)  # an earlier run's overrides: ml_collections defines them anew
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    train.main([argv[0]])
