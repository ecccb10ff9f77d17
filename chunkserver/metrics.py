"""The chunkserver's Prometheus metrics, served when `metrics_listen` is set.

Two kinds, so that no count is kept twice:

- per request, where nothing counts yet: bytes read and seconds per read request
  by transport (a gRPC ReadChunks call, a data-port READ over TCP or the local
  socket, a READ_SHM), and seconds per WriteChunk call. One counter increment and
  one histogram observation per request, a couple of microseconds, from the
  data port's connection threads and the event loop alike (prometheus_client's
  values take their own locks);
- at scrape time, in prometheus_client's thread: what the store already counts
  for `kvfs chunk stat` (ChunkStore.counters, chunks and bytes stored), slots per
  size class, the scrubber's progress, the data port's open connections and the
  io_uring reader's queue. Each is a plain int or a short locked copy: a scrape
  never waits for the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .dataport import DataServer
from .scrub import Scrubber
from .store import ChunkStore
from .uring import UringReader

# grpc: ReadChunks; tcp: data-port READ over TCP; local: READ over the data port's
# local socket (a same-host client whose shared memory was refused); shm: READ_SHM
TRANSPORTS = ("grpc", "tcp", "local", "shm")
# a request of a few 64 KiB blocks from the page cache takes ~100 us, one of
# hundreds of MiB from disk a second or more
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)

COUNTERS = (  # metric (the exposition adds _total), Counters field, help
    ("kvfs_chunk_read_ranges", "reads", "ranges read and served to clients (not scrub reads)"),
    ("kvfs_chunk_write_bytes", "write_bytes", "bytes of chunks stored (written by clients and copied here by "
                                              "re-replication; a chunk already stored is not counted)"),
    ("kvfs_chunk_writes", "writes", "chunks stored"),
    ("kvfs_chunk_deleted_chunks", "deletes", "chunks deleted"),
    ("kvfs_chunk_checksum_errors", "checksum_errors", "verifications that failed, on reads and scrubs (the bytes "
                                                      "were not served)"),
    ("kvfs_chunk_rejected_requests", "rejected_requests", "requests refused as malformed, unauthorized or too slow "
                                                          "to arrive"),
    ("kvfs_chunk_scrubbed_bytes", "scrubbed_bytes", "bytes the scrubber verified"),
    ("kvfs_chunk_scrub_passes", "scrub_passes", "full scrub passes completed"),
    ("kvfs_chunk_corrupt_chunks_removed", "corrupt_chunks_removed", "chunks removed as corrupt (reported lost to "
                                                                    "the metaserver, which copies them back)"),
    ("kvfs_chunk_reads_paced", "reads_paced", "reads that waited for their tenant's pace (tenant_read_rate)"),
    ("kvfs_chunk_paced_seconds", "paced_seconds", "how long paced reads waited, in all"),
    ("kvfs_chunk_writes_deferred", "writes_deferred", "chunk writes that waited for client reads in flight before "
                                                      "taking the disk (reads first, write_yield)"),
    ("kvfs_chunk_write_deferred_seconds", "deferred_seconds", "how long deferred writes waited, in all"),
)


class TransportReads:
    """One transport's read counters, resolved once: a labels() lookup per request
    would cost as much as the observation."""

    __slots__ = ("nbytes", "seconds")

    def __init__(self, nbytes: Counter, seconds: Histogram, transport: str):
        self.nbytes = nbytes.labels(transport)
        self.seconds = seconds.labels(transport)

    def served(self, nbytes: int, seconds: float) -> None:
        """One request answered: `nbytes` served, `seconds` from its arrival to its reply sent."""
        self.nbytes.inc(nbytes)
        self.seconds.observe(seconds)


class ChunkMetrics:
    """The per-request metrics: reads and writes by transport."""

    def __init__(self, registry: CollectorRegistry):
        nbytes = Counter("kvfs_chunk_read_bytes", "bytes served to reads (whole 64 KiB checksum blocks on the data "
                         "port), by transport", ["transport"], registry=registry)
        seconds = Histogram("kvfs_chunk_read_seconds", "time from a read request's arrival to its reply sent, by "
                            "transport (refused requests included)", ["transport"], buckets=SECONDS_BUCKETS,
                            registry=registry)
        self.reads = {t: TransportReads(nbytes, seconds, t) for t in TRANSPORTS}
        written = Histogram("kvfs_chunk_write_seconds", "time to answer a chunk write (gRPC WriteChunk, or a "
                            "data-port WRITE over tcp or the local socket), from its first message to the chunk "
                            "durable, by transport (failed writes included)", ["transport"],
                            buckets=SECONDS_BUCKETS, registry=registry)
        self.write_seconds = {t: written.labels(t) for t in ("grpc", "tcp", "local")}


class StoreCollector(Collector):
    """What the store, the scrubber, the data port and the reader count, at scrape time."""

    def __init__(self, store: ChunkStore, scrubber: Scrubber, data: DataServer | None):
        self.store = store
        self.scrubber = scrubber
        self.data = data

    def collect(self) -> Iterator[Metric]:
        store, c = self.store, self.store.counters
        for metric, field, text in COUNTERS:
            yield CounterMetricFamily(metric, text, value=getattr(c, field))
        yield GaugeMetricFamily("kvfs_chunk_chunks", "chunks stored", value=store.chunk_count)
        yield GaugeMetricFamily("kvfs_chunk_used_bytes", "bytes of the chunks stored", value=store.used_bytes)
        yield GaugeMetricFamily("kvfs_chunk_allocated_bytes", "bytes of slot files allocated (slots in use and "
                                "free)", value=store.slots.allocator.allocated_bytes)
        yield GaugeMetricFamily("kvfs_chunk_capacity_bytes", "most bytes of slot files this server may allocate",
                                value=store.cfg.capacity)
        used = GaugeMetricFamily("kvfs_chunk_slots_used", "slots holding a chunk, by size class (bytes)",
                                 labels=["size_class"])
        allocated = GaugeMetricFamily("kvfs_chunk_slots_allocated", "slots in the slot files, by size class "
                                      "(bytes)", labels=["size_class"])
        for cls, (n_used, n_allocated) in sorted(store.slots.usage().items()):
            used.add_metric([str(cls)], n_used)
            allocated.add_metric([str(cls)], n_allocated)
        yield used
        yield allocated
        yield GaugeMetricFamily("kvfs_chunk_scrub_pass_chunks", "chunks the scrub pass under way has checked (the "
                                "last pass's total between passes)", value=self.scrubber.current.chunks)
        yield GaugeMetricFamily("kvfs_chunk_scrub_last_pass_end_timestamp_seconds", "when the last full scrub "
                                "pass ended (Unix time; 0: none yet)", value=self.scrubber.last_pass_end)
        if self.data is not None:
            tcp, local = self.data.connections()
            open_ = GaugeMetricFamily("kvfs_chunk_data_connections", "data-port connections open, by socket "
                                      "(tcp, or local: the same-host Unix socket)", labels=["socket"])
            open_.add_metric(["tcp"], tcp)
            open_.add_metric(["local"], local)
            yield open_
            yield CounterMetricFamily("kvfs_chunk_data_connections_refused", "data-port connections refused (the "
                                      "server's or a peer's connection limit)", value=self.data.refused)
            yield GaugeMetricFamily("kvfs_chunk_read_backlog_bytes", "bytes of data-port reads taken and not yet "
                                    "sent, from every client (each read's reply tells the backlog it found)",
                                    value=self.data.read_backlog)
        if isinstance(store.reader, UringReader):
            inflight, waiting = store.reader.queue_depth()
            yield GaugeMetricFamily("kvfs_chunk_uring_inflight_reads", "reads submitted to the io_uring ring and "
                                    "not completed", value=inflight)
            yield GaugeMetricFamily("kvfs_chunk_uring_waiting_reads", "reads waiting for a free ring entry",
                                    value=waiting)
