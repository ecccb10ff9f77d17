"""Hedged-read bookkeeping: fences, per-server p95, the hedge budget."""

import threading

from kvfs.client.hedge import Fence, HedgeBudget, ServerLatency


def test_fence_lets_one_reader_write_and_reopens_when_its_bytes_were_bad():
    fence, a, b = Fence(), object(), object()
    assert fence.claim(a)
    assert fence.claim(a)  # the owner may write the rest of its range
    assert not fence.claim(b)
    fence.release(b)  # not the owner: no effect
    assert not fence.claim(b)
    fence.release(a)  # a's bytes failed their checksum
    assert fence.claim(b) and not fence.claim(a)


def test_fence_claims_race_to_exactly_one_winner():
    def go(fence, barrier, winners, me):
        barrier.wait()
        if fence.claim(me):
            winners.append(me)

    for _ in range(50):
        fence, barrier, winners = Fence(), threading.Barrier(8), []
        threads = [threading.Thread(target=go, args=(fence, barrier, winners, object())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1


def test_p95_needs_min_samples_and_tracks_the_tail():
    lat = ServerLatency(window=100, min_samples=20)
    for _ in range(19):
        lat.observe("a", 0.001)
    assert lat.p95("a") is None
    lat.observe("a", 0.001)
    assert lat.p95("a") == 0.001
    for i in range(100):  # the window now holds 0..99 ms
        lat.observe("a", i / 1000)
    assert 0.090 <= lat.p95("a") <= 0.095
    assert lat.p95("b") is None
    assert lat.snapshot()["a"]["samples"] == 100


def test_budget_allows_a_burst_then_a_share_of_batches():
    budget = HedgeBudget(budget=0.1, burst=2)
    assert budget.take() and budget.take() and not budget.take()
    for _ in range(20):
        budget.issued()
    assert budget.take() and budget.take() and not budget.take()  # 10% of 20, plus the burst
    assert budget.hedges == 4


def test_server_backlog_sums_the_fresh_reports_of_each_server():
    from kvfs.client.hedge import ServerBacklog

    now = [100.0]
    b = ServerBacklog(clock=lambda: now[0])
    assert b.total() == 0
    b.report("cs-1:9", 10 << 20)
    b.report("cs-2:9", 4 << 20)
    b.report("cs-1:9", 6 << 20)  # the latest report of a server stands
    assert b.total() == 10 << 20
    now[0] += 0.5
    b.report("cs-3:9", 1 << 20)
    now[0] += ServerBacklog.FRESH - 0.25  # cs-1 and cs-2 last spoke too long ago
    assert b.total() == 1 << 20
