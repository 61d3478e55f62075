"""Find the cluster this process belongs to, and check it before anything can hang.

A cluster comes from TF_CONFIG, from SLURM's environment, from a dict in TF_CONFIG's
shape, or from any `tf.distribute.cluster_resolver.ClusterResolver`. Whatever the
source, it becomes one `Cluster` and passes the same checks, each mistake with its own
message that names the fix.

Example:
    >>> cluster = find_cluster("tf_config")          # reads os.environ["TF_CONFIG"]
    >>> cluster.num_tasks, cluster.task_type, cluster.task_index
    (2, 'worker', 0)
    >>> resolver = cluster.resolver()                # for the tf.distribute strategy
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from tfpar.errors import ClusterConfigError

KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
SLURM_PORT_BASE = 8888

_TF_CONFIG_EXAMPLE = (
    'TF_CONFIG=\'{"cluster": {"worker": ["host0:12345", "host1:12345"]}, '
    '"task": {"type": "worker", "index": 0}}\''
)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A validated cluster: jobs -> addresses, and which task this process is."""

    jobs: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    source: str
    rpc_layer: str = "grpc"

    @property
    def num_tasks(self) -> int:
        return sum(len(addresses) for addresses in self.jobs.values())

    @property
    def address(self) -> str:
        """This task's own host:port."""
        return self.jobs[self.task_type][self.task_index]

    @property
    def has_ps(self) -> bool:
        return bool(self.jobs.get("ps"))

    @property
    def num_workers(self) -> int:
        """Tasks that compute: workers plus the chief."""
        return len(self.jobs.get("worker", ())) + len(self.jobs.get("chief", ()))

    @property
    def is_chief(self) -> bool:
        return is_chief(self.jobs, self.task_type, self.task_index)

    def tasks(self) -> list[tuple[str, int, str]]:
        """Every task as (type, index, address), in a stable order."""
        return [
            (job, index, address)
            for job in sorted(self.jobs)
            for index, address in enumerate(self.jobs[job])
        ]

    def peers(self) -> list[tuple[str, int, str]]:
        """The tasks this one must reach: all others, except evaluators."""
        return [
            (job, index, address)
            for job, index, address in self.tasks()
            if job != "evaluator" and (job, index) != (self.task_type, self.task_index)
        ]

    def resolver(self):
        """A `SimpleClusterResolver` for tf.distribute."""
        import tensorflow as tf

        spec = tf.train.ClusterSpec({job: list(addrs) for job, addrs in self.jobs.items()})
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type=self.task_type, task_id=self.task_index, rpc_layer=self.rpc_layer
        )


def is_chief(jobs: Mapping[str, Any], task_type: str | None, task_index: int | None) -> bool:
    """The chief: the 'chief' task if the cluster has one, else worker 0 (or no cluster)."""
    if task_type is None:
        return True
    if "chief" in jobs:
        return task_type == "chief"
    return task_type == "worker" and task_index == 0


def find_cluster(source: Any = None, environ: Mapping[str, str] | None = None) -> Cluster | None:
    """Returns the validated cluster named by `source`, or None where there is none.

    `source` is "tf_config", "slurm", a dict in TF_CONFIG's shape, a ClusterResolver,
    or None to look for TF_CONFIG first and SLURM second.
    """
    environ = os.environ if environ is None else environ
    if source is None:
        if environ.get("TF_CONFIG", "").strip():
            return parse_tf_config(environ["TF_CONFIG"])
        if _slurm_tasks(environ) > 1:
            return cluster_from_slurm(environ)
        return None
    if isinstance(source, str):
        kind = source.strip().lower()
        if kind == "tf_config":
            raw = environ.get("TF_CONFIG", "")
            if not raw.strip():
                raise ClusterConfigError(
                    f"cluster='tf_config' but TF_CONFIG is not set. Set it, e.g. {_TF_CONFIG_EXAMPLE}, "
                    "or start the processes with `tfpar-launch`, which sets it for you."
                )
            return parse_tf_config(raw)
        if kind == "slurm":
            return cluster_from_slurm(environ)
        raise ClusterConfigError(
            f"Unknown cluster source {source!r}. Use 'tf_config', 'slurm', a dict shaped like "
            "TF_CONFIG, or a tf.distribute.cluster_resolver.ClusterResolver."
        )
    if isinstance(source, Mapping):
        return validate_config(dict(source), source_name="cluster dict")
    if hasattr(source, "cluster_spec") and hasattr(source, "task_type"):
        return cluster_from_resolver(source)
    raise ClusterConfigError(
        f"cluster={source!r} is not a cluster description. Use 'tf_config', 'slurm', a dict "
        "shaped like TF_CONFIG, or a ClusterResolver."
    )


