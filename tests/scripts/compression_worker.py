"""One worker of the two-process compression test: every compressor under
multi_worker_mirrored, through TensorFlow's own cross-process collectives.

argv: OUT_DIR. Saves each compressor's final weights per worker and prints the bytes
per step counted in the traced graph beside the compressor's analytic size.
"""

import sys

import numpy as np

import tfpar

strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=60)
info = tfpar.describe(strategy)

import keras  # noqa: E402

import fit_model  # noqa: E402
from tfpar import compression as C  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402

initial = fit_model.initial_weights()


def per_worker(context):
    """Each worker its half of every global batch, endless, as tfpar.data.distribute_train
    does: then TensorFlow knows every batch is full (static shapes, no end-of-data sync)."""
    batch = context.get_per_replica_batch_size(fit_model.GLOBAL_BATCH)
    return (fit_model.dataset().unbatch().batch(batch, drop_remainder=True)
            .shard(context.num_input_pipelines, context.input_pipeline_id).repeat())


for name in ["none", "fp16", "bf16", "int8", "topk", "powersgd", "sign"]:
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    compression = C.Compression(C.get(name, **({"ratio": 0.1} if name == "topk" else {})),
                                C.Policy(min_size=0))
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, compression=compression, steps_per_loop=3)
    dataset = strategy.distribute_datasets_from_function(per_worker)  # static shapes: countable
    wire = trainer.wire_bytes(dataset)
    analytic = sum(compression.payload_bytes(model.trainable_variables).values())
    trainer.fit(dataset, steps=fit_model.STEPS)
    np.savez(f"{sys.argv[1]}/{name}_{info.task_index}.npz", *model.get_weights())
    print(f"WIRE {name} {wire['bytes_per_step'] - wire['check_bytes_per_step']} {analytic} {wire['ratio']:.2f} "
          f"{wire['bytes_per_call']} {wire['check_bytes_per_step']} {bool(trainer.aggregator.state_variables())}",
          flush=True)
