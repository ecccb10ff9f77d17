"""The chunkservers' Prometheus endpoints against a real cluster: reads counted by
the transport that served them, writes by replica, and the store's state as Stat
reports it."""

import os

import pytest

from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import restore_all, tokens_for, wait_until
from test_metrics import moved, scrape

NS = Namespace("acme", "deepseek-v3")
MLA = BlockLayout.mla()  # 1.9 MiB blocks: two chunks each
TRANSPORTS = ("grpc", "tcp", "local", "shm")
STAT_COUNTERS = {"kvfs_chunk_read_ranges_total": "reads", "kvfs_chunk_write_bytes_total": "write_bytes",
                 "kvfs_chunk_writes_total": "writes", "kvfs_chunk_deleted_chunks_total": "deletes",
                 "kvfs_chunk_checksum_errors_total": "checksum_errors",
                 "kvfs_chunk_rejected_requests_total": "rejected_requests",
                 "kvfs_chunk_scrubbed_bytes_total": "scrubbed_bytes", "kvfs_chunk_scrub_passes_total": "scrub_passes",
                 "kvfs_chunk_corrupt_chunks_removed_total": "corrupt_chunks_removed"}


def scrape_all(cluster) -> list[dict]:
    return [scrape(cs.metrics_address) for cs in cluster.chunkservers]


def total(before: list[dict], after: list[dict], name: str, **labels) -> float:
    """How far a sample moved, summed over the chunkservers."""
    return sum(moved(b, a, name, **labels) for b, a in zip(before, after))


def connections(cluster, socket: str) -> float:
    return sum(s[("kvfs_chunk_data_connections", (("socket", socket),))] for s in scrape_all(cluster))


@pytest.mark.parametrize("mode", ["direct", "buffered"])
async def test_chunkserver_metrics_count_reads_by_transport_writes_by_replica_and_match_stat(local_cluster, mode):
    cluster = local_cluster(chunk_extra=["--io-mode", mode])
    assert all(cs.metrics_address.startswith("127.0.0.1:") for cs in cluster.chunkservers)
    # writes: the data port's local socket by default (loopback), TCP with "tcp", WriteChunk with "grpc"
    for seed, (writer_transport, counted) in enumerate((("grpc", "grpc"), ("tcp", "tcp"), ("auto", "local"))):
        tokens = tokens_for(4, seed=21 + seed)  # the last one is restored below
        payload = os.urandom(MLA.buffer_bytes(len(tokens)))
        before = scrape_all(cluster)
        async with Client(cluster.meta_address, transport=writer_transport) as writer:
            assert (await writer.write(NS, tokens, payload, MLA)).committed == 4
        after = scrape_all(cluster)
        assert total(before, after, "kvfs_chunk_write_bytes_total") == 2 * len(payload)  # two replicas
        chunks = total(before, after, "kvfs_chunk_writes_total")
        assert chunks == 2 * 4 * 2  # replicas x blocks x two chunks a block
        for label in ("grpc", "tcp", "local"):  # one write each, under the transport it took
            assert total(before, after, "kvfs_chunk_write_seconds_count", transport=label) == \
                (chunks if label == counted else 0), (writer_transport, label)
        assert total(before, after, "kvfs_chunk_write_seconds_sum", transport=counted) > 0
        assert all(a[("kvfs_chunk_write_seconds_bucket", (("le", "+Inf"), ("transport", counted)))] ==
                   a[("kvfs_chunk_write_seconds_count", (("transport", counted),))] for a in after)

    for transport in ("grpc", "tcp", "shm"):
        before = scrape_all(cluster)
        async with Client(cluster.meta_address, transport=transport, hedge=False) as client:
            out, _, stats = await restore_all(client, await client.lookup(NS, tokens), MLA)
            assert bytes(out) == payload and stats.retries == 0
            if transport != "grpc":  # the client holds its data-port connections open until it closes
                socket = "local" if transport == "shm" else "tcp"
                assert connections(cluster, socket) >= 1
        after = scrape_all(cluster)
        # whole 64 KiB checksum blocks on the data port: at least the payload
        assert total(before, after, "kvfs_chunk_read_bytes_total", transport=transport) >= len(payload), transport
        requests = total(before, after, "kvfs_chunk_read_seconds_count", transport=transport)
        assert 1 <= requests == total(before, after, "kvfs_chunk_read_seconds_bucket", transport=transport,
                                      le="+Inf")
        assert total(before, after, "kvfs_chunk_read_seconds_sum", transport=transport) > 0
        for other in TRANSPORTS:
            if other != transport:
                assert total(before, after, "kvfs_chunk_read_bytes_total", transport=other) == 0, (transport, other)
                assert total(before, after, "kvfs_chunk_read_seconds_count", transport=other) == 0
        assert total(before, after, "kvfs_chunk_checksum_errors_total") == 0
    wait_until(lambda: connections(cluster, "tcp") == connections(cluster, "local") == 0, 15,
               "the data-port connections to close with their clients")

    for cs, samples in zip(cluster.chunkservers, scrape_all(cluster)):
        async with ChunkClient(cs.address) as admin:
            stat = await admin.stat()
        assert samples[("kvfs_chunk_chunks", ())] == stat.chunk_count > 0
        assert samples[("kvfs_chunk_used_bytes", ())] == stat.used_bytes
        assert samples[("kvfs_chunk_allocated_bytes", ())] == stat.allocated_bytes
        assert samples[("kvfs_chunk_capacity_bytes", ())] == stat.capacity_bytes
        assert {name: samples[(name, ())] for name in STAT_COUNTERS} == \
            {name: getattr(stat.counters, field) for name, field in STAT_COUNTERS.items()}
        # every byte the store counted as read, counted once under one transport
        assert sum(samples[("kvfs_chunk_read_bytes_total", (("transport", t),))] for t in TRANSPORTS) == \
            stat.counters.read_bytes
        slots_used = {dict(labels)["size_class"]: v for (name, labels), v in samples.items()
                      if name == "kvfs_chunk_slots_used"}
        assert sum(slots_used.values()) == stat.chunk_count
        assert all(samples[("kvfs_chunk_slots_allocated", (("size_class", c),))] >= n for c, n in slots_used.items())
        assert samples[("kvfs_chunk_data_connections_refused_total", ())] == 0
        if stat.io_engine == "io_uring":  # nothing in flight at rest
            assert (samples[("kvfs_chunk_uring_inflight_reads", ())],
                    samples[("kvfs_chunk_uring_waiting_reads", ())]) == (0, 0)
        assert samples[("process_resident_memory_bytes", ())] > 0


def test_chunkserver_metrics_reuse_their_port_on_restart(local_cluster):
    cluster = local_cluster(chunkservers=2)
    address = cluster.chunkservers[0].metrics_address
    cluster.chunkservers[0].stop()
    assert cluster.start_chunkserver(0).metrics_address == address
    assert scrape(address)[("kvfs_chunk_chunks", ())] == 0


def test_chunkserver_metrics_are_off_unless_asked_for(local_cluster):
    cluster = local_cluster(chunkservers=2, metrics=False)
    assert [cs.metrics_address for cs in cluster.chunkservers] == ["", ""]