def parse_tf_config(raw: str) -> Cluster:
    """Parses and validates the text of a TF_CONFIG variable."""
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
            f"It should look like {_TF_CONFIG_EXAMPLE}"
        ) from None
    return validate_config(config, source_name="TF_CONFIG")


def validate_config(config: Any, source_name: str = "TF_CONFIG") -> Cluster:
    """Checks a TF_CONFIG-shaped dict; raises ClusterConfigError naming the fix."""
    where = source_name
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"{where} must be a JSON object with 'cluster' and 'task', got {type(config).__name__}. "
            f"Example: {_TF_CONFIG_EXAMPLE}"
        )
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterConfigError(
            f"{where} has no 'cluster' (a mapping job -> list of 'host:port'). "
            f"Example: {_TF_CONFIG_EXAMPLE}"
        )
    jobs = _jobs(cluster, where)
    task_type, task_index = _task(config.get("task"), jobs, where)
    _check_duplicates(jobs, where)
    _check_loopback_mix(jobs, where)
    return Cluster(
        jobs=jobs,
        task_type=task_type,
        task_index=task_index,
        source=source_name,
        rpc_layer=config.get("rpc_layer", "grpc") or "grpc",
    )


def _jobs(cluster: dict, where: str) -> dict[str, tuple[str, ...]]:
    """The cluster's jobs, each a checked tuple of addresses."""
    jobs: dict[str, tuple[str, ...]] = {}
    for job, addresses in cluster.items():
        if job not in KNOWN_JOBS:
            raise ClusterConfigError(
                f"{where} names an unknown job {job!r}; jobs are {', '.join(KNOWN_JOBS)}. "
                "Rename it (for example 'master' is now 'chief')."
            )
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)) or not addresses:
            raise ClusterConfigError(
                f"{where} job {job!r} must be a non-empty list of 'host:port' strings, "
                f"got {addresses!r}."
            )
        for index, address in enumerate(addresses):
            _check_address(address, f"{where} {job}[{index}]")
        jobs[job] = tuple(addresses)
    if len(jobs.get("chief", ())) > 1:
        raise ClusterConfigError(
            f"{where} lists {len(jobs['chief'])} chiefs; a cluster has at most one. "
            "Move the others to the 'worker' job."
        )
    if "ps" in jobs and "chief" not in jobs:
        raise ClusterConfigError(
            f"{where} has a 'ps' job but no 'chief': parameter-server training needs one chief "
            "(the coordinator). Add \"chief\": [\"host:port\"]."
        )
    return jobs


