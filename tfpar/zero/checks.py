"""What the sharded update (tfpar.zero.update) refuses, by name, before anything is built.

`check_shard` is also what the training binary calls to validate `--config.parallel.shard`
against the strategy, the compression and the placement it was given.

Compression and sharding:

- none, fp16, bf16 (a sum in another dtype): both modes; the reduce-scatter sends each
  variable in the dtype the compression's policy gives it.
- int8, topk, sign, powersgd (their exchange gives every replica the whole sum): shard=
  'optimizer' only (the compressed sum, then each replica's chunk); ZeRO-2 never holds the
  whole sum.
- dgc, onebit_adam, dgc_adam (they compute momentum's or Adam's step themselves, with
  full-size state per replica, and leave a stateless SGD to apply it) and auto (decides at
  run time): refused, there is no optimizer state to shard.

A tensor-parallel model (`check_split_model`): both modes, partitioned over each
data-parallel group; refused with it: LAMB and clipnorm (each reads norms of whole
variables, of which a data-parallel group holds one shard) and compression (the model sums
its own gradients); what tensor parallelism refuses (tfpar.loop.tensor_parallel) stays
refused.

Example:
    >>> check_shard("gradients", "mirrored", compression="fp16")
    'gradients'
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.errors import ShardingError
from tfpar.strategy import private_api

NONE, OPTIMIZER, GRADIENTS = MODES = ("none", "optimizer", "gradients")
STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored")
WIRE_DTYPE_ONLY = ("none", "fp16", "bf16")  # compressors that only change the sum's dtype
NEED_WHOLE_SUM = ("int8", "topk", "sign", "powersgd")
OWN_OPTIMIZER = ("dgc", "onebit_adam", "dgc_adam")


def check_shard(name: str, strategy_kind: str | None = None, compression=None, placement=None) -> str:
    """The shard mode `name` ('none', 'optimizer' or 'gradients') if it can run with this
    strategy (a tfpar kind, e.g. 'mirrored'), compression (a name, compressor or
    Compression) and placement; otherwise ShardingError naming why and the fix.

    Example:
        >>> check_shard("optimizer", "multi_worker_mirrored", "topk")
        'optimizer'
    """
    if name not in MODES:
        raise ShardingError(f"Unknown shard mode {name!r}: choose 'none', 'optimizer' (ZeRO-1: each "
                            "replica keeps 1/R of the optimizer state) or 'gradients' (ZeRO-2: also "
                            "1/R of the accumulated gradients).")
    if name == NONE:
        return name
    if strategy_kind == "parameter_server":
        raise ShardingError(f"shard={name!r} under parameter_server: the variables live on the "
                            "parameter servers and each worker updates them there, so there is no "
                            "replicated optimizer state to shard. Use multi_worker_mirrored, or shard='none'.")
    if strategy_kind is not None and strategy_kind not in STRATEGIES:
        raise ShardingError(f"shard={name!r} under {strategy_kind}: the sharded update runs under "
                            f"{', '.join(STRATEGIES)} (its reduce-scatter and all-gather go through "
                            "their collective launchers). Use shard='none' there.")
    if placement is not None:
        raise ShardingError(f"shard={name!r} with layer placement (a pipeline): each stage's "
                            "variables live on their own devices, and sharding them across the "
                            "pipeline replicas is not built yet. Use shard='none' with placement.")
    _check_compression(name, compression)
    return name


def compression_name(compression) -> str | None:
    """'fp16', 'topk', ... for a name, a compressor or a Compression (None: none)."""
    from tfpar import compression as C  # pylint: disable=import-outside-toplevel

    if compression is None:
        return None
    if isinstance(compression, str):
        return compression.lower()
    for kind, known in ((C.Auto, "auto"), (C.DGCAdam, "dgc_adam"), (C.OneBitAdam, "onebit_adam")):
        if isinstance(compression, kind):
            return known
    if isinstance(compression, C.Compression):
        names = {compression_name(c) for c in _planned(compression)}
        worst = [n for n in (*OWN_OPTIMIZER, *NEED_WHOLE_SUM, "bf16", "fp16", "none") if n in names]
        return worst[0] if worst else "none"
    by_class = {C.NoCompression: "none", C.FP16: "fp16", C.BF16: "bf16", C.Int8: "int8", C.TopK: "topk",
                C.Sign: "sign", C.PowerSGD: "powersgd", C.DGC: "dgc"}
    return by_class.get(type(compression), type(compression).__name__.lower())


def _planned(compression) -> list:
    """Every compressor a Compression may send with: its own, the policy's start, overrides."""
    from tfpar import compression as C  # pylint: disable=import-outside-toplevel

    found = [compression.compressor, compression.policy.start()]
    found += [C.get(c) if isinstance(c, str) else c for c in compression.policy.overrides.values()]
    return [c for c in found if c is not None]


