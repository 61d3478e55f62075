"""Benchmark: tokens/s of tfpar's loop vs Keras fit vs the tf.distribute tutorial loop.

    python benchmarks/loop_vs_fit.py --out=bench_out            # JSON + PNG in bench_out/

gpt_tiny (2 blocks of 128, 128-byte windows, global batch 32) on the embedded corpus,
under one device (TensorFlow's default strategy) and `mirrored` over 2 logical CPUs,
measured side by side in one run. Keras fit gets the best steps_per_execution of
{1, 10, 50} (picked in a first round) and XLA where Keras allows it; the tutorial loop is the one from
"Custom training with tf.distribute.Strategy" (tf.function per step, apply_gradients).
Each of `--repeats` rounds then measures fit, tfpar's loop and the tutorial loop one after
the other; the JSON keeps every round and reports medians (tokens/s and the per-round
ratios), since a shared 2-core VM drifts by +-10% between runs.
Speed lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.strategy import runtime  # noqa: E402

runtime.split_devices(2)  # before TensorFlow starts: 2 logical CPUs for `mirrored`

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar import data as data_lib  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.models import GPT  # noqa: E402
from tfpar.recipes import SmoothedSparseCrossentropy  # noqa: E402

SEQ, BATCH = 128, 32
TOKENS_PER_STEP = SEQ * BATCH


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = GPT(vocab_size=256, max_len=SEQ, dim=128, depth=2, heads=4)
        optimizer = keras.optimizers.AdamW(1e-3)
    return model, optimizer


def timed(run_steps, warmup: int, steps: int) -> float:
    run_steps(warmup)
    started = time.perf_counter()
    run_steps(steps)
    return steps * TOKENS_PER_STEP / (time.perf_counter() - started)


def keras_fit(strategy, splits, spe, warmup, steps):
    model, optimizer = build(strategy)
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=SmoothedSparseCrossentropy(), steps_per_execution=spe,
                      jit_compile=True if strategy is tf.distribute.get_strategy() else "auto")
    dataset = data_lib.distribute_train(strategy, splits.train, BATCH)

    def run(n):
        model.fit(dataset, steps_per_epoch=n, epochs=1, verbose=0)
    return timed(run, max(warmup, spe), (steps // spe) * spe)


def tfpar_loop(strategy, splits, warmup, steps):
    model, optimizer = build(strategy)
    trainer = Trainer(model, optimizer, SmoothedSparseCrossentropy(), strategy=strategy, steps_per_loop=10)
    iterator = iter(data_lib.distribute_train(strategy, splits.train, BATCH))
    return timed(lambda n: trainer.train_steps(iterator, n), warmup, steps)


def tutorial_loop(strategy, splits, warmup, steps):
    model, optimizer = build(strategy)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            per_token = loss_object(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(tf.reduce_mean(per_token, axis=-1), global_batch_size=BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    with strategy.scope():
        optimizer.build(model.trainable_variables)
    iterator = iter(data_lib.distribute_train(strategy, splits.train, BATCH))

    def run(n):
        for _ in range(n):
            loss = distributed_train_step(next(iterator))
        float(loss)
    return timed(run, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    splits = data_lib.text_corpus(SEQ)
    strategies = {
        "one_device": tf.distribute.get_strategy(),
        "mirrored_2cpu": tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"]),
    }
    results = {}
    for name, strategy in strategies.items():
        fit = {spe: keras_fit(strategy, splits, spe, args.warmup, args.steps) for spe in (1, 10, 50)}
        best_spe = max(fit, key=fit.get)
        rounds = []
        for _ in range(args.repeats):
            row = {"keras_fit_tok_s": keras_fit(strategy, splits, best_spe, args.warmup, args.steps),
                   "tfpar_loop_tok_s": tfpar_loop(strategy, splits, args.warmup, args.steps),
                   "tutorial_loop_tok_s": tutorial_loop(strategy, splits, args.warmup, args.steps)}
            row["loop_over_fit"] = row["tfpar_loop_tok_s"] / row["keras_fit_tok_s"]
            row["loop_over_tutorial"] = row["tfpar_loop_tok_s"] / row["tutorial_loop_tok_s"]
            rounds.append(row)
            print(name, json.dumps(row), flush=True)
        results[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        results[name].update({"keras_fit_steps_per_execution": best_spe,
                              "keras_fit_by_spe_first_round": {str(k): v for k, v in fit.items()},
                              "rounds": rounds})
    with open(os.path.join(args.out, "loop_vs_fit.json"), "w") as f:
        json.dump({"model": "gpt_tiny", "seq_len": SEQ, "global_batch": BATCH, "results": results}, f, indent=2)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = [("keras_fit_tok_s", "Keras fit (best spe)"), ("tutorial_loop_tok_s", "tutorial loop"),
             ("tfpar_loop_tok_s", "tfpar loop")]
    width = 0.25
    for i, (key, label) in enumerate(kinds):
        ax.bar([j + i * width for j in range(len(results))], [r[key] for r in results.values()], width, label=label)
    ax.set_xticks([j + width for j in range(len(results))], list(results))
    ax.set_ylabel("tokens / s")
    ax.set_title("gpt_tiny training throughput (2 CPU cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loop_vs_fit.png"), dpi=120)


if __name__ == "__main__":
    main()
