"""Bit-exact packing of compressed payloads into int32, the dtype every collective carries.

TensorFlow's collective all_gather refuses int8/uint8/bool/bfloat16 payloads, so tfpar
sends int32 words: four int8 values per word, 32 sign bits per word, float32 scales and
values bitcast. Every function here is pure and runs inside or outside tf.function.

Example:
    >>> words = pack_int8(tf.constant([1, -2, 3, -4, 5], tf.int8))   # 2 words
    >>> unpack_int8(words, 5)
    <tf.Tensor: shape=(5,), dtype=int8, numpy=array([ 1, -2,  3, -4,  5], dtype=int8)>
"""

from __future__ import annotations

import tensorflow as tf


def words_for(count: int, per_word: int) -> int:
    return -(-count // per_word)


def _pad_to(x: tf.Tensor, multiple: int) -> tf.Tensor:
    size = x.shape[0]
    return tf.pad(x, [[0, words_for(size, multiple) * multiple - size]])


def pack_int8(values: tf.Tensor) -> tf.Tensor:
    """int8 [n] -> int32 [ceil(n/4)] (zero padding at the end)."""
    padded = tf.reshape(_pad_to(values, 4), [-1, 4])
    return tf.reshape(tf.bitcast(padded, tf.int32), [-1])


def unpack_int8(words: tf.Tensor, count: int) -> tf.Tensor:
    """int32 [..., w] -> int8 [..., count]."""
    values = tf.bitcast(words, tf.int8)  # [..., w, 4]
    flat = tf.reshape(values, tf.concat([tf.shape(words)[:-1], [-1]], 0))
    return flat[..., :count]


_BIT_VALUES = [1 << i for i in range(31)] + [-(1 << 31)]  # a tensor only when used: importing
                                                         # tfpar must not start TensorFlow


def _bits() -> tf.Tensor:
    return tf.constant(_BIT_VALUES, tf.int32)


def pack_bits(bits: tf.Tensor) -> tf.Tensor:
    """bool [n] -> int32 [ceil(n/32)], bit i of word j = bits[32 j + i]."""
    padded = tf.reshape(_pad_to(tf.cast(bits, tf.int32), 32), [-1, 32])
    return tf.reduce_sum(padded * _bits(), axis=1)  # distinct bits: the sum is a bitwise OR


def unpack_bits(words: tf.Tensor, count: int) -> tf.Tensor:
    """int32 [..., w] -> bool [..., count]."""
    bits = tf.not_equal(tf.bitwise.bitwise_and(words[..., None], _bits()), 0)  # [..., w, 32]
    flat = tf.reshape(bits, tf.concat([tf.shape(words)[:-1], [-1]], 0))
    return flat[..., :count]


def float_words(values: tf.Tensor) -> tf.Tensor:
    """float32 [...] -> int32 [...] with the same bits."""
    return tf.bitcast(tf.cast(values, tf.float32), tf.int32)


def word_floats(words: tf.Tensor) -> tf.Tensor:
    return tf.bitcast(words, tf.float32)
