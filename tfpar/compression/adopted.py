"""The user's optimizer, taken over by a compressor that computes the step itself.

1-bit Adam and dgc_adam compute Adam's step; DGC computes momentum SGD's. The user names
the optimizer they mean (Adam or AdamW; SGD with momentum) and its hyper-parameters apply:
the compressor takes what belongs to the step (betas, epsilon, momentum, nesterov, global
clipping), and a plain SGD applies the step with the user's learning rate, schedule,
weight decay and EMA (decoupled weight decay is the same update in SGD and AdamW). A value
given to the compressor and a different one on the optimizer are refused, never chosen
between silently.

Example:
    >>> onebit = OneBitAdam(freeze_step=100)
    >>> onebit.check_optimizer(keras.optimizers.AdamW(schedule, weight_decay=0.01, beta_2=0.98,
    ...                                               global_clipnorm=1.0))
    >>> onebit.beta_2, onebit.clip_norm
    (0.98, 1.0)
    >>> onebit.optimizer_for(adamw)        # SGD(schedule, momentum=0, weight_decay=0.01)
"""

from __future__ import annotations

import keras

from tfpar.compression.compressors import CompressionError
from tfpar.strategy import private_api


def agree(kind: str, key: str, given, found, default):
    """The value of `key`: the compressor's (`given`, None: not given), the optimizer's
    (`found`, None: it has none) or `default`; refused when both are given and differ."""
    if given is not None and found is not None and abs(float(given) - float(found)) > 1e-12:
        raise CompressionError(
            f"{kind} was given {key}={given:g} and the optimizer has {key}={found:g}: the "
            f"optimizer's {key} applies to {kind}; drop it from the compressor (or make them equal).")
    for value in (given, found):
        if value is not None:
            return value
    return default


def refuse_options_of(optimizer, kind: str, clipping: str) -> None:
    """Refuses Keras options that would act on the compressor's step instead of the gradient:
    per-tensor clipping (`clipping` names what replaces it) and gradient accumulation."""
    inner = private_api.base_optimizer(optimizer)
    if inner.clipnorm or inner.clipvalue:
        raise CompressionError(
            f"{kind} clips by the global norm of the mean gradient ({clipping}); clipnorm and "
            "clipvalue would clip its step instead: use global_clipnorm "
            "(--config.optimizer.clip_norm).")
    if inner.gradient_accumulation_steps:
        raise CompressionError(
            f"{kind} with gradient_accumulation_steps would accumulate its step, not the "
            "gradients: accumulate before the compressor with tfpar.Trainer(accumulate=K) "
            "(--config.train.accumulate=K), the same mean of K micro-batches.")


def plain_sgd_for(optimizer) -> keras.optimizers.Optimizer:
    """SGD without momentum or clipping, with `optimizer`'s learning rate (or schedule),
    weight decay (and its exclusions) and EMA; wrapped in a LossScaleOptimizer like it."""
    inner = private_api.base_optimizer(optimizer)
    sgd = keras.optimizers.SGD(
        learning_rate=private_api.learning_rate_of(inner), momentum=0.0,
        weight_decay=inner.weight_decay, use_ema=inner.use_ema, ema_momentum=inner.ema_momentum,
        ema_overwrite_frequency=inner.ema_overwrite_frequency, name=f"{inner.name}_step")
    private_api.copy_weight_decay_exclusions(inner, sgd)
    if not private_api.is_loss_scaled(optimizer):
        return sgd
    return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=optimizer.initial_scale,
                                               dynamic_growth_steps=optimizer.dynamic_growth_steps)


def is_plain_sgd(optimizer) -> bool:
    """SGD without momentum or clipping: it applies a compressor's step as it is."""
    inner = private_api.base_optimizer(optimizer)
    return (isinstance(inner, keras.optimizers.SGD) and not inner.momentum and not inner.nesterov
            and not (inner.clipnorm or inner.clipvalue or inner.global_clipnorm))
