"""ZeRO checkpoints written one partition per worker (multi_worker_mirrored).

Under multi_worker_mirrored each worker holds its own replicas' chunks of the optimizer
state and no other's. tfpar's Checkpoints then saves a ZeRO run in three moves:

1. every worker writes the slices its replicas own (tfpar.zero.checkpoint, LOCAL) under
   the keys of the chief's checkpoint, to its own file beside the checkpoints
   (`<directory>/ckpt-<step>_partitions/<task>/part`: the workdir must be on a filesystem
   every worker sees, as the chief reads these files);
2. one small all-reduce (the barrier): the chief merges nothing before every worker has
   written, and no worker goes on if one could not (each raises WorkdirError);
3. the chief's save writes the object graph and everything else (the slots' keys
   recorded, no values: SKIP) and merges the workers' files into the checkpoint in its
   own MergeV2Checkpoints (a registered saver on `WorkerPartitions`), which moves their
   data files in: ckpt-<step>.data-0000k-of-0000N, one per worker and the chief's own.

No process puts a slot together. A restore reads, on each worker, only its replicas'
slices (any replica count, any mode: tfpar.zero.checkpoint). `stored_slices` reads which
file holds which slice of each key from a checkpoint's index.

Example:
    >>> partitions = WorkerPartitions.find(objects)     # None: not a multi-worker ZeRO run
    >>> partitions.save(checkpoint, directory, step, manager.save)   # every worker calls it
"""

from __future__ import annotations

import os
import struct
from typing import Callable

import tensorflow as tf

from tfpar.errors import WorkdirError
from tfpar.strategy import private_api
from tfpar.strategy.replicas import count_failed_workers
from tfpar.zero import checkpoint as zero_checkpoint

SAVER = "ZeroWorkerPartitions"


class WorkerPartitions(tf.__internal__.tracking.Trackable):
    """The checkpoint node through which the chief's save merges every worker's partition
    file (a registered saver: it holds no value itself).

    Args:
      strategy: the multi_worker_mirrored strategy the partitioned variables live in.
      tasks, task: every worker's name ("worker-0", ...) in merge order and this one's
        (default: read from the strategy's cluster resolver).
    """

    def __init__(self, strategy, tasks: list[str] | None = None, task: str | None = None):
        self.strategy = strategy
        if tasks is None or task is None:
            resolver = strategy.cluster_resolver
            jobs = resolver.cluster_spec().as_dict()
            tasks = [f"{job}-{i}" for job in ("chief", "worker") for i in range(_task_count(jobs.get(job)))]
            task = f"{resolver.task_type}-{resolver.task_id}"
        self.tasks, self.task = list(tasks), task
        self.merging: list[str] = []  # the files the chief's next save merges in

    @classmethod
    def find(cls, objects: dict) -> "WorkerPartitions | None":
        """A WorkerPartitions where `objects` (checkpoint children) hold partitioned
        optimizer state whose replicas live on several workers; None otherwise."""
        for value in _partition_values(objects.values()):
            if not zero_checkpoint.holds_every_replica(value.variable):
                return cls(zero_checkpoint._tf_variable(value.variable).distribute_strategy)  # pylint: disable=protected-access
        return None

    def prefix(self, directory: str, step: int, task: str) -> str:
        """Where `task` writes its partitions of checkpoint `step`."""
        return os.path.join(directory, f"ckpt-{step}_partitions", task, "part")

    def save(self, root, directory: str, step: int, is_chief: bool, save: Callable[[], str | None]):
        """Every worker: writes its partitions, waits for every other, then runs `save`
        (the chief: its checkpoint, which merges them in; the others: their scratch save,
        so that every collective a save needs is reached). Returns what `save` returns."""
        mine = self.prefix(directory, step, self.task)
        failure = self._write_own(root, mine)
        failed = count_failed_workers(self.strategy, failure is not None)
        if failed:
            _remove(os.path.dirname(mine))
        if failure is not None:
            raise WorkdirError(f"Could not write this worker's ({self.task}) optimizer partitions of "
                               f"checkpoint {step} to {mine} ({failure}). Free some space or use "
                               "another --workdir; the previous checkpoint is intact.")
        if failed:
            raise WorkdirError(f"{failed} worker(s) could not write their optimizer partitions of "
                               f"checkpoint {step} under {directory} (their own error names why); "
                               "nothing was saved, the previous checkpoint is intact.")
        if not is_chief:
            with zero_checkpoint.saving(zero_checkpoint.SKIP):
                return save()
        self.merging = [self.prefix(directory, step, task) for task in self.tasks]
        try:
            self._check_visible(directory)
            with zero_checkpoint.saving(zero_checkpoint.SKIP):
                return save()
        finally:  # the merge moved the files in; after a failure they are not kept
            self.merging = []
            _rmtree(os.path.dirname(os.path.dirname(mine)))

    def _write_own(self, root, prefix: str) -> str | None:
        """This worker's slices of every partitioned slot, alone in a V2 checkpoint at
        `prefix`; the reason it failed, or None."""
        _rmtree(os.path.dirname(prefix))  # a killed save's leftovers
        keys = private_api.checkpoint_keys(root, lambda t: isinstance(t, zero_checkpoint.PartitionValue),
                                           zero_checkpoint.VALUE)
        try:
            tf.io.gfile.makedirs(os.path.dirname(prefix))
            with zero_checkpoint.saving(zero_checkpoint.LOCAL):
                saveables = [s for value, key in keys.items() for s in value.saveables(key)]
                private_api.write_saveables(saveables, prefix)
        except (OSError, tf.errors.OpError) as e:
            return getattr(e, "strerror", None) or str(getattr(e, "message", e)).splitlines()[0][:200]
        return None

    def _check_visible(self, directory: str) -> None:
        for task, prefix in zip(self.tasks, self.merging):
            if not tf.io.gfile.exists(prefix + ".index"):
                raise WorkdirError(
                    f"Worker {task} wrote its optimizer partitions to {prefix}, which the chief "
                    f"cannot see: the workdir ({os.path.dirname(directory)}) must be on a filesystem "
                    "every worker sees (NFS, GCS, ...), as the chief merges every worker's file into "
                    "its checkpoint. Give every worker the same shared --workdir.")


