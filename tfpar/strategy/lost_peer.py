"""Which peer a failed collective lost, by name and address.

When a host goes away, TensorFlow's error names a task ("/job:worker/replica:0/task:1",
"Error reported from /job:worker/task:1") somewhere in a long message; users think in
hosts. `describe_lost_peer` turns the first task it names into "worker 1 at 10.0.0.2:2222"
with the address from the cluster (TF_CONFIG by default).

Example:
    >>> describe_lost_peer("... Error reported from /job:worker/task:1: ...",
    ...                    {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]})
    'worker 1 at 10.0.0.2:2222'
"""

from __future__ import annotations

import json
import os
import re

_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")


def _tf_config() -> dict:
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def describe_lost_peer(message: str, cluster: dict | None = None, *,
                       this_task: tuple[str, int] | None = None) -> str | None:
    """'JOB INDEX at ADDRESS' for the first task in `message` other than `this_task` (None
    when the message names no task). `cluster`: job -> addresses (default: TF_CONFIG's)."""
    config = _tf_config()
    cluster = config.get("cluster", {}) if cluster is None else cluster
    if this_task is None:
        task = config.get("task", {})
        this_task = (task.get("type"), task.get("index")) if task else None
    for job, index in _TASK.findall(message):
        if this_task is not None and (job, int(index)) == (this_task[0], int(this_task[1])):
            continue
        addresses = cluster.get(job, [])
        address = addresses[int(index)] if int(index) < len(addresses) else None
        return f"{job} {index}" + (f" at {address}" if address else "")
    for job, addresses in cluster.items():  # no task named: maybe its address is
        for index, address in enumerate(addresses):
            mine = this_task is not None and (job, index) == (this_task[0], int(this_task[1]))
            if not mine and address in message:
                return f"{job} {index} at {address}"
    return None
