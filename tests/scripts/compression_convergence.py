"""reverse_tiny on 2 mirrored replicas, once per compressor, same steps; prints each run's
results as JSON lines (a fresh process: the CPU is split in 2 before TensorFlow starts)."""

import json
import runpy
import sys

from tfpar.strategy import runtime

runtime.split_devices(2)

from tfpar.train import train_and_evaluate  # noqa: E402

workdir, steps = sys.argv[1], int(sys.argv[2])
for name in sys.argv[3:]:
    config = runpy.run_path("configs/reverse_tiny.py")["get_config"]()
    config.strategy, config.mode, config.compression = "mirrored", "loop", name
    config.train.update(steps=steps, checkpoint_every=steps, log_every=steps)
    results = train_and_evaluate(config, f"{workdir}/{name}")
    print("RESULT " + json.dumps({"name": name, **results}), flush=True)
