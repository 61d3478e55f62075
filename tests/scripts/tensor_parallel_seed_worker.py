"""One worker of the "two workers without a seed agree" test (tests/test_tensor_parallel_paths.py):
multi_worker_mirrored, one replica per worker, a GPT split 2 ways over the two workers.

Each worker seeds Python's `random` (where Keras draws its initializers' seeds) with
100 + its index, as two unseeded processes would differ. Writes OUT_DIR/shards_{task}.npz:
for each weight i, `shard_i` and `axis_i` (its split axis) where it is split, else `whole_i`:
this worker's own copy, read locally (no collective).

argv: OUT_DIR.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np

TINY = dict(vocab_size=32, max_len=8, dim=32, depth=2, heads=4)


def main() -> None:
    out = sys.argv[1]
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored")
    from tfpar import tensor_parallel as tp
    from tfpar.models.gpt import GPT

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    random.seed(100 + task)
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=2)
    saved = {}
    for i, weight in enumerate(model.weights):
        (_, copy), = tp.shards.copies(weight)  # one replica per worker
        spec = tp.spec_of(weight)
        if spec is None:
            saved[f"whole_{i}"] = copy.numpy()
        else:
            saved[f"shard_{i}"], saved[f"axis_{i}"] = copy.numpy(), np.array(spec.axis)
    np.savez(os.path.join(out, f"shards_{task}.npz"), **saved)
    print(f"worker {task}: {tp.layout_of(model).describe()}", flush=True)


if __name__ == "__main__":
    main()