def _rmtree(directory: str) -> None:
    """Removes `directory` if it is there (a local path or a filesystem TensorFlow knows: gs://)."""
    try:
        if tf.io.gfile.exists(directory):
            tf.io.gfile.rmtree(directory)
    except (OSError, tf.errors.OpError):  # another worker removed it first
        pass


def _remove(directory: str) -> None:
    """Removes this worker's partition directory, and their parent once it is empty."""
    _rmtree(directory)
    parent = os.path.dirname(directory)
    try:
        if tf.io.gfile.exists(parent) and not tf.io.gfile.listdir(parent):
            tf.io.gfile.rmtree(parent)
    except (OSError, tf.errors.OpError):  # another worker's files are still there, or it is gone
        pass


def _task_count(addresses) -> int:
    if addresses is None:
        return 0
    return len(addresses) if not isinstance(addresses, dict) else max(addresses) + 1


def _partition_values(objects) -> list:
    """Every PartitionValue under the trackables `objects`."""
    found, seen = [], set()
    stack = list(objects)
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, tf.__internal__.tracking.Trackable):
            continue
        seen.add(id(node))
        if isinstance(node, zero_checkpoint.PartitionValue):
            found.append(node)
            continue
        stack.extend(tf.train.TrackableView(node).children(node).values())
    return found


private_api.register_merge_saver(SAVER, lambda t: isinstance(t, WorkerPartitions),
                                 lambda partitions: [p for w in partitions for p in w.merging])


# -- reading a checkpoint's index: which file holds which slice ------------------------

def stored_slices(prefix: str) -> dict:
    """{key: [(data file number, (start, ...), (length, ...)), ...]} for every key of checkpoint
    `prefix` that is stored as slices, read from its index (TensorFlow's reader shows
    only whole tensors).

    Example:
        >>> stored_slices("/run/checkpoints/ckpt-6")["optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE"]
        [(0, (0, 0), (16, 37)), (1, (16, 0), (16, 37))]
    """
    from tensorflow.core.protobuf import tensor_bundle_pb2  # pylint: disable=import-outside-toplevel

    found: dict = {}
    for key, value in _table_entries(prefix + ".index"):
        if not key or key[:1] != b"\x00":  # the header, or a whole tensor's (or slices' list) entry
            continue
        name, starts, lengths = _decode_slice_key(key)
        entry = tensor_bundle_pb2.BundleEntryProto.FromString(value)
        found.setdefault(name, []).append((entry.shard_id, starts, lengths))
    return found


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _block(data: bytes):
    """(key, value) of one table block (LevelDB's format: shared-prefix keys, restarts)."""
    restarts = struct.unpack("<I", data[-4:])[0]
    limit, pos, key = len(data) - 4 * (restarts + 1), 0, b""
    while pos < limit:
        shared, pos = _varint(data, pos)
        own, pos = _varint(data, pos)
        size, pos = _varint(data, pos)
        key = key[:shared] + data[pos:pos + own]
        pos += own
        yield key, data[pos:pos + size]
        pos += size


def _table_entries(path: str):
    """Every (key, value) of a TensorFlow table file (a checkpoint's .index)."""
    raw = tf.io.gfile.GFile(path, "rb").read()
    footer, pos = raw[-48:], 0
    for _ in range(2):  # the metaindex handle, then the index handle
        offset, pos = _varint(footer, pos)
        size, pos = _varint(footer, pos)
    for _, handle in _block(raw[offset:offset + size]):
        start, at = _varint(handle, 0)
        length, _ = _varint(handle, at)
        yield from _block(raw[start:start + length])


def _decode_slice_key(key: bytes) -> tuple[str, tuple, tuple]:
    """A slice's key (TensorFlow's EncodeTensorNameSlice, OrderedCode): 0, the name, the
    rank, then (start, length) per dimension."""
    end = key.index(b"\x00\x01", 1)
    name = key[1:end].replace(b"\x00\xff", b"\x00").decode()
    pos = end + 2
    width = key[pos]  # the rank: a length byte, then that many big-endian bytes
    rank = int.from_bytes(key[pos + 1:pos + 1 + width], "big")
    pos += 1 + width
    numbers = []
    for _ in range(2 * rank):
        number, pos = _signed_increasing(key, pos)
        numbers.append(number)
    return name, tuple(numbers[0::2]), tuple(numbers[1::2])


def _signed_increasing(key: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's WriteSignedNumIncreasing read back (lengths up to 7 bytes)."""
    negative = not key[pos] & 0x80
    first = key[pos] ^ 0xFF if negative else key[pos]
    length = 0
    while length < 8 and first & (0x80 >> length):  # the length: the header's leading ones
        length += 1
    raw = bytes((b ^ 0xFF) if negative else b for b in key[pos:pos + length])
    value = int.from_bytes(raw, "big") & ((1 << (8 * length - length - 1)) - 1)
    return (~value if negative else value), pos + length
