"""Bytes on the wire, read from the traced step: every collective op, its payload, its device.

Counted, not guessed: the static shape and dtype of each collective's input in the graph
(nested functions included), per device. An all-gather's shape exchange is its own small
collective and is counted like any other; its payload is padded to the largest replica's,
which is the same static size on every replica here, so the padding is zero and the
payload is counted from the tensor before the pad op.

Example:
    >>> ops = collectives(trainer.traced_step(dataset))
    >>> bytes_per_replica(ops)        # e.g. 61_464
    >>> dynamic(ops)                  # collectives whose size depends on the data
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

COLLECTIVE_TYPES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduce",
                    "CollectiveGather", "CollectiveBcastSendV2", "NcclAllReduce")


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


def collectives(concrete_function) -> list[Collective]:
    """Every collective op of a traced function, nested functions included."""
    found: list[Collective] = []

    def visit(graph):
        for op in graph.get_operations():
            if op.type in COLLECTIVE_TYPES:
                tensor = _static_input(op)
                shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else ()
                size = (int(tensor.shape.num_elements()) * tensor.dtype.size
                        if tensor.shape.is_fully_defined() else None)
                found.append(Collective(op.type, op.name, op.device, tensor.dtype.name, shape, size))
        for function in graph._functions.values():  # pylint: disable=protected-access
            visit(function.graph)

    visit(concrete_function.graph)
    return found


def bytes_per_replica(found: list[Collective]) -> int:
    """Bytes one replica hands to collectives per traced call (the busiest device); sizes
    that depend on the data (see `dynamic`) are not in it."""
    by_device = collections.Counter()
    for c in found:
        by_device[c.device] += c.bytes or 0
    return max(by_device.values(), default=0)


def dynamic(found: list[Collective]) -> list[Collective]:
    """Collectives whose size depends on the data (e.g. an embedding's sparse gradient)."""
    return [c for c in found if c.bytes is None]


def fp32_bytes(variables) -> int:
    """What one dense float32 all-reduce of every gradient hands to the collective."""
    return sum(4 * int(v.shape.num_elements()) for v in variables)
