"""The metaserver's metrics collector in-process: what a scrape reads, also while
the event loop is held up."""

import threading

import pytest

from kvfs.keys import KEY_BYTES, Namespace
from kvfs.metaserver import metrics
from kvfs.metaserver.config import MetaserverConfig
from kvfs.metaserver.metrics import StatusCollector
from kvfs.proto import meta_pb2


def sample(collector: StatusCollector, name: str) -> float:
    return next(s.value for family in collector.collect() for s in family.samples if s.name == name)


def test_a_scrape_reads_a_fresh_snapshot_or_while_the_loop_is_held_up_the_previous_one(
        make_state, event_loop_thread, monkeypatch):
    taken = []

    def status():
        taken.append(1)
        return meta_pb2.StatusReply(blocks=len(taken))

    collector = StatusCollector(make_state().blocks, status, event_loop_thread)
    assert sample(collector, "kvfs_meta_blocks") == 2  # taken on the loop for this scrape
    held, release = threading.Event(), threading.Event()
    event_loop_thread.call_soon_threadsafe(lambda: (held.set(), release.wait()))
    held.wait()
    monkeypatch.setattr(metrics, "FRESH_WAIT", 0.05)
    try:
        assert sample(collector, "kvfs_meta_blocks") == 2  # the scrape answers, with the previous snapshot
    finally:
        release.set()
    assert sample(collector, "kvfs_meta_blocks") == len(taken) > 2


def test_lookups_count_the_keys_asked_and_the_blocks_matched(make_state, event_loop_thread):
    state = make_state()
    collector = StatusCollector(state.blocks, meta_pb2.StatusReply, event_loop_thread)
    digest = Namespace("acme", "m").digest
    assert state.match(digest, [bytes([i]) * KEY_BYTES for i in range(1, 6)]).matched == 0
    assert state.match(digest, []).matched == 0
    assert [sample(collector, f"kvfs_meta_{n}_total") for n in ("lookups", "lookup_blocks_requested",
                                                                 "lookup_blocks_matched")] == [2, 5, 0]


@pytest.mark.parametrize("listen", ["9100", ":9100", "[]:9100", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000"])
def test_metrics_listen_needs_a_host_and_a_port(listen):
    with pytest.raises(ValueError, match="metrics_listen must be host:port"):
        MetaserverConfig(metrics_listen=listen)


def test_metrics_listen_takes_a_host_and_a_port_or_nothing():
    for listen in ("", "127.0.0.1:0", "0.0.0.0:9100", "[::1]:9100", "meta-1:9100"):
        assert MetaserverConfig(metrics_listen=listen).metrics_listen == listen


def test_steps_held_for_lookups_are_counted_with_the_time_they_waited(make_state, event_loop_thread):
    import asyncio

    from kvfs.metaserver.readsfirst import ReadsFirst

    reads = ReadsFirst()
    collector = StatusCollector(make_state().blocks, meta_pb2.StatusReply, event_loop_thread, reads)
    assert sample(collector, "kvfs_meta_steps_held_for_lookups_total") == 0

    async def held_step():
        reads.began()  # a lookup under way that does not end: the step waits MAX_WAIT
        await reads.before_step()

    asyncio.run_coroutine_threadsafe(held_step(), event_loop_thread).result(10)
    assert sample(collector, "kvfs_meta_steps_held_for_lookups_total") == 1
    from kvfs.metaserver.readsfirst import MAX_WAIT

    assert MAX_WAIT * 0.9 < sample(collector, "kvfs_meta_steps_held_for_lookups_seconds_total") < 0.5
