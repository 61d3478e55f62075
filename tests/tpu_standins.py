"""Stand-ins for what only a TPU has: its gather semantics, its topology, its machine.

- `mask_and_sum_gather`: TPUStrategy's all_gather formula on stacked replica values, with the
  TPU's float arithmetic (subnormals flushed to zero), runnable eagerly and under XLA.
- `MaskAndSumContext`: TensorFlow's own `_TPUReplicaContext` (its all_gather code runs as
  is) whose cross-replica sum, the TPU's CrossReplicaSum, is a MirroredStrategy all-reduce
  with subnormals flushed. Used inside `strategy.run` on logical CPU devices.
- `FakeResolver`: a TPUClusterResolver's answers for an in-memory slice topology.
- `fake_machine`: a /sys and /dev tree in a temporary folder.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.python.distribute import tpu_strategy


def flush_subnormals(value: tf.Tensor) -> tf.Tensor:
    """What a TPU does to a float subnormal in arithmetic: it becomes a zero of its sign."""
    if not value.dtype.is_floating:
        return value
    tiny = tf.constant(_smallest_normal(value.dtype), value.dtype)
    return tf.where(tf.abs(value) < tiny, value * 0, value)


def _smallest_normal(dtype: tf.DType) -> float:
    import numpy as np

    return float(np.finfo(dtype.as_numpy_dtype).tiny)


def mask_and_sum_gather(stacked: tf.Tensor) -> tf.Tensor:
    """TPU all_gather of `stacked[r]` from every replica r, as every replica receives it.

    Each replica multiplies its value by its one-hot replica mask, then CrossReplicaSum adds
    the R products (tpu_strategy.py `_all_gather_tensor`), in the TPU's float arithmetic.
    """
    replicas = int(stacked.shape[0])
    total = None
    for r in range(replicas):
        mask = tf.reshape(tf.one_hot(r, replicas), [replicas] + [1] * (stacked.shape.rank - 1))
        term = flush_subnormals(stacked[r][None] * tf.cast(mask, stacked.dtype))
        total = term if total is None else flush_subnormals(total + term)
    return total


class MaskAndSumContext(tpu_strategy._TPUReplicaContext):  # pylint: disable=protected-access
    """TensorFlow's TPU replica context, its CrossReplicaSum done by a Mirrored replica."""

    def __init__(self, inner: tf.distribute.ReplicaContext):
        super().__init__(inner.strategy, inner.replica_id_in_sync_group)
        self._inner = inner
        self.summed = []  # (dtype, shape) handed to the "CrossReplicaSum"

    def all_reduce(self, reduce_op, value, options=None):
        self.summed.append((value.dtype, tuple(value.shape.as_list())))
        return self._inner.all_reduce(reduce_op, flush_subnormals(value), options)


class FakeResolver:
    """What tfpar asks a TPUClusterResolver after initialising, for an in-memory slice."""

    def __init__(self, tpu: str = "local", hosts: int = 1, cores_per_host: int = 8):
        self.tpu = tpu
        self.hosts = hosts
        self.cores_per_host = cores_per_host

    def get_tpu_system_metadata(self):
        return _Metadata(self.hosts, self.hosts * self.cores_per_host)


class _Metadata:  # the fields of tf.tpu.experimental.TPUSystemMetadata that tfpar reads
    def __init__(self, num_hosts: int, num_cores: int):
        self.num_hosts = num_hosts
        self.num_cores = num_cores


def fake_machine(root, *, pci=(), dev=(), dev_dirs=()) -> str:
    """Writes /sys/bus/pci/devices/<n>/{vendor,device} and /dev entries under `root`.

    `pci`: (vendor, device) pairs such as ("0x1ae0", "0x0063") for a TPU v5e chip.
    """
    root = str(root)
    for i, (vendor, device) in enumerate(pci):
        folder = os.path.join(root, "sys/bus/pci/devices", f"0000:00:{i:02x}.0")
        os.makedirs(folder, exist_ok=True)
        for name, value in (("vendor", vendor), ("device", device)):
            with open(os.path.join(folder, name), "w", encoding="ascii") as f:
                f.write(value + "\n")
    for name in dev:
        path = os.path.join(root, "dev", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w", encoding="ascii").close()
    for name in dev_dirs:
        os.makedirs(os.path.join(root, "dev", name), exist_ok=True)
    return root
