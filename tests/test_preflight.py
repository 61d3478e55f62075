"""The pre-flight check turns a missing peer into a named error instead of a hang."""

import socket
import threading
import time

import pytest

from procs import run_python
from tfpar.errors import ClusterConfigError, PeerUnreachableError
from tfpar.launch import free_ports
from tfpar.strategy import cluster as cluster_lib
from tfpar.strategy.preflight import wait_for_peers


def local_cluster(ports, index):
    addresses = [f"127.0.0.1:{port}" for port in ports]
    return cluster_lib.validate_config(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )


def test_unreachable_peer_is_named_within_the_deadline():
    ports = free_ports(3)
    started = time.monotonic()
    with pytest.raises(PeerUnreachableError) as info:
        wait_for_peers(local_cluster(ports, 0), timeout_s=1.0)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert f"worker[1] at 127.0.0.1:{ports[1]}" in message
    assert f"worker[2] at 127.0.0.1:{ports[2]}" in message
    assert "Connection refused" in message and "connect_timeout_s" in message


def test_tasks_checking_each_other_at_once_do_not_deadlock():
    """Each task listens while it checks, then (like TensorFlow's server) keeps its port."""
    ports = free_ports(3)
    errors, servers = [], []
    done = threading.Event()

    def task(index):
        try:
            time.sleep(0.3 * index)  # peers start at different times
            wait_for_peers(local_cluster(ports, index), timeout_s=20)
            server = socket.socket()
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", ports[index]))
            server.listen(8)
            servers.append(server)
            done.wait(30)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    while len(servers) + len(errors) < 3 and threads[-1].is_alive():
        time.sleep(0.05)
    done.set()
    for thread in threads:
        thread.join(timeout=30)
    for server in servers:
        server.close()
    assert not errors and len(servers) == 3


def test_own_port_in_use_is_reported():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(ClusterConfigError, match=f"127.0.0.1:{port} is already in use"):
            wait_for_peers(local_cluster([port, free_ports(1)[0]], 0), timeout_s=1)
    finally:
        holder.close()


def test_create_strategy_with_a_dead_peer_fails_fast_and_names_it():
    """End to end in a fresh process: no hang inside TensorFlow's start-up."""
    ports = free_ports(2)
    code = (
        "import tfpar\n"
        f"cluster = {{'cluster': {{'worker': ['127.0.0.1:{ports[0]}', '127.0.0.1:{ports[1]}']}},"
        " 'task': {'type': 'worker', 'index': 0}}\n"
        "try:\n"
        "    tfpar.create_strategy('mwms', cluster=cluster, connect_timeout_s=2)\n"
        "except tfpar.PeerUnreachableError as e:\n"
        "    print('REFUSED:', e)\n"
    )
    started = time.monotonic()
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"REFUSED: worker[0] could not reach worker[1] at 127.0.0.1:{ports[1]}" in result.stdout
    assert time.monotonic() - started < 60
