"""PowerSGD (Vogels et al., 2019): rank-r gradient compression with two all-reduces.

For each gradient matrix M (a tensor reshaped to its most square 2-D view, e.g. an attention
output kernel [heads, head_dim, dim] to [heads * head_dim, dim]) with error feedback,
every replica computes P = M Q and all-reduces it, orthonormalises the sum to P^, then
computes Q' = M^T P^ and all-reduces that; P^ Q'^T is the rank-r approximation of the sum
of the replicas' matrices. Q' is kept for the next step (warm start), and so is each
replica's share of what the approximation missed. All matrices go in one all-reduce per
phase. Exact whenever the summed matrix has rank <= r.

A rank schedule ({first step: rank}, counted from the end of the policy's uncompressed
start, torch's `start_powerSGD_iter`) changes r during training: Q is kept at the largest
rank and each stage warm-starts from its first r columns; every stage is its own traced
step, so its bytes are counted exactly.

`factor_dtype="bfloat16"` sends P and Q in bfloat16: half the bytes at the same rank. The
sums are decoded to float32 before the orthonormalisation, and what the rounding loses joins
the error feedback like the rest of the approximation's error.

Example:
    >>> psgd = PowerSGD(rank=4)
    >>> psgd.matrix_shape([4, 32, 128])      # (128, 128): not (4, 4096)
    >>> PowerSGD(rank_schedule="8@0,4@300").stages_at()     # [(0, 8), (300, 4)]
    >>> PowerSGD(rank=3, factor_dtype="bfloat16")          # powersgd(3,bf16): 2 bytes a float
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import tensorflow as tf

from tfpar.compression.compressors import CompressionError, Compressor


FACTOR_DTYPES = ("float32", "bfloat16")


class PowerSGD(Compressor):
    """On the wire: P [n, r] and Q [m, r] per n x m matrix (the tensor's most square 2-D
    view) in float32 or `factor_dtype`, two all-reduces;
    what the low-rank sum misses stays behind as error feedback."""

    name = "powersgd"
    error_feedback = True
    bfloat16_on_gpus = ("powersgd factor_dtype bfloat16", "factor_dtype float32 there")

    def __init__(self, rank: int = 4, seed: int = 0, rank_schedule: str | Mapping[int, int] | None = None,
                 factor_dtype: str = "float32"):
        if factor_dtype not in FACTOR_DTYPES:
            raise CompressionError(f"powersgd factor_dtype {factor_dtype!r} is not one of "
                                   f"{', '.join(FACTOR_DTYPES)}.")
        self.factor_dtype = factor_dtype
        self.wire_dtype = tf.as_dtype(factor_dtype)  # bfloat16: refused where NCCL sums (GPUs)
        self.schedule = parse_rank_schedule(rank_schedule) if rank_schedule else [(0, rank)]
        if any(r < 1 for _, r in self.schedule):
            raise CompressionError(f"powersgd rank must be >= 1, got {rank_schedule or rank}.")
        self.rank, self.seed = self.schedule[-1][1], seed
        self.max_rank = max(r for _, r in self.schedule)

    def stages_at(self) -> list[tuple[int, int]]:
        """(first step, counted from the start of compression, rank) per stage."""
        return list(self.schedule)

    def check_shape(self, path: str, shape) -> None:
        """Refuses a matrix smaller than the rank (the policy chose PowerSGD for it)."""
        if len(shape) < 2:
            return
        n, m = self.matrix_shape(shape)
        if self.max_rank > min(n, m):
            raise CompressionError(
                f"powersgd rank {self.max_rank} is larger than the matrix {path!r} ({n}x{m}): use "
                f"rank <= {min(n, m)}, or leave it out (compression_args.skip / Policy(skip=...)).")

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
        return self.max_rank * (n + m) < n * m  # only where it sends fewer floats (the same plan in bf16)

    def payload_bytes(self, size, shape=None, param=None):
        n, m = self.matrix_shape(shape)
        return self.wire_dtype.size * (param or self.rank) * (n + m)

    def initial_q(self, shape, index: int) -> tf.Tensor:
        """The same random start on every replica (seeded by the tensor's index)."""
        _, m = self.matrix_shape(shape)
        return tf.random.stateless_normal([m, self.max_rank], seed=[self.seed, index])

    def aggregate(self, matrices: Sequence[tf.Tensor], qs: Sequence[tf.Variable],
                  all_reduce: Callable[[list], list], rank: int | None = None) -> list[tf.Tensor]:
        """Summed rank-r approximations of `matrices` ([n, m] each); updates `qs` (their
        first r columns; r = `rank`, default the final rank)."""
        rank = rank or self.rank
        ps = self._all_reduce(all_reduce, [tf.matmul(m, q[:, :rank]) for m, q in zip(matrices, qs)])  # [n, r]
        p_hats = [tf.linalg.qr(p)[0] for p in ps]
        new_qs = self._all_reduce(all_reduce, [tf.matmul(m, p, transpose_a=True)
                                               for m, p in zip(matrices, p_hats)])
        for q, new in zip(qs, new_qs):
            q.assign(new if rank == self.max_rank else tf.concat([new, q[:, rank:]], 1))
        return [tf.matmul(p, q, transpose_b=True) for p, q in zip(p_hats, new_qs)]

    def _all_reduce(self, all_reduce: Callable[[list], list], factors: list) -> list:
        """Sums factors across replicas in the wire dtype; float32 back."""
        if self.wire_dtype == tf.float32:
            return all_reduce(factors)
        return [tf.cast(f, tf.float32) for f in all_reduce([tf.cast(f, self.wire_dtype) for f in factors])]

    def __repr__(self):
        wire = "" if self.wire_dtype == tf.float32 else ",bf16"
        if len(self.schedule) > 1:
            return "powersgd(" + ",".join(f"{r}@{s}" for s, r in self.schedule) + wire + ")"
        return f"powersgd({self.rank}{wire})"


def parse_rank_schedule(schedule: str | Mapping[int, int]) -> list[tuple[int, int]]:
    """"8@0,4@300" or {0: 8, 300: 4} -> [(0, 8), (300, 4)]; starts at step 0, steps rising."""
    if isinstance(schedule, str):
        pairs = []
        for item in filter(None, (p.strip() for p in schedule.split(","))):
            rank, sep, step = item.partition("@")
            if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
                raise CompressionError(f"powersgd rank_schedule item {item!r} is not 'RANK@STEP' "
                                       "(e.g. '8@0,4@300').")
            pairs.append((int(step), int(rank)))
    else:
        pairs = [(int(s), int(r)) for s, r in schedule.items()]
    steps = [s for s, _ in pairs]
    if not pairs or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise CompressionError(
            f"powersgd rank_schedule {schedule!r} must start at step 0 and its steps must rise "
            "(a stage cannot end before it starts), e.g. '8@0,4@300'.")
    return pairs
