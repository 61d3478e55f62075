"""Deep Gradient Compression (Lin et al., 2018): momentum-corrected top-k sparsification.

Every replica keeps its own velocity u and accumulation v for each compressed tensor:

    g <- g * c                               clipped: one factor c agreed by every replica
    u <- momentum * u + g                    momentum correction: the velocity is local
    v <- v + u   (nesterov: v + g + momentum * u)   accumulated, then sparsified
    send the k = density * n largest |v|     top-k words (indices, values), all-gathered
    v[sent] <- 0, u[sent] <- 0               error feedback + momentum-factor masking

and the optimizer applies the sum of what was sent. Train with the SGD you mean
(`SGD(lr, momentum=0.9, nesterov=..., global_clipnorm=...)`): its momentum, nesterov and
clipping move into the compressor and a plain SGD applies the step with its learning rate,
schedule and weight decay (tfpar.compression.adopted). Tensors the policy leaves
uncompressed are all-reduced and get the same momentum on the sum. At density 1.0 (the
sparsity warm-up's start, or ratio 1) every gradient is summed first and clipped by its
exact global norm, each replica keeping 1/R of the velocity: DGC is then exactly SGD with
momentum. In a sparse stage the clip's norm estimates the compressed tensors' part from
each replica's R g (tfpar.compression.clipping).

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

import keras

import tensorflow as tf

from tfpar.compression import adopted, clipping, packing
from tfpar.compression.compressors import CompressionError, Compressor
from tfpar.strategy import private_api

DEFAULT_MOMENTUM = 0.9


class DGC(Compressor):
    """On the wire: top-k of the locally accumulated, momentum-corrected gradient as int32
    indices + float32 values (2k words), k = density * n; see module docstring."""

    name = "dgc"
    error_feedback = True

    def __init__(self, ratio: float = 0.001, momentum: float | None = None, clip_norm: float | None = None,
                 masking: bool = True, warmup_steps: int = 0, stages: int = 4, nesterov: bool = False):
        if not 0 < ratio <= 1:
            raise CompressionError(f"dgc ratio must be in (0, 1], got {ratio}.")
        if momentum is not None and not 0 <= momentum < 1:
            raise CompressionError(f"dgc momentum must be in [0, 1), got {momentum}.")
        if (clip_norm or 0) < 0 or warmup_steps < 0 or stages < 1:
            raise CompressionError("dgc clip_norm and warmup_steps must be >= 0, stages >= 1.")
        if 0 < warmup_steps < stages:
            raise CompressionError(
                f"dgc sparsity warm-up of {warmup_steps} steps ends before its {stages} stages "
                f"start: use warmup_steps >= {stages} (or stages <= {warmup_steps}, or 0).")
        self._given = {"momentum": momentum, "clip_norm": clip_norm}
        self.ratio, self.nesterov = ratio, nesterov
        self.momentum = DEFAULT_MOMENTUM if momentum is None else momentum
        self.clip_norm = clip_norm or 0.0
        self.masking, self.warmup_steps, self.stages = masking, warmup_steps, stages
        self._adopted = None

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
        """Takes SGD's momentum, nesterov and global_clipnorm (a plain SGD: DGC's own);
        refuses any other optimizer by name."""
        inner = private_api.base_optimizer(optimizer)
        if not isinstance(inner, keras.optimizers.SGD):
            raise CompressionError(
                f"dgc is momentum SGD on sparsified gradients: train with keras.optimizers.SGD("
                f"learning_rate, momentum=0.9) (its momentum, nesterov, global_clipnorm, schedule "
                f"and weight decay apply), not {type(inner).__name__}; for Adam use dgc_adam "
                "(config: --config.optimizer.name=sgd, or --config.compression=dgc_adam).")
        adopted.refuse_options_of(optimizer, "dgc", "global_clipnorm")
        self._adopted = None if adopted.is_plain_sgd(inner) else inner
        if self._adopted is None:
            return
        if inner.momentum:  # else DGC's own (given, or its default)
            self.momentum = adopted.agree("dgc", "momentum", self._given["momentum"], inner.momentum,
                                          DEFAULT_MOMENTUM)
        self.nesterov = bool(inner.nesterov) or self.nesterov
        self.clip_norm = adopted.agree("dgc", "clip_norm", self._given["clip_norm"], inner.global_clipnorm, 0.0)

    def optimizer_for(self, optimizer):
        """A plain SGD with the SGD's learning rate, weight decay and EMA (or the plain SGD given)."""
        return optimizer if self._adopted is None else adopted.plain_sgd_for(optimizer)

    def __repr__(self):
        return f"dgc({self.ratio:g})"


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
    if density >= 1 or not any(compressed):
        return _dense_step(dgc, slots, gradients, compressed, replicas, all_reduce)
    dense = [i for i, c in enumerate(compressed) if not c]
    index = [i for i, c in enumerate(compressed) if c]
    sums, local = clipping.reduce_and_clip(dgc.clip_norm, [gradients[i] for i in dense],
                                           [gradients[i] * replicas for i in index], replicas, all_reduce)
    result: list = [None] * len(gradients)
    for i, summed in zip(dense, sums):  # momentum on the sum: the same on every replica
        result[i] = _momentum_step(dgc, slots[i]["velocity"], summed)
    sparse = []
    for i, estimate in zip(index, local):  # this replica's share: R g / R, clipped
        step = _momentum_step(dgc, slots[i]["velocity"], estimate / replicas)
        sparse.append((i, slots[i]["residual"] + step))
    _sparse_step(dgc, slots, sparse, density, all_gather, result)
    return result


def _momentum_step(dgc: DGC, velocity: tf.Variable, gradient: tf.Tensor) -> tf.Tensor:
    """u <- momentum u + g; returns u, or g + momentum u with nesterov (Keras SGD's step)."""
    updated = dgc.momentum * velocity + gradient
    velocity.assign(updated)
    return gradient + dgc.momentum * updated if dgc.nesterov else updated


def _dense_step(dgc, slots, gradients, compressed, replicas, all_reduce) -> list[tf.Tensor]:
    """Density 1: every gradient summed and clipped by its exact global norm, then SGD with
    momentum on the sum. A compressed tensor's velocity is kept as 1/R on each replica (its
    share of the sum the sparse stages go on from), so R times its step is the sum's."""
    sums = clipping.clip_exactly(dgc.clip_norm, all_reduce(list(gradients)))
    result = []
    for summed, slot, c in zip(sums, slots, compressed):
        if not c:
            result.append(_momentum_step(dgc, slot["velocity"], summed))
            continue
        slot["residual"].assign(tf.zeros_like(slot["residual"]))  # nothing is owed at density 1
        result.append(replicas * _momentum_step(dgc, slot["velocity"], summed / replicas))
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