def _task(task: Any, jobs: dict[str, tuple[str, ...]], where: str) -> tuple[str, int]:
    """(type, index) of this process's task, checked against the jobs."""
    if not isinstance(task, dict) or "type" not in task:
        raise ClusterConfigError(
            f"{where} has a cluster but no 'task' saying which one this process is. "
            'Add "task": {"type": "worker", "index": N} (a different N in each process).'
        )
    task_type = task["type"]
    if task_type not in jobs:
        raise ClusterConfigError(
            f"{where} task type {task_type!r} is not a job of the cluster "
            f"(jobs: {', '.join(sorted(jobs))}). Fix task.type."
        )
    task_index = task.get("index", 0)
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ClusterConfigError(
            f"{where} task index must be an integer, got {task_index!r}. Fix task.index."
        )
    count = len(jobs[task_type])
    if not 0 <= task_index < count:
        raise ClusterConfigError(
            f"{where} task index {task_index} is out of range for job {task_type!r}, "
            f"which has {count} task(s) (valid: 0..{count - 1}). Fix task.index or add the "
            "missing address to the cluster."
        )
    return task_type, task_index


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); IPv6 hosts in brackets ('[::1]:80')."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_address(address: Any, what: str) -> None:
    if not isinstance(address, str) or ":" not in address:
        raise ClusterConfigError(
            f"{what} = {address!r} is not 'host:port'. Write each task as e.g. '10.0.0.2:12345'."
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(
            f"{what} = {address!r} is not 'host:port' with a port in 1..65535. "
            "Write each task as e.g. '10.0.0.2:12345'."
        )


def _check_duplicates(jobs: Mapping[str, tuple[str, ...]], where: str) -> None:
    seen: dict[str, str] = {}
    for job in jobs:
        for index, address in enumerate(jobs[job]):
            name = f"{job}[{index}]"
            if address in seen:
                raise ClusterConfigError(
                    f"{where} gives {seen[address]} and {name} the same address {address!r}; "
                    "two tasks cannot share a port. Give each task its own host:port."
                )
            seen[address] = name


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _check_loopback_mix(jobs: Mapping[str, tuple[str, ...]], where: str) -> None:
    local, remote = [], []
    for job in jobs:
        for index, address in enumerate(jobs[job]):
            host, _ = split_address(address)
            (local if _is_loopback(host) else remote).append(f"{job}[{index}]={address}")
    if local and remote:
        raise ClusterConfigError(
            f"{where} mixes loopback addresses ({', '.join(local)}) with other hosts "
            f"({', '.join(remote)}): a task on another machine cannot reach 'localhost'. "
            "Use every task's real hostname or IP, or run all tasks on this machine."
        )


def _slurm_tasks(environ: Mapping[str, str]) -> int:
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "0"
    try:
        return int(value)
    except ValueError:
        return 0


def cluster_from_slurm(environ: Mapping[str, str] | None = None) -> Cluster:
    """Builds the cluster of a SLURM job step: one 'worker' per SLURM task.

    Hosts come from SLURM_STEP_NODELIST (TensorFlow's own hostlist expansion), tasks per
    node from SLURM_STEP_TASKS_PER_NODE; ports start at TFPAR_SLURM_PORT_BASE (8888).
    """
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist,
        expand_tasks_per_node,
    )

    environ = os.environ if environ is None else environ

    def need(*names: str) -> str:
        for name in names:
            if environ.get(name):
                return environ[name]
        raise ClusterConfigError(
            f"SLURM cluster asked for but {names[0]} is not set. Run inside `srun`/`sbatch`, "
            "or pass cluster='tf_config' or a dict instead."
        )

    try:
        hosts = expand_hostlist(need("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        per_node = expand_tasks_per_node(
            need("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        )
        rank = int(need("SLURM_PROCID"))
        port_base = int(environ.get("TFPAR_SLURM_PORT_BASE", SLURM_PORT_BASE))
    except (ValueError, IndexError) as e:
        raise ClusterConfigError(
            f"SLURM environment could not be read ({e}). Check SLURM_STEP_NODELIST, "
            "SLURM_STEP_TASKS_PER_NODE and SLURM_PROCID, or pass cluster='tf_config'."
        ) from None
    if len(per_node) != len(hosts):
        raise ClusterConfigError(
            f"SLURM gives {len(hosts)} node(s) but tasks-per-node for {len(per_node)}. "
            "Check SLURM_STEP_TASKS_PER_NODE."
        )
    addresses = [
        f"{host}:{port_base + offset}"
        for host, count in sorted(zip(hosts, per_node))
        for offset in range(count)
    ]
    if not 0 <= rank < len(addresses):
        raise ClusterConfigError(
            f"SLURM_PROCID={rank} is out of range for {len(addresses)} task(s). "
            "Launch one process per SLURM task (srun --ntasks=N)."
        )
    return validate_config(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}},
        source_name="SLURM",
    )


def cluster_from_resolver(resolver: Any) -> Cluster:
    """Validates the cluster of any tf.distribute ClusterResolver."""
    spec = resolver.cluster_spec()
    jobs = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
    jobs = {job: list(addrs.values()) if isinstance(addrs, dict) else list(addrs)
            for job, addrs in jobs.items()}
    task = {"type": resolver.task_type, "index": resolver.task_id}
    return validate_config(
        {"cluster": jobs, "task": task, "rpc_layer": getattr(resolver, "rpc_layer", "grpc")},
        source_name=type(resolver).__name__,
    )
