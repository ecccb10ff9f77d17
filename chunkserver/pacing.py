"""Per-tenant reads: counted, and paced so that one tenant's restore storm cannot
take a chunkserver's disk and network from the others.

Every read carries its lookup's read grant, which names the namespace's tenant
(kvfs.grants.tenant_id, a hash: chunkservers never see tenant names). Each
tenant's reads and bytes are counted (Stat's tenant_reads: what restores read,
per tenant). With `tenant_read_rate` set, each tenant's reads from this server
are paced to that many bytes per second, in bursts of up to BURST_S seconds'
worth, by a virtual clock per tenant (kvfs.pacing.Gcra): a read that would run its tenant
past the pace waits for its turn on the connection (data port) or call (gRPC)
that sent it, so only that tenant's reads queue. Other tenants' reads, and a
tenant under its pace, never wait. This is the minimum the issue asks for (a
token bucket); a work-conserving fair queue across tenants would also let a
tenant use capacity the others leave idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfs.pacing import Gcra

BURST_S = 1.0
MAX_TRACKED = 65_536  # tenants counted one by one; past it, together under OTHER
OTHER = b""


@dataclass(slots=True)
class TenantReads:
    reads: int = 0
    bytes: int = 0
    paced: int = 0  # reads that waited for the tenant's pace
    paced_seconds: float = 0.0


class ReadPacer:
    def __init__(self, rate: int, counters, clock: Callable[[], float] = time.monotonic):
        self.rate = rate  # bytes/s per tenant; 0: no pacing
        self.counters = counters  # the store's Counters: reads_paced, paced_seconds over all tenants
        self.clock = clock
        self.tenants: dict[bytes, TenantReads] = {}
        self._pace = Gcra(rate, BURST_S, MAX_TRACKED)
        self._lock = threading.Lock()  # data-port connections run in threads of their own

    def delay(self, tenant: bytes, nbytes: int) -> float:
        """Counts a read of `nbytes` by `tenant`; the seconds it must wait for the
        tenant's pace (0: none), booked."""
        if not tenant:  # an admin's or a server's read, or an --insecure server: no tenant to count or pace
            return 0.0
        with self._lock:
            stats = self.tenants.get(tenant)
            if stats is None:
                stats = self.tenants.setdefault(tenant if len(self.tenants) < MAX_TRACKED else OTHER, TenantReads())
            stats.reads += 1
            stats.bytes += nbytes
            wait = self._pace.charge(tenant, nbytes, self.clock())
            if wait <= 0:
                return 0.0
            stats.paced += 1
            stats.paced_seconds += wait
            self.counters.reads_paced += 1
            self.counters.paced_seconds += wait
            return wait

    def snapshot(self) -> list[tuple[bytes, TenantReads]]:
        with self._lock:
            return [(t, TenantReads(s.reads, s.bytes, s.paced, s.paced_seconds)) for t, s in self.tenants.items()]
