"""Read grants: a chunkserver serves a worker's gRPC read of a chunk only with the
read grant of a lookup in the chunk's namespace (kvfs/grants.py). From raw
chunkserver stubs, against a real secure cluster: tenant B's worker, knowing the
id of one of A's chunks, reads nothing of it, with no grant, its own grant, or
a grant edited to name A's namespace; B's own chunks, and A's with A's grant,
are served beside it."""

from __future__ import annotations

import grpc
import pytest

from kvfs.client import ChunkClient, Client
from kvfs.errors import PermissionDenied
from kvfs.keys import Namespace

from test_attacks import NS_A, write_and_restore

NS_B = Namespace("tenant-b", "m")


async def lookup(cluster, creds, ns, tokens):
    async with Client(cluster.meta_address, credentials=creds, transport="grpc") as client:
        return await client.lookup(ns, tokens)


async def test_a_worker_reads_a_chunk_only_with_a_grant_for_its_namespace(cluster, who):
    tokens_a, _ = await write_and_restore(cluster, who.worker_a, NS_A, seed=71)
    tokens_b, _ = await write_and_restore(cluster, who.worker_b, NS_B, seed=72)
    match_a = await lookup(cluster, who.worker_a, NS_A, tokens_a)
    match_b = await lookup(cluster, who.worker_b, NS_B, tokens_b)
    assert match_a.read_grant and match_b.read_grant and match_a.read_grant != match_b.read_grant
    victim = match_a.blocks[0].chunks[0]
    mine = next(c for b in match_b.blocks for c in b.chunks if set(c.replicas) & set(victim.replicas))
    server = match_a.servers[sorted(set(victim.replicas) & set(mine.replicas))[0]].address
    async with ChunkClient(server, credentials=who.worker_b) as raw:
        for grant in (b"",  # none
                      match_a.read_grant[:16] + match_b.read_grant[16:]):  # B's grant edited to name A's namespace
            with pytest.raises(PermissionDenied, match="no valid read grant"):
                await raw.read([(victim.chunk_id, 0, 0)], read_grant=grant)
        # with its own grant: A's chunk refused, B's own chunk in the same call served
        results = await raw.read([(victim.chunk_id, 0, 0), (mine.chunk_id, 0, 0)], read_grant=match_b.read_grant)
        assert results[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0] and not results[0].data
        assert "not in the namespace" in results[0].message
        assert results[1].code == 0 and len(results[1].data) == mine.length
    async with ChunkClient(server, credentials=who.worker_a) as raw:
        (ok,) = await raw.read([(victim.chunk_id, 0, 0)], read_grant=match_a.read_grant)
        assert ok.code == 0 and len(ok.data) == victim.length
    # the SDK's restores carry their grants
    await write_and_restore(cluster, who.worker_a, NS_A, seed=73)
