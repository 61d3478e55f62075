"""PowerSGD (Vogels et al., 2019): rank-r gradient compression with two all-reduces.

For each gradient matrix M (a tensor reshaped to its most square 2-D view, e.g. an attention
output kernel [heads, head_dim, dim] to [heads * head_dim, dim]) with error feedback,
every replica computes P = M Q and all-reduces it, orthonormalises the sum to P^, then
computes Q' = M^T P^ and all-reduces that; P^ Q'^T is the rank-r approximation of the sum
of the replicas' matrices. Q' is kept for the next step (warm start), and so is each
replica's share of what the approximation missed. All matrices go in one all-reduce per
phase. Exact whenever the summed matrix has rank <= r.

Example:
    >>> psgd = PowerSGD(rank=4)
    >>> psgd.matrix_shape([4, 32, 128])      # (128, 128): not (4, 4096)
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import tensorflow as tf

from tfpar.compression.compressors import CompressionError, Compressor


class PowerSGD(Compressor):
    """On the wire: P [n, r] and Q [m, r] float32 per n x m matrix (the tensor's most square
    2-D view), two all-reduces;
    what the low-rank sum misses stays behind as error feedback."""

    name = "powersgd"
    error_feedback = True

    def __init__(self, rank: int = 4, seed: int = 0):
        if rank < 1:
            raise CompressionError(f"powersgd rank must be >= 1, got {rank}.")
        self.rank, self.seed = rank, seed

    @staticmethod
    def matrix_shape(shape) -> tuple[int, int]:
        """[n, m] with n = prod(shape[:k]), m = prod(shape[k:]) for the k making n + m
        smallest: the fewest floats for P and Q at any rank."""
        shape = [int(d) for d in shape]
        splits = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
        return min(splits, key=sum)

    def applies_to(self, shape):
        if len(shape) < 2:
            return False
        n, m = self.matrix_shape(shape)
        return self.rank * (n + m) < n * m  # only where it sends fewer bytes

    def payload_bytes(self, size, shape=None):
        n, m = self.matrix_shape(shape)
        return 4 * self.rank * (n + m)

    def initial_q(self, shape, index: int) -> tf.Tensor:
        """The same random start on every replica (seeded by the tensor's index)."""
        _, m = self.matrix_shape(shape)
        return tf.random.stateless_normal([m, self.rank], seed=[self.seed, index])

    def aggregate(self, matrices: Sequence[tf.Tensor], qs: Sequence[tf.Variable],
                  all_reduce: Callable[[list], list]) -> list[tf.Tensor]:
        """Summed rank-r approximations of `matrices` ([n, m] each); updates `qs`."""
        ps = all_reduce([tf.matmul(m, q) for m, q in zip(matrices, qs)])
        p_hats = [tf.linalg.qr(p)[0] for p in ps]
        new_qs = all_reduce([tf.matmul(m, p, transpose_a=True) for m, p in zip(matrices, p_hats)])
        for q, new in zip(qs, new_qs):
            q.assign(new)
        return [tf.matmul(p, q, transpose_b=True) for p, q in zip(p_hats, new_qs)]

    def __repr__(self):
        return f"powersgd({self.rank})"
