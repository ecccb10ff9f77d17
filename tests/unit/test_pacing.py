"""Per-tenant read pacing (chunkserver/pacing.py) with a settable clock."""

from kvfs.chunkserver.pacing import BURST_S, ReadPacer
from kvfs.chunkserver.store import Counters

from helpers import Clock


def test_each_tenant_is_paced_on_its_own_after_a_burst_and_starts_afresh_once_caught_up():
    clock, counters = Clock(), Counters()
    pacer = ReadPacer(1000, counters, clock)  # 1,000 bytes/s, bursts of BURST_S seconds' worth
    assert BURST_S == 1.0
    assert pacer.delay(b"tenant-a", 1000) == 0  # within the burst
    assert pacer.delay(b"tenant-a", 500) == 0.5  # past it: waits for its pace
    assert pacer.delay(b"tenant-a", 500) == 1.0  # and the next after that one
    assert pacer.delay(b"tenant-b", 1000) == 0  # another tenant: its own pace
    clock.now += 1.0
    assert pacer.delay(b"tenant-a", 1000) == 1.0  # its reads are booked 1 s ahead, + 1 s for this one, - the burst
    assert (counters.reads_paced, counters.paced_seconds) == (3, 2.5)
    a, b = pacer.tenants[b"tenant-a"], pacer.tenants[b"tenant-b"]
    assert (a.reads, a.bytes, a.paced, a.paced_seconds) == (4, 3000, 3, 2.5) and (b.reads, b.paced) == (1, 0)
    clock.now += 60
    assert pacer.delay(b"tenant-a", 1000) == 0  # caught up long since: a burst again
    unpaced = ReadPacer(0, Counters(), clock)
    assert unpaced.delay(b"tenant-a", 1 << 30) == 0 and unpaced.tenants[b"tenant-a"].bytes == 1 << 30  # counted
    assert pacer.delay(b"", 1 << 30) == 0 and b"" not in pacer.tenants  # no tenant (admin, --insecure): neither
