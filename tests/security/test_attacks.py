"""An attacker against a real secure cluster, from raw gRPC stubs: every call that
its identity (or lack of one) does not allow is refused with a clear status, the
refusal is logged, nothing it aimed at changes, and the legitimate path keeps
working beside it."""

from __future__ import annotations

import os

import grpc
import pytest

from kvfs import tls
from kvfs.client import Client
from kvfs.errors import PermissionDenied
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS

from helpers import restore_all, tokens_for

LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
NS_A = Namespace("tenant-a", "m")
NS_A_MSG = meta_pb2.Namespace(tenant="tenant-a", model="m")


async def refused(call, *codes: grpc.StatusCode) -> grpc.aio.AioRpcError:
    """Awaits `call`, which must fail with one of `codes`; returns the error."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() in codes, (info.value.code(), info.value.details())
    return info.value


async def write_and_restore(cluster, creds, ns: Namespace, seed: int) -> tuple[list[int], bytes]:
    """The legitimate path: a worker writes blocks, looks them up and restores them exactly."""
    tokens = tokens_for(3, seed=seed)
    payload = os.urandom(LAYOUT.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, credentials=creds) as client:
        await client.write(ns, tokens, payload, LAYOUT)
        match = await client.lookup(ns, tokens)
        assert match.matched == 3
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == payload
    return tokens, payload


async def committed_chunk(cluster, creds, ns, tokens):
    """(chunk id, address of a chunkserver holding it) of the first block of a committed prefix."""
    async with Client(cluster.meta_address, credentials=creds) as client:
        match = await client.lookup(ns, tokens)
    chunk = match.blocks[0].chunks[0]
    return chunk.chunk_id, match.servers[chunk.replicas[0]].address


async def test_callers_without_a_trusted_certificate_are_refused(cluster, who):
    targets = [cluster.meta_address, cluster.chunkservers[0].address]
    for address in targets:
        # plaintext, TLS without a client certificate, a certificate from another CA
        channels = [grpc.aio.insecure_channel(address),
                    grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=who.worker_a.ca)),
                    tls.aio_channel(address, tls.Credentials(who.worker_a.ca, who.foreign.cert, who.foreign.key))]
        for channel in channels:
            async with channel:
                if address == cluster.meta_address:
                    call = meta_pb2_grpc.MetaServiceStub(channel).MatchPrefix(
                        meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[b"k" * 16]), timeout=5)
                else:
                    call = chunk_pb2_grpc.ChunkServiceStub(channel).ListChunks(chunk_pb2.ListChunksRequest(),
                                                                               timeout=5)
                await refused(call, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    # the legitimate path beside it
    await write_and_restore(cluster, who.worker_a, NS_A, seed=1)
    async with tls.aio_channel(cluster.meta_address, who.admin) as channel:
        status = await meta_pb2_grpc.MetaServiceStub(channel).Status(meta_pb2.StatusRequest(), timeout=10)
    assert sum(s.live for s in status.servers) == 3 and status.blocks >= 3


async def test_a_worker_cannot_call_server_or_admin_methods(cluster, who):
    tokens, payload = await write_and_restore(cluster, who.worker_a, NS_A, seed=2)
    chunk_id, holder = await committed_chunk(cluster, who.worker_a, NS_A, tokens)
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as channel:
        meta = meta_pb2_grpc.MetaServiceStub(channel)
        for call in (meta.Register(meta_pb2.RegisterRequest(server_id="cs-0", address="10.6.6.6:1"), timeout=10),
                     meta.Heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-0", lost_chunks=[
                         meta_pb2.LostChunk(chunk_id=chunk_id)]), timeout=10),
                     meta.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=10),
                     meta.Rebuild(meta_pb2.RebuildRequest(), timeout=10)):
            err = await refused(call, denied)
            assert "worker-a" in err.details() and "may not call" in err.details()
    async with tls.aio_channel(holder, who.worker_a, CHANNEL_OPTIONS) as channel:
        chunks = chunk_pb2_grpc.ChunkServiceStub(channel)
        for call in (chunks.ListChunks(chunk_pb2.ListChunksRequest(), timeout=10),
                     chunks.DeleteChunks(chunk_pb2.DeleteChunksRequest(chunk_ids=[chunk_id]), timeout=10),
                     chunks.Stat(chunk_pb2.StatRequest(), timeout=10),
                     chunks.CopyChunk(chunk_pb2.CopyChunkRequest(chunk_id=b"x", source="127.0.0.1:1", length=1),
                                      timeout=10)):
            await refused(call, denied)
    # an admin inspects chunkservers but reads no tenant's blocks and copies nothing
    async with tls.aio_channel(cluster.meta_address, who.admin) as channel:
        await refused(meta_pb2_grpc.MetaServiceStub(channel).MatchPrefix(
            meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[b"k" * 16]), timeout=10), denied)
    async with tls.aio_channel(holder, who.admin, CHANNEL_OPTIONS) as channel:
        chunks = chunk_pb2_grpc.ChunkServiceStub(channel)
        await refused(chunks.CopyChunk(chunk_pb2.CopyChunkRequest(chunk_id=b"x", source="127.0.0.1:1", length=1),
                                       timeout=10), denied)
        listed = await chunks.ListChunks(chunk_pb2.ListChunksRequest(), timeout=10)
    assert chunk_id in {c.chunk_id for c in listed.chunks}  # the refused delete removed nothing
    async with tls.aio_channel(cluster.meta_address, who.admin) as channel:
        status = await meta_pb2_grpc.MetaServiceStub(channel).Status(meta_pb2.StatusRequest(), timeout=10)
    assert {s.id: (s.address, s.live) for s in status.servers} == {
        f"cs-{i}": (cs.address, True) for i, cs in enumerate(cluster.chunkservers)}
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:  # still restores, exactly
        match = await client.lookup(NS_A, tokens)
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == payload
    log = cluster.meta.log_path.read_text()
    assert "refused /kvfs.meta.MetaService/Register from 'worker-a'" in log
    assert "PERMISSION_DENIED" in log


async def test_a_worker_of_tenant_a_cannot_name_tenant_b(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS_A, seed=3)
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:
        keys = (await client.lookup(NS_A, tokens)).keys
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with tls.aio_channel(cluster.meta_address, who.worker_b) as channel:
        meta = meta_pb2_grpc.MetaServiceStub(channel)
        err = await refused(meta.MatchPrefix(meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=keys),
                                             timeout=10), denied)
        assert "tenant 'tenant-a'" in err.details() and "tenant-b" in err.details()
        await refused(meta.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
            namespace=NS_A_MSG, keys=keys, layout=meta_pb2.BlockLayout(layers=2, block_tokens=64, kv_dim=64,
                                                                       dtype="bfloat16")), timeout=10), denied)
        await refused(meta.CommitBlocks(meta_pb2.CommitBlocksRequest(namespace=NS_A_MSG, allocation_id=b"x" * 16),
                                        timeout=10), denied)
        # its own tenant: the same keys are simply not there
        own = await meta.MatchPrefix(meta_pb2.MatchPrefixRequest(
            namespace=meta_pb2.Namespace(tenant="tenant-b", model="m"), keys=keys), timeout=10)
        assert own.matched == 0
    async with Client(cluster.meta_address, credentials=who.worker_b) as client:  # through the SDK, a typed error
        with pytest.raises(PermissionDenied, match="tenant-a"):
            await client.lookup(NS_A, tokens)
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:
        assert (await client.lookup(NS_A, tokens)).matched == 3
    assert "may not act for tenant 'tenant-a'" in cluster.meta.log_path.read_text()


async def test_a_server_id_cannot_be_taken_by_another_certificate(cluster, who):
    tokens, payload = await write_and_restore(cluster, who.worker_a, NS_A, seed=4)
    chunk_id, _ = await committed_chunk(cluster, who.worker_a, NS_A, tokens)
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with tls.aio_channel(cluster.meta_address, who.rogue_server) as channel:
        meta = meta_pb2_grpc.MetaServiceStub(channel)
        err = await refused(meta.Register(meta_pb2.RegisterRequest(
            server_id="cs-0", address="127.0.0.1:1", failure_domain="host-0", capacity_bytes=1 << 40), timeout=10),
            denied)
        assert "'rogue'" in err.details() and "cs-0" in err.details()
        await refused(meta.Heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-0", lost_chunks=[
            meta_pb2.LostChunk(chunk_id=chunk_id)]), timeout=10), denied)
    async with tls.aio_channel(cluster.meta_address, who.admin) as channel:
        status = await meta_pb2_grpc.MetaServiceStub(channel).Status(meta_pb2.StatusRequest(), timeout=10)
    cs0 = next(s for s in status.servers if s.id == "cs-0")
    assert (cs0.address, cs0.live, status.replicas_lost) == (cluster.chunkservers[0].address, True, 0)
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:
        match = await client.lookup(NS_A, tokens)
        assert match.matched == 3
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == payload
    assert "'rogue' (server) may not act as server 'cs-0'" in cluster.meta.log_path.read_text()


async def test_a_method_without_a_rule_is_refused_to_everyone(who, tmp_path):
    """An in-process server with an empty rule table: whatever the caller's role."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvfs.auth import Authorizer

    authority = tls.Authority.create()
    server = grpc.aio.server(interceptors=[Authorizer("test server", rules={})])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = tls.add_port(server, "127.0.0.1:0", authority.issue("s", [tls.SERVER], hosts=["127.0.0.1"]))
    await server.start()
    try:
        for roles in ([tls.SERVER], [tls.WORKER], [tls.ADMIN]):
            creds = authority.issue("caller", roles, tenants=["*"], hosts=["127.0.0.1"])
            async with tls.aio_channel(f"127.0.0.1:{port}", creds) as channel:
                err = await refused(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                                timeout=5),
                                    grpc.StatusCode.PERMISSION_DENIED)
                assert "no access rule" in err.details()
    finally:
        await server.stop(None)


