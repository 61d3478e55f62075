"""Saves checkpoint 10, then is SIGKILLed in the middle of saving checkpoint 20: after the
new checkpoint's files are written, before the checkpoint state names it.

    python kill_in_save.py WORKDIR     # prints the step-10 weights' sum, then dies (-9)
"""

import json
import os
import signal
import sys

import keras
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from tfpar.checkpoints import Checkpoints
from tfpar.models.gpt import GPT

keras.utils.set_random_seed(0)
model = GPT(vocab_size=32, max_len=8, dim=32, depth=1, heads=2)
checkpoints = Checkpoints(sys.argv[1], True, model=model)
checkpoints.save(10)
print(json.dumps({"sum": float(sum(tf.reduce_sum(w) for w in model.weights))}), flush=True)


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


checkpoint_management.update_checkpoint_state_internal = die
for w in model.weights:
    w.assign(w + 1.0)
checkpoints.save(20)
print("not reached", flush=True)
