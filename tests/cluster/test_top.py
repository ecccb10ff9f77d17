"""`kvfs top --once` against a real cluster after a workload: every number it shows
is what the servers' own Status, Usage and Stat replies say."""

from __future__ import annotations

import os
import re

from kvfs import tls
from kvfs.cli.launcher import meta_status
from kvfs.cli.main import _human
from kvfs.cli.main import main as kvfs
from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, layer_major, restore_all, tokens_for, wait_until

NS = Namespace("acme", "top")
SMALL = BlockLayout(layers=6, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 48 KiB blocks, one chunk


def rows(out: str) -> list[list[str]]:
    """The cells of every table row printed (header rows too)."""
    return [[c.strip() for c in re.split(r"[│┃]", line)[1:-1]] for line in out.splitlines() if "│" in line or "┃" in line]


def row(out: str, first: str) -> list[str]:
    """The cells of the row whose first cell is `first`."""
    found = [r for r in rows(out) if r and r[0] == first]
    assert found, f"no row {first!r} in:\n{out}"
    return found[0]


async def test_top_once_shows_what_the_servers_report(local_cluster, capsys):
    cluster = local_cluster(chunkservers=2, replicas=2)
    tokens = tokens_for(6, seed=5)
    payloads = [os.urandom(SMALL.payload_bytes) for _ in range(4)]
    async with Client(cluster.meta_address) as client:
        assert (await client.write(NS, tokens[: 4 * 64], layer_major(SMALL, payloads), SMALL)).committed == 4
        match = await client.lookup(NS, tokens)  # 6 asked, 4 hit
        await restore_all(client, match, SMALL)
        assert (await client.lookup(NS, tokens_for(2, seed=6))).matched == 0  # 2 asked, a miss
    stats = {}

    async def stat_all():
        for cs in cluster.chunkservers:
            async with ChunkClient(cs.address) as c:
                stats[cs.name] = await c.stat()

    await stat_all()
    wait_until(lambda: {s.id: s.used_bytes for s in meta_status(cluster.meta_address, credentials=cluster.admin)
                        .servers} == {k: v.used_bytes for k, v in stats.items()}, 15, "heartbeats to report usage")

    env = os.environ
    assert kvfs(["top", "--once", "--interval", "0.2", "--meta", cluster.meta_address, "--tls-ca",
                 env["KVFS_CLIENT_TLS_CA"], "--tls-cert", env["KVFS_CLIENT_TLS_CERT"], "--tls-key",
                 env["KVFS_CLIENT_TLS_KEY"]]) == 0
    out = capsys.readouterr().out
    status = meta_status(cluster.meta_address, credentials=cluster.admin)
    with tls.channel(cluster.meta_address, credentials()) as channel:
        usage = meta_pb2_grpc.MetaServiceStub(channel).Usage(meta_pb2.UsageRequest(), timeout=10)
    (acme,) = [u for u in usage.tenants if u.tenant == "acme"]
    assert (acme.lookups, acme.blocks_requested, acme.blocks_hit) == (2, 8, 4)

    table = rows(out)
    names = row(out, "hit ratio")
    values = dict(zip(names, table[table.index(names) + 1]))  # the cluster's one row, under its header
    restored = sum(s.counters.read_bytes for s in stats.values())
    assert restored >= 4 * SMALL.payload_bytes  # the restore read every block
    assert values["hit ratio"] == "50.0%" and values["lookups"] == "2"
    assert values["restored"] == _human(restored)
    assert values["lookups/s"] == "0.0/s" and values["restore B/s"] == "0 B/s"  # nothing ran meanwhile
    assert (values["blocks"], values["evicted"], values["lost blocks"]) == (str(status.blocks), "0", "0")
    assert status.blocks == 4
    names = row(out, "dead servers")
    repair = dict(zip(names, table[table.index(names) + 1]))
    assert repair == {"dead servers": "0", "short of copies": str(status.repair_backlog), "copied": "0",
                      "copied B": "0 B", "copies/s": "0.0/s", "failed": "0"} and status.repair_backlog == 0
    assert row(out, "acme")[1:4] == ["2", "4", "50.0%"]
    for s in status.servers:
        cells = row(out, s.id)
        assert cells[1:7] == [s.failure_domain, "yes", str(s.chunk_count), _human(s.used_bytes),
                              _human(s.capacity_bytes), f"{s.allocated_bytes / s.capacity_bytes:.1%}"], cells