async def test_the_shard_map_is_given_to_workers_and_admins_only(cluster, who):
    # ShardMap (several metaservers' slots; a lone metaserver answers with none): a server
    # identity has no use for it and is refused, from a raw stub, while workers are served
    async with tls.aio_channel(cluster.meta_address, who.rogue_server) as channel:
        err = await refused(meta_pb2_grpc.MetaServiceStub(channel).ShardMap(meta_pb2.ShardMapRequest(), timeout=10),
                            grpc.StatusCode.PERMISSION_DENIED)
        assert "rogue" in err.details() and "may not call" in err.details()
    for creds in (who.worker_a, who.admin):
        async with tls.aio_channel(cluster.meta_address, creds) as channel:
            reply = await meta_pb2_grpc.MetaServiceStub(channel).ShardMap(meta_pb2.ShardMapRequest(), timeout=10)
        assert reply.map_json == "" and reply.epoch == 0  # alone: every slot is its own
    # its request is empty: a megabyte of unknown fields is refused before it is parsed
    padded = b"\x0a" + bytes([0x80, 0x80, 0x40]) + os.urandom(1 << 20)  # field 1, 1 MiB long
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as channel:
        call = channel.unary_unary("/kvfs.meta.MetaService/ShardMap")(padded, timeout=10)
        err = await refused(call, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "ShardMap" in err.details()
    await write_and_restore(cluster, who.worker_a, NS_A, seed=7)  # the SDK routes through it, as before
