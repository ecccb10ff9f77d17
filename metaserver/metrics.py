"""The metaserver's Prometheus metrics, in a registry of their own (never
prometheus_client's global one), served over HTTP on `metrics_listen`.

Nothing here costs anything per block. Three sources:
- `RpcMetrics`: latency histograms and failures by status code of the data-path
  RPCs, which `timed` records (a couple of microseconds a call);
- the lookup counters BlockTable.match adds a request's totals to;
- `StatusCollector`: what `kvfs status` reports, from a snapshot the event loop
  takes when asked. A scrape runs in prometheus_client's own thread: it reads
  plain counters and that snapshot, never the loop's dicts while the loop changes
  them.

No metric has a tenant label: tenants are unbounded, and a label per tenant
would grow the series without bound. Counts are since the process started, as
Prometheus counters are (rate() takes restarts in its stride).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfs.errors import KvfsError
from kvfs.proto import meta_pb2

from .blocks import BlockTable
from .readsfirst import ReadsFirst

TIMED_RPCS = ("MatchPrefix", "AllocateBlocks", "CommitBlocks")
# A lookup of 2,000 blocks takes about 2 ms, shorter ones less; a commit that evicts
# waits up to seconds for the deletes.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0)
FRESH_WAIT = 2.0  # seconds a scrape waits for the event loop's snapshot before taking the previous one

GAUGES = (  # metric, StatusReply field, help
    ("kvfs_meta_blocks", "blocks", "committed blocks in the cache"),
    ("kvfs_meta_block_bytes", "block_bytes", "payload bytes of the cached blocks"),
    ("kvfs_meta_cache_bytes", "cache_bytes", "what cached blocks take of chunkserver capacity, per replica "
                                             "(what eviction counts)"),
    ("kvfs_meta_cache_capacity_bytes", "cache_capacity_bytes", "the live chunkservers' capacity divided by "
                                                               "replicas; eviction keeps kvfs_meta_cache_bytes "
                                                               "under evict_high of it"),
    ("kvfs_meta_open_allocations", "open_allocations", "allocations neither committed nor expired yet"),
    ("kvfs_meta_chains", "chains", "chains in the chain table (over live servers)"),
    ("kvfs_meta_repair_backlog_chunks", "repair_backlog", "chunks short of copies at the last repair round's "
                                                          "start (0 once repair keeps up)"),
    ("kvfs_meta_loop_longest_stall_seconds", "loop_longest_stall_s", "the event loop's longest stall since the "
                                                                     "start"),
)
COUNTERS = (  # metric (the exposition adds _total), StatusReply field, help
    ("kvfs_meta_evicted_blocks", "evicted_blocks", "blocks dropped by capacity eviction"),
    ("kvfs_meta_expired_blocks", "expired_blocks", "blocks dropped past their TTL"),
    ("kvfs_meta_stranded_blocks", "stranded_blocks", "blocks dropped because an ancestor expired, was evicted or "
                                                     "was lost"),
    ("kvfs_meta_blocks_lost", "blocks_lost", "blocks dropped because a chunk of theirs had no copy left"),
    ("kvfs_meta_forgotten_blocks", "forgotten_blocks", "blocks of hash slots handed to another metaserver, "
                                                       "dropped from metadata with their chunks kept"),
    ("kvfs_meta_replicas_lost", "replicas_lost", "chunk copies chunkservers removed as corrupt"),
    ("kvfs_meta_gc_deleted_chunks", "gc_deleted_chunks", "chunks deleted on chunkservers (garbage, evicted, "
                                                         "expired)"),
    ("kvfs_meta_repair_copied_chunks", "repair_copied_chunks", "chunk copies repair made"),
    ("kvfs_meta_repair_copied_bytes", "repair_copied_bytes", "bytes of the chunk copies repair made"),
    ("kvfs_meta_repair_failed_copies", "repair_failed_copies", "chunk copies that failed (tried again the next "
                                                               "round)"),
)


class RpcMetrics:
    """Seconds per call of each of TIMED_RPCS, and their failures by gRPC status code."""

    def __init__(self, registry: CollectorRegistry):
        seconds = Histogram("kvfs_meta_rpc_seconds", "time the metaserver spent answering a call, failed ones "
                            "included", ["method"], buckets=RPC_BUCKETS, registry=registry)
        self.errors = Counter("kvfs_meta_rpc_errors", "calls answered with an error status", ["method", "code"],
                              registry=registry)
        # resolved once: a labels() lookup per call would cost as much as the observation
        self.seconds = {name: seconds.labels(name) for name in TIMED_RPCS}


def timed(method):
    """Servicer method decorator, under handles_errors: records the call's time and
    any failure's status code in the servicer's `rpc_metrics`."""
    name = method.__name__
    assert name in TIMED_RPCS, f"{name} is not in TIMED_RPCS"

    @functools.wraps(method)
    async def wrapper(self, request, context):
        metrics = self.rpc_metrics
        self.state.client_calls += 1
        t0 = time.perf_counter()
        try:
            return await method(self, request, context)
        except KvfsError as err:
            metrics.errors.labels(name, err.code.name).inc()
            raise
        except Exception:  # a bug: gRPC answers UNKNOWN
            metrics.errors.labels(name, "UNKNOWN").inc()
            raise
        finally:
            metrics.seconds[name].observe(time.perf_counter() - t0)

    return wrapper


class StatusCollector(Collector):
    """What `kvfs status` reports, and the lookup counters, at scrape time."""

    def __init__(self, blocks: BlockTable, status: Callable[[], meta_pb2.StatusReply],
                 loop: asyncio.AbstractEventLoop, reads: ReadsFirst | None = None):
        self.blocks = blocks
        self.reads = reads or ReadsFirst()
        self.status = status
        self.loop = loop
        self.snapshot = status()

    async def _take(self) -> meta_pb2.StatusReply:
        self.snapshot = self.status()
        return self.snapshot

    def fresh(self) -> meta_pb2.StatusReply:
        """A snapshot the event loop takes now; the previous one while the loop is held
        up past FRESH_WAIT (a scrape must answer then most of all)."""
        future = asyncio.run_coroutine_threadsafe(self._take(), self.loop)
        try:
            return future.result(FRESH_WAIT)
        except TimeoutError:
            future.cancel()
            return self.snapshot

    def collect(self) -> Iterator[Metric]:
        b = self.blocks
        yield CounterMetricFamily("kvfs_meta_lookups", "MatchPrefix calls answered", value=b.lookups)
        yield CounterMetricFamily("kvfs_meta_lookup_blocks_requested", "block keys the answered MatchPrefix calls "
                                  "asked for", value=b.lookup_blocks_requested)
        yield CounterMetricFamily("kvfs_meta_lookup_blocks_matched", "blocks they matched (the hit ratio is "
                                  "matched / requested)", value=b.lookup_blocks_matched)
        yield CounterMetricFamily("kvfs_meta_steps_held_for_lookups", "steps of writes and background passes "
                                  "that waited for lookups under way (readsfirst.py)", value=self.reads.waits)
        yield CounterMetricFamily("kvfs_meta_steps_held_for_lookups_seconds", "how long they waited, together",
                                  value=self.reads.waited_s)
        st = self.fresh()
        for metric, field, text in GAUGES:
            yield GaugeMetricFamily(metric, text, value=getattr(st, field))
        for metric, field, text in COUNTERS:
            yield CounterMetricFamily(metric, text, value=getattr(st, field))
        servers = GaugeMetricFamily("kvfs_meta_servers", "chunkservers known, by state (dead: silent past "
                                    "heartbeat_timeout, or back and not reconciled yet)", labels=["state"])
        live = sum(s.live for s in st.servers)
        servers.add_metric(["live"], live)
        servers.add_metric(["dead"], len(st.servers) - live)
        yield servers
        used = GaugeMetricFamily("kvfs_meta_server_used_bytes", "bytes a chunkserver last reported in use",
                                 labels=["server"])
        capacity = GaugeMetricFamily("kvfs_meta_server_capacity_bytes", "a chunkserver's capacity",
                                     labels=["server"])
        for s in st.servers:
            used.add_metric([s.id], s.used_bytes)
            capacity.add_metric([s.id], s.capacity_bytes)
        yield used
        yield capacity
        stalls = CounterMetricFamily("kvfs_meta_loop_stalls", "event loop stalls longer than over_seconds",
                                     labels=["over_seconds"])
        busy = CounterMetricFamily("kvfs_meta_loop_busy_stalls", "of those, stalls during which the loop's thread "
                                   "was on the CPU (its own work held it, not a busy machine)",
                                   labels=["over_seconds"])
        waiting = CounterMetricFamily("kvfs_meta_loop_waiting_stalls", "of the others, stalls during which the "
                                      "loop's thread waited for a core at least half the time (the machine's cores "
                                      "were taken)", labels=["over_seconds"])
        for s in st.loop_stalls:
            stalls.add_metric([repr(s.over_s)], s.count)
            busy.add_metric([repr(s.over_s)], s.busy_count)
            waiting.add_metric([repr(s.over_s)], s.waiting_count)
        yield stalls
        yield busy
        yield waiting
        steps = CounterMetricFamily("kvfs_meta_steps", "steps of writes and background passes on the event loop, "
                                    "by kind (readsfirst.StepTimes)", labels=["kind"])
        held = CounterMetricFamily("kvfs_meta_steps_seconds", "how long they held the event loop, together",
                                   labels=["kind"])
        long = CounterMetricFamily("kvfs_meta_long_steps", "of those, steps longer than over_seconds (a lookup "
                                   "that arrives during one waits for its end)", labels=["kind", "over_seconds"])
        cpu = CounterMetricFamily("kvfs_meta_steps_cpu_seconds", "the event loop thread's CPU time in them, "
                                  "together", labels=["kind"])
        long_cpu = CounterMetricFamily("kvfs_meta_long_busy_steps", "of those, steps whose CPU time alone passed "
                                       "over_seconds (their own work held the loop; the others also waited for a "
                                       "core, the disk or a lock)", labels=["kind", "over_seconds"])
        for s in st.steps:
            steps.add_metric([s.kind], s.count)
            held.add_metric([s.kind], s.seconds)
            cpu.add_metric([s.kind], s.cpu_seconds)
            for bound, n, busy_n in zip(s.over_s, s.over_count, s.over_cpu_count):
                long.add_metric([s.kind, repr(bound)], n)
                long_cpu.add_metric([s.kind, repr(bound)], busy_n)
        yield from (steps, held, cpu, long, long_cpu)
