"""Benchmark: a keras-hub Llama split by keras.distribution beside tfpar's GPT, T = 1, 2, 4.

    python benchmarks/tensor_parallel_keras_hub.py    # benchmarks/results/tensor_parallel/keras_hub.{json,png}
    python benchmarks/tensor_parallel_keras_hub.py --out=/tmp/tpk --steps=2 --rounds=1 --seq=32

Four logical CPUs. Each model is trained with AdamW and a global-norm clip by tfpar.Trainer
(xla=False) on the same global batch (`--batch` sequences of `--seq` tokens), at
- T = 1: data parallel over the 4 devices (keras-hub: `keras.distribution.DataParallel`),
- T = 2: 2 data x 2 model (`ModelParallel` on a (2, 2) mesh),
- T = 4: 1 x 4.
Models, close in size: tfpar's GPT (`GPT(tensor_parallel=T)`, 4 blocks of 256, 8 heads,
MLP 1024) and keras-hub's LlamaCausalLM (4 layers of 256, 8 query and 4 key-value heads,
MLP 704 gated), split by its own `LlamaBackbone.get_layout_map` ("llama (own map)") and by
tfpar's `layout_maps.llama_megatron` ("llama (megatron map)"), through
`tfpar.distribution.enable()`. Reported per setting:
- weight and optimizer-state bytes per device, read from every copy of every variable on
  its device (the largest device; the split ones hold 1/T of each split kernel);
- ms/step: median of `--rounds` interleaved rounds of `--steps` steps after a warm-up and
  an untimed round (the 4 devices share the host's cores: ratios only);
- all-reduces per step on device 0 and their bytes, counted from the traced step.
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

DEVICES = 4
VOCAB = 256
GPT_SIZE = dict(vocab_size=VOCAB, dim=256, depth=4, heads=8, mlp_ratio=4)
LLAMA_SIZE = dict(vocabulary_size=VOCAB, num_layers=4, num_query_heads=8, num_key_value_heads=4,
                  hidden_dim=256, intermediate_dim=704, dropout=0.0)
MODELS = ("gpt (tfpar)", "llama (own map)", "llama (megatron map)")


def _optimizer():
    import keras

    return keras.optimizers.AdamW(1e-3, global_clipnorm=1.0)


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _tokens(args):
    import numpy as np

    x = np.random.RandomState(0).randint(0, VOCAB, size=(args.batch, args.seq + 1)).astype("int32")
    return x[:, :-1], x[:, 1:], np.ones((args.batch, args.seq), "float32")


def _gpt(degree: int, args):
    """tfpar's GPT under a MirroredStrategy over the 4 devices; each TP group one batch."""
    import keras

    import tfpar
    from tfpar.data.pipeline import same_batch_for_groups
    from tfpar.models.gpt import GPT

    strategy = tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(DEVICES)])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(**GPT_SIZE, max_len=args.seq, tensor_parallel=degree)
        optimizer = _optimizer()
    trainer = tfpar.Trainer(model, optimizer, _loss(), strategy=strategy, steps_per_loop=args.steps, xla=False)
    rows = args.batch // (DEVICES // degree)
    data = tf.data.Dataset.from_tensors(_tokens(args)).unbatch().batch(rows, drop_remainder=True).repeat()
    dataset = strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree))
    return model, trainer, dataset, None


