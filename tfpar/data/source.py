"""Source: what a dataset is before it is batched and distributed.

A source builds a tf.data.Dataset of single examples, `(x, y)` or `(x, y, weight)`, for one
shard of the input: either a share of its files (FILE sharding) or every `num`-th example
(DATA sharding). `tfpar.data.pipeline` decides which, from the real shard count.

Example:
    >>> source = stdlib_corpus(seq_len=128).train
    >>> dataset = source.build(Shard(num=2, index=0, by_file=True), training=True)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Shard:
    """This input pipeline's part of the data: `index` of `num`, by file or by example."""

    num: int = 1
    index: int = 0
    by_file: bool = False


@dataclasses.dataclass
class Source:
    """A dataset before batching. `num_files`: units FILE sharding can split (0: none)."""

    name: str
    build_fn: Callable[[Shard, bool], tf.data.Dataset]
    num_files: int = 0
    num_examples: Optional[int] = None

    def build(self, shard: Shard = Shard(), training: bool = True) -> tf.data.Dataset:
        return self.build_fn(shard, training)


@dataclasses.dataclass
class Splits:
    """The train and validation sources of one dataset, and what models need to know."""

    train: Source
    validation: Source
    info: dict


def shard_examples(dataset: tf.data.Dataset, shard: Shard) -> tf.data.Dataset:
    """DATA sharding (a no-op for one pipeline or when the source already split files)."""
    if shard.num > 1 and not shard.by_file:
        return dataset.shard(shard.num, shard.index)
    return dataset
