"""All-gather of int32 payload words that arrive bit for bit on every strategy.

TPUStrategy gathers a dtype its CrossReplicaSum supports as value x one-hot(replica) summed
over the replicas (tensorflow/python/distribute/tpu_strategy.py, `_all_gather_tensor`).
That is exact for int32 (one non-zero term per element) but not for float32 bit patterns:
NaN x 0 is NaN and poisons every other replica's word, Inf x 0 too, -0.0 + 0.0 is +0.0,
and the TPU flushes subnormals (every word below 2^23, i.e. most top-k indices) to zero.
The other strategies gather with CollectiveGatherV2, which copies bits; MirroredStrategy
sends int32 through a copy to one device instead, so there the words travel as float32 bits.

Example:
    >>> everyone = all_gather_words(tf.distribute.get_replica_context(), words[None])
    >>> everyone.shape                                    # [R, number of words], int32
"""

from __future__ import annotations

import tensorflow as tf


def gathers_by_sum(context) -> bool:
    """True where `context.all_gather` is a masked cross-replica sum (TPUStrategy)."""
    from tensorflow.python.distribute import tpu_strategy  # pylint: disable=g-direct-tensorflow-import

    tpu_context = getattr(tpu_strategy, "_TPUReplicaContext", ())
    tpu_extended = getattr(tpu_strategy, "TPUExtended", ())
    extended = getattr(getattr(context, "strategy", None), "extended", None)
    return isinstance(context, tpu_context) or isinstance(extended, tpu_extended)


def all_gather_words(context, words: tf.Tensor) -> tf.Tensor:
    """Gathers int32 `words` ([1, W] per replica) into [R, W] int32, every bit kept.

    Args:
      context: the replica context (inside `strategy.run`, inside a tf.function).
      words: int32 payload words; any bit pattern (NaN, Inf, -0.0, subnormal as float).

    Returns:
      The words of every replica along axis 0, in replica order.
    """
    if words.dtype != tf.int32:
        raise TypeError(f"all_gather_words gathers int32 words, got {words.dtype.name}.")
    if gathers_by_sum(context):
        return context.all_gather(words, axis=0)  # int32 mask-and-sum: exact
    gathered = context.all_gather(tf.bitcast(words, tf.float32), axis=0)
    return tf.bitcast(gathered, tf.int32)
