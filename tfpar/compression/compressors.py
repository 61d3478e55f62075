"""Gradient compressors: what one replica puts on the wire for one gradient tensor.

Three families, by the collective they use:
- ReduceCompressor: a cheaper dtype, summed by one all-reduce (none, fp16, bf16);
- GatherCompressor: a packed int32 payload per replica, all-gathered and decoded by every
  replica (int8, topk, sign); with error feedback the part not sent is kept and added to
  the next step's gradient;
- PowerSGD: two low-rank all-reduces per matrix (see tfpar.compression.powersgd).

Every method runs in the replica context of a traced step; `payload_bytes` is the
analytic size per replica that tests compare with the collectives in the traced graph.

Example:
    >>> topk = TopK(0.01)
    >>> words = topk.encode(gradient)                    # int32 [2k]: indices, values
    >>> total = topk.decode_sum(gathered_words, size)    # [R, 2k] -> dense sum
"""

from __future__ import annotations

import abc
import math

import tensorflow as tf

from tfpar.compression import packing
from tfpar.errors import TfparError


class CompressionError(TfparError, ValueError):
    """A compression option that cannot work with this model or strategy."""


class Compressor(abc.ABC):
    """Base class. `name` is what configs and the progress line call it."""

    name = "base"
    error_feedback = False

    def applies_to(self, shape: tf.TensorShape) -> bool:
        """Whether this compressor can take a tensor of `shape` (else it goes dense)."""
        return True

    @abc.abstractmethod
    def payload_bytes(self, size: int, shape: tf.TensorShape | None = None) -> int:
        """Bytes this replica hands to collectives for a tensor of `size` elements."""

    def __repr__(self) -> str:
        return self.name


class ReduceCompressor(Compressor):
    """Summed by all-reduce in `wire_dtype`; pre-divided by the replica count so that fp16
    cannot overflow on the sum, multiplied back in float32 afterwards."""

    wire_dtype = tf.float32
    # (what goes in bfloat16, the fix) for the refusal on GPUs, whose NCCL cannot sum it
    bfloat16_on_gpus = ("bf16 gradients", "compression 'fp16' there (same 2x saving, pre-scaled so it "
                                          "cannot overflow)")

    def encode(self, x: tf.Tensor, replicas: int) -> tf.Tensor:
        if self.wire_dtype == tf.float32:
            return x
        return tf.cast(x / replicas, self.wire_dtype)

    def decode(self, summed: tf.Tensor, replicas: int) -> tf.Tensor:
        if self.wire_dtype == tf.float32:
            return summed
        return tf.cast(summed, tf.float32) * replicas

    def payload_bytes(self, size, shape=None):
        return size * self.wire_dtype.size


class NoCompression(ReduceCompressor):
    """On the wire: the float32 gradient, one all-reduce (exactly what tf.distribute does)."""

    name = "none"


class FP16(ReduceCompressor):
    """On the wire: float16 gradient / replicas, one all-reduce; 2x fewer bytes."""

    name = "fp16"
    wire_dtype = tf.float16


class BF16(ReduceCompressor):
    """On the wire: bfloat16 gradient / replicas, one all-reduce; 2x fewer bytes.

    NCCL cannot sum bfloat16: refused on GPUs (use fp16 there); fine on CPU collectives."""

    name = "bf16"
    wire_dtype = tf.bfloat16


class GatherCompressor(Compressor):
    """An int32 payload per replica, all-gathered; every replica decodes and sums them."""

    @abc.abstractmethod
    def encode(self, x: tf.Tensor) -> tf.Tensor:
        """float32 [n] -> int32 [payload_words(n)]."""

    @abc.abstractmethod
    def decode_sum(self, words: tf.Tensor, size: int) -> tf.Tensor:
        """int32 [R, payload_words(size)] -> float32 [size], the sum of the R contributions."""

    @abc.abstractmethod
    def payload_words(self, size: int) -> int:
        """int32 words in one replica's payload for a tensor of `size` elements."""

    def payload_bytes(self, size, shape=None):
        return 4 * self.payload_words(size)


class Int8(GatherCompressor):
    """On the wire: 8-bit stochastically rounded values (4 per int32) plus one float32
    scale; unbiased (QSGD-style), so no error feedback; ~4x fewer bytes."""

    name = "int8"

    def __init__(self, seed: int | None = None):
        self.seed = seed

    def payload_words(self, size):
        return 1 + packing.words_for(size, 4)

    def encode(self, x):
        scale = tf.maximum(tf.reduce_max(tf.abs(x)), 1e-30)
        noise = tf.random.uniform(tf.shape(x), seed=self.seed)
        q = tf.clip_by_value(tf.floor(x / scale * 127.0 + noise), -127.0, 127.0)
        scale_word = packing.float_words(scale)[None]
        return tf.concat([scale_word, packing.pack_int8(tf.cast(q, tf.int8))], 0)

    def decode_sum(self, words, size):
        scales = packing.word_floats(words[:, 0])                                 # [R]
        values = tf.cast(packing.unpack_int8(words[:, 1:], size), tf.float32)   # [R, n]
        return tf.reduce_sum(values * (scales / 127.0)[:, None], axis=0)


class TopK(GatherCompressor):
    """On the wire: the k = ratio * n largest-magnitude entries as int32 indices and
    float32 values (2k words); the rest stays behind as error feedback."""

    name = "topk"
    error_feedback = True

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise CompressionError(f"topk ratio must be in (0, 1], got {ratio}.")
        self.ratio = ratio

    def k(self, size: int) -> int:
        return max(1, min(size, int(math.ceil(self.ratio * size))))

    def payload_words(self, size):
        return 2 * self.k(size)

    def encode(self, x):
        k = self.k(x.shape[0])
        _, indices = tf.math.top_k(tf.abs(x), k=k, sorted=False)
        return tf.concat([indices, packing.float_words(tf.gather(x, indices))], 0)

    def decode_sum(self, words, size):
        k = self.k(size)
        indices = tf.reshape(words[:, :k], [-1, 1])
        values = tf.reshape(packing.word_floats(words[:, k:]), [-1])
        return tf.tensor_scatter_nd_add(tf.zeros([size], tf.float32), indices, values)

    def __repr__(self):
        return f"topk({self.ratio:g})"


class Sign(GatherCompressor):
    """On the wire: one sign bit per entry (32 per int32) plus one float32 scale, the mean
    magnitude; what the signs miss stays behind as error feedback (EF-signSGD); ~32x."""

    name = "sign"
    error_feedback = True

    def payload_words(self, size):
        return 1 + packing.words_for(size, 32)

    def encode(self, x):
        scale = tf.reduce_mean(tf.abs(x))
        return tf.concat([packing.float_words(scale)[None], packing.pack_bits(x >= 0)], 0)

    def decode_sum(self, words, size):
        scales = packing.word_floats(words[:, 0])                                # [R]
        signs = tf.where(packing.unpack_bits(words[:, 1:], size), 1.0, -1.0)    # [R, n]
        return tf.reduce_sum(signs * scales[:, None], axis=0)
