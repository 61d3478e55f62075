"""One worker of DiLoCo's two-process test (tests/test_diloco.py), under
multi_worker_mirrored (one replica per worker, the TF_CONFIG tfpar-launch sets). Each
worker reads its own slice of every global batch, as replica k of a mirrored run would.
Saves this worker's weights after: synchronous SGD (4 steps); DiLoCo H = 1 with an outer
SGD(1) (4 steps); DiLoCo H = 3 with AdamW and int4 outer gradients, 9 steps
uninterrupted; and the same stopped at step 4 (mid-round: the workers' copies and their
int4 remainders differ), checkpointed, restored into a new Trainer and trained to step 9.
A tf.train.Checkpoint of the model and optimizer (one worker's copies) is refused by name.

argv: INIT_WEIGHTS.npz OUT_DIR WORKDIR
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored")

import fit_model  # noqa: E402
from tfpar.checkpoints import Checkpoints  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.sync import DiLoCo, SyncError  # noqa: E402

init = np.load(sys.argv[1])
WEIGHTS = [init[f"w{i}"] for i in range(len(init.files))]
info = tfpar.describe(strategy)
TASK = info.task_index


def trainer(optimizer, sync=None):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(WEIGHTS)
        optimizer = optimizer()
    return model, Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, sync=sync, xla=False)


def data(steps, skip=0):
    return strategy.distribute_datasets_from_function(
        lambda context: fit_model.replica_dataset(context.input_pipeline_id, 2, steps).skip(skip))


def save(name, model):
    np.savez(f"{sys.argv[2]}/{name}{TASK}.npz", *model.get_weights())


def diloco():
    return DiLoCo(inner_steps=3, compression="int4")


def sgd():
    return keras.optimizers.SGD(0.1)


def adamw():
    return keras.optimizers.AdamW(0.01, epsilon=1e-3)


print(f"STRATEGY {info.kind} replicas={strategy.num_replicas_in_sync} workers={info.num_workers}", flush=True)
model, plain = trainer(sgd)
plain.fit(data(4), steps=4)
save("sync", model)
model, h1 = trainer(sgd, DiLoCo(inner_steps=1, outer_optimizer=keras.optimizers.SGD(1.0)))
h1.fit(data(4), steps=4)
save("h1_", model)
model, whole = trainer(adamw, diloco())
whole.fit(data(9), steps=9)
save("whole", model)

model, first = trainer(adamw, diloco())
checkpoints = Checkpoints(sys.argv[3], info.is_chief, model=model, optimizer=first.optimizer, **first.checkpoint_items())
first.fit(data(9), steps=4)
save("mid_round", model)  # this worker's own copy at step 4
checkpoints.save(4)
model, second = trainer(adamw, diloco())
checkpoints = Checkpoints(sys.argv[3], info.is_chief, model=model, optimizer=second.optimizer,
                          **second.checkpoint_items())
assert checkpoints.restore() == 4
second.fit(data(9, skip=4), steps=9, start_step=4)
save("resumed", model)
try:  # a user's own checkpoint would keep one worker's copies: refused by name
    tf.train.Checkpoint(model=model, optimizer=second.optimizer).write(f"{sys.argv[2]}/own{TASK}/ckpt")
except SyncError as error:
    print("REFUSED", "tfpar.checkpoints.Checkpoints(" in str(error), flush=True)
print("DONE", flush=True)
