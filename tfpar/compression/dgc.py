"""Deep Gradient Compression (Lin et al., 2018): momentum-corrected top-k sparsification.

Every replica keeps its own velocity u and accumulation v for each compressed tensor:

    g <- clip(g, clip_norm / sqrt(R))        local gradient clipping (whole local gradient)
    u <- momentum * u + g                    momentum correction: the velocity is local
    v <- v + u                               accumulated, then sparsified
    send the k = density * n largest |v|     top-k words (indices, values), all-gathered
    v[sent] <- 0, u[sent] <- 0               error feedback + momentum-factor masking

and the optimizer applies the sum of what was sent: momentum lives in the compressor, so
the Keras optimizer must be plain SGD (momentum=0, no nesterov, no clipping of its own;
`DGC.check_optimizer` says so by name). Tensors the policy leaves uncompressed are
all-reduced and get the same momentum on the sum, so with nothing compressed (or density
1.0, where nothing is masked) DGC is exactly SGD with momentum.

Density warm-up (the paper's 75% -> 93.75% -> 98.4% -> 99.6% -> 99.9% sparsity): over
`warmup_steps` steps in `stages` equal stages the density falls exponentially from
`ratio ** (1 / (stages + 1))` to `ratio`; each stage is one traced step with a static k,
so its bytes are counted exactly.

Example:
    >>> dgc = DGC(ratio=0.001, momentum=0.9, clip_norm=1.0, warmup_steps=200)
    >>> [round(1 - d, 4) for d in dgc.densities()]
    [0.7488, 0.9369, 0.9842, 0.996, 0.999]
    >>> trainer = Trainer(model, keras.optimizers.SGD(0.1), loss, strategy=strategy,
    ...                   compression=Compression(dgc))
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from tfpar.compression import packing
from tfpar.compression.compressors import CompressionError, Compressor


class DGC(Compressor):
    """On the wire: top-k of the locally accumulated, momentum-corrected gradient as int32
    indices + float32 values (2k words), k = density * n; see module docstring."""

    name = "dgc"
    error_feedback = True

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, clip_norm: float = 0.0,
                 masking: bool = True, warmup_steps: int = 0, stages: int = 4):
        if not 0 < ratio <= 1:
            raise CompressionError(f"dgc ratio must be in (0, 1], got {ratio}.")
        if not 0 <= momentum < 1:
            raise CompressionError(f"dgc momentum must be in [0, 1), got {momentum}.")
        if clip_norm < 0 or warmup_steps < 0 or stages < 1:
            raise CompressionError("dgc clip_norm and warmup_steps must be >= 0, stages >= 1.")
        if 0 < warmup_steps < stages:
            raise CompressionError(
                f"dgc sparsity warm-up of {warmup_steps} steps ends before its {stages} stages "
                f"start: use warmup_steps >= {stages} (or stages <= {warmup_steps}, or 0).")
        self.ratio, self.momentum, self.clip_norm = ratio, momentum, clip_norm
        self.masking, self.warmup_steps, self.stages = masking, warmup_steps, stages

    # -- the schedule ------------------------------------------------------------------

    def densities(self) -> list[float]:
        """Density of each stage, the last one `ratio` (it lasts to the end)."""
        if not self.warmup_steps:
            return [self.ratio]
        return [self.ratio ** ((j + 1) / (self.stages + 1)) for j in range(self.stages)] + [self.ratio]

    def stages_at(self) -> list[tuple[int, float]]:
        """(first step, counted from the start of compression, density) per stage."""
        densities = self.densities()
        if len(densities) == 1:
            return [(0, self.ratio)]
        starts = [round(j * self.warmup_steps / self.stages) for j in range(self.stages)]
        return list(zip(starts + [self.warmup_steps], densities))

    @staticmethod
    def k(size: int, density: float) -> int:
        return max(1, min(size, int(math.ceil(density * size))))

    def payload_bytes(self, size, shape=None, param=None):
        density = self.ratio if param is None else param
        return 4 * size if density >= 1 else 8 * self.k(size, density)

    # -- what it asks of the optimizer ----------------------------------------------------

    def check_optimizer(self, optimizer) -> None:
        """Refuses an optimizer that would apply momentum (or clip) a second time."""
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        momentum = getattr(inner, "momentum", None)
        if not isinstance(inner, _sgd_class()) or momentum or getattr(inner, "nesterov", False):
            raise CompressionError(
                f"dgc keeps the momentum itself (momentum correction): train with "
                f"keras.optimizers.SGD(learning_rate, momentum=0.0), not {type(inner).__name__}"
                f"{f' with momentum={momentum}' if momentum else ''}; pass the momentum as "
                "DGC(momentum=...) (config: --config.optimizer.name=sgd "
                "--config.optimizer.momentum=0 --config.compression_args.momentum=0.9).")
        if inner.clipnorm or inner.clipvalue or inner.global_clipnorm:
            raise CompressionError(
                "dgc clips each replica's gradient itself (local clipping): leave the optimizer's "
                "clipping off and pass DGC(clip_norm=...) (config: --config.optimizer.clip_norm=0 "
                "--config.compression_args.clip_norm=1.0).")

    def __repr__(self):
        return f"dgc({self.ratio:g})"


def _sgd_class():
    import keras

    return keras.optimizers.SGD


def top_k_words(x: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
    """(indices int32 [k], words int32 [2k]) of the k largest |x|."""
    _, indices = tf.math.top_k(tf.abs(x), k=k, sorted=False)
    return indices, tf.concat([indices, packing.float_words(tf.gather(x, indices))], 0)


def decode_sum(words: tf.Tensor, size: int, k: int) -> tf.Tensor:
    """int32 [R, 2k] -> float32 [size], the sum of every replica's sparse values."""
    indices = tf.reshape(words[:, :k], [-1, 1])
    values = tf.reshape(packing.word_floats(words[:, k:]), [-1])
    return tf.tensor_scatter_nd_add(tf.zeros([size], tf.float32), indices, values)


