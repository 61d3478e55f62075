"""Runs one training step of a GPT pipelined on 2 devices, 2 micro-batches, with the
schedule named by argv[1] (gpipe by default; interleaved and zb-v put 2 stage groups on
each device), with TensorFlow's device placement log on, for tests/test_placement.py: the placer's decisions for the executed
function graphs are printed as `name: (OpType): device` lines, which the test reads.

Prints, last, one JSON line: {"stages": {stage name: device index}, "layers": {stage name:
layer name}, "variables_per_device": {index: count}} so the test can match op names to stages.
"""

import json
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"

import tensorflow as tf  # noqa: E402

tf.debugging.set_log_device_placement(True)  # before the runtime starts, or it is ignored

from tfpar.strategy import runtime  # noqa: E402

runtime.split_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import placement  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.models.gpt import GPT  # noqa: E402


def small_gpt():
    return GPT(vocab_size=32, max_len=8, dim=32, depth=2, heads=2)


template = small_gpt()
template.build((None, 8))
schedule = sys.argv[1] if len(sys.argv) > 1 else "gpipe"
plan = placement.balanced(template, ["/cpu:0", "/cpu:1"], chunks=2 if schedule in ("interleaved", "zb-v") else 1,
                          layout="v" if schedule == "zb-v" else "round_robin")
with plan.scope():
    model = small_gpt()
    model.build((None, 8))
pipe = placement.Pipeline(model, plan, micro_batches=2, schedule=schedule)
trainer = Trainer(model, keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  placement=pipe)
x = np.random.RandomState(0).randint(0, 32, size=(4, 8)).astype("int32")
dataset = tf.data.Dataset.from_tensors((x, np.roll(x, -1, axis=1), np.ones((4, 8), "float32"))).repeat()
trainer.fit(dataset, steps=1)
print(json.dumps({"stages": {name: tf.DeviceSpec.from_string(plan.device_of(name)).device_index
                             for name, _ in model.stages()},
                  "layers": {name: layer.name for name, layer in model.stages()},
                  "variables_per_device": {i: sum(tf.DeviceSpec.from_string(plan.device_of(name)).device_index == i
                                                  for name, layer in model.stages()
                                                  for _ in layer.trainable_variables) for i in (0, 1)}}),
      flush=True)
