"""Block keys chain under a per-tenant secret (TenantKey; kvfs/keys.py), so the keys
in owner records and listings no longer let whoever sees them test guesses of a
tenant's prompts offline. From raw stubs against a real secure cluster: only the
tenant's own workers get its secret; an admin who lists every chunk and knows a
prompt's exact tokens still cannot find its blocks by key, and the tenant's workers
hit their cache as before."""

from __future__ import annotations

import grpc

from kvfs import tls
from kvfs.client import ChunkClient, Client
from kvfs.keys import block_keys
from kvfs.proto import meta_pb2, meta_pb2_grpc

from test_attacks import NS_A, refused, write_and_restore


def stub(cluster, creds) -> meta_pb2_grpc.MetaServiceStub:
    return meta_pb2_grpc.MetaServiceStub(tls.aio_channel(cluster.meta_address, creds))


async def tenant_key(cluster, creds, tenant: str) -> bytes:
    return (await stub(cluster, creds).TenantKey(meta_pb2.TenantKeyRequest(tenant=tenant), timeout=10)).key


async def test_only_a_tenants_own_workers_get_its_secret(cluster, who):
    key = await tenant_key(cluster, who.worker_a, "tenant-a")
    assert len(key) == 16 and key == await tenant_key(cluster, who.worker_a, "tenant-a")  # the same every time
    assert key != await tenant_key(cluster, who.worker_b, "tenant-b")
    denied = grpc.StatusCode.PERMISSION_DENIED
    err = await refused(stub(cluster, who.worker_b).TenantKey(meta_pb2.TenantKeyRequest(tenant="tenant-a"),
                                                              timeout=10), denied)
    assert "may not act for tenant 'tenant-a'" in err.details()
    for creds in (who.admin, who.rogue_server):  # not a worker: the rule refuses before the handler
        await refused(stub(cluster, creds).TenantKey(meta_pb2.TenantKeyRequest(tenant="tenant-a"), timeout=10),
                      denied)
    for name in ("", "t" * 257):
        err = await refused(stub(cluster, who.worker_a).TenantKey(meta_pb2.TenantKeyRequest(tenant=name),
                                                                  timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
        assert "one tenant of 1 to 256 characters" in err.details()


async def test_an_admin_listing_every_chunk_cannot_find_a_known_prompt_by_its_keys(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS_A, seed=81)
    owners: set[bytes] = set()
    for cs in cluster.chunkservers:  # everything an operator (or a stolen disk) shows: every owner record
        async with ChunkClient(cs.address, credentials=who.admin) as c:
            async for info in c.list():
                owners.add(meta_pb2.ChunkOwner.FromString(info.owner).block_key)
    guessed = block_keys(NS_A, tokens, 64)  # the right tokens, hashed as anyone can
    assert not owners & set(guessed), "a prompt's blocks were found by keys computed without the tenant's secret"
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:
        real = await client.keys(NS_A, tokens)
        assert set(real) <= owners  # the blocks are there, under keys only the tenant's workers compute
        assert real == block_keys(NS_A, tokens, 64, secret=await tenant_key(cluster, who.worker_a, "tenant-a"))
        assert (await client.lookup(NS_A, tokens)).matched == 3
