"""The SDK's own numbers as Prometheus metrics, on a registry the host process serves.

An inference worker already runs an exporter (vLLM's, or its own
`prometheus_client.start_http_server(port, registry=...)`); kvfs adds its metrics
to that registry rather than opening a port of its own. Off unless a client is
given one: `Client(..., metrics=ClientMetrics(registry))`. The engine's admission
decisions and write-back queue are in kvfs.engine.metrics.

What the servers cannot see: the time a lookup, restore or write-back took as the
worker waited for it (network and queues included), the bytes restored by the
transport that carried them, and hedges (a slow server's reads asked of another
replica).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from .restore import RestoreStats

# 0.5 ms to 10 s: a lookup is a millisecond or two, a 128K-token restore a second or more
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=BUCKETS, registry=registry)

        self.lookups = counter("kvfs_client_lookups", "MatchPrefix calls answered")
        self.lookup_blocks = counter("kvfs_client_lookup_blocks", "blocks the lookups asked for (requested) and "
                                     "found cached (matched)", ("result",))
        self.lookup_seconds = histogram("kvfs_client_lookup_seconds", "a lookup's MatchPrefix round trip")
        self.restores = counter("kvfs_client_restores", "restores finished, by outcome (ok, failed)", ("outcome",))
        self.restore_bytes = counter("kvfs_client_restore_bytes", "bytes restores read, by transport",
                                     ("transport",))
        self.restore_seconds = histogram("kvfs_client_restore_seconds", "a successful restore, from its start to "
                                         "its last layer in the buffer")
        self.hedges = counter("kvfs_client_hedges", "chunk reads also asked of another replica because their "
                              "server was slow (sent), and those the other replica delivered first (won)",
                              ("result",))
        self.retries = counter("kvfs_client_restore_retries", "chunk reads retried on another replica after a "
                               "failure")
        self.writes = counter("kvfs_client_writes", "write-backs finished, by outcome (ok, failed)", ("outcome",))
        self.write_blocks = counter("kvfs_client_write_blocks", "blocks write-backs committed")
        self.write_bytes = counter("kvfs_client_write_bytes", "payload bytes write-backs sent (once, not per "
                                   "replica)")
        self.write_seconds = histogram("kvfs_client_write_seconds", "a successful write-back: allocate, write "
                                       "every replica, commit")

    def looked_up(self, requested: int, matched: int, seconds: float) -> None:
        self.lookups.inc()
        self.lookup_blocks.labels("requested").inc(requested)
        self.lookup_blocks.labels("matched").inc(matched)
        self.lookup_seconds.observe(seconds)

    def restored(self, stats: RestoreStats, transport_of, failed: bool) -> None:
        """One restore's stats; transport_of(server id) names how its bytes came."""
        self.restores.labels("failed" if failed else "ok").inc()
        for server, nbytes in stats.per_server.items():
            self.restore_bytes.labels(transport_of(server)).inc(nbytes)
        if not failed:
            self.restore_seconds.observe(stats.seconds)
        self.hedges.labels("sent").inc(stats.hedges)
        self.hedges.labels("won").inc(stats.hedges_won)
        self.retries.inc(stats.retries)

    def wrote(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.writes.labels("ok").inc()
        self.write_blocks.inc(blocks)
        self.write_bytes.inc(nbytes)
        self.write_seconds.observe(seconds)

    def write_failed(self) -> None:
        self.writes.labels("failed").inc()
