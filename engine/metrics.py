"""The engine's admission decisions and write-back queue as Prometheus metrics, read
at scrape time from the counters they already keep (no cost per request). Register
`EngineCollector(engine)` on the host process's registry, beside the client's
(kvfs.client.ClientMetrics)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .admission import WriteBackQueue

DECISIONS = ("restore", "partial", "recompute")


class EngineCollector(Collector):
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        decisions = CounterMetricFamily("kvfs_engine_admission_decisions", "requests with a cached prefix, by what "
                                        "admission chose: restore all of it, a leading part, or recompute",
                                        labels=["decision"])
        made = getattr(self.engine.admission, "decisions", {})  # NoAdmission decides nothing
        for kind in DECISIONS:
            decisions.add_metric([kind], made.get(kind, 0))
        yield decisions
        queue = self.engine.writebacks
        if not isinstance(queue, WriteBackQueue):  # write-backs start at once: none waits, none dropped
            return
        yield CounterMetricFamily("kvfs_engine_write_backs_deferred", "write-backs that waited for restores",
                                  value=queue.deferred)
        yield CounterMetricFamily("kvfs_engine_write_backs_dropped", "write-backs dropped: the queue, or the "
                                  "tenant's share of it, was full", value=queue.dropped)
        yield CounterMetricFamily("kvfs_engine_write_back_dropped_bytes", "bytes of the dropped write-backs",
                                  value=queue.dropped_bytes)
        yield GaugeMetricFamily("kvfs_engine_write_back_queued_bytes", "bytes of write-backs waiting",
                                value=queue.queued_bytes)
