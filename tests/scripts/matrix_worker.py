"""One worker of the combination matrix's two-process runs (tests/test_matrix.py).

argv: RUNS.json OUT_DIR. RUNS.json lists Run keys (tests/matrix_cases.py); both workers
train them in that order under one multi_worker_mirrored strategy, and each prints one line
per run, `MATRIX {json}`; worker 0 also saves the run's weights (initial, after each step,
final) to OUT_DIR/<index>.npz, and both a digest of the final weights (the
workers must agree bit for bit). A run that fails is reported and the next one starts.
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: matrix_cases

import tfpar  # noqa: E402

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60, timeout_s=120)
info = tfpar.describe(strategy)

import numpy as np  # noqa: E402

import matrix_cases as M  # noqa: E402

keys = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
weights = {kind: M.initial_weights(kind) for kind in (False, True)}  # by model: tensor or not
for index, key in enumerate(keys):
    run = M.Run.from_key(key)
    result = M.execute(run, strategy, weights[run.tensor > 0])
    record = result.to_json() | {"index": index, "worker": info.task_index}
    if result.outcome == "trained":  # the replicas must agree: compared across the workers
        record["digest"] = hashlib.sha256(result.final.tobytes()).hexdigest()[:16]
    if info.task_index == 0 and result.outcome == "trained":
        np.savez(out / f"{index}.npz", initial=result.initial, final=result.final,
                 steps=np.stack(result.steps) if result.steps else np.zeros((0, result.initial.size)))
        record["weights"] = f"{index}.npz"
    print("MATRIX " + json.dumps(record), flush=True)
