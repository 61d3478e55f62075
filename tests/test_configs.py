"""Every config file in configs/ starts and trains a few steps with the training binary.

The model, data, precision and optimizer are the file's own; only the run is shortened
(2 steps, small batches, 64-token sequences: gpt_base's 512 took minutes). TFDS datasets
come from tfds.testing.mock_data, so no download
is needed. A new configs/*.py is picked up by itself.
"""

import json

import pytest

from procs import REPO, SCRIPTS, run_python

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.py"))
SHORT = ["--config.train.steps=2", "--config.train.steps_per_loop=1", "--config.train.log_every=1",
         "--config.train.checkpoint_every=2", "--config.train.batch_size=4",
         "--config.train.eval_batch_size=4", "--config.train.eval_examples=8",
         "--config.sample.length=4", "--config.data.seq_len=64"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_trains_a_few_steps(tmp_path, name):
    result = run_python([str(SCRIPTS / "train_with_mock_tfds.py"), f"--config=configs/{name}",
                         f"--workdir={tmp_path}", *SHORT], timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "step 2/2" in result.stdout and "eval: " in result.stdout
    assert json.loads((tmp_path / "results.json").read_text())["step"] == 2
    assert (tmp_path / "checkpoints" / "ckpt-2.index").exists()
