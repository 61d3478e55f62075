"""Bytes on the wire, read from the traced step: every collective op, its payload, its device.

Counted, not guessed: the static shape and dtype of each collective's input in the graph,
per device, following the graph as it executes (a loop body once per step, the larger
branch of a conditional, or the mean of one named `every_K_steps`, called functions). An
all-gather's shape exchange is its own small
collective and is counted like any other; its payload is padded to the largest replica's,
which is the same static size on every replica here, so the padding is zero and the
payload is counted from the tensor before the pad op.

Example:
    >>> step = trainer.traced_step(dataset)
    >>> bytes_per_replica(step)                # e.g. 61_464
    >>> dynamic(collectives(step))             # collectives whose size depends on the data
"""

from __future__ import annotations

import collections
import dataclasses
import re

import tensorflow as tf

from tfpar.strategy import private_api

COLLECTIVE_TYPES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduce",
                    "CollectiveGather", "CollectiveBcastSendV2", "NcclAllReduce",
                    "CollectiveAllToAllV2", "CollectiveReduceScatterV2")
# TPUStrategy's collectives (tpu_ops): all_reduce is CrossReplicaSum; all_gather is a
# CrossReplicaSum of value x one-hot replica mask, so its input, R x the payload, is what
# one replica hands over; dtypes CrossReplicaSum lacks gather through AllToAll of the value
# tiled R times (plus a small AllToAll of replica ids). Counted from the input like the rest.
TPU_COLLECTIVE_TYPES = ("CrossReplicaSum", "AllToAll", "CollectivePermute", "XlaAllReduce",
                        "XlaReduceScatter")
COLLECTIVE_TYPES = COLLECTIVE_TYPES + TPU_COLLECTIVE_TYPES

# The name scope of collectives that carry no gradient: the replicas' one-float agreement
# that every gradient is finite (tfpar.loop.nonfinite). Counted, and also named apart.
CHECK_SCOPE = "tfpar_finite_check"
# Bytes a worker transmits per byte it hands to the collective, on a ring / pairwise
# exchange of R workers: what a link carries, unlike the handed bytes for a gather.
LINK_FACTORS = {"reduce": lambda r: 2 * (r - 1) / r, "gather": lambda r: r - 1.0,
                "all_to_all": lambda r: (r - 1) / r, "reduce_scatter": lambda r: (r - 1) / r,
                "bcast": lambda r: 1.0}


@dataclasses.dataclass(frozen=True)
class Collective:
    type: str
    name: str
    device: str
    dtype: str
    shape: tuple
    bytes: int | None  # None: a data-dependent size (e.g. a sparse gradient's rows)


def _static_input(op) -> tf.Tensor:
    tensor = op.inputs[0]
    if not tensor.shape.is_fully_defined() and tensor.op.type in ("Pad", "PadV2"):
        tensor = tensor.op.inputs[0]  # see module docstring: the padding is zero
    return tensor


def collectives(concrete_function, checks: bool = True) -> list[Collective]:
    """Every collective op of a traced function, nested functions included (each op once);
    `checks=False`: the gradients' alone (see CHECK_SCOPE)."""
    found: list[Collective] = []
    for graph in _all_graphs(concrete_function.graph).values():
        for op in graph.get_operations():
            if _counted(op, checks):
                found.append(_describe(op))
    return found


def _describe(op) -> Collective:
    tensor = _static_input(op)
    shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else ()
    size = (int(tensor.shape.num_elements()) * tensor.dtype.size
            if tensor.shape.is_fully_defined() else None)
    return Collective(op.type, op.name, op.device, tensor.dtype.name, shape, size)


def graphs(concrete_function) -> list:
    """The graph of a traced function and of every function it calls, each once."""
    return list(_all_graphs(concrete_function.graph).values())


def _all_graphs(top) -> dict:
    """Function name -> graph for every function reachable from `top` (itself as '')."""
    found = {"": top}

    def visit(graph):
        for name, function in private_api.function_library(graph).items():
            if name not in found and hasattr(function, "graph"):
                found[name] = function.graph
                visit(function.graph)

    visit(top)
    return found


_BRANCHING = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
              "Case": ("branches",), "StatelessCase": ("branches",)}
_CALLING = {"While": ("body",), "StatelessWhile": ("body",), "PartitionedCall": ("f",),
            "StatefulPartitionedCall": ("f",)}


def every_k_steps_name(k: int) -> str:
    """The name for a conditional whose TRUE branch runs once in every k steps and whose
    false branch runs the other k - 1 (e.g. a compressed exchange every k-th step): counted
    as its mean per step, not its larger branch."""
    return f"every_{k}_steps"


