"""Which gradient gets which compressor.

By default, small tensors (fewer than `min_size` elements), biases, normalisation scales
and offsets, and embeddings go as plain float32: they are cheap, or they do not tolerate
compression well. `overrides` maps regexes over variable paths to a compressor name (or
"none"); the first match wins and beats the defaults. `warmup_steps` runs the first steps
without the lossy compressor: in float32, or (`warmup_compressor="fp16"` or "bf16") every
tensor in 16 bits, half the bytes of a start that on a slow link costs most of the time to
quality.

Example:
    >>> policy = Policy(min_size=4096, overrides={r"embedding": "topk"}, warmup_steps=100)
    >>> policy.choose("gpt/blocks.0/attn/query/kernel", (128, 4, 32), topk)   # -> topk
    >>> Policy(warmup_steps=120, warmup_compressor="fp16").start()             # -> fp16
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

from tfpar.compression.compressors import CompressionError, Compressor

DEFAULT_SKIP = (r"bias", r"norm|gamma|beta", r"embed")
WARMUP_COMPRESSORS = ("none", "fp16", "bf16")  # dense and lossless enough for the start


@dataclasses.dataclass(frozen=True)
class Policy:
    min_size: int = 1024
    skip: tuple[str, ...] = DEFAULT_SKIP
    overrides: Mapping[str, Compressor | str] = dataclasses.field(default_factory=dict)
    warmup_steps: int = 0
    warmup_compressor: Compressor | str = "none"

    def __post_init__(self):
        if self.min_size < 0 or self.warmup_steps < 0:
            raise CompressionError("Policy min_size and warmup_steps must be >= 0.")
        start = start_compressor(self.warmup_compressor, "warmup_compressor")
        if start is not None and not self.warmup_steps:
            raise CompressionError(f"warmup_compressor={start.name!r} needs warmup_steps > 0 "
                                   "(it compresses the start, which is empty).")
        for pattern in (*self.skip, *self.overrides):
            try:
                re.compile(pattern)
            except re.error as e:
                raise CompressionError(f"Compression policy regex {pattern!r} is invalid: {e}.") from None

    def start(self) -> Compressor | None:
        """What every tensor goes through during the first `warmup_steps` (None: float32)."""
        return start_compressor(self.warmup_compressor, "warmup_compressor")

    def choose(self, path: str, shape, default: Compressor) -> Compressor | None:
        """The compressor for the variable at `path` (None: plain float32 all-reduce)."""
        wanted = self.wanted(path, shape, default)
        return None if wanted is None else self._fit(wanted, shape)

    def wanted(self, path: str, shape, default: Compressor) -> Compressor | None:
        """What the overrides and skip rules ask for, before checking that it applies."""
        from tfpar.compression import get  # names -> compressors

        for pattern, chosen in self.overrides.items():
            if re.search(pattern, path):
                return get(chosen) if isinstance(chosen, str) else chosen
        if math.prod(shape) < self.min_size or any(re.search(p, path) for p in self.skip):
            return None
        return default

    @staticmethod
    def _fit(compressor: Compressor, shape) -> Compressor | None:
        if compressor.name == "none" or not compressor.applies_to(shape):
            return None
        return compressor


def start_compressor(value: Compressor | str, what: str) -> Compressor | None:
    """The compressor a start sends every tensor through (None: float32), checked: only a
    dense one of WARMUP_COMPRESSORS. `what` names the argument in the message."""
    name = getattr(value, "name", str(value)).lower()
    if name not in WARMUP_COMPRESSORS:
        raise CompressionError(
            f"{what} {value!r} is not one of {', '.join(WARMUP_COMPRESSORS)}: the start sends "
            "every tensor dense; a lossy compressor belongs after it (the Compression's own compressor).")
    from tfpar.compression import get  # names -> compressors

    chosen = get(name) if isinstance(value, str) else value
    return None if chosen.name == "none" else chosen
