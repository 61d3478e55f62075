"""Is a checkpoint whole? Every file present and every tensor read back with its checksum.

A partial copy from shared storage, a full disk or a dying host can leave the newest
checkpoint truncated, corrupted or without its index. TensorFlow finds that only in the
middle of a restore (an `IndexError: Read less bytes than requested` or a DataLossError),
after some variables were already overwritten. `problems(prefix)` reads the checkpoint
first, through TensorFlow's own reader, which checks each tensor's CRC32C; the restore
then picks the newest checkpoint that has none.

Example:
    >>> problems("/run/checkpoints/ckpt-300")
    ['/run/checkpoints/ckpt-300.data-00000-of-00001: Read less bytes than requested']
    >>> chosen, damaged = newest_intact(["/run/checkpoints/ckpt-300", "/run/checkpoints/ckpt-200"])
"""

from __future__ import annotations

import re
from typing import Sequence

import tensorflow as tf

_READ_ERRORS = (tf.errors.OpError, IndexError, ValueError, OSError)


def _reason(error: BaseException) -> str:
    text = str(getattr(error, "message", error)) or type(error).__name__
    return text.splitlines()[0][:200]


def _data_files(prefix: str) -> tuple[list[str], list[str]]:
    """(present, missing) data shards of `prefix`, from the shard count in their names."""
    present = sorted(tf.io.gfile.glob(prefix + ".data-*-of-*"))
    counts = {int(m[1]) for m in (re.search(r"-of-(\d+)$", p) for p in present) if m}
    total = max(counts) if counts else 1
    expected = [f"{prefix}.data-{i:05d}-of-{total:05d}" for i in range(total)]
    return present, [p for p in expected if p not in present]


def problems(prefix: str) -> list[str]:
    """What is wrong with checkpoint `prefix`: [] when it is whole."""
    index = prefix + ".index"
    if not tf.io.gfile.exists(index):
        return [f"{index} is missing"]
    present, missing = _data_files(prefix)
    if missing:
        return [f"{path} is missing" for path in missing]
    try:
        reader = tf.train.load_checkpoint(prefix)
    except _READ_ERRORS as e:
        return [f"{index}: {_reason(e)}"]
    for key in sorted(reader.get_variable_to_shape_map()):
        try:
            reader.get_tensor(key)
        except _READ_ERRORS as e:
            return [f"{', '.join(present)}: {_reason(e)} (reading {key})"]
    return []


def newest_intact(prefixes: Sequence[str]) -> tuple[str | None, dict[str, list[str]]]:
    """The first whole checkpoint of `prefixes` (give them newest first), and the problems
    of each damaged one met before it, by prefix."""
    damaged: dict[str, list[str]] = {}
    for prefix in prefixes:
        found = problems(prefix)
        if not found:
            return prefix, damaged
        damaged[prefix] = found
    return None, damaged
