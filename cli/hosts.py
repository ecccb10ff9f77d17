"""Hosts on one machine: network namespaces joined by a bridge, each behind a veth
pair whose link can be shaped with `tc` (a rate, each way), so servers
started inside them (`ip netns exec`, the launcher's `netns`) talk over a network
that is slower than loopback and the page cache, as a cluster's is.

Needs root and iproute2 (`ip`, `tc`). The process that makes them reaches every
host from the bridge's address, `{subnet}.1`; host i is `{subnet}.{10 + i}`.
Nothing listens outside the namespaces and the bridge this makes.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from dataclasses import dataclass

_made = itertools.count()  # Hosts made by this process


def run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def ip(*args: str) -> None:
    run("ip", *args)


@dataclass(frozen=True, slots=True)
class Link:
    """How fast a host's link is, each way: `rate` bits a second. Shaped by a token
    bucket (tc's tbf; kernels built without netem, as this project's machines are,
    cannot add delay, so none is offered)."""

    rate: int

    @classmethod
    def parse(cls, spec: str) -> Link:
        """`10gbit`, `2.5gbit`, `800mbit` (tc's units)."""
        units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
        unit = next((u for u in units if spec.lower().endswith(u)), None)
        try:
            rate = int(float(spec[: -len(unit)]) * units[unit]) if unit else 0
        except (ValueError, OverflowError):  # not a number, or inf
            rate = 0
        if rate <= 0:
            raise ValueError(f"link rate {spec!r}: a positive number with a unit (gbit, mbit, kbit)")
        return cls(rate)

    def __str__(self) -> str:
        return f"{self.rate / 1e9:g} Gbit/s"

    def tbf(self) -> list[str]:
        """tc tbf's arguments: a bucket of 4 ms at the rate (at least 256 KiB, so the
        64 KiB segments veth passes whole go through), a queue of 250 ms."""
        burst = max(256 << 10, self.rate // 8 // 250)
        return ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "250ms"]


class Hosts:
    """`n` namespaces on a private bridge; host i has address {subnet}.{10 + i}."""

    def __init__(self, n: int):
        # unique per instance, not per process: a namespace's veth pair goes some time after
        # `ip netns del` returns (the kernel cleans up in the background), so names reused at
        # once can still be taken
        unique = os.getpid() * 10 + next(_made) % 10
        tag = f"{unique % 1000000:06d}"
        self.bridge = f"kvbr{tag}"
        self.subnet = f"10.{200 + unique % 50}.{unique // 50 % 250}"
        self.names = [f"kvfs{tag}h{i}" for i in range(n)]
        self.veths = [f"kv{tag}v{i}" for i in range(n)]  # the bridge side; interface names <= 15 chars
        self.links: list[Link | None] = [None] * n

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def create(self) -> Hosts:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)  # the creating process reaches hosts here
            ip("link", "set", self.bridge, "up")
            for i, (name, veth) in enumerate(zip(self.names, self.veths)):
                ip("netns", "add", name)
                ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                ip("link", "set", f"{veth}p", "netns", name)
                ip("link", "set", veth, "master", self.bridge, "up")
                ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", f"{veth}p")
                ip("-n", name, "link", "set", f"{veth}p", "up")
                ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def shape(self, i: int, link: Link) -> None:
        """Shapes host i's link both ways: what it sends (its end of the veth pair) and
        what it receives (the bridge's end)."""
        run("ip", "netns", "exec", self.names[i], "tc", "qdisc", "replace", "dev", f"{self.veths[i]}p", "root",
            *link.tbf())
        run("tc", "qdisc", "replace", "dev", self.veths[i], "root", *link.tbf())
        self.links[i] = link

    def qdiscs(self, i: int) -> tuple[str, str]:
        """What tc says of host i's link: (its sending side, its receiving side)."""
        out = [subprocess.run(cmd, capture_output=True, text=True, check=True).stdout for cmd in (
            ["ip", "netns", "exec", self.names[i], "tc", "qdisc", "show", "dev", f"{self.veths[i]}p"],
            ["tc", "qdisc", "show", "dev", self.veths[i]])]
        return out[0], out[1]

    def cut(self, i: int) -> None:
        ip("link", "set", self.veths[i], "down")

    def reconnect(self, i: int) -> None:
        ip("link", "set", self.veths[i], "up")

    def destroy(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes its veth pair along
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()
