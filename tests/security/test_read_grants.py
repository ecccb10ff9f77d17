"""Read grants: a chunkserver serves a worker's read of a chunk, over gRPC or its
data port, only with the read grant of a lookup in the chunk's namespace
(kvfs/grants.py). From raw chunkserver stubs and raw data-port frames, against a
real secure cluster: tenant B's worker, knowing the id of one of A's chunks,
reads nothing of it, with no grant, its own grant, or a grant edited to name A's
namespace; B's own chunks, and A's with A's grant, are served beside it."""

from __future__ import annotations

import grpc
import pytest

from kvfs import wire
from kvfs.client import ChunkClient, Client
from kvfs.errors import PermissionDenied
from kvfs.keys import Namespace

from helpers import data_connection, recv_exactly, restore_all
from test_attacks import LAYOUT, NS_A, write_and_restore

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


def data_port_read(address: str, chunk_ids: list[bytes], grant: bytes, creds) -> tuple[wire.Header, bytes]:
    """One raw READ frame on a data port, over mutual TLS with `creds`; the reply's header and body."""
    with data_connection(address, creds) as sock:
        sock.sendall(wire.encode_read(1, [wire.Range(c, 0, 0) for c in chunk_ids], grant=grant))
        header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
        return header, recv_exactly(sock, header.body_len)


async def test_the_data_port_serves_a_chunk_only_with_a_grant_for_its_namespace(cluster, who):
    tokens_a, payload_a = await write_and_restore(cluster, who.worker_a, NS_A, seed=74)
    tokens_b, _ = await write_and_restore(cluster, who.worker_b, NS_B, seed=75)
    match_a = await lookup(cluster, who.worker_a, NS_A, tokens_a)
    match_b = await lookup(cluster, who.worker_b, NS_B, tokens_b)
    victim = match_a.blocks[0].chunks[0]
    mine = next(c for b in match_b.blocks for c in b.chunks if set(c.replicas) & set(victim.replicas))
    data_address = match_a.servers[sorted(set(victim.replicas) & set(mine.replicas))[0]].data_address
    for grant in (b"", match_a.read_grant[:16] + match_b.read_grant[16:], b"x" * 40):
        header, body = data_port_read(data_address, [victim.chunk_id], grant, who.worker_b)
        assert header.kind == wire.STATUS
        code, message = wire.parse_status(header, body)
        assert code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "no valid read grant" in message
    header, body = data_port_read(data_address, [victim.chunk_id, mine.chunk_id], match_b.read_grant, who.worker_b)
    results = wire.parse_read_reply(header, body)
    assert results[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0] and results[0].data_len == 0
    assert results[1].code == 0 and results[1].data_len == mine.length
    header, body = data_port_read(data_address, [victim.chunk_id], match_a.read_grant, who.worker_a)
    (ok,) = wire.parse_read_reply(header, body)
    assert ok.code == 0 and ok.data_len == victim.length
    # the SDK's restores over the data port carry their grants
    for transport in ("tcp", "shm"):
        async with Client(cluster.meta_address, credentials=who.worker_a, transport=transport) as client:
            out, _, _ = await restore_all(client, await client.lookup(NS_A, tokens_a), LAYOUT)
            assert bytes(out) == payload_a