def aggregate(dgc: DGC, slots: Sequence[dict], gradients: Sequence[tf.Tensor],
              compressed: Sequence[bool], density: float, replicas: int,
              all_reduce, all_gather) -> list[tf.Tensor]:
    """One DGC step (replica context). `slots[i]` holds 'velocity' (every tensor) and
    'residual' (compressed ones); `gradients` are dense float32; `all_reduce` and
    `all_gather` are the fused collectives. Returns what the optimizer applies."""
    if dgc.clip_norm:  # the threshold scaled by R^-1/2, as the paper does
        gradients, _ = tf.clip_by_global_norm(list(gradients), dgc.clip_norm / math.sqrt(replicas))
    result: list = [None] * len(gradients)
    dense_sent, dense_index, sparse = [], [], []
    for i, (g, slot, c) in enumerate(zip(gradients, slots, compressed)):
        if not c:  # all-reduced, then momentum on the sum (the same on every replica)
            dense_sent.append(g)
            dense_index.append(i)
            continue
        velocity = dgc.momentum * slot["velocity"] + g
        slot["velocity"].assign(velocity)
        accumulated = slot["residual"] + velocity
        if density >= 1:  # nothing left behind, nothing masked: SGD with momentum, exactly
            slot["residual"].assign(tf.zeros_like(accumulated))
            dense_sent.append(accumulated)
            dense_index.append(i)
        else:
            sparse.append((i, accumulated))
    for i, summed in zip(dense_index, all_reduce(dense_sent)):
        if compressed[i]:
            result[i] = summed
        else:
            velocity = dgc.momentum * slots[i]["velocity"] + summed
            slots[i]["velocity"].assign(velocity)
            result[i] = velocity
    if sparse:
        _sparse_step(dgc, slots, sparse, density, all_gather, result)
    return result


def _sparse_step(dgc, slots, sparse, density, all_gather, result) -> None:
    words, picked = [], []
    for i, accumulated in sparse:
        flat = tf.reshape(accumulated, [-1])
        indices, w = top_k_words(flat, DGC.k(int(flat.shape[0]), density))
        words.append(w)
        picked.append(indices[:, None])
    sizes = [int(w.shape[0]) for w in words]
    everyone = all_gather(tf.concat(words, 0)[None])  # [R, total words]
    for (i, accumulated), part, size, idx in zip(sparse, tf.split(everyone, sizes, axis=1), sizes, picked):
        shape = accumulated.shape
        flat = tf.reshape(accumulated, [-1])
        zeros = tf.zeros([size // 2], tf.float32)
        slots[i]["residual"].assign(tf.reshape(tf.tensor_scatter_nd_update(flat, idx, zeros), shape))
        if dgc.masking:
            velocity = tf.reshape(slots[i]["velocity"], [-1])
            slots[i]["velocity"].assign(tf.reshape(tf.tensor_scatter_nd_update(velocity, idx, zeros), shape))
        result[i] = tf.reshape(decode_sum(part, int(flat.shape[0]), size // 2), shape)
