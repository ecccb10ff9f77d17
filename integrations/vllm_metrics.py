"""KvfsConnector's numbers in vLLM's own stats: `KvfsStats`, the per-interval
counts vLLM carries from the connector to its stat loggers, and `KvfsPromMetrics`,
the `vllm:kvfs_*` Prometheus metrics they feed.

vLLM 0.32 asks both connector roles for `get_kv_connector_stats()` once per engine
step: the worker's travels in the model runner output to the scheduler, which
aggregates its own into it and ships `to_dict()` in `SchedulerStats` to the
frontend (msgpack when the engine core is its own process, so `data` holds only
numbers and lists of numbers). There `LoggingStatLogger` rebuilds a `KvfsStats`
through `KvfsConnector.build_kv_connector_stats`, sums the steps of its interval
and logs `reduce()` as "KV Transfer metrics: ..."; `PrometheusStatLogger` hands
each step's dict to `KvfsPromMetrics.observe`. Both need `disable_log_stats=False`
(`LLM()` defaults to True; `vllm serve` logs stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvfs.client.metrics import BUCKETS  # the SDK's own histograms' buckets: the two read side by side

# summed over an interval; each is the Prometheus counter vllm:kvfs_<key>_total
COUNTERS = {
    "lookup_blocks": "Full kvfs blocks in the prompts the scheduler looked up in kvfs.",
    "matched_blocks": "Of those, blocks kvfs held (matched_blocks / lookup_blocks is the block hit ratio).",
    "lookup_failures": "Lookups that failed (metaserver unreachable): those requests were computed in full.",
    "loaded_tokens": "Prompt tokens restored from kvfs into vLLM's paged cache.",
    "loaded_bytes": "KV bytes restored from kvfs into vLLM's paged cache.",
    "load_failed_blocks": "vLLM blocks whose restore failed and that vLLM recomputed.",
    "saved_blocks": "kvfs blocks written back and committed.",
    "saved_bytes": "KV bytes written back to kvfs (payload, counted once, not per replica).",
    "save_failures": "Write-backs that failed: their prefixes stay uncached.",
    "snapshot_seconds": "Seconds spent copying newly computed blocks out of the paged cache for write-back.",
    "load_wait_seconds": "Seconds the forward pass was blocked waiting for restored layers.",
}
# one observation per operation (a list in `data`); each is the histogram vllm:kvfs_<key>
TIMINGS = {
    "lookup_seconds": ("lookups", "Scheduler-side kvfs lookup (MatchPrefix) of a new request."),
    "load_seconds": ("loads", "A request's load, from start_load_kv until its last layer was in the paged "
                              "cache (the forward pass's layers before it included)."),
    "restore_seconds": ("restores", "A request's restore alone: the worker's lookup and its read, from "
                                    "start_load_kv until the last byte was in the staging buffer."),
    "save_seconds": ("saves", "A write-back, from its start until kvfs committed its blocks."),
}


@dataclass
class KvfsStats(KVConnectorStats):
    """What one connector (or, aggregated, all of them) did in an interval:
    `data` maps a COUNTERS key to its sum and a TIMINGS key to its observations."""

    def record(self, **values: float) -> None:
        self._add({key: [value] if key in TIMINGS else value for key, value in values.items()})

    def aggregate(self, other: KVConnectorStats) -> KvfsStats:
        # a new object: vLLM hands the same dict to several loggers, none may see another's sums
        merged = KvfsStats({key: list(value) if isinstance(value, list) else value
                            for key, value in self.data.items()})
        merged._add(other.data)
        return merged

    def _add(self, data: dict[str, Any]) -> None:
        """Counters summed, timings' observations appended."""
        for key, value in data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def reduce(self) -> dict[str, int | float]:
        """The interval's line in vLLM's log: counters that moved, then per timing
        the count and mean milliseconds, then the block hit ratio."""
        out: dict[str, int | float] = {key: round(self.data[key], 4) for key in COUNTERS if self.data.get(key)}
        for key, (count, _) in TIMINGS.items():
            if seconds := self.data.get(key):
                out[count] = len(seconds)
                out[f"{count}_mean_ms"] = round(sum(seconds) / len(seconds) * 1e3, 3)
        if self.data.get("lookup_blocks"):
            out["block_hit_ratio"] = round(self.data.get("matched_blocks", 0) / self.data["lookup_blocks"], 4)
        return out


class KvfsPromMetrics(KVConnectorPromMetrics):
    """vllm:kvfs_<counter>_total and vllm:kvfs_<timing> histograms, labelled like
    vLLM's own (model_name, engine). The `vllm:` prefix is what vLLM unregisters when
    it builds a new engine's metrics and what `LLM.get_metrics()` returns."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {key: create_metric_per_engine(
            self._counter_cls(name=f"vllm:kvfs_{key}", documentation=doc, labelnames=labelnames),
            per_engine_labelvalues) for key, doc in COUNTERS.items()}
        self.histograms = {key: create_metric_per_engine(
            self._histogram_cls(name=f"vllm:kvfs_{key}", documentation=doc, labelnames=labelnames,
                                buckets=list(BUCKETS)),
            per_engine_labelvalues) for key, (_, doc) in TIMINGS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self.counters:
                self.counters[key][engine_idx].inc(value)
            elif key in self.histograms:
                for seconds in value:
                    self.histograms[key][engine_idx].observe(seconds)
