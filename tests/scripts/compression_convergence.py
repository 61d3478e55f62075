"""reverse_tiny on 2 mirrored replicas, once per configuration, same steps; prints each run's
results as JSON lines (a fresh process: the CPU is split in 2 before TensorFlow starts).

argv: WORKDIR STEPS SPEC...; SPEC is a compressor name, optionally with config overrides:
"dgc:compression_args.ratio=0.01;optimizer.name=sgd" (values parsed as Python literals).
"""

import ast
import json
import runpy
import sys

from tfpar.strategy import runtime

runtime.split_devices(2)

from tfpar.train import train_and_evaluate  # noqa: E402


def configure(spec: str, steps: int):
    name, _, overrides = spec.partition(":")
    config = runpy.run_path("configs/reverse_tiny.py")["get_config"]()
    config.strategy, config.mode, config.compression = "mirrored", "loop", name
    config.train.update(steps=steps, checkpoint_every=steps, log_every=steps)
    for item in filter(None, overrides.split(";")):
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        target = config
        for parent in parents:
            target = target[parent]
        try:
            target[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            target[leaf] = value
    return config


workdir, steps = sys.argv[1], int(sys.argv[2])
for index, spec in enumerate(sys.argv[3:]):
    results = train_and_evaluate(configure(spec, steps), f"{workdir}/{index}")
    print("RESULT " + json.dumps({"name": spec, **results}), flush=True)
