"""Gradient compression for tfpar's loop: fewer bytes on the wire, same model at the end.

Example:
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy,
    ...                         compression=tfpar.compression.TopK(0.01))
    >>> tfpar.compression.get("powersgd", rank=4)
    powersgd(4)
"""

from __future__ import annotations

from tfpar.compression.auto import Auto
from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import (BF16, FP16, CompressionError, Compressor, Int8,
                                           NoCompression, Sign, TopK)
from tfpar.compression.dgc import DGC
from tfpar.compression.dgc_adam import DGCAdam
from tfpar.compression.keras_fit import compress_fit
from tfpar.compression.onebit_adam import OneBitAdam
from tfpar.compression.policy import DEFAULT_SKIP, Policy
from tfpar.compression.powersgd import PowerSGD

COMPRESSORS = {"none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "topk": TopK,
               "powersgd": PowerSGD, "sign": Sign, "dgc": DGC}


def get(name: str, **args) -> Compressor:
    """A compressor by name: none, fp16, bf16, int8, topk(ratio=), powersgd(rank=,
    rank_schedule=, factor_dtype=), sign, dgc(ratio=, momentum=, clip_norm=, masking=,
    warmup_steps=, stages=)."""
    if isinstance(name, Compressor):
        return name
    key = name.lower()
    if key not in COMPRESSORS:
        raise CompressionError(f"Unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}.")
    try:
        return COMPRESSORS[key](**args)
    except TypeError as e:
        raise CompressionError(f"Compressor {key!r} does not take {sorted(args)}: {e}.") from None


NAMES = (*COMPRESSORS, "onebit_adam", "dgc_adam", "auto")  # what --config.compression accepts


def from_config(name: str, ratio: float = 0.01, rank: int = 4, min_size: int = 1024,
                warmup_steps: int = 0, warmup_compression: str = "none", overrides: str = "", skip: str = "",
                reset_on_restore: bool = False, embeddings: bool = False,
                momentum: float | None = None, clip_norm: float = 0.0, masking: bool = True,
                sparsity_warmup_steps: int = 0, stages: int = 4, rank_schedule: str = "",
                factor_dtype: str = "float32",
                freeze_step: int = 100, exchange_every: int = 1, auto_total_steps: int = 600,
                auto_tokens: int = 1024, auto_quality_steps: int = 0) -> Compression | None:
    """The Compression that `--config.compression=NAME --config.compression_args.*` asks for
    (None for 'none' with no overrides). `overrides`: "regex=name,regex=name"; `skip`: a
    comma-separated list of regexes that replaces the default skip list ("none": skip
    nothing, biases and norms included); `embeddings`: also
    compress the embeddings with NAME. dgc: ratio, masking, sparsity_warmup_steps, stages
    (momentum, nesterov and clipping: the optimizer's SGD); dgc_adam: ratio, freeze_step,
    momentum (its local velocity; None: 0), masking; powersgd: rank or rank_schedule
    ("8@0,4@300"), factor_dtype; warmup_steps: the uncompressed start (sent in float32, or in
    `warmup_compression` fp16 or bf16: also onebit_adam's Adam warm-up); onebit_adam:
    freeze_step, exchange_every (betas, epsilon, clipping: the optimizer's AdamW); auto: the
    run's steps and one replica's tokens per step (the binary passes both from its config).
    `clip_norm` is refused: clipping is the optimizer's `global_clipnorm` everywhere."""
    if clip_norm:
        raise CompressionError("compression_args.clip_norm: clipping is the optimizer's global_clipnorm "
                               "(--config.optimizer.clip_norm) for every compressor.")

    def named(key: str) -> Compressor:
        args = {"topk": {"ratio": ratio},
                "powersgd": {"rank": rank, "rank_schedule": rank_schedule or None,
                             "factor_dtype": factor_dtype},
                "dgc": {"ratio": ratio, "masking": masking, "warmup_steps": sparsity_warmup_steps,
                        "stages": stages}}  # momentum and clipping: the optimizer's
        return get(key, **args.get(key.lower(), {}))

    parsed = _parse_overrides(overrides, named)
    skip_list = _skip_list(skip, embeddings)
    policy_args = {"skip": skip_list} if skip_list is not None else {}
    if name.lower() == "auto":
        return Auto(total_steps=auto_total_steps, tokens=auto_tokens, quality_steps=auto_quality_steps or None)
    if name.lower() == "onebit_adam":
        if parsed:
            raise CompressionError("onebit_adam compresses every large tensor's momentum; "
                                   "compression_args.overrides do not apply (use skip/min_size).")
        return OneBitAdam(freeze_step=freeze_step, warmup_compressor=warmup_compression,
                          exchange_every=exchange_every,
                          policy=Policy(min_size=min_size, **policy_args))
    if name.lower() == "dgc_adam":
        if parsed:
            raise CompressionError("dgc_adam sparsifies every large tensor's Adam step; "
                                   "compression_args.overrides do not apply (use skip/min_size).")
        return DGCAdam(ratio=ratio, freeze_step=freeze_step, momentum=momentum or 0.0, masking=masking,
                       warmup_compressor=warmup_compression,
                       policy=Policy(min_size=min_size, **policy_args))
    compressor = named(name)
    if compressor.name == "none" and not parsed:
        return None
    policy = Policy(min_size=min_size, warmup_steps=warmup_steps, warmup_compressor=warmup_compression,
                    overrides=parsed, **policy_args)
    return Compression(compressor, policy, reset_on_restore=reset_on_restore)


