"""Where a profiled step's time went, read back from the TensorBoard profile (xplane.pb).

TensorFlow's profiler writes one XSpace per worker: on the plane "/host:CPU" (GPUs add a
plane per device) one line per thread, each event an op (`name:Type`) or a named region
with its start and duration. tfpar marks each profiled step with a
`tf.profiler.experimental.Trace("train", step_num=N)` region on the thread that runs it;
this module cuts the timeline at those marks and says, instant by instant, what the
worker was doing:

  compute       an op or XLA program running on a compute thread (inter-op pool, Eigen
                intra-op pool, a GPU stream)
  collective    a collective op in flight (by kind: all-reduce, all-gather,
                reduce-scatter, all-to-all, broadcast, send/recv) and no compute
  input         waiting for the input pipeline (IteratorGetNext) and nothing above
  idle          none of these (Python, dispatch, waiting on nothing traced)

The parts of a step add up to its marked duration exactly; the test of the method is
that these durations equal the steps' times measured on the host clock (tests/test_profiling.py).

Example:
    >>> steps = read_steps(xplane_file)          # [Step(number=11, ...), ...]
    >>> breakdown(steps[0])                      # {'compute': 0.12, 'all_reduce': 0.01, ...}
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

from tfpar.errors import TfparError

STEP_REGION = "train"  # the name of tfpar's step marks (Keras's TensorBoard callback uses it too)

COLLECTIVE_KINDS = {
    "CollectiveReduceV2": "all_reduce", "CollectiveReduce": "all_reduce", "NcclAllReduce": "all_reduce",
    "CrossReplicaSum": "all_reduce", "XlaAllReduce": "all_reduce",
    "CollectiveGatherV2": "all_gather", "CollectiveGather": "all_gather",
    "CollectiveReduceScatterV2": "reduce_scatter", "XlaReduceScatter": "reduce_scatter",
    "CollectiveAllToAllV2": "all_to_all", "AllToAll": "all_to_all",
    "CollectiveBcastSendV2": "broadcast", "CollectiveBcastRecvV2": "broadcast",
    "CollectivePermute": "send_recv", "_Send": "send_recv", "_Recv": "send_recv",
    "_HostSend": "send_recv", "_HostRecv": "send_recv",
}
# A GPU's NCCL kernels (on its device plane): the kind from the kernel's name
NCCL_KINDS = (("ReduceScatter", "reduce_scatter"), ("AllReduce", "all_reduce"), ("AllGather", "all_gather"),
              ("AllToAll", "all_to_all"), ("Broadcast", "broadcast"), ("SendRecv", "send_recv"),
              ("Send", "send_recv"), ("Recv", "send_recv"))
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
PARTS = ("compute", *KINDS, "input", "idle")  # in the order the picture stacks them
INPUT_TYPES = ("IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
               "MultiDeviceIteratorGetNextFromShard")
INPUT_REGIONS = ("IteratorGetNextOp::DoCompute", "IteratorGetNextAsOptionalOp::DoCompute",
                 "MultiDeviceIteratorGetNextFromShardOp::DoCompute")  # a consumer's wait
COMPUTE_THREADS = ("tf_Compute", "tf_numa", "Eigen", "tf_XLA", "Stream")
_PRIORITY = {part: rank for rank, part in enumerate(("compute", *KINDS, "input"))}


class ProfileError(TfparError):
    """A profile that cannot be read back (no file, no step marks)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One traced event, times in picoseconds on the profile's clock."""

    name: str
    start: int
    duration: int
    stats: dict

    @property
    def end(self) -> int:
        return self.start + self.duration

    @property
    def op_type(self) -> str:
        return self.name.rsplit(":", 1)[-1] if ":" in self.name else ""

    @property
    def op_name(self) -> str:
        return self.name.rsplit(":", 1)[0]


@dataclasses.dataclass
class Step:
    """One marked step and the events that overlap it, by class."""

    number: int
    start: int
    duration: int
    compute: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)  # (kind, Event)
    inputs: list = dataclasses.field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.duration / 1e12


def xplane_files(logdir: str) -> list[str]:
    """The xplane.pb files under a profile logdir, oldest session first."""
    return sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))


def load_xspace(path: str):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def _stats(plane, stats) -> dict:
    found = {}
    for s in stats:
        name = plane.stat_metadata[s.metadata_id].name
        kind = s.WhichOneof("value")
        value = getattr(s, kind) if kind else None
        if kind == "ref_value":
            value = plane.stat_metadata[value].name
        found[name] = value
    return found


