"""One worker of tests/test_profiling_workers.py: gpt_tiny in tfpar's loop through the
binary's own code (tfpar.run), steps 10-13 profiled; `--slow-worker=K`: worker K sleeps
SECONDS in every step before its forward pass (a straggler on purpose).

Usage: profile_worker.py WORKDIR [--slow-worker=K --sleep=SECONDS] [--steps=N --profile=A,B]
"""

import argparse
import json
import os
import runpy
import time

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--slow-worker", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.15)
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--profile", default="10,13")
args = parser.parse_args()

import tensorflow as tf  # noqa: E402

from tfpar import run as run_lib  # noqa: E402
from tfpar.loop import forward_backward  # noqa: E402

config = runpy.run_path("configs/gpt_tiny.py")["get_config"]()
config.mode, config.strategy = "loop", "multi_worker_mirrored"
config.train.update(dict(steps=args.steps, log_every=8, profile_steps=args.profile, eval_examples=64,
                         checkpoint_every=1000))
config.strategy_args.update(dict(timeout_s=60.0, connect_timeout_s=60.0))
config.sample.length = 0

if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == args.slow_worker:
    original = forward_backward.ForwardBackward.__call__

    def slowed(self, x, y, w, loss_scale):
        late = tf.py_function(lambda: (time.sleep(args.sleep), 0.0)[1], [], tf.float32)
        with tf.control_dependencies([late]):
            x = tf.identity(x)
        return original(self, x, y, w, loss_scale)

    forward_backward.ForwardBackward.__call__ = slowed

run_lib.train_and_evaluate(config, args.workdir)
