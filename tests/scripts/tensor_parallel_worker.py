"""One worker of the tensor-parallel-across-processes test (tests/test_tensor_parallel.py):
multi_worker_mirrored, one replica per worker (CPU workers), a GPT split T ways over
consecutive workers, trained by tfpar.Trainer with AdamW and a global-norm clip.

With 2 workers and T = 2 one tensor-parallel group spans both processes; with 4 workers
and T = 2 the groups {0, 1} and {2, 3} see different halves of the batch and each shard's
gradients are summed over {0, 2} or {1, 3}: data x tensor parallelism, every collective
between processes.

argv: INIT.npz OUT_DIR T. Writes OUT_DIR/weights_{task}.npz: the unsplit model's weights
after training (tensor_parallel.full_weights, joined across the group).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 8
TINY = dict(vocab_size=32, max_len=SEQ, dim=32, depth=2, heads=4)


def batch():
    x = np.random.RandomState(0).randint(0, 32, size=(GLOBAL_BATCH, SEQ)).astype("int32")
    return x, np.roll(x, -1, axis=1), np.ones((GLOBAL_BATCH, SEQ), "float32")


def optimizer():
    import keras

    return keras.optimizers.AdamW(1e-2, weight_decay=0.01, global_clipnorm=0.5)


def main() -> None:
    init, out, degree = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored")
    import keras
    import tensorflow as tf

    from tfpar import tensor_parallel as tp
    from tfpar.models.gpt import GPT

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    groups = strategy.num_replicas_in_sync // degree
    rows = GLOBAL_BATCH // groups
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=degree)
        adamw = optimizer()
    plain = GPT(**TINY)
    saved = np.load(init)
    plain.set_weights([saved[f"w{i}"] for i in range(len(saved.files))])
    tp.copy_weights(plain, model)

    def per_worker(context):  # one replica per worker: worker i is in TP group i // degree
        group = context.input_pipeline_id // degree
        data = tf.data.Dataset.from_tensors(tuple(a[group * rows:(group + 1) * rows] for a in batch()))
        return data.repeat()

    trainer = tfpar.Trainer(model, adamw, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            strategy=strategy, steps_per_loop=2)
    trainer.fit(strategy.distribute_datasets_from_function(per_worker), steps=STEPS)
    weights = tp.full_weights(model)  # a collective: every worker joins its group's shards
    np.savez(os.path.join(out, f"weights_{task}.npz"), *weights)
    print(f"TP {tp.layout_of(model).describe()}", flush=True)


if __name__ == "__main__":
    main()
