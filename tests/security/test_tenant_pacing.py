"""Per-tenant reads on real chunkservers (issue "Abuse resistance": one tenant's
restore storm must not starve another's). With tenant_read_rate set, tenant B
restoring far more than a second's worth per server waits for its pace, over the
data port and over gRPC, and its restores stay byte-exact; tenant A, restoring
while B's reads wait, waits not at all: the pace is B's alone, not the server's.
Each server counts every tenant's reads and bytes (Stat's tenant_reads)."""

from __future__ import annotations

import asyncio
import os

from kvfs.client import ChunkClient, Client
from kvfs.grants import tenant_id
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import restore_all, tokens_for, until

LAYOUT = BlockLayout(layers=8, block_tokens=64, kv_dim=512, dtype="bfloat16")  # 512 KiB blocks
A, B = Namespace("tenant-a", "m"), Namespace("tenant-b", "m")
RATE = 4 << 20  # per tenant and server: bursts of 4 MiB, then 4 MiB/s


async def reads(cluster, ns: Namespace) -> tuple[int, int, int]:
    """The tenant's reads, bytes read and reads that waited for its pace, over every chunkserver."""
    total = [0, 0, 0]
    for cs in cluster.chunkservers:
        async with ChunkClient(cs.address) as c:
            for t in (await c.stat()).tenant_reads:
                if t.tenant_id == tenant_id(ns.tenant):
                    total = [total[0] + t.reads, total[1] + t.bytes, total[2] + t.reads_paced]
    return total[0], total[1], total[2]


async def restore(cluster, ns, tokens, payload, transport):
    async with Client(cluster.meta_address, transport=transport) as client:
        out, _, _ = await restore_all(client, await client.lookup(ns, tokens), LAYOUT)
    assert bytes(out) == payload


async def test_a_tenants_reads_wait_for_its_own_pace_and_never_for_anothers(local_cluster):
    cluster = local_cluster(chunk_extra=["--tenant-read-rate", str(RATE)])
    small, big = tokens_for(2, seed=31), tokens_for(48, seed=32)  # A: 1 MiB; B: 24 MiB, ~8 MiB per server
    payload_a, payload_b = os.urandom(LAYOUT.buffer_bytes(len(small))), os.urandom(LAYOUT.buffer_bytes(len(big)))
    async with Client(cluster.meta_address) as client:
        await client.write(A, small, payload_a, LAYOUT)
        await client.write(B, big, payload_b, LAYOUT)

    await restore(cluster, A, small, payload_a, "tcp")
    n, nbytes, waited = await reads(cluster, A)
    assert n > 0 and nbytes >= len(payload_a) and waited == 0  # counted; within its burst

    await restore(cluster, B, big, payload_b, "grpc")  # 24 MiB: past its bursts on every server
    assert (await reads(cluster, B))[2] > 0
    # B again, over the data port; A restores while B's reads wait for B's pace
    paced_before = (await reads(cluster, B))[2]
    flood = asyncio.create_task(restore(cluster, B, big, payload_b, "tcp"))

    async def b_waits():
        return (await reads(cluster, B))[2] > paced_before

    await until(b_waits, 30, "B's reads waiting for its pace")
    for transport in ("tcp", "grpc"):
        await restore(cluster, A, small, payload_a, transport)
    assert (await reads(cluster, A))[2] == 0  # A's own pace: B's queue is not A's
    await flood
