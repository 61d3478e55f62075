"""One worker of the multi-worker fit test: `fit` under multi_worker_mirrored.

argv: INIT_WEIGHTS.npz OUT_DIR [loop]. First shows that Keras's own fit fails without
tfpar's fix (keras#20585), then trains with it and saves this worker's final weights; then
the same with tfpar's loop. With `loop`, only the loop runs (slow links: fewer collectives).
"""

import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
info = tfpar.describe(strategy)
print(f"describe: {info}", flush=True)

import fit_model  # noqa: E402
from tfpar.strategy import keras_fixes  # noqa: E402

init = np.load(sys.argv[1])
weights = [init[f"w{i}"] for i in range(len(init.files))]

LOOP_ONLY = sys.argv[3:] == ["loop"]
if not LOOP_ONLY:
    keras_fixes.revert()
    try:
        fit_model.train(strategy, weights, steps=1)
        print("UNFIXED_FIT: passed", flush=True)
    except Exception as e:  # pylint: disable=broad-except
        print(f"UNFIXED_FIT: failed {type(e).__name__}", flush=True)
    keras_fixes.apply()

    final, history = fit_model.train(strategy, weights)
    np.savez(f"{sys.argv[2]}/worker{info.task_index}.npz", *final)

# The same training with tfpar's own loop.
import keras  # noqa: E402

from tfpar.loop import Trainer  # noqa: E402

with strategy.scope():
    model = fit_model.build_model()
    model.set_weights(weights)
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  strategy=strategy, steps_per_loop=3)
trainer.fit(strategy.experimental_distribute_dataset(fit_model.dataset()), steps=fit_model.STEPS)
np.savez(f"{sys.argv[2]}/loop{info.task_index}.npz", *model.get_weights())
if not LOOP_ONLY:
    print(f"FIXED_FIT: ok loss={history['loss'][-1]:.6f} replicas={info.replicas} "
          f"workers={info.num_workers} chief={info.is_chief}", flush=True)
