"""`kvfs top`: a live terminal view of what an operator watches, read from the
servers over gRPC with an admin's certificate: the metaserver's Status (blocks,
cache, servers, losses) and Usage (lookups and hits, every tenant), and each live
chunkserver's Stat (the bytes its reads served: restores and repair copies).
Rates are the change between two samples. For people without Grafana; the
Prometheus metrics (docs/operations.md) say the same and more."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from rich.console import Group
from rich.table import Table

from kvfs import tls
from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2, meta_pb2_grpc

from .main import _human


@dataclass(frozen=True)
class Sample:
    """What the servers said at one moment (`at`: monotonic seconds)."""

    at: float
    status: meta_pb2.StatusReply
    usage: meta_pb2.UsageReply
    read_bytes: dict[str, int] = field(default_factory=dict)  # server id -> bytes served (live ones that answered)

    def total(self, name: str) -> int:
        """A Usage figure summed over every tenant."""
        return sum(getattr(u, name) for u in self.usage.tenants)


def take_sample(meta: str, credentials: tls.Credentials | None) -> Sample:
    with tls.channel(meta, credentials) as channel:
        stub = meta_pb2_grpc.MetaServiceStub(channel)
        status = stub.Status(meta_pb2.StatusRequest(), timeout=10)
        usage = stub.Usage(meta_pb2.UsageRequest(), timeout=10)
    read_bytes = {}
    for server in status.servers:
        if not server.live:
            continue
        try:
            with tls.channel(server.address, credentials) as channel:
                stat = chunk_pb2_grpc.ChunkServiceStub(channel).Stat(chunk_pb2.StatRequest(), timeout=5)
            read_bytes[server.id] = stat.counters.read_bytes
        except grpc.RpcError:
            pass  # shown as "-": a slow or refusing server does not stop the view
    return Sample(time.monotonic(), status, usage, read_bytes)


def _ratio(hit: int, asked: int) -> str:
    return f"{hit / asked:.1%}" if asked else "-"


def _rate(prev: Sample, cur: Sample, now: int, before: int | None, unit: str = "") -> str:
    if before is None or cur.at <= prev.at:
        return "-"
    per_s = (now - before) / (cur.at - prev.at)
    return f"{_human(per_s)}/s" if unit == "bytes" else f"{per_s:,.1f}/s"


def frame(prev: Sample, cur: Sample) -> Group:
    """One screen: the cluster's totals and rates, each tenant, each server."""
    st = cur.status
    restored, restored_before = sum(cur.read_bytes.values()), sum(prev.read_bytes.get(k, 0) for k in cur.read_bytes)
    dead = sum(not s.live for s in st.servers)
    cluster = Table(title="kvfs top", caption=f"cache {_human(st.cache_bytes)} of {_human(st.cache_capacity_bytes)}"
                    "; write-backs deferred or dropped are counted in the clients, not here")
    columns = {"hit ratio": _ratio(cur.total("blocks_hit"), cur.total("blocks_requested")),
               "lookups": f"{cur.total('lookups'):,}",
               "lookups/s": _rate(prev, cur, cur.total("lookups"), prev.total("lookups")),
               "restored": _human(restored),
               "restore B/s": _rate(prev, cur, restored, restored_before, "bytes"),
               "blocks": f"{st.blocks:,}", "evicted": f"{st.evicted_blocks:,}", "expired": f"{st.expired_blocks:,}",
               "lost blocks": f"{st.blocks_lost:,}", "lost copies": f"{st.replicas_lost:,}"}
    for name in columns:
        cluster.add_column(name, justify="right")
    cluster.add_row(*columns.values())

    tenants = Table(title="per tenant (since metering began)")
    for name in ("tenant", "lookups", "blocks hit", "hit ratio", "stored"):
        tenants.add_column(name, justify="left" if name == "tenant" else "right")
    for u in cur.usage.tenants:
        tenants.add_row(u.tenant, f"{u.lookups:,}", f"{u.blocks_hit:,}", _ratio(u.blocks_hit, u.blocks_requested),
                        _human(u.bytes_stored))

    servers = Table(title="per chunkserver")
    for name in ("server", "domain", "live", "chunks", "used", "capacity", "full", "read B/s"):
        servers.add_column(name, justify="left" if name in ("server", "domain") else "right")
    for s in st.servers:
        now = cur.read_bytes.get(s.id)
        servers.add_row(s.id, s.failure_domain, "yes" if s.live else "[red]NO[/]", f"{s.chunk_count:,}",
                        _human(s.used_bytes), _human(s.capacity_bytes),
                        _ratio(s.allocated_bytes, s.capacity_bytes),
                        "-" if now is None else _rate(prev, cur, now, prev.read_bytes.get(s.id), "bytes"))
    repair = Table(title="repair (chunks short of copies: at the start of its last round)")
    for name in ("dead servers", "short of copies", "copied", "copied B", "copies/s", "failed"):
        repair.add_column(name, justify="right")
    repair.add_row(f"{dead:,}", f"{st.repair_backlog:,}", f"{st.repair_copied_chunks:,}",
                   _human(st.repair_copied_bytes),
                   _rate(prev, cur, st.repair_copied_chunks, prev.status.repair_copied_chunks),
                   f"{st.repair_failed_copies:,}")
    return Group(cluster, repair, tenants, servers)


def run(console, meta: str, credentials: tls.Credentials | None, interval: float, once: bool) -> int:
    """Redraws every `interval` seconds until Ctrl-C; with `once`, prints one frame
    (its rates over one interval) and returns."""
    from rich.live import Live

    prev = take_sample(meta, credentials)
    time.sleep(interval)  # a rate needs two samples
    cur = take_sample(meta, credentials)
    if once:
        console.print(frame(prev, cur))
        return 0
    try:
        with Live(frame(prev, cur), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                prev, cur = cur, take_sample(meta, credentials)
                live.update(frame(prev, cur))
    except KeyboardInterrupt:
        return 0
