"""Two tenants on one small cache (issue "Abuse resistance": one tenant's writes
must not evict another's blocks). Tenant B writes far more than the whole cache
holds. With a quota for B, B's writes evict only B's own blocks and every one of
A's blocks stays; the same flood on a cluster without quotas evicts A's blocks,
which is what the quota prevents."""

from __future__ import annotations

import os

from kvfs import tls
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, tokens_for

LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 16 KiB: one 64 KiB slot each
A, B = Namespace("tenant-a", "m"), Namespace("tenant-b", "m")
PROMPT = 10  # blocks
SLOT = 64 << 10
CAPACITY = "16MiB"  # per chunkserver: 3 x 16 MiB / 2 replicas = 24 MiB of cache, 384 slots


async def write_prompts(client: Client, ns: Namespace, first_seed: int, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        tokens = tokens_for(PROMPT, seed=first_seed + i)
        assert (await client.write(ns, tokens, os.urandom(LAYOUT.buffer_bytes(len(tokens))), LAYOUT)).committed \
            == PROMPT
        prompts.append(tokens)
    return prompts


async def cached(client: Client, ns: Namespace, prompts: list[list[int]]) -> int:
    return sum([(await client.lookup(ns, p)).matched for p in prompts])


async def flood(cluster) -> tuple[int, int, meta_pb2.TenantUsage]:
    """A writes 100 blocks, then B 600 (the cache holds 384): A's blocks still
    cached, B's last prompt cached, and B's usage record."""
    async with Client(cluster.meta_address) as client:
        a = await write_prompts(client, A, 1000, 10)  # not looked up: ranked like B's blocks, and older
        b = await write_prompts(client, B, 5000, 60)
        a_left, b_last = await cached(client, A, a), await cached(client, B, b[-1:])
    async with tls.aio_channel(cluster.meta_address, credentials()) as channel:
        reply = await meta_pb2_grpc.MetaServiceStub(channel).Usage(meta_pb2.UsageRequest(tenants=["tenant-b"]),
                                                                    timeout=10)
    return a_left, b_last, reply.tenants[0]


async def test_one_tenants_flood_evicts_only_its_own_blocks_within_its_quota(local_cluster):
    quota = 6 << 20  # a quarter of the cache: 96 slots
    with_quota = local_cluster(capacity=CAPACITY, meta_extra=["--tenant-quotas", "tenant-b=25%"])
    a_left, b_last, b = await flood(with_quota)
    assert a_left == 100  # every one of A's blocks
    assert b_last == PROMPT  # B is served: its newest prompt is cached
    assert b.blocks_written == 600 and b.cache_bytes <= quota and b.blocks_stored * SLOT == b.cache_bytes
    assert "tenant 'tenant-b' over its quota" in with_quota.meta.log_path.read_text()

    # the control: the same flood without quotas evicts A's blocks
    without = local_cluster(capacity=CAPACITY)
    a_left, b_last, b = await flood(without)
    assert a_left < 100 and b_last == PROMPT and b.cache_bytes > quota
