"""One worker of the hybrid-across-machines test (tests/test_hosts.py): data parallel over
workers (multi_worker_mirrored, one replica per worker) x a 2-stage pipeline on this
worker's two logical CPUs, trained by tfpar.Trainer twice in this one process: without
compression, then with TopK(0.1) (error feedback, an all-gather across workers).

argv: INIT.npz OUT_DIR. Writes OUT_DIR/{run}_{task}.npz (final weights) and, in
OUT_DIR/worker{task}.log (all this worker's stdout and stderr), per run one line
`PLACED {json}`: every variable's stage device, its device and its momentum slot's device,
each stage's device and layer name; TensorFlow's device placement log is on, and its
`op: (Type): device` lines say where every op of the executed graphs ran.

The test process imports the helpers (`small_gpt`, `per_worker`, `train`) for its own
references: one device, and the same pipeline replicated twice in one process.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 8
RUNS = {"none": None, "topk": 0.1}  # run name -> TopK ratio (None: no compression)


def small_gpt():
    from tfpar.models.gpt import GPT

    return GPT(vocab_size=32, max_len=SEQ, dim=32, depth=2, heads=2)


def per_worker(context):
    """Input pipeline i gets rows [4i, 4i+4) of one fixed global batch of 8, forever; under
    one process (one input pipeline) replica r gets batch r, the same rows."""
    import tensorflow as tf

    x = np.random.RandomState(0).randint(0, 32, size=(GLOBAL_BATCH, SEQ)).astype("int32")
    data = (x, np.roll(x, -1, axis=1), np.ones((GLOBAL_BATCH, SEQ), "float32"))
    local = context.get_per_replica_batch_size(GLOBAL_BATCH)
    return (tf.data.Dataset.from_tensors(data).unbatch().batch(local, drop_remainder=True)
            .shard(context.num_input_pipelines, context.input_pipeline_id).repeat())


def train(model, strategy, pipe=None, topk=None):
    """SGD with momentum, STEPS steps, 2 per call; returns the Trainer."""
    import keras

    from tfpar import compression
    from tfpar.loop import Trainer

    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    options = {} if topk is None else {
        "compression": compression.Compression(compression.TopK(topk), compression.Policy(min_size=0))}
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, steps_per_loop=2, placement=pipe, **options)
    trainer.fit(strategy.distribute_datasets_from_function(per_worker), steps=STEPS)
    return trainer


def placed(model, plan, trainer) -> dict:
    """Where each variable, and its momentum slot, lives; each stage's layer name."""
    slots = {m.path.split("/")[-1]: m for m in trainer.optimizer.variables}
    variables = []
    for name, layer in model.stages():
        for v in layer.trainable_variables:
            slot = slots[v.path.replace("/", "_") + "_momentum"]
            variables.append({"path": v.path, "stage": plan.device_of(name),
                              "device": v.value.device, "slot": slot.value.device})
    return {"variables": variables, "stages": {name: plan.device_of(name) for name, _ in model.stages()},
            "layers": {name: layer.name for name, layer in model.stages()}}


def main(init_path: str, out_dir: str) -> None:
    # Everything this worker prints goes to a file: the placement log is tens of thousands of
    # lines, and a pipe that the parent reads one worker at a time would fill and stall this
    # worker mid-collective (its peer then reports a heartbeat timeout).
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    log = os.open(f"{out_dir}/worker{task}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # the placement log is INFO
    import tensorflow as tf

    tf.debugging.set_log_device_placement(True)  # before the runtime starts, or it is ignored

    import tfpar
    from tfpar import placement

    # Two logical CPUs on this worker, split before TensorFlow starts (the strategy starts it).
    strategy = tfpar.create_strategy("multi_worker_mirrored", virtual_devices=2, connect_timeout_s=60)
    info = tfpar.describe(strategy)
    saved = np.load(init_path)
    initial = [saved[f"w{i}"] for i in range(len(saved.files))]
    template = small_gpt()
    template.build((None, SEQ))
    plan = placement.balanced(template, ["/cpu:0", "/cpu:1"])  # each worker's own devices
    for run, topk in RUNS.items():
        with plan.scope(strategy):
            model = small_gpt()
            model.build((None, SEQ))
        model.set_weights(initial)
        pipe = placement.Pipeline(model, plan, micro_batches=2, schedule="1f1b")
        trainer = train(model, strategy, pipe, topk)
        np.savez(f"{out_dir}/{run}_{info.task_index}.npz", *model.get_weights())
        print("PLACED " + json.dumps({"run": run, "task": info.task_index, "replicas": info.replicas,
                                      **placed(model, plan, trainer)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
