"""How much of a step's gradient a rank-r PowerSGD can carry, on gpt_tiny and gpt_wide.

PowerSGD sends each gradient matrix (its most square 2-D view, as tfpar.compression.PowerSGD
reshapes it) at rank r; what the rank leaves out waits in the error feedback. This trains
each model uncompressed (AdamW, its config's learning rate, one replica's batch: the
benchmark's global batch over 2 workers) and, at a few steps, takes the singular values of
every matrix PowerSGD would compress (the embeddings too) and reports the share of the
gradient's energy (squared Frobenius norm, summed over the matrices) in the top r singular
values (and the median matrix's share), and the median stable rank (||M||_F^2 / ||M||_2^2). A model whose gradients keep
more of their energy in a few directions loses less to a low rank.

    python benchmarks/gradient_spectrum.py                      # about 3 minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics

import keras
import numpy as np
import tensorflow as tf

from tfpar import data as tfdata
from tfpar.compression import PowerSGD
from tfpar.models import GPT

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RANKS = (4, 8, 16, 32)


def config(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def spectrum(gradients, variables) -> dict:
    """Energy share in the top r singular values (over all matrices) and the stable ranks."""
    captured, total, stable, shares = {r: 0.0 for r in RANKS}, 0.0, [], {r: [] for r in RANKS}
    for g, v in zip(gradients, variables):
        if g is None or len(v.shape) < 2:
            continue
        g = tf.convert_to_tensor(g)
        n, m = PowerSGD.matrix_shape(v.shape)
        s = np.linalg.svd(g.numpy().reshape(n, m), compute_uv=False).astype("float64")
        energy = s ** 2
        total += energy.sum()
        for r in RANKS:
            captured[r] += energy[:r].sum()
            shares[r].append(energy[:r].sum() / energy.sum())
        stable.append(energy.sum() / energy[0])
    return {"energy_in_top_r": {r: captured[r] / total for r in RANKS},
            "median_matrix_share_in_top_r": {r: statistics.median(shares[r]) for r in RANKS},
            "median_stable_rank": statistics.median(stable), "matrices": len(stable)}


def measure(name: str, at_steps: list[int], workers: int) -> dict:
    cfg = config(name)
    keras.utils.set_random_seed(0)
    args = dict(cfg.model_args)
    model = GPT(vocab_size=256, max_len=cfg.data.seq_len, dim=args["dim"], depth=args["depth"],
                heads=args["heads"], mlp_ratio=args["mlp_ratio"])
    batch = cfg.train.batch_size // workers
    train = tfdata.load("corpus", seq_len=cfg.data.seq_len).train.build(training=True)
    batches = iter(train.batch(batch, drop_remainder=True).repeat())
    optimizer = keras.optimizers.AdamW(cfg.optimizer.learning_rate)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def step(x, y):
        loss, grads = gradients(x, y)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    found = {}
    for index in range(max(at_steps) + 1):
        x, y = next(batches)
        if index in at_steps:
            loss, grads = gradients(x, y)
            found[index] = {"loss": float(loss), **spectrum(grads, model.trainable_variables)}
        step(x, y)
    return {"dim": args["dim"], "tokens_per_replica": batch * cfg.data.seq_len, "learning_rate":
            cfg.optimizer.learning_rate, "at_step": found}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt_tiny,gpt_wide")
    parser.add_argument("--steps", default="120,300,600", help="the steps to measure at")
    parser.add_argument("--workers", type=int, default=2, help="the batch is the config's over this")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gradient_spectrum.json"))
    args = parser.parse_args()
    at_steps = [int(s) for s in args.steps.split(",")]
    results = {name: measure(name, at_steps, args.workers) for name in args.models.split(",")}
    for name, result in results.items():
        for s, found in result["at_step"].items():
            shares = "  ".join(f"r={r}: {share:.2f} ({found['median_matrix_share_in_top_r'][r]:.2f})"
                               for r, share in found["energy_in_top_r"].items())
            print(f"{name:9s} step {s:4d}  {shares}  stable rank {found['median_stable_rank']:.1f}")
    print("energy share in the top r singular values, over all matrices (median matrix's)")
    with open(args.out, "w") as f:
        json.dump({"results": results, "ranks": RANKS,
                   "note": "one replica's gradient of uncompressed AdamW training; energy = squared "
                           "singular values summed over every matrix PowerSGD compresses"}, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
