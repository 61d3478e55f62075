"""The training binary: a real run, resume at the exact step, clear refusals, two workers."""

import glob
import json
import os
import re
import runpy
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from procs import REPO, run_python, train_in_process
from tfpar.config import ConfigError, validate
from tfpar.train import train_and_evaluate


def load_config(name, **train):
    config = runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()
    config.train.update(train)
    return config


def test_every_config_file_is_valid():
    for path in sorted(glob.glob(str(REPO / "configs" / "*.py"))):
        validate(runpy.run_path(path)["get_config"]())


def test_reverse_task_reaches_100_percent_and_writes_the_workdir(tmp_path):
    config = load_config("reverse_tiny", steps=200, checkpoint_every=100, log_every=100)
    results = train_and_evaluate(config, str(tmp_path))
    assert results["exact"] == 1.0 and results["examples"] == 1000
    assert json.loads((tmp_path / "results.json").read_text())["exact"] == 1.0
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-200")
    assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))


def checkpoint_values(workdir):
    path = tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    names = sorted(n for n in reader.get_variable_to_shape_map() if "save_counter" not in n
                   and not n.startswith("_CHECKPOINTABLE"))
    return path, {n: reader.get_tensor(n) for n in names}


@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_resume_at_an_odd_step_continues_with_the_same_weights(tmp_path, mode):
    """Stopped at step 23 and restarted == uninterrupted, at the step-45 checkpoint; with
    steps_per_loop 7 and checkpoint_every 20 every checkpoint lands on its step."""
    def config(steps):
        c = load_config("reverse_tiny", steps=steps, checkpoint_every=20, log_every=10,
                        steps_per_loop=7, eval_examples=100)
        c.optimizer.schedule, c.mode = "constant", mode
        return c

    train_and_evaluate(config(45), str(tmp_path / "straight"))
    train_and_evaluate(config(23), str(tmp_path / "resumed"))
    train_and_evaluate(config(45), str(tmp_path / "resumed"))
    path_a, a = checkpoint_values(str(tmp_path / "straight"))
    path_b, b = checkpoint_values(str(tmp_path / "resumed"))
    assert path_a.endswith("ckpt-45") and path_b.endswith("ckpt-45") and a.keys() == b.keys() and a
    steps = lambda workdir: sorted(int(p.rsplit("-", 1)[1].split(".")[0]) for p in  # noqa: E731
                                   glob.glob(str(tmp_path / workdir / "checkpoints" / "ckpt-*.index")))
    assert steps("straight") == [20, 40, 45] and steps("resumed") == [23, 40, 45]  # 3 kept
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_intervals_that_do_not_divide_land_on_their_steps(tmp_path, capsys):
    """steps 20, steps_per_loop 4, checkpoint_every 15, eval_every 10, log_every 6: each
    interval lands on its step, and the run ends with a checkpoint and a line at step 20."""
    config = load_config("reverse_tiny", steps=20, steps_per_loop=4, checkpoint_every=15,
                         eval_every=10, log_every=6, eval_examples=100)
    train_and_evaluate(config, str(tmp_path))
    out = capsys.readouterr().out
    assert [int(s) for s in re.findall(r"^step\s+(\d+)/20", out, re.M)] == [6, 12, 18, 20]
    assert [int(s) for s in re.findall(r"^eval at step (\d+):", out, re.M)] == [10]
    assert sorted(int(p.rsplit("-", 1)[1].split(".")[0]) for p in glob.glob(
        str(tmp_path / "checkpoints" / "ckpt-*.index"))) == [15, 20]


def test_bad_values_name_their_key():
    config = load_config("gpt_tiny")
    config.train.steps = 0
    with pytest.raises(ConfigError, match="config.train.steps: must be a positive integer, got 0"):
        validate(config)
    config = load_config("gpt_tiny")
    config.model_args.heads = 5
    with pytest.raises(ConfigError, match="config.model_args.heads"):
        validate(config)
    config = load_config("gpt_tiny")
    config.strategy = "mirrord"
    with pytest.raises(ConfigError, match="config.strategy: Unknown strategy 'mirrord'. Did you mean 'mirrored'"):
        validate(config)


@pytest.mark.parametrize("flags,message", [
    (["--config.train.stepz=5"], "stepz"),
    (["--config.optimizer.name=adam"], "config.optimizer.name: 'adam' is not one of adamw, sgd, lamb"),
    (["--config.mode=lop"], "config.mode: 'lop' is not one of fit, loop"),
    (["--workdir=/etc/hostname/run"], "is not writable"),
])
def test_the_binary_refuses_at_start_with_the_key(flags, message):
    args = ["-m", "tfpar.train", "--config=configs/gpt_tiny.py", "--workdir=" + tempfile.mkdtemp()]
    result = run_python(args + flags, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_two_workers_train_checkpoint_and_resume(tmp_path):
    workdir = str(tmp_path / "run")
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tfpar_ckpt_*")))

    def run(steps):
        return run_python(
            ["-m", "tfpar.launch", "--workers", "2", "--", "python", "-m", "tfpar.train",
             "--config=configs/reverse_tiny.py", f"--workdir={workdir}",
             f"--config.train.steps={steps}", "--config.train.checkpoint_every=20",
             "--config.train.log_every=20", "--config.train.eval_examples=200"],
            timeout=300,
        )

    first = run(40)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "[worker:0] tfpar: multi_worker_mirrored, 2 replica(s), 2 worker(s)" in first.stdout
    assert "[worker:0] checkpoint:" in first.stdout and "[worker:1] checkpoint:" not in first.stdout
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[0] == "checkpoint"
    assert tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints")).endswith("ckpt-40")
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tfpar_ckpt_*"))) == before

    second = run(60)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "[worker:0] resuming from step 40" in second.stdout
    assert "[worker:0] step 60/60" in second.stdout and "step 20/60" not in second.stdout


def test_a_short_run_in_process_writes_its_results_and_a_sample(tmp_path, capsys, monkeypatch):
    """The binary's whole path in this process (flags, checks, fit, checkpoint, eval, sample):
    the fast tier's one end-to-end run, a few steps of a small GPT on the corpus."""
    argv = ["tfpar-train", "--config=configs/gpt_tiny.py", f"--workdir={tmp_path}",
            "--config.model_args.dim=32", "--config.model_args.depth=1", "--config.data.seq_len=32",
            "--config.train.steps=3", "--config.train.batch_size=8", "--config.train.steps_per_loop=3",
            "--config.train.eval_examples=64", "--config.train.eval_batch_size=32", "--config.sample.length=12"]
    train_in_process(argv, monkeypatch)
    said = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["step"] == 3 and np.isfinite(results["loss"]) and results["unigram_baseline"] > 0
    assert "step 3/3 | loss" in said and "eval: loss" in said and "sample:" in said
    assert len((tmp_path / "sample.txt").read_text()) >= 12
    assert glob.glob(str(tmp_path / "checkpoints" / "ckpt-3*"))
