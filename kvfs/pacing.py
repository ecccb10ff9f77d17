"""Per-tenant pace by a virtual clock per key (GCRA): each key may spend `rate`
units a second, in bursts of up to `burst` seconds' worth. Chunkservers pace each
tenant's reads with it (a read past the pace waits its turn), the metaserver each
tenant's writes (an allocation past the pace is refused with when to retry)."""

from __future__ import annotations


class Gcra:
    def __init__(self, rate: float, burst: float = 1.0, most_keys: int = 65_536):
        self.rate = rate  # units per second; 0: unpaced
        self.burst = burst
        self.most_keys = most_keys
        self._due: dict[bytes | str, float] = {}  # key -> when what it spent so far is paid for

    def charge(self, key: bytes | str, amount: float, now: float, refuse: bool = False) -> float:
        """Books `amount` for `key` at `now`; the seconds it is past its pace (0: within
        it), which a caller waits. With `refuse`: nothing is booked, and the seconds
        until it may try again are returned, while what `key` spent before is more
        than a burst ahead of its pace; otherwise it is booked whatever its size (so
        one request larger than a burst goes through, and the next ones pay for it)."""
        if not self.rate:
            return 0.0
        start = max(self._due.get(key, now), now)
        if refuse and start - now > self.burst:
            return start - now - self.burst
        due = start + amount / self.rate
        over = 0.0 if refuse else due - now - self.burst
        if len(self._due) >= self.most_keys and key not in self._due:
            for caught_up in [k for k, d in self._due.items() if d <= now]:  # they start afresh, as new ones do
                del self._due[caught_up]
        self._due[key] = due
        return max(0.0, over)