def _period(op_name: str) -> int | None:
    """k of an op named exactly `every_k_steps` (TensorFlow may add `_N` to make it unique)."""
    found = re.fullmatch(r"every_(\d+)_steps(?:_\d+)?", op_name.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


def _kind(op_type: str) -> str:
    if "AllToAll" in op_type:
        return "all_to_all"
    if "ReduceScatter" in op_type:
        return "reduce_scatter"
    if "Gather" in op_type:
        return "gather"
    return "bcast" if "Bcast" in op_type else "reduce"


def executed_bytes(concrete_function, in_loops_only: bool = False,
                   weight=None, checks: bool = True) -> collections.Counter:
    """Bytes per device that one execution hands to collectives: loop bodies once, the
    larger branch of each conditional (only one runs; one named by `every_k_steps_name(k)`:
    its true branch 1/k and its false branch (k-1)/k, the mean per step), called functions
    included.
    Collectives of data-dependent size count 0 here (see `dynamic`). `in_loops_only`:
    only what runs inside while loops (a train step's body, not the once-per-call part).
    `checks=False`: leaves out the collectives under CHECK_SCOPE (gradients only)."""
    graphs = _all_graphs(concrete_function.graph)

    def functions(op, attrs):
        names = []
        for attr in attrs:
            try:
                value = op.get_attr(attr)
            except ValueError:
                continue
            for item in value if isinstance(value, list) else [value]:
                names.append(item.name)
        return [graphs[n] for n in names if n in graphs]

    def count(graph, counting: bool) -> collections.Counter:
        total = collections.Counter()
        for op in graph.get_operations():
            if counting and _counted(op, checks):
                total[op.device] += (_describe(op).bytes or 0) * (weight(op.type) if weight else 1)
            elif op.type in _BRANCHING:
                branches = [count(g, counting) for g in functions(op, _BRANCHING[op.type])]
                k = _period(op.name) if len(branches) == 2 else None
                for device in set().union(*branches):
                    per_branch = [b[device] for b in branches]
                    total[device] += (per_branch[0] + (k - 1) * per_branch[1]) / k if k else max(per_branch)
            elif op.type in _CALLING:
                inside = counting or "While" in op.type
                for g in functions(op, _CALLING[op.type]):
                    total.update(count(g, inside))
        return total

    return count(concrete_function.graph, not in_loops_only)


def bytes_per_replica(concrete_function, in_loops_only: bool = False, checks: bool = True) -> float:
    """Bytes one replica hands to collectives per execution (the busiest device);
    `checks=False`: the gradients' alone (see CHECK_SCOPE)."""
    return max(executed_bytes(concrete_function, in_loops_only, checks=checks).values(), default=0)


def link_bytes_per_worker(concrete_function, replicas: int, in_loops_only: bool = True,
                          checks: bool = True) -> float:
    """Bytes one replica transmits per execution (ring all-reduce 2(R-1)/R of its payload,
    all-gather (R-1)x, all-to-all (R-1)/R): the number that grows, or not, with R."""
    weight = lambda op_type: LINK_FACTORS[_kind(op_type)](replicas)  # noqa: E731
    return max(executed_bytes(concrete_function, in_loops_only, weight, checks).values(), default=0)


def analytic_link_bytes(handed: dict, replicas: int) -> float:
    """The same from analytic handed bytes by kind: {'reduce'|'gather'|'all_to_all': bytes}."""
    return sum(LINK_FACTORS[kind](replicas) * b for kind, b in handed.items())


def dynamic(found: list[Collective]) -> list[Collective]:
    """Collectives whose size depends on the data (e.g. an embedding's sparse gradient)."""
    return [c for c in found if c.bytes is None]


def _counted(op, checks: bool) -> bool:
    """A collective op, and not the finiteness check unless `checks`."""
    return op.type in COLLECTIVE_TYPES and (checks or not _in_scope(op.name, CHECK_SCOPE))


def in_scope(op_name: str, scope: str) -> bool:
    """Whether op `op_name` was made under name scope `scope` (or `scope_N`)."""
    return _in_scope(op_name, scope)


def _in_scope(op_name: str, scope: str) -> bool:
    """Whether a path component is `scope` (or `scope_N`, as TensorFlow names a scope again)."""
    return any(re.fullmatch(rf"{re.escape(scope)}(_\d+)?", part) for part in op_name.split("/")[:-1])


def bytes_in_scope(found: list[Collective], scope: str = CHECK_SCOPE) -> int:
    """Bytes of the collectives under name scope `scope`, on the busiest device (each op
    once: for a step's own ops, per step). E.g. bytes_in_scope(collectives(step))."""
    per_device = collections.Counter()
    for c in found:
        if _in_scope(c.name, scope):
            per_device[c.device] += c.bytes or 0
    return max(per_device.values(), default=0)


def fp32_bytes(variables) -> int:
    """What one dense float32 all-reduce of every gradient hands to the collective."""
    return sum(4 * int(v.shape.num_elements()) for v in variables)
