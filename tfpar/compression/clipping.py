"""One meaning of clipping for every compressor: the global norm of the mean gradient.

Where the mean gradient is known on every replica (no compressor, the dense compressors,
every warm-up, the tensors a policy leaves dense) it is clipped exactly, as on one device.
A compressor that sends each replica's own state (dgc, onebit_adam and dgc_adam after
their start) knows its compressed tensors only locally: each replica's estimate of the
mean is R g (its gradient times the replica count). The clip then uses the norm

    norm^2 = ||sum of the dense tensors||^2 + mean over replicas of ||R g of the compressed||^2

one float more on the dense all-reduce, so every replica scales by the same factor
min(1, clip_norm / norm) and the weights stay identical everywhere. With one replica it is
the exact norm.

Example:
    >>> sums, local = reduce_and_clip(1.0, dense, [replicas * g for g in compressed],
    ...                               replicas, all_reduce)
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

#: Bytes the agreed norm adds to the dense all-reduce (one float32).
NORM_BYTES = 4


def _squared(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(tf.square(t)) for t in tensors] + [tf.constant(0.0)])


def factor(clip_norm: float, norm: tf.Tensor) -> tf.Tensor:
    """min(1, clip_norm / norm) in Keras's form (so a warm-up equals Keras's clip bit for
    bit); NaN where the norm is not finite (the step is then skipped)."""
    return clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)


def reduce_and_clip(clip_norm: float, dense: Sequence[tf.Tensor], local: Sequence[tf.Tensor],
                    replicas: int, all_reduce: Callable[[list], list]) -> tuple[list, list]:
    """(`dense` summed over replicas, `local`), both clipped by one agreed factor (see the
    module docstring). `local`: this replica's estimates of the mean, R g. Without
    `clip_norm`: the sums and `local` as they are."""
    if not clip_norm:
        return list(all_reduce(list(dense))), list(local)
    if not local:  # every mean known (e.g. a warm-up): exact, and no float added to the wire
        return clip_exactly(clip_norm, all_reduce(list(dense))), []
    reduced = all_reduce([*dense, tf.reshape(_squared(local) / replicas, [1])])
    sums, mean_square = list(reduced[:-1]), reduced[-1][0]
    scale = factor(clip_norm, tf.sqrt(_squared(sums) + mean_square))
    return [s * scale for s in sums], [x * scale for x in local]


def clip_exactly(clip_norm: float, sums: Sequence[tf.Tensor]) -> list:
    """The summed (mean) gradients clipped by their global norm, as on one device."""
    if not clip_norm:
        return list(sums)
    return [s * factor(clip_norm, tf.sqrt(_squared(sums))) for s in sums]
