"""Stage plans on TPU cores: S cores per replica, stage s on the replica's logical core s.

On a TPU a replica's computation is one XLA program; model parallelism inside it is
asked for by annotating tensors with a logical core
(`TPUStrategy.experimental_assign_to_logical_device`), and the cores of each replica come
from a DeviceAssignment of S cores per replica. `logical(plan)` rewrites a plan's devices
to `logical:0 .. logical:S-1`; the Pipeline then annotates each stage's input (and each
gradient handed back) with its stage's core instead of entering `tf.device`. Variables
created under TPUStrategy land on logical core 0 unless created under
`strategy.extended.experimental_logical_device(s)`: build the model inside `plan.scope()`
(inside `strategy.scope()`), which creates stage s's variables under core s.

NOT YET RUN ON A TPU: this machine has none. The plan-to-core mapping (which cores form
each replica, which logical core runs each stage) is unit-tested on topologies built in
memory; the annotations, and the logical core each stage's variables are created under
(`strategy.extended.experimental_logical_device(s)`, entered by `plan.scope()` and by the
Pipeline for each stage), are tested against a recording stand-in for the strategy.

Example (on a TPU VM):
    >>> resolver = tf.distribute.cluster_resolver.TPUClusterResolver("local")
    >>> tf.config.experimental_connect_to_cluster(resolver)
    >>> topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    >>> plan = tpu_cores.logical(balanced(model_template, ["a", "b"]))     # 2 stages
    >>> strategy = tpu_cores.tpu_strategy(resolver, topology, plan)           # replicas = cores / 2
    >>> with strategy.scope(), plan.scope():
    ...     model = GPT.from_preset("tiny")
    >>> pipe = Pipeline(model, plan, micro_batches=8)
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpar.placement.plan import LOGICAL, PlacementError, StagePlan, is_logical

__all__ = ["LOGICAL", "computation_shape", "device_assignment", "is_logical", "logical",
           "logical_core", "tpu_strategy"]


def logical_core(device: str) -> int:
    """'logical:3' -> 3."""
    return int(device[len(LOGICAL):])


def logical(plan: StagePlan) -> StagePlan:
    """The same stage groups, group s on logical core s of every replica (an interleaved
    plan's group g on the core of its device, g % S).

    Example:
        >>> logical(plan).devices
        ['logical:0', 'logical:1']
    """
    groups = tuple(dataclasses.replace(g, device=f"{LOGICAL}{plan.device_index(s)}")
                   for s, g in enumerate(plan.groups))
    return StagePlan(groups)


def computation_shape(mesh_shape, stages: int) -> list[int]:
    """The block of the TPU mesh one replica occupies: the cores of a chip first, then
    neighbouring chips along x, y, z (S must fill that block exactly)."""
    shape, left = [1] * len(mesh_shape), stages
    for axis in [len(mesh_shape) - 1] + list(range(len(mesh_shape) - 1)):  # cores, then x, y, z
        take = min(left, mesh_shape[axis])
        if left % take or mesh_shape[axis] % take:
            break
        shape[axis], left = take, left // take
        if left == 1:
            return shape
    raise PlacementError(f"{stages} stages do not tile this TPU mesh {list(mesh_shape)} (cores "
                         "per chip, then chips along x, y, z); use a stage count that does.")


def device_assignment(topology, stages: int,
                      replicas: int | None = None) -> tf.tpu.experimental.DeviceAssignment:
    """S cores per replica; as many replicas as fit (or `replicas`)."""
    cores = topology.num_tasks * topology.num_tpus_per_task
    if stages < 1 or cores % stages:
        raise PlacementError(f"{stages} stages per replica do not divide the {cores} TPU cores.")
    replicas = replicas or cores // stages
    if replicas * stages > cores:
        raise PlacementError(f"{replicas} replicas x {stages} stages need {replicas * stages} "
                             f"cores; this TPU has {cores}.")
    return tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=computation_shape(list(topology.mesh_shape), stages),
        num_replicas=replicas)


def tpu_strategy(resolver, topology, plan: StagePlan, replicas: int | None = None):
    """A TPUStrategy whose replicas each hold len(plan.groups) cores, for `logical(plan)`."""
    assignment = device_assignment(topology, len(plan.groups), replicas)
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
