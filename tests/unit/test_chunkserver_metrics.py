"""The chunkserver's scrape-time metrics in-process, over a real ChunkStore."""

import os

import pytest
from prometheus_client import CollectorRegistry

from kvfs.checksum import chunk_checksum
from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.chunkserver.metrics import ChunkMetrics, StoreCollector
from kvfs.chunkserver.scrub import Scrubber
from kvfs.chunkserver.uring import UringReader

KiB = 1024


async def test_a_scrape_reports_the_store_its_slots_and_the_scrubber(make_store):
    store = make_store()
    registry = CollectorRegistry()
    ChunkMetrics(registry)
    scrubber = Scrubber(store, rate=1 << 40, interval=3600, remove=True)
    registry.register(StoreCollector(store, scrubber, None))
    for cid, n in ((b"a", 10 * KiB), (b"b", 64 * KiB), (b"c", 700 * KiB)):
        data = os.urandom(n)
        assert await store.write(cid, data, chunk_checksum(data))
    await store.read([(b"c", 0, 0)])
    assert (await scrubber.scrub_pass()).chunks == 3

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("kvfs_chunk_chunks") == store.chunk_count == 3
    assert value("kvfs_chunk_used_bytes") == (10 + 64 + 700) * KiB
    assert value("kvfs_chunk_write_bytes_total") == (10 + 64 + 700) * KiB
    assert value("kvfs_chunk_writes_total") == 3
    assert value("kvfs_chunk_read_ranges_total") == 1  # the scrubber's reads are not client reads
    assert value("kvfs_chunk_scrubbed_bytes_total") == (10 + 64 + 700) * KiB
    assert value("kvfs_chunk_scrub_passes_total") == 1 and value("kvfs_chunk_scrub_pass_chunks") == 3
    assert value("kvfs_chunk_scrub_last_pass_end_timestamp_seconds") == scrubber.last_pass_end > 0
    assert value("kvfs_chunk_slots_used", size_class=str(64 * KiB)) == 2
    assert value("kvfs_chunk_slots_used", size_class=str(1024 * KiB)) == 1
    assert value("kvfs_chunk_slots_allocated", size_class=str(64 * KiB)) >= 2
    assert value("kvfs_chunk_capacity_bytes") == 1 << 30
    # the per-request metrics exist before any request: every transport at zero
    assert [value("kvfs_chunk_read_seconds_count", transport=t) for t in ("grpc", "tcp", "local", "shm")] == [0] * 4
    assert value("kvfs_chunk_data_connections", socket="tcp") is None  # no data port here
    uring = isinstance(store.reader, UringReader)
    assert (value("kvfs_chunk_uring_inflight_reads"), value("kvfs_chunk_uring_waiting_reads")) == \
        ((0, 0) if uring else (None, None))


@pytest.mark.parametrize("listen", ["9100", ":9100", "127.0.0.1:", "127.0.0.1:70000"])
def test_metrics_listen_needs_a_host_and_a_port(listen):
    with pytest.raises(ValueError, match="metrics_listen must be host:port"):
        ChunkserverConfig(metrics_listen=listen)


def test_metrics_listen_is_off_by_default():
    assert ChunkserverConfig().metrics_listen == ""
    assert ChunkserverConfig(metrics_listen="0.0.0.0:9101").metrics_listen == "0.0.0.0:9101"
