"""Gradient compression for tfpar's loop: fewer bytes on the wire, same model at the end.

Example:
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy,
    ...                         compression=tfpar.compression.TopK(0.01))
    >>> tfpar.compression.get("powersgd", rank=4)
    powersgd(4)
"""

from __future__ import annotations

from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import (BF16, FP16, CompressionError, Compressor, Int8,
                                           NoCompression, Sign, TopK)
from tfpar.compression.dgc import DGC
from tfpar.compression.keras_fit import compress_fit
from tfpar.compression.policy import Policy
from tfpar.compression.powersgd import PowerSGD

COMPRESSORS = {"none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "topk": TopK,
               "powersgd": PowerSGD, "sign": Sign, "dgc": DGC}


def get(name: str, **args) -> Compressor:
    """A compressor by name: none, fp16, bf16, int8, topk(ratio=), powersgd(rank=,
    rank_schedule=), sign, dgc(ratio=, momentum=, clip_norm=, masking=, warmup_steps=, stages=)."""
    if isinstance(name, Compressor):
        return name
    key = name.lower()
    if key not in COMPRESSORS:
        raise CompressionError(f"Unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}.")
    try:
        return COMPRESSORS[key](**args)
    except TypeError as e:
        raise CompressionError(f"Compressor {key!r} does not take {sorted(args)}: {e}.") from None


def from_config(name: str, ratio: float = 0.01, rank: int = 4, min_size: int = 1024,
                warmup_steps: int = 0, overrides: str = "", skip: str = "",
                reset_on_restore: bool = False) -> Compression | None:
    """The Compression that `--config.compression=NAME --config.compression_args.*` asks for
    (None for 'none' with no overrides). `overrides`: "regex=name,regex=name"; `skip`: a
    comma-separated list of regexes that replaces the default skip list."""
    def named(key: str) -> Compressor:
        return get(key, **{"topk": {"ratio": ratio}, "powersgd": {"rank": rank}}.get(key.lower(), {}))

    compressor = named(name)
    parsed = {}
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        pattern, sep, chosen = item.rpartition("=")
        if not sep or not pattern:
            raise CompressionError(f"compression_args.overrides item {item!r} is not 'regex=name'.")
        parsed[pattern] = named(chosen.strip())
    skip_list = tuple(p.strip() for p in skip.split(",") if p.strip()) if skip else None
    if compressor.name == "none" and not parsed:
        return None
    policy = Policy(min_size=min_size, warmup_steps=warmup_steps, overrides=parsed,
                    **({"skip": skip_list} if skip_list is not None else {}))
    return Compression(compressor, policy, reset_on_restore=reset_on_restore)


__all__ = ["BF16", "COMPRESSORS", "Compression", "CompressionError", "Compressor", "DGC", "FP16",
           "Int8", "NoCompression", "Policy", "PowerSGD", "Sign", "TopK", "compress_fit", "from_config",
           "get"]
