"""Gradient compression for Keras `fit` users: the optimizer's own all-reduce, replaced.

Keras 3's optimizer sums gradients across replicas inside `apply`, in the replica
context, with one call (`_all_reduce_sum_gradients`). `compress_fit` puts a Compression
in that place, so `model.fit` under the injected strategy sends every gradient once,
through the compressor; the rest of fit (metrics, callbacks, steps_per_execution) is
untouched. Anything with phases (warm-up steps, DGC's density warm-up, PowerSGD's rank
schedule, 1-bit Adam's freeze) needs tfpar's loop (fit traces one step) and is refused
here; DGC without warm-up works: the model's SGD momentum, nesterov and clipping move into
DGC and a plain SGD with its learning rate replaces `model.optimizer`. Keras's clip, weight
decay, accumulation and EMA then act on the decompressed sum (tfpar.strategy.optimizer_update).

Example:
    >>> with strategy.scope():
    ...     model = build_model()
    ...     model.compile(optimizer="adam", loss=...)
    ...     compress_fit(model, tfpar.compression.TopK(0.01))
    >>> model.fit(dataset, epochs=3)
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfpar.compression.auto import Auto
from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import CompressionError, Compressor
from tfpar.strategy import private_api


def compress_fit(model: keras.Model, compression: Compressor | Compression) -> Compression:
    """Makes `model.fit` aggregate gradients through `compression`; returns the Compression
    (its `checkpoint_items()` belong in your checkpoint). Call after `compile`, under the
    strategy's scope (or outside it: the model's strategy is used)."""
    if getattr(model, "optimizer", None) is None:
        raise CompressionError("compress_fit needs a compiled model: call model.compile(...) first.")
    compression = compression if isinstance(compression, Compression) else Compression(compression)
    if isinstance(compression, Auto):
        raise CompressionError("compression='auto' may pick a compressor with an uncompressed start, "
                               "which Keras fit cannot run (it traces one train step): use "
                               "tfpar.Trainer (--config.mode=loop), or name a compressor for fit.")
    if compression.policy.warmup_steps:
        raise CompressionError("Compression warm-up steps need tfpar.Trainer (Keras fit traces a "
                               "single train step). Set warmup_steps=0 for fit.")
    if compression.boundaries():
        raise CompressionError(
            f"{compression.compressor if type(compression) is Compression else compression!r} changes "
            f"phase at steps {list(compression.boundaries())} (a warm-up, a density or rank "
            "schedule, 1-bit Adam's freeze): Keras fit traces a single train step, so this needs "
            "tfpar.Trainer (--config.mode=loop). In fit use dgc without warmup_steps, powersgd "
            "without rank_schedule.")
    compression.check_optimizer(model.optimizer)
    variables = list(model.trainable_weights)
    _refuse_split(variables)
    # the state (error feedback, per replica) under the model's strategy, also when called
    # outside its scope (a keras.distribution model: tfpar made its strategy)
    with contextlib.nullcontext() if tf.distribute.has_strategy() else model.distribute_strategy.scope():
        compression.build(variables)
        model.optimizer = compression.optimizer_for(model.optimizer)

    def all_reduce(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if len(grads_and_vars) != len(variables):
            raise CompressionError(
                f"The optimizer got {len(grads_and_vars)} gradients for {len(variables)} trainable "
                "weights: compress_fit needs every trainable weight to have a gradient.")
        grads = compression([g for g, _ in grads_and_vars], variables)
        return list(zip(grads, [v for _, v in grads_and_vars]))  # fix 4 sums sparse rows next

    private_api.replace_all_reduce(model.optimizer, all_reduce)
    return compression


def _refuse_split(variables) -> None:
    """A tensor-parallel model's split gradients are summed over their data-parallel group
    only (tfpar.loop.tensor_parallel): a compressor in the all-reduce's place would sum
    them across their tensor-parallel group too."""
    from tfpar.tensor_parallel.shards import spec_of  # pylint: disable=import-outside-toplevel

    split = [v.path for v in variables if spec_of(v) is not None]
    if split:
        raise CompressionError(
            f"compress_fit on a tensor-parallel model ({len(split)} split weights, e.g. {split[0]}): "
            "its split gradients must not be summed across their tensor-parallel group, which a "
            "compressor in the all-reduce's place would do. Leave compress_fit out for a split "
            "model (or train the model unsplit with compression).")
