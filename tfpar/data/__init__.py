"""Datasets: the embedded stdlib corpus, algorithmic tasks, TFDS, and their distribution."""

from tfpar.data.corpus import text_corpus, unigram_entropy
from tfpar.data.pipeline import (distribute_eval, distribute_train, per_replica_batch_size,
                                 worker_train_fn)
from tfpar.data.source import Shard, Source, Splits
from tfpar.data.tasks import majority_task, reverse_task
from tfpar.data.tfds_source import tfds_splits
from tfpar.errors import DataError


NAMES = ("corpus", "task:reverse", "task:majority")  # and tfds:NAME[:CONFIG]
TFDS_PREFIX = "tfds:"


def check_name(name: str) -> None:
    """Raises DataError unless `name` is one of NAMES or 'tfds:NAME[:CONFIG]'."""
    if name not in NAMES and not name.startswith(TFDS_PREFIX):
        raise DataError(f"Unknown data.name {name!r}: use {', '.join(repr(n) for n in NAMES)} or "
                        f"'{TFDS_PREFIX}NAME[:CONFIG]'.")


def load(name: str, seq_len: int = 128, files: str | None = None, data_dir: str | None = None,
         seed: int = 0, **task_args) -> Splits:
    """Splits for a data name: 'corpus', 'task:reverse', 'task:majority' or 'tfds:NAME[:CONFIG]'."""
    if name == "corpus":
        return text_corpus(seq_len, files=files, seed=seed)
    if name == "task:reverse":
        return reverse_task(seed=seed, **task_args)
    if name == "task:majority":
        return majority_task(seed=seed, **task_args)
    check_name(name)
    return tfds_splits(name, data_dir=data_dir, max_len=seq_len, seed=seed)


__all__ = ["NAMES", "TFDS_PREFIX", "check_name", "Shard", "Source", "Splits", "distribute_eval", "distribute_train", "load",
           "majority_task", "per_replica_batch_size", "reverse_task", "text_corpus",
           "tfds_splits", "unigram_entropy", "worker_train_fn"]