def _llama(degree: int, args, megatron: bool):
    """keras-hub's Llama built under a keras.distribution, trained by tfpar.Trainer with a
    plain dataset (the model's strategy distributes it)."""
    import keras
    import keras_hub

    import tfpar
    from tfpar.models.layout_maps import layout_map_for, llama_megatron

    devices = keras.distribution.list_devices()[:DEVICES]
    if degree == 1:
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh((DEVICES // degree, degree), ["batch", "model"], devices)
        layout_map = llama_megatron(mesh) if megatron else layout_map_for("LlamaBackbone", mesh)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(**LLAMA_SIZE)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    trainer = tfpar.Trainer(model, _optimizer(), _loss(), steps_per_loop=args.steps, xla=False)
    x, y, w = _tokens(args)
    inputs = {"token_ids": x, "padding_mask": tf.ones_like(x)}
    data = tf.data.Dataset.from_tensors((inputs, y, w)).repeat()
    return model, trainer, trainer._distributed(data), distribution  # pylint: disable=protected-access


def _bytes_per_device(variables) -> int:
    """The most bytes any one device holds of `variables` (every copy on its device)."""
    from tfpar.tensor_parallel import shards

    held: dict[str, int] = {}
    for variable in variables:
        for _, copy in shards.copies(variable):
            device = tf.DeviceSpec.from_string(copy.device).to_string()
            held[device] = held.get(device, 0) + int(copy.shape.num_elements()) * copy.dtype.size
    return max(held.values())


def _all_reduces(trainer, dataset) -> tuple[int, int]:
    """(count, bytes) of device 0's all-reduces in one traced step."""
    from tfpar.compression import accounting

    found = [c for c in accounting.collectives(trainer.traced_step(dataset))
             if "Reduce" in c.type and c.device.endswith("CPU:0")]
    return len(found), sum(c.bytes or 0 for c in found)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
    degrees = (1, 2, 4)
    width = 0.27
    for i, name in enumerate(MODELS):
        rows = [result["settings"][f"{name}, T={t}"] for t in degrees]
        xs = [d + (i - 1) * width for d in range(len(degrees))]
        held = [(r["weight_bytes_per_device"] + r["optimizer_bytes_per_device"]) / 2**20 for r in rows]
        memory.bar(xs, held, width, label=name)
        speed.bar(xs, [r["ms_per_step"] for r in rows], width, label=name)
    for axis, title in ((memory, "weights + optimizer state per device (MiB)"), (speed, "ms per step")):
        axis.set_xticks(range(len(degrees)), [f"T = {t}" for t in degrees])
        axis.set_title(title)
    memory.legend()
    fig.suptitle(f"4 logical CPUs, batch {result['batch']} x {result['seq']} tokens, AdamW, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    runtime.split_devices(DEVICES)
    import keras

    import tfpar

    tfpar.distribution.enable()
    settings = {}
    for name in MODELS:
        for degree in (1, 2, 4):
            if name == "gpt (tfpar)":
                model, trainer, dataset, distribution = _gpt(degree, args)
            else:
                model, trainer, dataset, distribution = _llama(degree, args, megatron="megatron" in name)
            iterator = iter(dataset)
            trainer.fit(iterator, steps=args.steps)  # warm-up: traces and runs
            count, wire = _all_reduces(trainer, dataset)
            settings[f"{name}, T={degree}"] = dict(trainer=trainer, iterator=iterator, distribution=distribution,
                                                   times=[], row=dict(
                model=name, degree=degree, parameters=model.count_params(),
                weight_bytes_per_device=_bytes_per_device(model.weights),
                optimizer_bytes_per_device=_bytes_per_device(trainer.optimizer.variables),
                all_reduces_per_step=count, all_reduce_bytes_per_step=wire))
            print(f"built {name}, T={degree}: {settings[f'{name}, T={degree}']['row']}", flush=True)
    for round_ in range(args.rounds + 1):  # interleaved (the machine drifts); round 0 untimed
        for setting in settings.values():
            keras.distribution.set_distribution(setting["distribution"])
            start = time.perf_counter()
            setting["trainer"].fit(setting["iterator"], steps=args.steps)
            if round_:
                setting["times"].append((time.perf_counter() - start) / args.steps * 1000)
    keras.distribution.set_distribution(None)
    rows = {name: {**s["row"], "ms_per_step": round(statistics.median(s["times"]), 1),
                   "ms_per_step_rounds": [round(t, 1) for t in s["times"]]} for name, s in settings.items()}
    result = dict(gpt=GPT_SIZE, llama=LLAMA_SIZE, batch=args.batch, seq=args.seq, steps=args.steps,
                  rounds=args.rounds, device=f"{DEVICES} logical CPUs sharing the host's cores",
                  load_average=os.getloadavg(), settings=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "keras_hub.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    _plot(result, os.path.join(args.out, "keras_hub.png"))
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
