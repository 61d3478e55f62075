"""Shaped links: one network namespace per worker, joined through a bridge, each worker's
veth shaped with tc (netem delay + tbf rate; tbf alone where the kernel has no sch_netem).

Namespaces tfpw0..tfpwN-1 (addresses 10.77.0.1..N/24) joined by veth pairs to a bridge
that lives in its own namespace tfphub (no address in the root namespace). Everything is
removed at the end, on errors and on Ctrl-C. Needs root and iproute2.
"""

from __future__ import annotations

import subprocess
import sys

HUB = "tfphub"                     # the namespace that holds the bridge (no address)
BRIDGE = "tfpbr0"
PORT = 23456


def namespaces(workers: int) -> list[str]:
    return [f"tfpw{i}" for i in range(workers)]


def addresses(workers: int) -> list[str]:
    return [f"10.77.0.{i + 1}" for i in range(workers)]


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def teardown_link(workers: int = 8) -> None:
    """Deletes the namespaces this script creates (their veth ends and the bridge go too)."""
    for ns in [*namespaces(workers), HUB]:
        _sh("ip", "netns", "del", ns, check=False)


def _shape(ns: str, inner: str, rate: str, delay: str) -> str:
    """netem delay + tbf on `inner` in `ns`; returns the chain installed."""
    netem = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", "handle", "1:",
                "netem", "delay", delay, check=False).returncode == 0
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner,
        *(("parent", "1:", "handle", "2:") if netem else ("root", "handle", "1:")),
        "tbf", "rate", rate, "burst", "64kbit", "latency", "50ms")
    return (f"netem delay {delay} + tbf rate {rate}" if netem else
            f"tbf rate {rate} only (no sch_netem in this kernel: no added delay)")


def setup_link(rate: str, workers: int, delay: str = "1ms") -> str:
    """One namespace per worker, veth pairs to a bridge in HUB, netem delay + tbf on each
    worker's end (so every packet a worker sends is shaped once, at its own link). Returns
    the qdisc chain installed: a kernel without sch_netem gets tbf alone, and says so."""
    teardown_link()
    chains = set()
    _sh("ip", "netns", "add", HUB)
    _sh("ip", "-n", HUB, "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "-n", HUB, "link", "set", BRIDGE, "up")
    for i, (ns, address) in enumerate(zip(namespaces(workers), addresses(workers))):
        inner, outer = f"tfpv{i}", f"tfph{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", HUB)
        _sh("ip", "-n", HUB, "link", "set", outer, "master", BRIDGE)
        _sh("ip", "-n", HUB, "link", "set", outer, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", inner, "up")
        chains.add(_shape(ns, inner, rate, delay))
    if len(chains) == 1 and "only" in next(iter(chains)):
        print(f"warning: {next(iter(chains))}", flush=True)
    return " / ".join(sorted(chains))


def qdisc_stats(workers: int) -> dict:
    return {ns: _sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", f"tfpv{i}").stdout.strip()
            for i, ns in enumerate(namespaces(workers))}


_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); got, t = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t is None: t = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - t, flush=True)
"""
_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
"""


def measure_link(megabytes: int = 20) -> dict:
    """Mbit/s of one TCP stream worker 0 -> worker 1 and back, through the shaped links."""
    out, ns, address = {}, namespaces(2), addresses(2)
    for src, dst in [(0, 1), (1, 0)]:
        sink = subprocess.Popen(["ip", "netns", "exec", ns[dst], sys.executable, "-c", _SINK,
                                 address[dst], str(PORT + 100)], stdout=subprocess.PIPE, text=True)
        try:
            sink.stdout.readline()
            subprocess.run(["ip", "netns", "exec", ns[src], sys.executable, "-c", _SOURCE,
                            address[dst], str(PORT + 100), str(megabytes)], check=True, timeout=300)
            got, seconds = sink.stdout.readline().split()
            sink.wait(timeout=30)
        finally:
            if sink.poll() is None:
                sink.kill()
        out[f"{ns[src]}->{ns[dst]}_mbit_s"] = int(got) * 8 / float(seconds) / 1e6
    return out