def _check_compression(mode: str, compression) -> None:
    name = compression_name(compression)
    if name is None or name in WIRE_DTYPE_ONLY:
        return
    if name in OWN_OPTIMIZER or name == "auto":
        why = ("decides at run time which compressor runs" if name == "auto" else
               "computes Adam's or momentum's step itself, with its own full-size state on every "
               "replica, and leaves a stateless SGD to apply it: there is no optimizer state to shard")
        raise ShardingError(f"shard={mode!r} with compression {name}: {name} {why}. Use shard='none' "
                            "with it, or fp16/bf16 (both modes) or topk/int8/sign/powersgd "
                            "(shard='optimizer') as the compression.")
    if name in NEED_WHOLE_SUM and mode == GRADIENTS:
        raise ShardingError(f"shard='gradients' with compression {name}: {name}'s exchange gives every "
                            "replica the whole summed gradient, which ZeRO-2 never holds (each "
                            "replica keeps 1/R of it). Use shard='optimizer' with it (the compressed "
                            "sum, then each replica updates its chunk), or fp16/bf16 with 'gradients'.")
    if name not in NEED_WHOLE_SUM:
        raise ShardingError(f"shard={mode!r} does not know compression {name!r}: use none, fp16 or "
                            "bf16 (both modes) or int8, topk, sign, powersgd (shard='optimizer').")


def check_split_model(mode: str, optimizer, aggregator=None) -> None:
    """Refuses, by name, what the sharded update cannot do with a tensor-parallel model
    (`optimizer`: the caller's; `aggregator`: the Trainer's).

    Example:
        >>> check_split_model("optimizer", keras.optimizers.Lamb())   # ShardingError
    """
    from tfpar.compression import Compression  # pylint: disable=import-outside-toplevel

    if isinstance(aggregator, Compression):
        raise ShardingError(f"shard={mode!r} with a tensor-parallel model and compression "
                            f"{compression_name(aggregator)}: the split model sums its own gradients "
                            "(split ones over their data-parallel group). Leave the compression out.")
    base = private_api.base_optimizer(optimizer)
    if isinstance(base, keras.optimizers.Lamb):
        raise ShardingError(f"shard={mode!r} with Lamb and a tensor-parallel model: LAMB scales each "
                            "variable's update by the norms of the whole variable, of which a "
                            "data-parallel group holds one shard. Use AdamW (or another elementwise "
                            "optimizer) with it, or train with shard='none'.")
    if base.clipnorm:
        raise ShardingError(f"shard={mode!r} with clipnorm={base.clipnorm} and a tensor-parallel model: "
                            "clipnorm clips each variable by its whole norm, of which a data-parallel "
                            "group holds one shard. Use global_clipnorm (the whole gradient's norm).")


def check_variable(variable) -> None:
    """Refuses a trainable variable the layout cannot flatten and cut, naming it."""
    path = getattr(variable, "path", variable.name)
    if private_api.is_sharded(variable.value if isinstance(variable, keras.Variable) else variable):
        raise ShardingError(f"Variable {path} is partitioned (a ShardedVariable): the sharded update "
                            "cuts whole variables itself. Build the model without a partitioner.")
    if getattr(variable, "overwrite_with_gradient", False):
        raise ShardingError(f"Variable {path} is overwritten with its gradient (float8 scaling): it has "
                            "no optimizer state to shard. Train this model with shard='none'.")
    if not tf.as_dtype(variable.dtype).is_floating:
        raise ShardingError(f"Variable {path} is {tf.as_dtype(variable.dtype).name}: the sharded update "
                            "flattens floating-point variables only. Make it non-trainable, or shard='none'.")
