"""Algorithmic tasks: small, exact, and quick to learn. The fast convergence check.

`reverse`: the model reads `a_1 .. a_n SEP` and must write `a_n .. a_1` (causal LM, loss
and accuracy only on the reversed half). A tiny GPT reaches 100% exact-sequence accuracy.
`majority`: classify a sequence by its most frequent symbol (encoder classifier).

Token ids: 0 padding, 1 separator / [CLS], symbols from 2.

Example:
    >>> splits = reverse_task(length=8, symbols=10)
    >>> x, y, w = next(iter(splits.train.build()))     # w masks the prompt half
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfpar.data.source import Shard, Source, Splits, shard_examples

PAD, SEP = 0, 1


def _reverse_examples(count: int, length: int, symbols: int, seed: int):
    rng = np.random.RandomState(seed)
    a = rng.randint(2, 2 + symbols, size=(count, length))
    seq = np.concatenate([a, np.full((count, 1), SEP), a[:, ::-1]], axis=1).astype(np.int32)
    x, y = seq[:, :-1], seq[:, 1:]
    w = np.zeros_like(y, dtype=np.float32)
    w[:, length:] = 1.0  # targets after SEP: the reversed sequence
    return x, y, w


def _majority_examples(count: int, length: int, symbols: int, seed: int):
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, symbols, size=count)
    probs = np.full((count, symbols), 0.5 / (symbols - 1))
    probs[np.arange(count), labels] = 0.5
    tokens = np.array([rng.choice(symbols, size=length - 1, p=p) for p in probs])
    counts = np.stack([(tokens == s).sum(1) for s in range(symbols)], axis=1)
    labels = counts.argmax(1)  # the true majority (ties: smallest symbol)
    x = np.concatenate([np.full((count, 1), SEP), tokens + 2], axis=1).astype(np.int32)
    return x, labels.astype(np.int32)


def _in_memory(name: str, arrays, seed: int) -> Source:
    def build(shard: Shard, training: bool) -> tf.data.Dataset:
        dataset = shard_examples(tf.data.Dataset.from_tensor_slices(arrays), shard)
        if training:
            dataset = dataset.shuffle(min(len(arrays[0]), 20_000), seed=seed).repeat()
        return dataset

    return Source(name, build, num_files=0, num_examples=len(arrays[0]))


def reverse_task(length: int = 8, symbols: int = 10, train_size: int = 50_000,
                 validation_size: int = 1_000, seed: int = 0) -> Splits:
    """Sequence reversal as causal language modelling."""
    return Splits(
        train=_in_memory("reverse/train", _reverse_examples(train_size, length, symbols, seed), seed),
        validation=_in_memory("reverse/validation",
                              _reverse_examples(validation_size, length, symbols, seed + 1), seed),
        info={"vocab_size": symbols + 2, "max_len": 2 * length, "kind": "lm"},
    )


def majority_task(length: int = 32, symbols: int = 4, train_size: int = 20_000,
                  validation_size: int = 1_000, seed: int = 0) -> Splits:
    """Most frequent symbol of a sequence, as classification from [CLS]."""
    return Splits(
        train=_in_memory("majority/train", _majority_examples(train_size, length, symbols, seed), seed),
        validation=_in_memory("majority/validation",
                              _majority_examples(validation_size, length, symbols, seed + 1), seed),
        info={"vocab_size": symbols + 2, "max_len": length, "num_classes": symbols, "kind": "classify"},
    )
