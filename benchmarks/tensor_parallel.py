"""Benchmark: tensor parallelism (T = 2) against data parallelism on gpt_small, 2 logical CPUs.

    python benchmarks/tensor_parallel.py          # benchmarks/results/tensor_parallel/tensor_parallel.json
    python benchmarks/tensor_parallel.py --out=/tmp/tp --steps=5 --rounds=1 --batch=4 --seq=64

Both settings train gpt_small's model (6 blocks of 384, 6 heads, MLP 1536) with AdamW and a
global-norm clip under one MirroredStrategy over 2 logical CPUs, with the same global batch
(`--batch` sequences of `--seq` tokens): data parallel splits the batch over the 2 replicas;
T = 2 gives both replicas the whole batch and splits every block. Reported per setting:
- ms/step: median over `--rounds` interleaved rounds of `--steps` steps (after a warm-up
  and one untimed round); the machine is shared, so only the ratio in one run means anything;
- bytes held per device: weights and optimizer slots, read from every copy of every
  variable on its device (TensorFlow keeps no per-device allocator statistics for logical
  CPUs: `get_memory_info` reads 0, so activations are not measured here);
- all-reduce bytes per step per replica, counted from the traced step (the shapes and dtypes
  handed to the collectives), beside the formula: data parallel P x 4 bytes (one sum of
  every gradient); Megatron, per block 2 forward and 2 backward all-reduces of the block's
  [b, s, h] activations, 4 x L x b x s x h x 4 bytes, plus the clip's one scalar, plus one
  sum of the replicated weights' gradients over every replica (P_r x 4 bytes: what keeps
  them the same bits on every replica; tfpar.loop.tensor_parallel).
float32 throughout; dropout off (the binary's gpt_small uses bf16 and dropout 0.1).
Speed lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfpar.strategy import runtime  # noqa: E402

SMALL = dict(vocab_size=256, dim=384, depth=6, heads=6, mlp_ratio=4)


def _setting(strategy, degree: int, args):
    import keras
    import numpy as np

    import tfpar
    from tfpar.data.pipeline import same_batch_for_groups
    from tfpar.models.gpt import GPT

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(**SMALL, max_len=args.seq, tensor_parallel=degree)
        optimizer = keras.optimizers.AdamW(1e-3, global_clipnorm=1.0)
    trainer = tfpar.Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            strategy=strategy, steps_per_loop=args.steps, xla=False)
    x = np.random.RandomState(0).randint(0, 256, size=(args.batch, args.seq)).astype("int32")
    rows = args.batch // (strategy.num_replicas_in_sync // degree)
    data = tf.data.Dataset.from_tensors((x, np.roll(x, -1, 1), np.ones(x.shape, "float32")))
    data = data.unbatch().batch(rows, drop_remainder=True).repeat()  # static shapes: bytes counted
    dataset = strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree))
    return model, trainer, dataset


def _bytes_per_device(variables) -> dict[str, int]:
    from tfpar.tensor_parallel import shards

    held: dict[str, int] = {}
    for variable in variables:
        for _, copy in shards.copies(variable):
            device = tf.DeviceSpec.from_string(copy.device).to_string()
            held[device] = held.get(device, 0) + int(copy.shape.num_elements()) * copy.dtype.size
    return held


def _all_reduce_bytes(trainer, dataset) -> tuple[int, int]:
    """(bytes, count) of the all-reduces of replica 0 in one traced step."""
    from tfpar.compression import accounting

    found = [c for c in accounting.collectives(trainer.traced_step(dataset))
             if "Reduce" in c.type and c.device.endswith("CPU:0")]
    return sum(c.bytes or 0 for c in found), len(found)


def _formula(degree: int, args, params: int, replicated: int) -> int:
    if degree == 1:
        return params * 4
    layers, hidden = SMALL["depth"], SMALL["dim"]
    return 4 * layers * args.batch * args.seq * hidden * 4 + 4 + replicated * 4  # + the clip's scalar


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    runtime.split_devices(2)
    import tfpar

    from tfpar.tensor_parallel import shards

    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    settings = {}
    for name, degree in (("data parallel", 1), ("tensor parallel T=2", 2)):
        model, trainer, dataset = _setting(strategy, degree, args)
        iterator = iter(dataset)
        trainer.fit(iterator, steps=args.steps)  # warm-up: traces and runs
        wire, count = _all_reduce_bytes(trainer, dataset)
        params = model.count_params()  # whole shapes, split or not
        replicated = sum(int(w.shape.num_elements()) for w in model.trainable_variables
                         if shards.spec_of(w) is None)
        settings[name] = dict(degree=degree, trainer=trainer, iterator=iterator, times=[], row=dict(
            all_reduce_bytes_per_step=wire, all_reduces_per_step=count,
            formula_bytes_per_step=_formula(degree, args, params, replicated),
            weight_bytes_per_device=_bytes_per_device(model.weights),
            optimizer_bytes_per_device=_bytes_per_device(trainer.optimizer.variables)))
    for round_ in range(args.rounds + 1):  # interleaved (the machine drifts); round 0 untimed
        for setting in settings.values():
            start = time.perf_counter()
            setting["trainer"].fit(setting["iterator"], steps=args.steps)
            if round_:
                setting["times"].append((time.perf_counter() - start) / args.steps * 1000)
    rows = {}
    for name, setting in settings.items():
        rows[name] = {"ms_per_step": round(statistics.median(setting["times"]), 1),
                      "ms_per_step_rounds": [round(t, 1) for t in setting["times"]], **setting["row"]}
    result = dict(model=SMALL, batch=args.batch, seq=args.seq, steps=args.steps, rounds=args.rounds,
                  device="2 logical CPUs sharing the host's cores", settings=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tensor_parallel.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
