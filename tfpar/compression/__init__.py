"""Gradient compression for tfpar's loop: fewer bytes on the wire, same model at the end.

Example:
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy,
    ...                         compression=tfpar.compression.TopK(0.01))
    >>> tfpar.compression.get("powersgd", rank=4)
    powersgd(4)
"""

from __future__ import annotations

from tfpar.compression.aggregation import Compression
from tfpar.compression.compressors import (BF16, FP16, CompressionError, Compressor, Int8,
                                           NoCompression, Sign, TopK)
from tfpar.compression.policy import Policy
from tfpar.compression.powersgd import PowerSGD

COMPRESSORS = {"none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "topk": TopK,
               "powersgd": PowerSGD, "sign": Sign}


def get(name: str, **args) -> Compressor:
    """A compressor by name: none, fp16, bf16, int8, topk(ratio=), powersgd(rank=), sign."""
    key = name.lower()
    if key not in COMPRESSORS:
        raise CompressionError(f"Unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}.")
    try:
        return COMPRESSORS[key](**args)
    except TypeError as e:
        raise CompressionError(f"Compressor {key!r} does not take {sorted(args)}: {e}.") from None


__all__ = ["BF16", "COMPRESSORS", "Compression", "CompressionError", "Compressor", "FP16",
           "Int8", "NoCompression", "Policy", "PowerSGD", "Sign", "TopK", "get"]
