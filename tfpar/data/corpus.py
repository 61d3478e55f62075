"""The embedded default: byte-level language modelling over Python's own standard library.

Always present, no network: the `.py` sources of the interpreter that runs tfpar, minus
tests, site-packages and caches, in sorted path order. Every 20th file is held out for
validation (a split by file, so no window is in both). On CPython 3.11 that is about 670
files and 11 MB of text and code (about 10.7 MB train, 0.6 MB validation).
`--config.data.files=GLOB` points the same pipeline at your own text files.

Example:
    >>> splits = text_corpus(seq_len=128)
    >>> x, y = next(iter(splits.train.build()))      # y is x shifted by one byte
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np
import tensorflow as tf

from tfpar.data.source import Shard, Source, Splits, shard_examples
from tfpar.errors import DataError

VOCAB_SIZE = 256
VALIDATION_EVERY = 20
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


def stdlib_files() -> list[str]:
    """The standard library's own .py files, sorted (deterministic on one interpreter)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _EXCLUDED_DIRS]
        files.extend(os.path.join(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def user_files(pattern: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if len(files) < 2:
        raise DataError(
            f"data.files={pattern!r} matches {len(files)} file(s); the corpus needs at least 2 "
            "(one is held out for validation). Check the glob (use ** with quotes for subfolders)."
        )
    return files


def split_by_file(files: list[str]) -> tuple[list[str], list[str]]:
    """Every VALIDATION_EVERY-th file (and at least one) goes to validation."""
    validation = files[VALIDATION_EVERY // 2 :: VALIDATION_EVERY] or files[-1:]
    held = set(validation)
    return [f for f in files if f not in held], validation


def _read(files: list[str]) -> np.ndarray:
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(np.frombuffer(f.read() + b"\n", dtype=np.uint8))
    return np.concatenate(chunks) if chunks else np.zeros((0,), np.uint8)


def _windows(data: np.ndarray, seq_len: int) -> np.ndarray:
    if len(data) <= seq_len:
        raise DataError(f"The corpus has {len(data)} bytes, fewer than one window of {seq_len + 1}.")
    return np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[::seq_len].astype(np.int32)


def _source(name: str, files: list[str], seq_len: int, seed: int) -> Source:
    def build(shard: Shard, training: bool) -> tf.data.Dataset:
        chosen = files[shard.index :: shard.num] if shard.by_file else files
        windows = _windows(_read(chosen), seq_len)
        dataset = shard_examples(tf.data.Dataset.from_tensor_slices(windows), shard)
        if training:
            dataset = dataset.shuffle(min(len(windows), 20_000), seed=seed).repeat()
        return dataset.map(lambda w: (w[:-1], w[1:]), num_parallel_calls=tf.data.AUTOTUNE)

    num_examples = (sum(os.path.getsize(f) + 1 for f in files) - 1) // seq_len
    return Source(name, build, num_files=len(files), num_examples=num_examples)


def text_corpus(seq_len: int, files: str | None = None, seed: int = 0) -> Splits:
    """Byte-level LM splits over the stdlib (default) or the files matching `files`."""
    all_files = user_files(files) if files else stdlib_files()
    train, validation = split_by_file(all_files)
    return Splits(
        train=_source("corpus/train", train, seq_len, seed),
        validation=_source("corpus/validation", validation, seq_len, seed),
        info={"vocab_size": VOCAB_SIZE, "max_len": seq_len, "kind": "lm",
              "files": len(all_files), "train_files": len(train), "validation_files": len(validation)},
    )


def unigram_entropy(source: Source) -> float:
    """Cross-entropy (nats/byte) of the best context-free model of `source`: the baseline."""
    data = source.build(training=False)
    counts = np.zeros(VOCAB_SIZE)
    for _, y in data.batch(4096).as_numpy_iterator():
        counts += np.bincount(y.ravel(), minlength=VOCAB_SIZE)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
