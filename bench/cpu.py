"""Where a bench phase's CPU went: the host's cores in use, and each role's share
(this process, a writer process, the chunkservers, the metaserver), from the
kernel's counters (psutil) at the phase's start and end. On a host whose cores
every process shares, a latency that grows under load is only explained once it
is known whether the cores were all in use, and by whom."""

from __future__ import annotations

import time

import psutil


def _busy_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


class CpuWindow:
    """CPU used between start() and stop(), per role (a name -> pids mapping, fixed at
    start: a process that ends meanwhile counts what it used until its last sample)."""

    def __init__(self, roles: dict[str, list[int]]):
        self.roles = {name: [psutil.Process(pid) for pid in pids] for name, pids in roles.items()}
        self._t0 = 0.0
        self._host0 = None
        self._proc0: dict[str, list[float]] = {}

    def _sample(self) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {}
        for name, procs in self.roles.items():
            out[name] = []
            for p in procs:
                try:
                    out[name].append(_busy_seconds(p))
                except psutil.NoSuchProcess:
                    out[name].append(None)
        return out

    def start(self) -> CpuWindow:
        self._proc0 = self._sample()
        self._host0 = psutil.cpu_times()
        self._t0 = time.monotonic()
        return self

    def stop(self) -> dict:
        """{"seconds", "cpus", "host_busy_cpus", "roles": {name: CPUs used on average}}."""
        seconds = time.monotonic() - self._t0
        host1, after = psutil.cpu_times(), self._sample()
        total = sum(host1) - sum(self._host0)
        idle = (host1.idle - self._host0.idle) + (getattr(host1, "iowait", 0.0) - getattr(self._host0, "iowait", 0.0))
        cpus = psutil.cpu_count() or 1
        roles = {}
        for name in self.roles:
            used = sum(b - a for a, b in zip(self._proc0[name], after[name]) if a is not None and b is not None)
            roles[name] = used / seconds if seconds > 0 else 0.0
        return {"seconds": seconds, "cpus": cpus,
                "host_busy_cpus": cpus * (1 - idle / total) if total > 0 else 0.0, "roles": roles}
