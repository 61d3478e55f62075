"""How DiLoCo's outer gradients travel: float32, fp16, or 8- and 4-bit blocks with error feedback.

The outer gradient of a round (the anchor minus a replica's weights) is gradient-like and
is sent once per round, so a coarse code costs little: Streaming DiLoCo (Douillard et al.,
2025) sends it in 4 bits. Every code but float32 keeps what it did not send (error
feedback): each replica adds its remainder to its next round's outer gradient, so nothing
is lost, only delayed by a round.

- `none`: float32, one all-reduce (the mean, exact).
- `fp16`: the outer gradient / R in float16, one all-reduce (2x fewer bytes).
- `int8`, `int4`: the replica's outer gradients, flattened into one vector, in blocks of
  `BLOCK` values, each block an absmax float32 scale and 8-bit (4 per int32 word) or 4-bit
  (8 per word) values rounded to nearest; all-gathered as int32 words and decoded by every
  replica (TensorFlow's collectives cannot sum int8). ~3.9x and ~7.5x fewer bytes than
  float32 for R = 2; an all-gather's link bytes grow with R where an all-reduce's do not.

Example:
    >>> code = outer_code("int4")
    >>> means, remainder = code.mean(context, deltas, remainder)   # replica context
    >>> code.payload_bytes(size=1_000_000)                          # bytes one replica hands on
    515724
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfpar.compression import packing
from tfpar.errors import SyncError

BLOCK = 256  # values per scale: 1/8 of a bit per value for the float32 scale


class OuterCode:
    """float32: the mean by one all-reduce, nothing kept behind.

    A code is two halves, so that its collective can run apart from its coding (DiLoCo's
    overlapped exchange): `encode` (local: what this replica sends, what that decodes to)
    and `exchange` (the collective and the decoding: the mean over replicas)."""

    name = "none"
    error_feedback = False
    collective = "reduce"  # what carries it: "reduce" (all-reduce) or "gather" (all-gather)
    shape_exchange_bytes = 0  # what the collective hands on besides the payload

    def mean(self, context, deltas: Sequence[tf.Tensor], remainder: tf.Tensor | None):
        """(the mean over replicas of `deltas` as this code delivers it, this replica's new
        remainder or None). `remainder`: a flat float32 vector of every delta's size."""
        if not self.error_feedback:  # float32: one batched all-reduce of the tensors as they are
            return context.all_reduce(tf.distribute.ReduceOp.MEAN, list(deltas)), None
        flat = flatten(deltas) + remainder
        sent, decoded = self.encode(flat, context.num_replicas_in_sync)
        return unflatten(self.exchange(context, sent, flat.shape[0]), deltas), flat - decoded

    def encode(self, flat: tf.Tensor, replicas: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(what this replica sends for the flat vector `flat`, what that decodes to)."""
        return flat, flat

    def exchange(self, context, sent: tf.Tensor, size: int) -> tf.Tensor:
        """The mean over replicas of what they sent, decoded: float32 [size]."""
        return context.all_reduce(tf.distribute.ReduceOp.MEAN, sent)

    def sent_spec(self, size: int) -> tuple[list[int], tf.DType]:
        """The shape and dtype of what `encode` gives for `size` values."""
        return [size], tf.float32

    def payload_bytes(self, size: int) -> int:
        """Bytes one replica hands to collectives for `size` values."""
        return 4 * size

    def __repr__(self) -> str:
        return self.name


class HalfCode(OuterCode):
    """float16 of (outer gradient + remainder) / R, summed by one all-reduce."""

    name = "fp16"
    error_feedback = True

    def encode(self, flat, replicas):
        sent = tf.cast(flat / replicas, tf.float16)
        return sent, tf.cast(sent, tf.float32) * replicas

    def exchange(self, context, sent, size):
        return tf.cast(context.all_reduce(tf.distribute.ReduceOp.SUM, sent), tf.float32)

    def sent_spec(self, size):
        return [size], tf.float16

    def payload_bytes(self, size):
        return 2 * size


class BlockCode(OuterCode):
    """`bits`-bit values in blocks of `BLOCK`, each with its absmax float32 scale."""

    error_feedback = True
    collective = "gather"
    shape_exchange_bytes = 8  # an all-gather first exchanges its input's shape, [1, W] in int32

    def __init__(self, bits: int):
        self.bits = bits
        self.name = f"int{bits}"
        self.levels = 2 ** (bits - 1) - 1  # symmetric: int8 [-127, 127], int4 [-7, 7]
        self.per_word = 32 // bits

    def payload_words(self, size: int) -> int:
        blocks = packing.words_for(size, BLOCK)
        return blocks + packing.words_for(blocks * BLOCK, self.per_word)

    def payload_bytes(self, size):
        return 4 * self.payload_words(size)

    def sent_spec(self, size):
        return [self.payload_words(size)], tf.int32

    def encode(self, flat: tf.Tensor, replicas: int = 1) -> tuple[tf.Tensor, tf.Tensor]:
        """(int32 words, what they decode to) for a flat float32 vector."""
        size = flat.shape[0]
        blocks = tf.reshape(tf.pad(flat, [[0, packing.words_for(size, BLOCK) * BLOCK - size]]), [-1, BLOCK])
        scales = tf.reduce_max(tf.abs(blocks), axis=1) / self.levels
        safe = tf.where(scales > 0, scales, tf.ones_like(scales))
        q = tf.clip_by_value(tf.round(blocks / safe[:, None]), -self.levels, self.levels)
        decoded = tf.reshape(q * scales[:, None], [-1])[:size]
        values = tf.cast(tf.reshape(q, [-1]), tf.int32)
        words = pack_int8(values) if self.bits == 8 else pack_int4(values)
        return tf.concat([packing.float_words(scales), words], 0), decoded

    def decode(self, words: tf.Tensor, size: int) -> tf.Tensor:
        """int32 [R, W] -> float32 [R, size], each replica's decoded vector."""
        blocks = packing.words_for(size, BLOCK)
        scales = packing.word_floats(words[:, :blocks])                           # [R, blocks]
        count = blocks * BLOCK
        values = unpack_int8(words[:, blocks:], count) if self.bits == 8 else unpack_int4(words[:, blocks:], count)
        values = tf.reshape(tf.cast(values, tf.float32), [-1, blocks, BLOCK]) * scales[:, :, None]
        return tf.reshape(values, [tf.shape(words)[0], count])[:, :size]

    def exchange(self, context, sent, size):
        from tfpar.compression.collectives import all_gather_words  # pylint: disable=import-outside-toplevel

        everyone = all_gather_words(context, sent[None])                           # [R, W]
        return tf.reduce_mean(self.decode(everyone, size), axis=0)


CODES = ("none", "fp16", "int8", "int4")


def outer_code(name: str | None) -> OuterCode:
    """The code named `name` (None: float32)."""
    made = {"none": OuterCode, "fp16": HalfCode, "int8": lambda: BlockCode(8), "int4": lambda: BlockCode(4)}
    if (name or "none") not in made:
        raise SyncError(f"DiLoCo compression={name!r}: give one of {', '.join(CODES)} "
                        "(how the outer gradient travels; int4 is Streaming DiLoCo's 4 bits).")
    return made[name or "none"]()


def pack_int8(values: tf.Tensor) -> tf.Tensor:
    """int32 values in [-127, 127] -> int32 words, 4 a word."""
    return packing.pack_int8(tf.cast(values, tf.int8))


def unpack_int8(words: tf.Tensor, count: int) -> tf.Tensor:
    return packing.unpack_int8(words, count)


_NIBBLE_SHIFTS = [4 * i for i in range(8)]


def pack_int4(values: tf.Tensor) -> tf.Tensor:
    """int32 values in [-7, 7] -> int32 words, 8 a word (value + 8 in nibble i of word j
    for value 8 j + i; the count must be a multiple of 8)."""
    nibbles = tf.reshape(values + 8, [-1, 8])
    return tf.reduce_sum(tf.bitwise.left_shift(nibbles, _NIBBLE_SHIFTS), axis=1)  # disjoint bits: an OR


def unpack_int4(words: tf.Tensor, count: int) -> tf.Tensor:
    """int32 [..., w] -> int32 [..., count] in [-7, 7]."""
    nibbles = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[..., None], _NIBBLE_SHIFTS), 15) - 8
    flat = tf.reshape(nibbles, tf.concat([tf.shape(words)[:-1], [-1]], 0))
    return flat[..., :count]


def flatten(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def unflatten(flat: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    sizes = [int(t.shape.num_elements()) for t in like]
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(flat, sizes), like)]
