"""One worker of the two-process compression checkpoint test: topk's residuals under
multi_worker_mirrored (one replica per worker, each on its own data), saved through
tfpar's Checkpoints (every worker saves, so every worker reaches the gather; the chief
keeps the file) and restored on every worker, as a resume does.

argv: WORKDIR. Prints one CKPT line per worker: the checkpoint holds both replicas' rows,
this worker's row is its own residuals, the rows differ, and the restore gave them back.
"""

import os
import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
info = tfpar.describe(strategy)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import fit_model  # noqa: E402
from tfpar import compression as C  # noqa: E402
from tfpar.checkpoints import Checkpoints  # noqa: E402
from tfpar.compression import replica_state  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402


def per_worker(context):
    batch = context.get_per_replica_batch_size(fit_model.GLOBAL_BATCH)
    return (fit_model.dataset().unbatch().batch(batch, drop_remainder=True)
            .shard(context.num_input_pipelines, context.input_pipeline_id).repeat())


with strategy.scope():
    model = fit_model.build_model()
    model.set_weights(fit_model.initial_weights())
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
compression = C.Compression(C.TopK(0.1), C.Policy(min_size=0))
trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  strategy=strategy, compression=compression)
trainer.fit(strategy.distribute_datasets_from_function(per_worker), steps=3)
state = dict(replica_state.state_by_path(compression))
own = {path: variable.values[0].numpy() for path, variable in state.items()}  # this worker's replica

workdir = sys.argv[1]
Checkpoints(workdir, info.is_chief, model=model, optimizer=optimizer, **trainer.checkpoint_items()).save(3)
strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)  # the chief has written it
reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints")))
rows = {path: reader.get_tensor(f"compression/per_replica/{path.replace('/', '.S')}/.ATTRIBUTES/per_replica")
        for path in state}
for variable in state.values():
    variable.assign(tf.zeros_like(variable))
step = Checkpoints(workdir, info.is_chief, model=model, optimizer=optimizer, **trainer.checkpoint_items()).restore()
replica = info.task_index
print(f"CKPT worker={replica} step={step} "
      f"rows={sorted({r.shape[0] for r in rows.values()})} "
      f"own_row={all(np.array_equal(rows[p][replica], own[p]) for p in state)} "
      f"rows_differ={all(np.abs(r[0] - r[1]).max() > 0 for r in rows.values())} "
      f"restored={all(np.array_equal(state[p].values[0].numpy(), own[p]) for p in state)}", flush=True)
