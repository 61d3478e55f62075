"""One worker of the two-worker sparse-gradient test: fit and tfpar's loop under
multi_worker_mirrored for every model and optimizer of sparse_models.

argv: OUT_DIR [OPTIMIZER ...]. Saves OUT_DIR/{fit,loop}-MODEL-OPTIMIZER-wTASK.npz.
"""

import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
task = tfpar.describe(strategy).task_index

import sparse_models  # noqa: E402

out, optimizers = sys.argv[1], sys.argv[2:] or list(sparse_models.OPTIMIZERS)
for name in sparse_models.MODELS:
    weights = sparse_models.initial_weights(name)
    for optimizer in optimizers:
        for mode in ("fit", "loop"):
            trained = getattr(sparse_models, mode)(strategy, name, weights, optimizer)
            np.savez(f"{out}/{mode}-{name}-{optimizer}-w{task}.npz", *trained)
print("SPARSE_WORKER: done", flush=True)
