"""Several TensorFlow processes on loopback, started with tfpar.launch."""

import numpy as np
import pytest
import tensorflow as tf

from procs import launch
from scripts import fit_model

pytestmark = pytest.mark.multiprocess


def test_fit_and_loop_under_multi_worker_mirrored_match_one_process(tmp_path):
    init = fit_model.initial_weights()
    np.savez(tmp_path / "init.npz", **{f"w{i}": w for i, w in enumerate(init)})
    result = launch(2, "fit_worker.py", str(tmp_path / "init.npz"), str(tmp_path))
    out = result.stdout
    assert result.returncode == 0, out[-4000:]

    # Without tfpar's fix Keras fails at the first batch (keras#20585); with it, fit runs.
    assert out.count("UNFIXED_FIT: failed") == 2, out[-4000:]
    assert out.count("FIXED_FIT: ok") == 2
    assert "[worker:0] FIXED_FIT: ok" in out and "[worker:1] FIXED_FIT: ok" in out
    assert "replicas=2 workers=2 chief=True" in out and "replicas=2 workers=2 chief=False" in out

    def saved(name):
        files = [np.load(tmp_path / f"{name}{i}.npz") for i in range(2)]
        return [[f[f"arr_{i}"] for i in range(len(f.files))] for f in files]

    reference, _ = fit_model.train(tf.distribute.get_strategy(), init)  # same global batch
    for name in ("worker", "loop"):  # Keras fit, then tfpar's loop
        workers = saved(name)
        for a, b in zip(*workers):
            np.testing.assert_array_equal(a, b)  # the replicas never drift apart
        for actual, expected in zip(workers[0], reference):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
