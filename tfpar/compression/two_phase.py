"""Two-phase 1-bit compressed all-reduce (mean), error compensation on both sides.

With R replicas each vector (padded to R chunks of c entries, c a multiple of 32) goes:

1. every replica adds its worker error, compresses each chunk to signs + one scale
   (||chunk|| / sqrt(c), DeepSpeed's choice: the scaled signs keep the norm) and keeps
   what that missed as its new worker error;
2. all-to-all: replica j receives chunk j from everyone (TensorFlow's CollectiveAllToAllV2,
   see tfpar.compression.collectives) and averages the R decoded chunks;
3. replica j adds its server error to that average, compresses it again, keeps what
   that missed as its server error, and the compressed chunks are all-gathered.

A replica hands 4R + c/8 * R bytes to the all-to-all and 4 + c/8 (+ 8, the shape
exchange) to the all-gather; on a ring it transmits about 2(R-1)/R of one compressed
copy: flat in R, where an all-gather of every replica's whole payload grows with R-1.

Example (replica context):
    >>> mean = compressed_mean(context, flat, worker_error, server_error, replicas=2,
    ...                        communicate=True)
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.compression import packing
from tfpar.compression.collectives import all_to_all


def padded_size(size: int, replicas: int) -> int:
    """Entries after padding `size` to R chunks of a multiple of 32."""
    unit = 32 * replicas
    return -(-size // unit) * unit


def payload_bytes(size: int, replicas: int) -> dict:
    """Bytes one replica hands to each collective for a vector of `size` entries."""
    chunk_words = padded_size(size, replicas) // replicas // 32
    return {"all_to_all": 4 * replicas * (1 + chunk_words), "all_gather": 4 * (1 + chunk_words),
            "(size exchange)": 8}


def _encode_rows(rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """float32 [R, c] -> (int32 words [R, 1 + c/32], what they decode to [R, c])."""
    c = int(rows.shape[1])
    scales = tf.norm(rows, axis=1) / (c ** 0.5)                                    # [R]
    positive = rows >= 0
    bits = tf.reshape(tf.cast(positive, tf.int32), [rows.shape[0], c // 32, 32])
    words = tf.reduce_sum(bits * packing._bits(), axis=-1)  # pylint: disable=protected-access
    decoded = tf.where(positive, 1.0, -1.0) * scales[:, None]
    return tf.concat([packing.float_words(scales)[:, None], words], 1), decoded


def _decode_rows(words: tf.Tensor, c: int) -> tf.Tensor:
    """int32 [R, 1 + c/32] -> float32 [R, c]."""
    scales = packing.word_floats(words[:, 0])
    return tf.where(packing.unpack_bits(words[:, 1:], c), 1.0, -1.0) * scales[:, None]


def compressed_mean(context, flat: tf.Tensor, worker_error: tf.Variable, server_error: tf.Variable,
                    replicas: int, communicate: bool, all_gather) -> tf.Tensor:
    """The mean over replicas of `flat` ([P], P = padded_size), 1-bit both ways; updates the
    worker error ([P]) and server error ([P / R]). `all_gather`: int32 [1, w] -> [R, w]."""
    c = int(flat.shape[0]) // replicas
    chunks = tf.reshape(flat + worker_error, [replicas, c])                       # [R, c]
    words, sent = _encode_rows(chunks)
    worker_error.assign(tf.reshape(chunks - sent, [-1]))
    received = all_to_all(context, words) if communicate else words              # [R, 1 + c/32]
    average = tf.reduce_mean(_decode_rows(received, c), axis=0) + server_error   # [c]
    server_words, server_sent = _encode_rows(average[None])
    server_error.assign(average - server_sent[0])
    everyone = all_gather(server_words) if communicate else server_words          # [R, 1 + c/32]
    return tf.reshape(_decode_rows(everyone, c), [-1])
