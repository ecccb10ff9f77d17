"""Hedged reads: what they need besides the restore loop.

A batch of chunk reads that has not come back within its server's measured p95
is sent again to other replicas; the first good answer is used. Two readers
may then race to put the same range into the same destination, and bytes land
there before their checksum is known, so a late reader with corrupt bytes could
overwrite good ones after the layer was handed to the model. A `Fence` per
range prevents that: a reader claims it before writing into the destination,
and a reader that finds it claimed receives into scratch and drops the bytes.
A claimant whose bytes fail their checksum releases the claim.

Hedges add load exactly when servers are slow, so they are rationed: a server
needs `min_samples` measured reads before it is hedged, and hedges may be at
most `budget` of the batches issued (the tail-at-scale rule of thumb: a few
percent of extra reads for most of the tail). A batch that has waited many p95s
is re-read past the budget: its server is failing (cut off, stopped), not slow.
"""

from __future__ import annotations

import collections
import threading
import time

_CLAIMS = threading.Lock()  # claims come from the transports' receive threads


class Fence:
    """Who may write one range into the destination."""

    __slots__ = ("owner",)

    def __init__(self) -> None:
        self.owner: object | None = None

    def claim(self, reader: object) -> bool:
        """True if `reader` may write the range (nobody else has, or is)."""
        with _CLAIMS:
            if self.owner is None:
                self.owner = reader
            return self.owner is reader

    def release(self, reader: object) -> None:
        """`reader`'s bytes were bad: let another reader write the range."""
        with _CLAIMS:
            if self.owner is reader:
                self.owner = None


class ServerLatency:
    """Recent batch-read latencies per chunkserver, and their p95."""

    def __init__(self, window: int = 256, min_samples: int = 20):
        self.window = window
        self.min_samples = min_samples
        self._samples: dict[str, collections.deque[float]] = {}
        self._p95: dict[str, float] = {}
        self._fresh: collections.Counter = collections.Counter()  # samples since the p95 was computed

    def observe(self, address: str, seconds: float) -> None:
        samples = self._samples.setdefault(address, collections.deque(maxlen=self.window))
        samples.append(seconds)
        self._fresh[address] += 1
        # sorting 256 floats per read would cost more than the read's bookkeeping
        if len(samples) >= self.min_samples and (address not in self._p95 or self._fresh[address] >= 16):
            ordered = sorted(samples)
            self._p95[address] = ordered[int(0.95 * (len(ordered) - 1))]
            self._fresh[address] = 0

    def p95(self, address: str) -> float | None:
        """None until the server has `min_samples` reads measured."""
        return self._p95.get(address)

    def snapshot(self) -> dict[str, dict]:
        return {a: {"p95_s": self._p95.get(a), "samples": len(s)} for a, s in self._samples.items()}


class ServerBacklog:
    """What each chunkserver's data port last said of its read backlog (READ_REPLY's
    header, kvfs/wire.py: bytes of reads from every client it had taken ahead of
    ours), and when. Reported from the transports' receive threads."""

    FRESH = 1.0  # seconds a report stands for: a server not read from since may have drained

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: dict[str, tuple[int, float]] = {}  # data address -> (bytes, when)

    def report(self, address: str, nbytes: int) -> None:
        self._last[address] = (nbytes, self.clock())

    def total(self) -> int:
        """Bytes ahead at every server heard from within FRESH seconds."""
        now = self.clock()
        return sum(n for n, at in list(self._last.values()) if now - at <= self.FRESH)


class HedgeBudget:
    """Hedges at most `budget` of the batches issued (counted since start)."""

    def __init__(self, budget: float = 0.05, burst: int = 4):
        self.budget = budget
        self.burst = burst
        self.batches = 0
        self.hedges = 0  # batches re-sent to another replica
        self.hedged_chunks = 0
        self.won = 0  # chunks whose hedge answered first
        self.rescues = 0  # batches re-read past the budget: their server had answered nothing for long

    def issued(self) -> None:
        self.batches += 1

    def take(self) -> bool:
        if self.hedges + 1 > self.budget * self.batches + self.burst:
            return False
        self.hedges += 1
        return True
