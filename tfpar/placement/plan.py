"""Stage plans: which device holds which of a model's ordered stages.

A StagedModel (tfpar.models) is a chain of named stages (`embed`, `blocks.0.attn`, ...,
`head`); a plan cuts that chain into contiguous groups and gives each group a device.
Plans are written by hand or balanced by parameter count (or any per-stage cost), and
printed as a table before training.

Example:
    >>> plan = manual(model, {"embed,blocks.0.attn-blocks.0.mlp": "/cpu:0",
    ...                       "blocks.1.attn-head": "/cpu:1"})
    >>> plan = balanced(model, ["/cpu:0", "/cpu:1"])          # by parameters
    >>> print(plan.table())
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from tfpar.errors import TfparError


class PlacementError(TfparError, ValueError):
    """A stage plan that does not fit the model or the devices."""


@dataclasses.dataclass(frozen=True)
class StageGroup:
    """Consecutive stages on one device."""

    names: tuple[str, ...]
    device: str
    params: int


@dataclasses.dataclass(frozen=True)
class StagePlan:
    groups: tuple[StageGroup, ...]

    @property
    def devices(self) -> list[str]:
        return [g.device for g in self.groups]

    def device_of(self, stage_name: str) -> str:
        for group in self.groups:
            if stage_name in group.names:
                return group.device
        raise PlacementError(f"Stage {stage_name!r} is in no group of this plan.")

    def scope(self):
        """Build the model inside: each stage's variables are created on its device.

        Example:
            >>> plan = balanced(GPT.from_preset("tiny"), ["/cpu:0", "/cpu:1"])
            >>> with plan.scope():
            ...     model = GPT.from_preset("tiny")
        """
        from tfpar.models.staged import StagedModel

        return StagedModel.placed({name: g.device for g in self.groups for name in g.names})

    def largest_share(self) -> float:
        """The largest group's share of all parameters (1/S when perfectly balanced)."""
        total = sum(g.params for g in self.groups)
        return max(g.params for g in self.groups) / max(total, 1)

    def table(self) -> str:
        """One line per group: stage index, layers, parameters, fp32 bytes, device."""
        rows = [("stage", "layers", "params", "memory", "device")]
        for i, g in enumerate(self.groups):
            layers = g.names[0] if len(g.names) == 1 else f"{g.names[0]} .. {g.names[-1]}"
            rows.append((str(i), layers, f"{g.params:,}", f"{4 * g.params / 1e6:.2f} MB", g.device))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def stage_params(model) -> list[tuple[str, int]]:
    """(name, parameter count) of every stage of a StagedModel, in order."""
    if not hasattr(model, "stages"):
        raise PlacementError(f"{type(model).__name__} has no stages(); use a tfpar StagedModel "
                             "(GPT, EncoderClassifier, ViT) or tfpar.placement.sequential_stages.")
    return [(name, int(sum(math.prod(v.shape) for v in layer.weights)))
            for name, layer in model.stages()]


def _expand(spec: str, names: list[str]) -> list[str]:
    """'embed,blocks.0.attn-blocks.1.mlp' -> the listed names, ranges inclusive."""
    chosen = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-") if part.count("-") == 1 else (part, "", "")
        for end in (first, last or first):
            if end not in names:
                raise PlacementError(f"Unknown stage {end!r} in plan; stages are: {', '.join(names)}.")
        start, stop = names.index(first), names.index(last or first)
        if stop < start:
            raise PlacementError(f"Stage range {part!r} runs backwards.")
        chosen.extend(names[start:stop + 1])
    return chosen


def manual(model, assignment: Mapping[str, str]) -> StagePlan:
    """A plan from {"stage list or range": device}; every stage exactly once, in order."""
    params = dict(stage_params(model))
    names = list(params)
    groups, seen = [], []
    for spec, device in assignment.items():
        members = _expand(spec, names)
        groups.append(StageGroup(tuple(members), device, sum(params[n] for n in members)))
        seen.extend(members)
    if seen != names:
        missing = [n for n in names if n not in seen]
        raise PlacementError(
            "A plan must list every stage once, in model order (each group a contiguous run). "
            + (f"Missing: {', '.join(missing)}." if missing else f"Got order: {', '.join(seen)}."))
    return StagePlan(tuple(groups))


def balanced(model, devices: Sequence[str],
             cost: Callable[[str, int], float] | None = None) -> StagePlan:
    """Cuts the stages into len(devices) contiguous groups minimising the largest group's
    cost (default: its parameter count; pass `cost(name, params)` for FLOPs or measured
    time). Exact: dynamic programming over the cut points."""
    stages = stage_params(model)
    if len(devices) > len(stages):
        raise PlacementError(f"{len(devices)} devices but only {len(stages)} stages to place.")
    weights = [cost(n, p) if cost else p for n, p in stages]
    cuts = _linear_partition(weights, len(devices))
    groups, start = [], 0
    for device, stop in zip(devices, cuts):
        members = stages[start:stop]
        groups.append(StageGroup(tuple(n for n, _ in members), device, sum(p for _, p in members)))
        start = stop
    return StagePlan(tuple(groups))


def _linear_partition(weights: list[float], parts: int) -> list[int]:
    """End indices of `parts` contiguous non-empty runs minimising the largest run sum."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    ends, i = [], n
    for k in range(parts, 0, -1):
        ends.append(i)
        i = choice[k][i]
    return ends[::-1]
