"""One worker of the two-process test of the stateful compressors: dgc, powersgd with an
uncompressed start and a rank schedule, 1-bit Adam (exchanging every step, and every 2nd) and DGC on Adam under multi_worker_mirrored,
through TensorFlow's own cross-process collectives (all-to-all included).

argv: OUT_DIR. Saves each run's final weights per worker; prints, per phase, the bytes per
step counted in the traced graph beside the analytic size.
"""

import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
info = tfpar.describe(strategy)

import keras  # noqa: E402

import fit_model  # noqa: E402
from tfpar import compression as C  # noqa: E402
from tfpar.compression import accounting  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402

initial = fit_model.initial_weights()
everything = C.Policy(min_size=0, skip=())
RUNS = {  # name -> (compression, optimizer)
    "dgc_dense": (C.Compression(C.DGC(ratio=1.0, momentum=0.9), everything), 0.0),
    "dgc": (C.Compression(C.DGC(ratio=0.1, momentum=0.9, clip_norm=1.0, warmup_steps=2, stages=2),
                          C.Policy(min_size=0, skip=(), warmup_steps=1)), 0.0),
    "powersgd": (C.Compression(C.PowerSGD(rank_schedule="4@0,2@2"), C.Policy(min_size=256, warmup_steps=1)), 0.9),
    "onebit_adam": (C.OneBitAdam(freeze_step=3, policy=C.Policy(min_size=0, skip=())), 0.0),
    # the exchange inside a tf.cond, every 2nd compressed step, across processes
    "onebit_adam_every2": (C.OneBitAdam(freeze_step=3, exchange_every=2, policy=C.Policy(min_size=0, skip=())), 0.0),
    # DGC's top-k on Adam's frozen variance: one top-k over every tensor, all-gathered
    "dgc_adam": (C.DGCAdam(ratio=0.1, freeze_step=3, clip_norm=1.0, policy=C.Policy(min_size=0, skip=())), 0.0),
}


def per_worker(context):
    batch = context.get_per_replica_batch_size(fit_model.GLOBAL_BATCH)
    return (fit_model.dataset().unbatch().batch(batch, drop_remainder=True)
            .shard(context.num_input_pipelines, context.input_pipeline_id).repeat())


for name, (compression, momentum) in RUNS.items():
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(learning_rate=0.01 if "adam" in name else 0.1,
                                         momentum=momentum)
    if momentum == 0.0:
        compression.check_optimizer(optimizer)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, compression=compression, steps_per_loop=2)
    dataset = strategy.distribute_datasets_from_function(per_worker)
    variables = model.trainable_variables
    for phase in sorted({compression.phase(s) for s in range(fit_model.STEPS)}, key=str):
        counted = accounting.bytes_per_replica(trainer.traced_step(dataset, phase), in_loops_only=True,
                                               checks=False)
        analytic = sum(compression.payload_bytes(variables, phase).values())
        print(f"WIRE {name} {str(phase).replace(' ', '')} {counted} {analytic}", flush=True)
    trainer.fit(dataset, steps=fit_model.STEPS)
    np.savez(f"{sys.argv[1]}/{name}_{info.task_index}.npz", *model.get_weights())
