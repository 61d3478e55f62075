"""Stage plans: which device holds which of a model's ordered stages.

A StagedModel (tfpar.models) is a chain of named stages (`embed`, `blocks.0.attn`, ...,
`head`); a plan cuts that chain into contiguous groups and gives each group a device.
Plans are written by hand or balanced by parameter count, FLOPs or measured time (see
tfpar.placement.costs), and printed as a table before training. `plan.replicate(devices)`
makes a hybrid plan: R data-parallel copies of the pipeline, replica r on its own S devices,
trained under `plan.strategy` (a MirroredStrategy, one replica per pipeline). Across
machines, `plan.scope(strategy)` builds under multi_worker_mirrored: data parallel over the
workers, the plan's pipeline on each worker's own devices.

Example:
    >>> plan = manual(model, {"embed,blocks.0.attn-blocks.0.mlp": "/cpu:0",
    ...                       "blocks.1.attn-head": "/cpu:1"})
    >>> plan = balanced(model, ["/cpu:0", "/cpu:1"])          # by parameters
    >>> print(plan.table())
    >>> hybrid = plan.replicate(["/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"])   # 2 x 2
    >>> with hybrid.scope():                   # hybrid.strategy()'s scope, stages placed
    ...     model = GPT.from_preset("tiny")
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Iterator, Mapping, Sequence

import tensorflow as tf
from tensorflow.python.eager import context as eager_context

from tfpar.errors import TfparError
from tfpar.models.staged import building_stage


class PlacementError(TfparError, ValueError):
    """A stage plan that does not fit the model or the devices."""


LOGICAL = "logical:"  # a TPU replica's logical core as a plan's "device" (see placement.tpu_cores)


def is_logical(device: str) -> bool:
    return device.startswith(LOGICAL)


def is_multi_worker_mirrored(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy (also with one worker)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


@dataclasses.dataclass(frozen=True)
class StageGroup:
    """Consecutive stages on one device."""

    names: tuple[str, ...]
    device: str
    params: int


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Stage groups in model order, each on a device; with `replicate`, R copies of them.

    `replica_devices[r][s]` is the device of group s in data-parallel replica r (one row,
    the groups' own devices, unless replicated).
    """

    groups: tuple[StageGroup, ...]
    replica_devices: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        if not self.replica_devices:
            object.__setattr__(self, "replica_devices", (tuple(g.device for g in self.groups),))

    @property
    def devices(self) -> list[str]:
        return [g.device for g in self.groups]

    @property
    def replicas(self) -> int:
        return len(self.replica_devices)

    def device_of(self, stage_name: str, replica: int = 0) -> str:
        return self.replica_devices[replica][self.group_of(stage_name)]

    def group_of(self, stage_name: str) -> int:
        for i, group in enumerate(self.groups):
            if stage_name in group.names:
                return i
        raise PlacementError(f"Stage {stage_name!r} is in no group of this plan.")

    @property
    def stage_devices(self) -> list[str]:
        """The distinct devices, in order of their first group (S of them; an interleaved
        plan has v groups on each)."""
        return list(dict.fromkeys(self.devices))

    @property
    def chunks(self) -> int:
        """Groups per device: v for an interleaved plan (`balanced(..., chunks=v)`), else 1."""
        return len(self.groups) // len(self.stage_devices)

    def device_index(self, group: int) -> int:
        """Which of `stage_devices` runs group `group`."""
        return self.stage_devices.index(self.groups[group].device)

    def replicate(self, devices: Sequence[str]) -> "StagePlan":
        """Hybrid data x pipeline parallelism: len(devices) / S copies of this plan, replica
        r on devices[r*S:(r+1)*S] (S = number of distinct stage devices). Build and train
        under `scope()`.

        Example:
            >>> plan.replicate(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]).replica_devices
            (('/cpu:0', '/cpu:1'), ('/cpu:2', '/cpu:3'))
        """
        stages, devices = len(self.stage_devices), list(devices)
        if not devices or len(devices) % stages:
            raise PlacementError(f"A hybrid plan needs a multiple of {stages} devices (one per stage "
                                 f"device per replica); got {len(devices)}.")
        if len(set(devices)) != len(devices):
            raise PlacementError(f"Devices repeat in {devices}: every (replica, stage) needs its own.")
        rows = tuple(tuple(devices[r * stages + self.device_index(g)] for g in range(len(self.groups)))
                     for r in range(len(devices) // stages))
        groups = tuple(dataclasses.replace(g, device=d) for g, d in zip(self.groups, rows[0]))
        return StagePlan(groups, rows)

    @functools.cached_property
    def strategy(self) -> tf.distribute.Strategy:
        """The strategy to train under: one replica per pipeline, on its stage-0 device (a
        MirroredStrategy; the default strategy for a single pipeline)."""
        if self.replicas == 1:
            return tf.distribute.get_strategy()
        from tfpar.strategy import create_strategy

        return create_strategy("mirrored", devices=[row[0] for row in self.replica_devices])

    @contextlib.contextmanager
    def scope(self, strategy: tf.distribute.Strategy | None = None) -> Iterator[tf.distribute.Strategy]:
        """Build the model inside: each stage's variables are created on its device (in every
        replica, for a hybrid plan, whose strategy's scope this also enters).

        `strategy`: a multi_worker_mirrored strategy to build under instead (hybrid across
        machines: data parallel over workers, this plan's pipeline on each worker's local
        devices). The plan then holds one pipeline per local replica and its devices are
        local ("/cpu:1"): on worker i they mean "/job:worker/replica:0/task:i/cpu:1".

        Raises:
            PlacementError: `strategy` is not multi-worker mirrored, or does not run one
                replica per pipeline of this plan on each worker, or the plan names a job,
                or a stage device is missing on this worker (see check_multi_worker).

        Example:
            >>> plan = balanced(GPT.from_preset("tiny"), ["/cpu:0", "/cpu:1"])
            >>> with plan.scope():
            ...     model = GPT.from_preset("tiny")
            >>> with plan.scope(tfpar.create_strategy("multi_worker_mirrored")) as strategy:
            ...     model = GPT.from_preset("tiny")          # trainer: strategy=strategy
        """
        if strategy is not None:
            self.check_multi_worker(strategy)
        # The creator goes outside the strategy's scope: it runs after the strategy's own
        # creator, so the stage's device wins over the replica's device.
        with tf.variable_creator_scope(self._place_variable):
            if strategy is None and self.replicas == 1:
                yield tf.distribute.get_strategy()
                return
            strategy = strategy or self.strategy
            with strategy.scope():
                yield strategy

    def check_multi_worker(self, strategy: tf.distribute.Strategy) -> None:
        """Refuses a multi-worker strategy this plan cannot run under, saying what can: one
        pipeline (plan row) per local replica of multi_worker_mirrored, on local devices."""
        if not is_multi_worker_mirrored(strategy):
            raise PlacementError(
                f"plan.scope(strategy) takes a multi_worker_mirrored strategy; got "
                f"{type(strategy).__name__}. On one machine use `with plan.scope() as strategy:` "
                "(a hybrid plan brings its own MirroredStrategy).")
        local = len(strategy.extended.worker_devices)
        if self.replicas != local:
            raise PlacementError(
                f"This plan has {self.replicas} pipeline replica(s) but multi_worker_mirrored runs "
                f"{local} replica(s) on each worker: give each worker one pipeline per local "
                f"replica (here {local}: " + ("the plan as built, without replicate()" if local == 1
                                              else f"plan.replicate(<{local} x stages devices>)") + ").")
        named = [d for d in self.devices if tf.DeviceSpec.from_string(d).job is not None
                 or tf.DeviceSpec.from_string(d).task is not None]
        if named:
            spec = tf.DeviceSpec.from_string(named[0])
            local_name = tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index)
            raise PlacementError(
                f"Under multi_worker_mirrored a plan's devices are each worker's own: write "
                f"{local_name.to_string()!r}, not {named[0]!r} (every worker runs the same pipeline "
                "on its own devices).")
        if local > 1:  # each replica's copy is found by its strategy device (_replica_here)
            for r, (row, device) in enumerate(zip(self.replica_devices, strategy.extended.worker_devices)):
                if not _same_device(row[0], device):
                    raise PlacementError(
                        f"Pipeline replica {r} starts on {row[0]} but multi_worker_mirrored's local "
                        f"replica {r} is {device}: order the devices given to plan.replicate so "
                        "that row r's first stage is the strategy's r-th local device.")
        self._check_local_devices(strategy.extended.worker_devices[0])

    def _check_local_devices(self, worker_device: str) -> None:
        """Every stage device exists on this worker (else TensorFlow's soft placement would
        quietly put the stage on the replica's device)."""
        worker = tf.DeviceSpec.from_string(worker_device)
        here = [d.name for d in tf.config.list_logical_devices()
                if (tf.DeviceSpec.from_string(d.name).job, tf.DeviceSpec.from_string(d.name).task)
                in ((None, None), (worker.job, worker.task))]
        missing = [d for d in dict.fromkeys(self.devices) if not any(_same_device(d, h) for h in here)]
        if missing:
            raise PlacementError(
                f"This worker has no {', '.join(missing)} (it has {', '.join(here)}): split its "
                "devices on every worker as the strategy starts, e.g. tfpar.create_strategy("
                "'multi_worker_mirrored', virtual_devices=2).")

    def _place_variable(self, next_creator, **kwargs):
        stage = building_stage()
        if stage is None:  # not a stage's weight (optimizer slots follow their variable)
            return next_creator(**kwargs)
        device = self.device_of(stage, self._replica_here())
        if is_logical(device):  # a TPU core: TPUStrategy places it on the core in scope
            core = int(device[len(LOGICAL):])
            with tf.distribute.get_strategy().extended.experimental_logical_device(core):
                return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)

    def _replica_here(self) -> int:
        """The replica whose copy is being created: MirroredStrategy creates replica r's
        copy under its device, replica r's stage-0 device."""
        if self.replicas == 1:
            return 0
        here = eager_context.context().device_name or ""
        for r, row in enumerate(self.replica_devices):
            if _same_device(row[0], here):
                return r
        raise PlacementError("Build a hybrid plan's model inside `with plan.scope():` (it enters "
                             "plan.strategy's scope, which creates one copy per replica).")

    def largest_share(self) -> float:
        """The largest group's share of all parameters (1/S when perfectly balanced)."""
        total = sum(g.params for g in self.groups)
        return max(g.params for g in self.groups) / max(total, 1)

    def table(self) -> str:
        """One line per group: stage index, layers, parameters, fp32 bytes, device (one per
        replica for a hybrid plan)."""
        rows = [("stage", "layers", "params", "memory", "devices" if self.replicas > 1 else "device")]
        for i, g in enumerate(self.groups):
            layers = g.names[0] if len(g.names) == 1 else f"{g.names[0]} .. {g.names[-1]}"
            devices = ", ".join(row[i] for row in self.replica_devices)
            rows.append((str(i), layers, f"{g.params:,}", f"{4 * g.params / 1e6:.2f} MB", devices))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def _same_device(a: str, b: str) -> bool:
    """Same device type and index, whatever job or task either names."""
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.device_type or "").upper() == (b.device_type or "").upper() and a.device_index == b.device_index


