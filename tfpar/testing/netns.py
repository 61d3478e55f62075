"""Hosts with their own network stacks on one machine: Linux network namespaces.

`Hosts(n)` makes n namespaces, each a host with its own address on a private /24, joined
through a bridge that lives in a namespace of its own (the "switch"), so nothing is added
to the machine's own network and only addresses inside namespaces made here are used.
Each host's link can be shaped (a `tc` tbf rate; delay and random loss), taken down and
brought back; delay and loss come from a userspace wire (tfpar.testing.linkemu) that joins
the hosts' TAP devices instead of the bridge, because kernels without sch_netem (this
machine's) cannot add them; 
`stranger()` adds a host on the same switch that is not part of the cluster. Everything is
removed on exit, also when the block raises or the process is interrupted.

Needs root (ip netns, tc); `Hosts.unavailable()` says why not, for a skip message.

Example:
    >>> with Hosts(2, rate="100mbit", delay="1ms") as hosts:
    ...     hosts.addresses                          # ['10.213.7.1', '10.213.7.2']
    ...     proc = hosts.popen(0, ["python", "-m", "http.server"])
    ...     hosts.link(1, up=False)                  # host 1 drops off the network
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

_LIVE: set["Hosts"] = set()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class HostsError(RuntimeError):
    """The namespaces could not be made (not root, no iproute2, a name clash)."""


class Hosts:
    """N network-namespace hosts on one switch; see the module docstring.

    Args:
      n: number of hosts.
      rate, delay, loss: optional shaping of every host's outgoing traffic (tc tbf rate such
        as "100mbit"; netem delay such as "1ms"; netem loss such as "1%").
      tag: a short name that keeps namespaces of parallel runs apart (default: from the pid).
    """

    def __init__(self, n: int, *, rate: str | None = None, delay: str | None = None,
                 loss: str | None = None, tag: str | None = None):
        if n < 1:
            raise HostsError("Hosts needs at least one host.")
        self.n = n
        self.tag = tag or f"{os.getpid() % 100000}"
        self.subnet = 200 + os.getpid() % 50  # 10.<subnet>.<x>.0/24: private, per run
        self.third = (os.getpid() // 50) % 250 + 1
        self.switch = f"tfp{self.tag}sw"
        self.names: list[str] = []
        self.addresses: list[str] = []
        self.rate = rate
        self.delay, self.loss = _seconds(delay), _fraction(loss)
        self._wire: subprocess.Popen | None = None
        self._procs: list[subprocess.Popen] = []

    # -- life cycle ----------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None when they can)."""
        if os.geteuid() != 0:
            return "network-namespace hosts need root (ip netns add, tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"network-namespace hosts need `{tool}` (Debian: iproute2)"
        return None

    def __enter__(self) -> "Hosts":
        reason = self.unavailable()
        if reason:
            raise HostsError(reason)
        _LIVE.add(self)
        _cleanup_on_sigterm()
        try:
            if self.delay or self.loss:
                self._start_wire()
            else:
                _ip("netns", "add", self.switch)
                self._exec(self.switch, "ip", "link", "add", "br0", "type", "bridge")
                self._exec(self.switch, "ip", "link", "set", "br0", "up")
            for i in range(self.n):
                self._add_host(f"tfp{self.tag}h{i}")
            if self.rate:
                for i in range(self.n):
                    self.shape(i, rate=self.rate)
        except Exception:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills what was started in the hosts and removes every namespace (idempotent)."""
        for proc in [*self._procs, *([self._wire] if self._wire else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        failed = {}
        for name in [*self.names, self.switch]:
            for _ in range(25):  # a process leaving the namespace can hold it for a moment
                done = _ip("netns", "del", name, check=False)
                if done.returncode == 0 or not os.path.exists(f"/run/netns/{name}"):
                    break
                time.sleep(0.2)
            else:
                failed[name] = done.stderr.strip()
        self.names, self.addresses, self._wire = [], [], None
        _LIVE.discard(self)
        if failed:
            raise HostsError(f"could not remove network namespaces {failed}: "
                             "remove them with `ip netns del NAME`")

    def _start_wire(self) -> None:
        taps = [self._tap(i) for i in range(self.n)]
        self._wire = subprocess.Popen(
            [sys.executable, "-m", "tfpar.testing.linkemu", "--delay", str(self.delay), "--loss",
             str(self.loss), *taps], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._wire.stdout.readline().strip() != "ready":
            raise HostsError("the link emulator (tfpar.testing.linkemu) did not start: "
                             "it needs /dev/net/tun")

    def _tap(self, host: int) -> str:
        return f"tfp{self.tag}t{host}"[:15]

    def _add_host(self, name: str) -> None:
        index = len(self.names) + 1
        inside, outside = f"h{index}", f"tfp{self.tag}p{index}"[:15]
        address = f"10.{self.subnet}.{self.third}.{index}"
        _ip("netns", "add", name)
        self.names.append(name)
        if self._wire is not None:  # the emulator's TAP device moves into the host
            _ip("link", "set", self._tap(index - 1), "netns", name)
            self._exec(name, "ip", "link", "set", self._tap(index - 1), "name", inside)
        else:
            _ip("link", "add", inside, "netns", name, "type", "veth", "peer", "name", outside,
                "netns", self.switch)
            self._exec(self.switch, "ip", "link", "set", outside, "master", "br0")
            self._exec(self.switch, "ip", "link", "set", outside, "up")
        self._exec(name, "ip", "addr", "add", f"{address}/24", "dev", inside)
        self._exec(name, "ip", "link", "set", inside, "up")
        self._exec(name, "ip", "link", "set", "lo", "up")
        self.addresses.append(address)

    # -- what tests do with them ---------------------------------------------------

    def _exec(self, namespace: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["ip", "netns", "exec", namespace, *cmd], capture_output=True,
                                text=True)
        if check and result.returncode:
            raise HostsError(f"{' '.join(cmd)} in {namespace}: {result.stderr.strip()}")
        return result

    def run(self, host: int, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `cmd` on host `host` and waits (subprocess.run keywords)."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *cmd], **kwargs)

    def popen(self, host: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `cmd` on host `host`; it is killed when the hosts are removed."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], **kwargs)
        self._procs.append(proc)
        return proc

    def interface(self, host: int) -> str:
        return f"h{host + 1}"

    def shape(self, host: int, *, rate: str | None) -> None:
        """Limits what `host` sends to `rate` (tc tbf, e.g. "100mbit"); None removes it."""
        dev, name = self.interface(host), self.names[host]
        self._exec(name, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if rate:
            self._exec(name, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", "256kb", "latency", "400ms")

    def link(self, host: int, *, up: bool) -> None:
        """Takes `host`'s cable out of the switch (up=False) or plugs it back in: frames to
        and from it vanish, the host's own interface stays up (as with a pulled cable)."""
        if self._wire is not None:
            self._wire.stdin.write(f"{'up' if up else 'down'} {host}\n")
            self._wire.stdin.flush()
            return
        outside = f"tfp{self.tag}p{host + 1}"[:15]
        self._exec(self.switch, "ip", "link", "set", outside, "up" if up else "down")

    def stranger(self) -> int:
        """Adds a host on the same switch that is not part of any cluster; returns its index."""
        if self._wire is not None:
            raise HostsError("stranger() needs hosts on the bridge (no delay or loss).")
        self._add_host(f"tfp{self.tag}h{len(self.names)}")
        return len(self.names) - 1

    def wait_reachable(self, src: int, dst: int, port: int, timeout: float = 30.0) -> bool:
        """Whether `src` can open a TCP connection to `dst`:`port` within `timeout` seconds."""
        probe = ("import socket,sys,time\nend=time.time()+float(sys.argv[3])\n"
                 "while time.time()<end:\n"
                 "  try: socket.create_connection((sys.argv[1],int(sys.argv[2])),1).close(); sys.exit(0)\n"
                 "  except OSError: time.sleep(0.2)\nsys.exit(1)")
        result = self.run(src, ["python3", "-c", probe, self.addresses[dst], str(port), str(timeout)],
                          capture_output=True)
        return result.returncode == 0


def _seconds(text: str | None) -> float:
    """'200ms' -> 0.2, '1s' -> 1.0, None -> 0."""
    if not text:
        return 0.0
    match = re.fullmatch(r"([0-9.]+)\s*(ms|s|us)?", text.strip())
    if not match:
        raise HostsError(f"delay {text!r}: write it as e.g. '200ms' or '0.5s'.")
    return float(match[1]) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1.0}[match[2]]


def _fraction(text: str | None) -> float:
    """'1%' -> 0.01, '0.01' -> 0.01, None -> 0."""
    if not text:
        return 0.0
    text = text.strip()
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= value < 1:
        raise HostsError(f"loss {text!r}: a fraction below 1 (e.g. '1%').")
    return value


def _cleanup_on_sigterm() -> None:
    """A SIGTERM (a test timeout, `kill`) removes the namespaces, then terminates the
    process as it would have without this handler."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _remove_and_terminate)


def _remove_and_terminate(signum, _frame) -> None:
    _remove_leftovers()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@atexit.register
def _remove_leftovers() -> None:
    for hosts in list(_LIVE):
        hosts.close()


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Polls `predicate` until it is true or `timeout` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
