"""The same launch command on every machine: a static host list and this node's rank.

torchrun's static form, without any service of our own: every node is given the same
host list, computes the same cluster from it (worker w of host h listens on port
`port + w`) and starts its own workers with their TF_CONFIG. The host list and rank can
also come from SLURM (SLURM_JOB_NODELIST expanded by TensorFlow's own code, SLURM_NODEID),
for one `tfpar-launch` per node (`srun --ntasks-per-node=1 tfpar-launch ...`).

Example:
    >>> plan = NodePlan.from_args("10.0.0.1,10.0.0.2", node_rank=1, workers_per_host=2, port=2222)
    >>> plan.cluster                      # the same on every node
    {'worker': ['10.0.0.1:2222', '10.0.0.1:2223', '10.0.0.2:2222', '10.0.0.2:2223']}
    >>> plan.local_workers                # this node's worker indexes
    [2, 3]
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

DEFAULT_PORT = 23456


class NodePlanError(ValueError):
    """A host list, rank or SLURM environment that does not describe a cluster."""


@dataclasses.dataclass(frozen=True)
class NodePlan:
    hosts: tuple[str, ...]
    node_rank: int
    workers_per_host: int = 1
    port: int = DEFAULT_PORT

    def __post_init__(self):
        if not self.hosts or any(not h or ":" in h or " " in h for h in self.hosts):
            raise NodePlanError(f"--hosts {','.join(self.hosts)!r}: give host names or addresses "
                                "without ports, comma-separated (ports come from --port).")
        if len(set(self.hosts)) != len(self.hosts):
            raise NodePlanError(f"--hosts lists a host twice ({','.join(self.hosts)}); use "
                                "--workers-per-host for several workers on one machine.")
        if not 0 <= self.node_rank < len(self.hosts):
            raise NodePlanError(f"--node-rank {self.node_rank} is out of range for "
                                f"{len(self.hosts)} host(s): use 0..{len(self.hosts) - 1}.")
        if self.workers_per_host < 1:
            raise NodePlanError("--workers-per-host must be >= 1.")
        if not 0 < self.port <= 65535 - self.workers_per_host:
            raise NodePlanError(f"--port {self.port} leaves no room for {self.workers_per_host} port(s).")

    @classmethod
    def from_args(cls, hosts: str, node_rank: int, workers_per_host: int = 1,
                  port: int = DEFAULT_PORT) -> "NodePlan":
        return cls(tuple(h.strip() for h in hosts.split(",") if h.strip()), node_rank,
                   workers_per_host, port)

    @classmethod
    def from_slurm(cls, environ: Mapping[str, str] | None = None, workers_per_host: int = 1,
                   port: int = DEFAULT_PORT) -> "NodePlan":
        """Hosts from SLURM_JOB_NODELIST, this node's rank from SLURM_NODEID."""
        from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (  # pylint: disable=g-import-not-at-top
            expand_hostlist)

        environ = os.environ if environ is None else environ
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        rank = environ.get("SLURM_NODEID")
        if not nodelist or rank is None:
            raise NodePlanError("--hosts slurm needs SLURM_JOB_NODELIST and SLURM_NODEID: run "
                                "one tfpar-launch per node inside srun (--ntasks-per-node=1).")
        return cls(tuple(expand_hostlist(nodelist)), int(rank), workers_per_host, port)

    @property
    def cluster(self) -> dict:
        return {"worker": [f"{host}:{self.port + w}" for host in self.hosts
                           for w in range(self.workers_per_host)]}

    @property
    def local_workers(self) -> list[int]:
        first = self.node_rank * self.workers_per_host
        return list(range(first, first + self.workers_per_host))

    def tf_config(self, worker: int) -> str:
        """TF_CONFIG of global worker `worker` (one of `local_workers`)."""
        return json.dumps({"cluster": self.cluster, "task": {"type": "worker", "index": worker}})
