"""Pre-flight check: every peer of the cluster answers before TensorFlow may wait on it.

TensorFlow's multi-worker start-up blocks until all tasks have registered; a worker that
never comes (wrong address, crashed, firewalled) turns into a silent hang. Before the
strategy exists, each task listens on its own port and TCP-connects to every peer,
retrying while peers start; the first task to give up names the ones it never reached.

Listening on our own port during the check is what keeps it deadlock-free: peers that run
the same check find us at once, even though our TensorFlow server does not exist yet.
The listener closes just before TensorFlow binds the same port; a peer that retries in
that gap reaches the TensorFlow server instead.

Example:
    >>> wait_for_peers(cluster, timeout_s=60)   # raises PeerUnreachableError naming the task
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time

from absl import logging

from tfpar.errors import ClusterConfigError, PeerUnreachableError
from tfpar.strategy.cluster import Cluster, split_address


def wait_for_peers(cluster: Cluster, timeout_s: float = 60.0, poll_s: float = 0.25) -> None:
    """Returns when every peer accepts a TCP connection; raises after `timeout_s`."""
    with _listen_on(cluster.address, f"{cluster.task_type}[{cluster.task_index}]"):
        pending = {f"{job}[{index}]": address for job, index, address in cluster.peers()}
        last_error: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for name, address in list(pending.items()):
                error = _try_connect(address, timeout_s=min(2.0, max(0.1, timeout_s)))
                if error is None:
                    del pending[name]
                else:
                    last_error[name] = error
            if not pending:
                break
            if time.monotonic() >= deadline:
                missing = ", ".join(
                    f"{name} at {address} ({last_error[name]})" for name, address in pending.items()
                )
                raise PeerUnreachableError(
                    f"{cluster.task_type}[{cluster.task_index}] could not reach {missing} within "
                    f"{timeout_s:g}s. Check that every task is started, that the addresses in "
                    f"{cluster.source} are right, and that no firewall blocks the ports; raise "
                    "connect_timeout_s if peers take longer to start."
                )
            time.sleep(poll_s)
    logging.info("tfpar: all %d peer(s) of the cluster answered.", len(cluster.peers()))


def _try_connect(address: str, timeout_s: float) -> str | None:
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


@contextlib.contextmanager
def _listen_on(address: str, name: str):
    host, port = split_address(address)
    bind_host = host if host.startswith("127.") or host == "localhost" else ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ClusterConfigError(
                f"{name}'s own address {address} is already in use on this machine: another "
                "process holds the port. Stop it or give this task another port."
            ) from None
        raise ClusterConfigError(
            f"{name} cannot listen on its own address {address} ({e.strerror}). "
            "Is this process meant to be that task? Check task.type/task.index."
        ) from None
    sock.listen(64)
    try:
        yield
    finally:
        sock.close()
