"""One worker of the keras.distribution multi-worker test: the keras.io guide's DataParallel
program, one tfpar line added, in a process of a cluster (the TF_CONFIG tfpar-launch sets):
tfpar runs it under multi_worker_mirrored. Trains fit_model's model by `model.fit`, then
by `tfpar.Trainer` with a plain dataset, and saves this worker's weights after each.

argv: INIT_WEIGHTS.npz OUT_DIR
"""

import sys

import keras
import numpy as np

import tfpar

tfpar.distribution.enable()
keras.distribution.set_distribution(keras.distribution.DataParallel())  # the guide's line

import fit_model  # noqa: E402

init = np.load(sys.argv[1])
weights = [init[f"w{i}"] for i in range(len(init.files))]

model = fit_model.build_model()
model.set_weights(weights)
fit_model.compile_model(model)
strategy = model.distribute_strategy
info = tfpar.describe(strategy)
print(f"STRATEGY {info.kind} replicas={strategy.num_replicas_in_sync} "
      f"workers={info.num_workers}", flush=True)
model.fit(fit_model.dataset(), epochs=1, verbose=0, shuffle=False)
np.savez(f"{sys.argv[2]}/fit{info.task_index}.npz", *model.get_weights())

model = fit_model.build_model()
model.set_weights(weights)
optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
trainer = tfpar.Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
trainer.fit(fit_model.dataset(), steps=fit_model.STEPS)  # a plain dataset: the model's strategy deals it
np.savez(f"{sys.argv[2]}/loop{info.task_index}.npz", *model.get_weights())
print("DONE", flush=True)
