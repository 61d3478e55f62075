"""The one collective tf.distribute does not expose, an all-to-all, and an all-gather that
runs inside control flow: on TensorFlow's own runtime.

`ReplicaContext` offers all_reduce and all_gather only. TensorFlow 2.21 has the op
(`CollectiveAllToAllV2`, CPU ring and GPU NCCL kernels) and every collective strategy
(MirroredStrategy, MultiWorkerMirroredStrategy) holds one `CollectiveReplicaLauncher` per
local replica with the group key, group size, device, ordering token and the
call-time instance keys that its own all_reduce uses. `all_to_all` issues the op with
exactly those, so it is ordered with, and keyed like, the strategy's other collectives:
nothing home-made travels on the wire. `all_gather_words` calls the same launcher's
all_gather: the strategy's own ops, but callable inside a `tf.cond` branch, where
`ReplicaContext.all_gather` (a merge_call) is refused by MirroredStrategy.

Example (replica context, inside tf.function):
    >>> received = all_to_all(context, chunks)   # chunks [R, w]: row j goes to replica j
    >>> # received [R, w]: row i came from replica i
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.compression.compressors import CompressionError
from tfpar.strategy import private_api


def all_to_all(context, tensor: tf.Tensor) -> tf.Tensor:
    """Row j of `tensor` ([R, ...]) goes to replica j; returns row i from replica i."""
    return private_api.launcher_all_to_all(_launcher(context), tensor)


def all_gather_words(context, words: tf.Tensor) -> tf.Tensor:
    """int32 `words` [1, W] of every replica -> [R, W], bit for bit (sent as float32 bits,
    which CollectiveGatherV2 copies exactly; see compression/gather.py)."""
    gathered = private_api.launcher_all_gather(_launcher(context), tf.bitcast(words, tf.float32))
    return tf.bitcast(gathered, tf.int32)


def _launcher(context):
    launcher = private_api.collective_launcher(context)
    if launcher is None:
        raise CompressionError(
            f"The two-phase compressed all-reduce (onebit_adam) needs a collective strategy: "
            f"{type(context.strategy).__name__} has no collective launchers. Train it under "
            "mirrored or multi_worker_mirrored, or pick another compressor.")
    return launcher