def stage_params(model) -> list[tuple[str, int]]:
    """(name, parameter count) of every stage of a StagedModel, in order."""
    if not hasattr(model, "stages"):
        raise PlacementError(f"{type(model).__name__} has no stages(); use a tfpar StagedModel "
                             "(GPT, EncoderClassifier, ViT), or tfpar.models.Chain.from_keras(model) for a "
                             "Sequential or chain-shaped functional model.")
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
             cost: Callable[[str, int], float] | Mapping[str, float] | None = None,
             chunks: int = 1, layout: str = "round_robin") -> StagePlan:
    """Cuts the stages into len(devices) * chunks contiguous groups minimising the largest
    group's cost: its parameter count by default, or a cost per stage name (a mapping, e.g.
    `costs.flops(model, x)` or `costs.seconds(model, x)`, or `cost(name, params)`).
    Exact: dynamic programming over the cut points. With chunks = v >= 2 (for
    schedule="interleaved") group g goes to devices[g % S], round robin; with chunks=2,
    layout="v" (for schedule="zb-v") to devices[g] for g < S and devices[2S - 1 - g] after.

    Example:
        >>> balanced(model, ["/cpu:0", "/cpu:1"], cost=costs.seconds(model, x)).table()
        >>> balanced(model, ["/cpu:0", "/cpu:1"], chunks=2).devices
        ['/cpu:0', '/cpu:1', '/cpu:0', '/cpu:1']
        >>> balanced(model, ["/cpu:0", "/cpu:1"], chunks=2, layout="v").devices
        ['/cpu:0', '/cpu:1', '/cpu:1', '/cpu:0']
    """
    stages = stage_params(model)
    parts = len(devices) * chunks
    if chunks < 1:
        raise PlacementError(f"chunks must be >= 1 (groups per device); got {chunks}.")
    if layout not in ("round_robin", "v") or (layout == "v" and chunks != 2):
        raise PlacementError(f"layout={layout!r} with chunks={chunks}: use layout='round_robin' "
                             "(any chunks), or layout='v' with chunks=2 (schedule='zb-v').")
    if parts > len(stages):
        most = len(stages) // len(devices)
        fixes = [f"at most {len(stages) // chunks} devices"] if len(stages) >= chunks else []
        if chunks > 1 and most >= 2:
            fixes.append(f"chunks <= {most}")
        elif chunks > 1 and most == 1:
            fixes.append("chunks=1 (one group per device: schedule gpipe, 1f1b or zb-h1)")
        raise PlacementError(
            f"{len(devices)} devices x {chunks} chunks = {parts} stage groups, but the model has "
            f"only {len(stages)} stages: use " + ", ".join(fixes + ["or a deeper model" if fixes else "a deeper model"]) + ".")
    if isinstance(cost, Mapping):
        missing = [n for n, _ in stages if n not in cost]
        if missing:
            raise PlacementError(f"The cost mapping has no entry for stages {', '.join(missing)}.")
        weights = [float(cost[n]) for n, _ in stages]
    else:
        weights = [cost(n, p) if cost else p for n, p in stages]
    cuts = _linear_partition(weights, parts)
    groups, start = [], 0
    for g, stop in enumerate(cuts):
        members = stages[start:stop]
        device = g % len(devices) if layout == "round_robin" else min(g, 2 * len(devices) - 1 - g)
        groups.append(StageGroup(tuple(n for n, _ in members), devices[device],
                                 sum(p for _, p in members)))
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