def nccl_kind(name: str) -> str | None:
    """The collective kind of a GPU kernel named for NCCL (None: not NCCL's).

    Example:
        >>> nccl_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, ...)")
        'all_reduce'
    """
    if "nccl" not in name.lower():
        return None
    return next((kind for part, kind in NCCL_KINDS if part.lower() in name.lower()), "all_reduce")


def _events(space) -> tuple[list[Event], list[Event], list[Event], list[tuple[str, Event]], list[Event]]:
    """(step marks, compute, input, (kind, collective), all) of every host and device plane."""
    marks, compute, inputs, collectives = [], [], [], []
    for plane in space.planes:
        if not (plane.name.startswith("/host:") or plane.name.startswith("/device:")):
            continue
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            computing = on_device or line.name.startswith(COMPUTE_THREADS)
            base = line.timestamp_ns * 1000
            for e in line.events:
                name = plane.event_metadata[e.metadata_id].name
                op_type = name.rsplit(":", 1)[-1] if ":" in name else ""
                if name == STEP_REGION:
                    stats = _stats(plane, e.stats)
                    if "step_num" in stats:
                        marks.append(Event(name, base + e.offset_ps, e.duration_ps, stats))
                elif op_type in COLLECTIVE_KINDS or (on_device and nccl_kind(name)):
                    event = Event(name, base + e.offset_ps, e.duration_ps, _stats(plane, e.stats))
                    collectives.append((COLLECTIVE_KINDS.get(op_type) or nccl_kind(name), event))
                elif op_type in INPUT_TYPES or name in INPUT_REGIONS:
                    inputs.append(Event(name, base + e.offset_ps, e.duration_ps, {}))
                elif computing:
                    compute.append(Event(name, base + e.offset_ps, e.duration_ps, {}))
    return marks, compute, inputs, collectives


def read_steps(path: str) -> list[Step]:
    """The marked steps of one xplane.pb, each with the events that overlap it."""
    marks, compute, inputs, collectives = _events(load_xspace(path))
    if not marks:
        raise ProfileError(f"{path} holds no step marks ('{STEP_REGION}' regions with a step_num): "
                           "it was not written by a tfpar profile window.")
    steps = [Step(int(m.stats["step_num"]), m.start, m.duration) for m in sorted(marks, key=lambda m: m.start)]

    def owners(event: Event):
        for step in steps:  # few steps: a scan is plain and fast enough
            if event.start < step.start + step.duration and event.end > step.start:
                yield step

    for event in compute:
        for step in owners(event):
            step.compute.append(event)
    for event in inputs:
        for step in owners(event):
            step.inputs.append(event)
    for kind, event in collectives:
        for step in owners(event):
            step.collectives.append((kind, event))
    return steps


def breakdown(step: Step) -> dict[str, float]:
    """Seconds of `step` in each of PARTS; they sum to the step's duration.

    Each instant goes to the first part that covers it: compute, then collectives (in
    KINDS order: communication that compute hides is not counted as waiting), then input,
    else idle.
    """
    lo, hi = step.start, step.start + step.duration
    edges = []  # (time, +1 / -1, part)
    for part, events in (("compute", step.compute), ("input", step.inputs)):
        for e in events:
            edges += [(max(e.start, lo), 1, part), (min(e.end, hi), -1, part)]
    for kind, e in step.collectives:
        edges += [(max(e.start, lo), 1, kind), (min(e.end, hi), -1, kind)]
    edges = sorted(edge for edge in edges if lo <= edge[0] <= hi)
    open_count = collections.Counter()
    parts = dict.fromkeys(PARTS, 0)
    now = lo
    for time, delta, part in edges:
        covering = [p for p, n in open_count.items() if n > 0]
        top = min(covering, key=_PRIORITY.__getitem__) if covering else "idle"
        parts[top] += time - now
        now = time
        open_count[part] += delta
    parts["idle"] += hi - now
    return {part: ps / 1e12 for part, ps in parts.items()}


_CONTROL_PATH = re.compile(r"/(?:body|cond|then|else|branch\d*)/_\d+/$")


def graph_name(traced_name: str, graph_names=()) -> str:
    """The name of a traced op in its function's graph. Control-flow lowering puts the
    loop's or branch's path in front (`while/body/_1/while/CollectiveReduceV2` is the loop
    body's `while/CollectiveReduceV2`): the longest of `graph_names` that the traced name
    ends with after such a path, else the traced name as it is.

    Example:
        >>> graph_name("while/body/_1/while/CollectiveReduceV2", ["while/CollectiveReduceV2"])
        'while/CollectiveReduceV2'
    """
    if traced_name in graph_names:
        return traced_name
    for name in sorted(graph_names, key=len, reverse=True):
        prefix = traced_name[:-len(name)]
        if traced_name.endswith("/" + name) and _CONTROL_PATH.search(prefix):
            return name
    return traced_name