def override_items(overrides: str) -> list[tuple[str, str]]:
    """"regex=name,regex=name" -> [(regex, name)], e.g. "embed=topk" -> [("embed", "topk")]."""
    items = []
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        pattern, sep, chosen = item.rpartition("=")
        if not sep or not pattern:
            raise CompressionError(f"compression_args.overrides item {item!r} is not 'regex=name'.")
        items.append((pattern, chosen.strip()))
    return items


def _parse_overrides(overrides: str, named) -> dict:
    """"regex=name,regex=name" -> {regex: named(name)}."""
    return {pattern: named(chosen) for pattern, chosen in override_items(overrides)}


def _skip_list(skip: str, embeddings: bool) -> tuple[str, ...] | None:
    """The policy's skip regexes (None: its default): "none" skips nothing (every tensor of at
    least min_size elements is compressed); `embeddings` drops "embed" from the default."""
    if skip.strip().lower() == "none":
        return ()
    if skip:
        return tuple(p.strip() for p in skip.split(",") if p.strip())
    return tuple(p for p in DEFAULT_SKIP if "embed" not in p) if embeddings else None


def check_config(config) -> str | None:
    """What --config.compression needs of --config.optimizer (None: fine). onebit_adam and
    dgc_adam compute AdamW's step (its betas, epsilon and clip_norm move into them); dgc
    computes SGD's with momentum (its momentum, nesterov and clip_norm move into it)."""
    name, optimizer = config.compression, config.optimizer.name
    if name in ("onebit_adam", "dgc_adam") and optimizer != "adamw":
        return (f"{name} computes AdamW's step with compressed momentum: use "
                "--config.optimizer.name=adamw (its schedule, weight_decay, beta_1, beta_2, epsilon "
                f"and clip_norm apply), not {optimizer}.")
    if name == "dgc" and optimizer != "sgd":
        return ("dgc is momentum SGD on sparsified gradients: use --config.optimizer.name=sgd (its "
                "momentum, schedule, weight_decay and clip_norm apply), or --config.compression=dgc_adam "
                f"with {optimizer}.")
    return None


__all__ = ["Auto", "BF16", "COMPRESSORS", "Compression", "CompressionError", "Compressor", "DGC", "FP16",
           "DGCAdam", "Int8", "NAMES", "NoCompression", "OneBitAdam", "Policy", "PowerSGD", "Sign", "TopK", "check_config", "compress_fit", "from_config",
           "get", "override_items"]
