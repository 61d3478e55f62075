"""A userspace link emulator: delay and loss for test hosts on kernels without sch_netem.

Some kernels (this CI machine's among them) ship `tc` with tbf but no netem, so there is
no kernel way to add latency or random loss. This process plays the wire instead: it
opens one TAP device per host, forwards every Ethernet frame from one TAP to the others
(a hub), and delays each frame by `delay` seconds and drops it with probability `loss`,
independently per frame and direction, as netem on every host's egress would. Frames keep
their order per direction. It reads commands on stdin: `down I` cuts host I off (its
frames vanish both ways, like a pulled cable), `up I` plugs it back.

It prints `ready` once the TAP devices exist; `tfpar.testing.netns.Hosts` then moves each
into its host's namespace (the open file descriptors follow the devices).

Run: python -m tfpar.testing.linkemu --delay 0.2 --loss 0.01 tap0 tap1
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    """Creates TAP device `name` (no packet-info header) and returns its descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


class Wire:
    """The hub: frames in from any port, out to every other port after delay, minus loss."""

    def __init__(self, fds: list[int], delay: float, loss: float, seed: int = 0):
        self.fds, self.delay, self.loss = fds, delay, loss
        self.down: set[int] = set()
        self.queue: list[tuple[float, int, int, bytes]] = []
        self.sequence = 0
        self.random = random.Random(seed)

    def receive(self, port: int) -> None:
        while True:
            try:
                frame = os.read(self.fds[port], 65536)
            except BlockingIOError:
                return
            if port in self.down:
                continue
            due = time.monotonic() + self.delay
            for other in range(len(self.fds)):
                if other == port or other in self.down or self.random.random() < self.loss:
                    continue
                self.sequence += 1
                heapq.heappush(self.queue, (due, self.sequence, other, frame))

    def deliver(self) -> float | None:
        """Sends every frame that is due; returns seconds until the next one (None: none)."""
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            _, _, port, frame = heapq.heappop(self.queue)
            if port not in self.down:
                try:
                    os.write(self.fds[port], frame)
                except OSError:  # the device is not up yet (or went down): the frame is lost
                    pass
        return max(0.0, self.queue[0][0] - now) if self.queue else None

    def command(self, line: str) -> None:
        verb, _, port = line.strip().partition(" ")
        if verb == "down":
            self.down.add(int(port))
        elif verb == "up":
            self.down.discard(int(port))


def serve(names: list[str], delay: float, loss: float, seed: int) -> None:
    wire = Wire([open_tap(name) for name in names], delay, loss, seed)
    print("ready", flush=True)
    watched = [*wire.fds, sys.stdin.fileno()]
    while True:
        timeout = wire.deliver()
        readable, _, _ = select.select(watched, [], [], timeout)
        for fd in readable:
            if fd == sys.stdin.fileno():
                line = sys.stdin.readline()
                if not line:  # the owner went away: so does the wire
                    return
                wire.command(line)
            else:
                wire.receive(wire.fds.index(fd))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("taps", nargs="+")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per direction")
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability per frame")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    serve(args.taps, args.delay, args.loss, args.seed)


if __name__ == "__main__":
    main()
