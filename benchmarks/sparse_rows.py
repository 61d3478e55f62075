"""What summing sparse rows costs: gpt_tiny in tfpar's loop with sum_sparse_rows on and off.

Same run, alternating rounds, so both see the same machine. Prints one JSON line.

    python benchmarks/sparse_rows.py --rounds=3 --steps=20
"""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf

from tfpar.loop import Trainer
from tfpar.models import GPT


def trainer(sum_sparse_rows: bool, batch: int, seq: int) -> Trainer:
    keras.utils.set_random_seed(0)
    model = GPT(vocab_size=256, max_len=seq, dim=128, depth=2, heads=4)  # gpt_tiny
    optimizer = keras.optimizers.AdamW(3e-3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Trainer(model, optimizer, loss, steps_per_loop=10, sum_sparse_rows=sum_sparse_rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    tokens = np.random.RandomState(0).randint(0, 256, size=(args.batch, args.seq + 1)).astype("int32")
    data = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    runs = {on: trainer(on, args.batch, args.seq) for on in (True, False)}
    iterators = {on: iter(data) for on in runs}
    for on, t in runs.items():  # trace and compile outside the timing
        t.train_steps(iterators[on], 10)
    seconds = {True: [], False: []}
    for _ in range(args.rounds):
        for on, t in runs.items():
            started = time.perf_counter()
            t.train_steps(iterators[on], args.steps)
            seconds[on].append(time.perf_counter() - started)
    rate = {on: args.steps / float(np.median(s)) for on, s in seconds.items()}
    print(json.dumps({"steps_per_s_summed": rate[True], "steps_per_s_keras": rate[False],
                      "cost": 1 - rate[True] / rate[False], "rounds": args.rounds,
                      "steps": args.steps, "note": "wall clock on a shared machine: noisy"}))


if __name__ == "__main__":
    main()
