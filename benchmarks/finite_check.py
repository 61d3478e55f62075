"""What nonfinite="stop" costs a compressed step over "ignore".

With a compressor that keeps state, tfpar's loop then checks each replica's own gradients and
all-reduces one float a step (the replicas' agreement, tfpar.loop.nonfinite.SkippedStepState),
and the guard checks the summed gradients' norm; "ignore" does neither. So the cost is an
upper bound on the agreement's. gpt_tiny on 2 logical CPUs (mirrored), rounds alternating
(and their order swapped each round) so both see the same machine. Prints one JSON line; a
loopback collective, so the network's latency (one more round trip a step) is not in it.

    python benchmarks/finite_check.py --rounds=5 --steps=20
"""

import argparse
import json
import time

import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
from tfpar import compression as C  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.models import GPT  # noqa: E402


def trainer(strategy, nonfinite: str, compression: str) -> Trainer:
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(vocab_size=256, max_len=128, dim=128, depth=2, heads=4)  # gpt_tiny
        optimizer = keras.optimizers.SGD(0.01) if compression == "onebit_adam" else keras.optimizers.AdamW(3e-3)
    chosen = (C.OneBitAdam(freeze_step=1) if compression == "onebit_adam"
              else C.Compression(C.get(compression, **({"ratio": 0.01} if compression == "topk" else {}))))
    return Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   strategy=strategy, steps_per_loop=10, compression=chosen, nonfinite=nonfinite)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compressors", default="topk,powersgd,onebit_adam")
    args = parser.parse_args()
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    tokens = np.random.RandomState(0).randint(0, 256, size=(32, 129)).astype("int32")
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat())
    results = {}
    for compression in args.compressors.split(","):
        runs = {policy: trainer(strategy, policy, compression) for policy in ("ignore", "stop")}
        iterators = {policy: iter(data) for policy in runs}
        for policy, t in runs.items():  # trace every phase (onebit_adam: warm-up, then compressed)
            for _ in range(2):
                t.train_steps(iterators[policy], 10)
        seconds = {policy: [] for policy in runs}
        for round_ in range(args.rounds):
            for policy, t in (runs.items() if round_ % 2 == 0 else reversed(runs.items())):
                started = time.perf_counter()
                t.train_steps(iterators[policy], args.steps)
                seconds[policy].append((time.perf_counter() - started) / args.steps)
        step = {policy: float(np.median(s)) for policy, s in seconds.items()}
        results[compression] = {"ms_per_step_without_check": 1e3 * step["ignore"],
                                "ms_per_step_with_check": 1e3 * step["stop"],
                                "cost": step["stop"] / step["ignore"] - 1,
                                "check_bytes_per_step": runs["stop"].wire_bytes(data)["check_bytes_per_step"]}
    print(json.dumps({"results": results, "rounds": args.rounds, "steps": args.steps,
                      "note": "median per-step wall clock, 2 logical CPUs on a shared machine: noisy"}))


if __name__ == "__main__":
    main()
