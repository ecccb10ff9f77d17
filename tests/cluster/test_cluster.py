"""A real metaserver and chunkservers as processes: KV blocks round-trip end to end."""

import asyncio
import os
import shutil

import grpc
import pytest

from kvfs import tls
from kvfs.client import BufferPool, ChunkClient, Client, SyncClient
from kvfs.errors import InvalidArgument, NotFound
from kvfs.keys import Namespace, block_keys
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, layer_major, restore_all, thread_names, thread_nices, tokens_for, wait_until

NS = Namespace("acme", "deepseek-v2-lite")
MLA = BlockLayout.mla()  # 1.9 MB blocks, two chunks each
SMALL = BlockLayout(layers=6, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 48 KiB blocks, one chunk


async def chunks_on_disk(cluster) -> int:
    total = 0
    for cs in cluster.chunkservers:
        async with ChunkClient(cs.address) as c:
            total += (await c.stat()).chunk_count
    return total


async def test_blocks_round_trip_across_three_chunkservers(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(6, seed=1, tail=17)
    payload = os.urandom(MLA.buffer_bytes(6 * 64))
    async with Client(cluster.meta_address) as client:
        res = await client.write(NS, tokens, payload, MLA, "chat")
        assert (res.committed, res.already_present) == (6, 0)
        match = await client.lookup(NS, tokens)
        assert (match.matched, match.tokens, len(match.keys)) == (6, 384, 6)
        out, order, stats = await restore_all(client, match, MLA)
        assert bytes(out) == bytes(payload)
        assert order == list(range(MLA.layers))  # per-layer readiness, in order
        assert stats.bytes == 6 * MLA.payload_bytes
        assert len(stats.per_server) == 3  # reads fanned out over every chunkserver
        status = await client.status()
        assert status.blocks == 6 and all(s.live for s in status.servers)
    wait_until(lambda: all(s.chunk_count > 0 for s in cluster.wait_live(3).servers), 10, "heartbeats with usage")


async def test_partial_prefix_matches_are_exact_from_token_zero(local_cluster):
    cluster = local_cluster()
    base = tokens_for(8, seed=2)
    payloads = [os.urandom(SMALL.payload_bytes) for _ in range(8)]
    async with Client(cluster.meta_address) as client:
        await client.write(NS, base[: 5 * 64], layer_major(SMALL, payloads[:5]), SMALL)
        match = await client.lookup(NS, base)  # 8 blocks asked, the first 5 cached
        assert match.matched == 5
        out, _, _ = await restore_all(client, match, SMALL)
        assert out == layer_major(SMALL, payloads[:5])
        diverged = base[:3 * 64] + [7] * 64 + base[4 * 64:]
        assert (await client.lookup(NS, diverged)).matched == 3
        assert (await client.lookup(NS, [1] + base[1:])).matched == 0
        assert (await client.lookup(Namespace("other", "deepseek-v2-lite"), base)).matched == 0
        assert (await client.lookup(NS, base[: 5 * 64 - 1])).matched == 4  # a partial block is not a block
        # write the rest, skipping what is there
        res = await client.write(NS, base, layer_major(SMALL, payloads), SMALL, first_block=5)
        assert res.committed == 3
        out, _, _ = await restore_all(client, await client.lookup(NS, base), SMALL)
        assert out == layer_major(SMALL, payloads)


async def test_a_salted_prompt_is_found_only_under_its_salt(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(4, seed=5)
    payload = layer_major(SMALL, [os.urandom(SMALL.payload_bytes) for _ in range(4)])
    async with Client(cluster.meta_address) as client:
        assert (await client.write(NS, tokens, payload, SMALL, salt="alice")).committed == 4
        assert [(await client.lookup(NS, tokens, salt=s)).matched for s in ("alice", "bob", None)] == [4, 0, 0]
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens, salt="alice"), SMALL)
        assert out == payload
        # the unsalted prompt is another prompt: written beside alice's, not deduplicated with it
        assert (await client.write(NS, tokens, payload, SMALL)).committed == 4


async def test_concurrent_writers_of_one_prefix_one_wins_whole(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(4, seed=3)
    candidates = [os.urandom(SMALL.buffer_bytes(4 * 64)) for _ in range(4)]
    async with Client(cluster.meta_address) as client:
        results = await asyncio.gather(*(client.write(NS, tokens, c, SMALL) for c in candidates))
        assert sorted(r.committed for r in results) == [0, 0, 0, 4]
        assert all(r.committed + r.already_present == 4 for r in results)
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens), SMALL)
        assert bytes(out) in {bytes(c) for c in candidates}
        # the losers' chunks are garbage: after a lifecycle round only the winner's remain
        with tls.channel(cluster.meta_address, credentials()) as ch:
            meta_pb2_grpc.MetaServiceStub(ch).RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=30)
        assert await chunks_on_disk(cluster) == 4 * 2  # 4 one-chunk blocks, 2 replicas


async def test_metaserver_crash_and_restart_keeps_committed_blocks(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(5, seed=4)
    payload = os.urandom(SMALL.buffer_bytes(5 * 64))
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, payload, SMALL)
    cluster.meta.kill()  # SIGKILL: no clean shutdown
    cluster.start_metaserver()
    cluster.wait_live(3)
    async with Client(cluster.meta_address) as client:
        match = await client.lookup(NS, tokens)
        assert match.matched == 5
        out, _, _ = await restore_all(client, match, SMALL)
        assert bytes(out) == bytes(payload)


async def test_metaserver_compactions_run_nicer_than_its_event_loop(local_cluster):
    cluster = local_cluster(meta_extra=["--compaction-nice", "7"])
    pid = cluster.meta.pid
    nices, names = thread_nices(pid), thread_names(pid)
    base = nices[pid]  # its main thread: the event loop's
    compaction = {tid for tid, name in names.items() if name.startswith("rocksdb:low")}
    assert compaction and {nices[tid] for tid in compaction} == {min(19, base + 7)}
    flushes = [tid for tid, name in names.items() if name.startswith("rocksdb:high")]
    assert flushes and all(nices[tid] == base for tid in flushes)
    assert sum(n == base for n in nices.values()) == len(nices) - len(compaction)  # only they are nicer
    tokens = tokens_for(3, seed=8)
    payload = os.urandom(SMALL.buffer_bytes(3 * 64))
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, payload, SMALL)
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens), SMALL)
    assert bytes(out) == bytes(payload)


async def test_restore_succeeds_from_replicas_with_a_chunkserver_killed(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(12, seed=5)
    payload = os.urandom(MLA.buffer_bytes(12 * 64))
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, payload, MLA)
        cluster.chunkservers[1].kill()
        print("injected: SIGKILL cs-1 (the metaserver still lists it as live)")
        match = await client.lookup(NS, tokens)
        assert match.matched == 12
        out, order, stats = await restore_all(client, match, MLA)
        assert bytes(out) == bytes(payload)
        assert order == list(range(MLA.layers))
        assert cluster.chunkservers[1].address not in stats.per_server
        print(f"saw: restore exact from the other replicas, {stats.retries} chunk reads retried")


async def test_ttl_expiry_hides_blocks_and_frees_chunk_space(local_cluster):
    cluster = local_cluster(meta_extra=["--ttl-classes", "brief=1s,chat=7d"])
    tokens = tokens_for(3, seed=6)
    keep = tokens_for(2, seed=7)
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, os.urandom(SMALL.buffer_bytes(3 * 64)), SMALL, "brief")
        await client.write(NS, keep, os.urandom(SMALL.buffer_bytes(2 * 64)), SMALL, "chat")
        assert (await client.lookup(NS, tokens)).matched == 3
        # poll with RunLifecycle, not lookups: a lookup hit refreshes the TTL
        deleted = []
        with tls.channel(cluster.meta_address, credentials()) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)

            def expired():
                reply = stub.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=30)
                deleted.append(reply.deleted_chunks)
                return reply.expired_blocks == 3

            wait_until(expired, 15, "the brief blocks to expire")
        assert sum(deleted) == 3 * 2  # three one-chunk blocks, two replicas each
        assert (await client.lookup(NS, tokens)).matched == 0
        assert (await client.lookup(NS, keep)).matched == 2
        assert (await client.status()).blocks == 2
        assert await chunks_on_disk(cluster) == 2 * 2  # only the kept blocks' chunks are left


async def test_orphans_and_abandoned_allocations_are_collected(local_cluster):
    cluster = local_cluster(meta_extra=["--gc-grace", "500ms", "--allocation-timeout", "1s"])
    tokens = tokens_for(2, seed=8)
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, os.urandom(SMALL.buffer_bytes(2 * 64)), SMALL)
        # a writer that crashed after writing its chunks, before committing
        with tls.channel(cluster.meta_address, credentials()) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            crashed = stub.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
                namespace=meta_pb2.Namespace(tenant=NS.tenant, model=NS.model, cache_format=NS.cache_format),
                keys=block_keys(NS, tokens_for(1, seed=9), 64),
                layout=meta_pb2.BlockLayout(layers=6, block_tokens=64, kv_dim=64, dtype="bfloat16")), timeout=10)
        placement = crashed.blocks[0].chunks[0]
        for address in placement.addresses:
            await client.chunkserver(address).write(placement.chunk_id, b"x" * placement.length)
        # and a chunk nobody allocated at all
        stray = cluster.chunkservers[0].address
        await client.chunkserver(stray).write(b"stray-chunk-00001", b"y" * 1000)
        with tls.channel(cluster.meta_address, credentials()) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            first = stub.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=30)
            assert first.deleted_chunks == 0  # within the grace period and the allocation's life

            deleted = []

            def collected():
                deleted.append(stub.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=30).deleted_chunks)
                return sum(deleted) >= 3

            wait_until(collected, 15, what="orphans collected")
            assert sum(deleted) == 3  # two replicas of the abandoned chunk and the stray, nothing else
        for address in placement.addresses:
            with pytest.raises(NotFound):
                await client.chunkserver(address).read_chunk(placement.chunk_id)
        with pytest.raises(NotFound):
            await client.chunkserver(stray).read_chunk(b"stray-chunk-00001")
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens), SMALL)  # committed data untouched
        assert len(out) == SMALL.buffer_bytes(128)


async def test_rebuild_from_chunkserver_inventories(local_cluster):
    cluster = local_cluster()
    prompts = [tokens_for(n, seed=10 + n) for n in (3, 5)]
    payloads = [os.urandom(MLA.buffer_bytes(len(p))) for p in prompts]
    async with Client(cluster.meta_address) as client:
        for p, data in zip(prompts, payloads):
            await client.write(NS, p, data, MLA, "agent")
    cluster.meta.stop()
    shutil.rmtree(cluster.root / "metaserver")
    print("injected: metaserver database wiped")
    cluster.start_metaserver()
    cluster.wait_live(3, timeout=30)  # chunkservers notice and register again
    with tls.channel(cluster.meta_address, credentials()) as ch:
        reply = meta_pb2_grpc.MetaServiceStub(ch).Rebuild(meta_pb2.RebuildRequest(), timeout=60)
    assert reply.blocks_restored == 8 and reply.blocks_incomplete == 0
    async with Client(cluster.meta_address) as client:
        for p, data in zip(prompts, payloads):
            match = await client.lookup(NS, p)
            assert match.matched == len(p) // 64
            out, _, _ = await restore_all(client, match, MLA)
            assert bytes(out) == bytes(data)


async def test_metaserver_bad_input_gets_clear_statuses(local_cluster):
    cluster = local_cluster()
    ns = meta_pb2.Namespace(tenant="t", model="m")
    async with tls.aio_channel(cluster.meta_address, credentials()) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        cases = [
            (stub.MatchPrefix, meta_pb2.MatchPrefixRequest(namespace=ns, keys=[b"short"]), "16 bytes"),
            (stub.MatchPrefix, meta_pb2.MatchPrefixRequest(keys=[b"k" * 16]), "tenant"),
            (stub.AllocateBlocks, meta_pb2.AllocateBlocksRequest(namespace=ns, keys=[b"k" * 16],
                                                                 layout=meta_pb2.BlockLayout()), "layout"),
            (stub.CommitBlocks, meta_pb2.CommitBlocksRequest(namespace=ns, allocation_id=b"nope"), "allocation"),
        ]
        for method, request, text in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(request, timeout=10)
            assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert text in info.value.details()
    # Register is servers' only: a server certificate sends the bad request
    async with tls.aio_channel(cluster.meta_address, cluster.credentials("cs-x", ["server"], hosts=["h"])) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await meta_pb2_grpc.MetaServiceStub(ch).Register(meta_pb2.RegisterRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "server_id" in info.value.details()
    async with tls.aio_channel(cluster.meta_address, credentials()) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        assert (await stub.Status(meta_pb2.StatusRequest(), timeout=10)).replicas == 2  # still serving
    assert "INVALID_ARGUMENT" in cluster.meta.log_path.read_text()


def test_sync_client_and_buffer_pool_cpu_path(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(3, seed=20)
    payload = os.urandom(SMALL.buffer_bytes(3 * 64))
    pool = BufferPool()
    assert not pool.pinned  # no CUDA here: page-aligned host memory
    with SyncClient(cluster.meta_address) as client:
        assert client.write(NS, tokens, payload, SMALL).committed == 3
        match = client.lookup(NS, tokens)
        buf = pool.get(SMALL.buffer_bytes(match.tokens))
        assert buf.data_ptr() % 4096 == 0
        stats = client.read(match, buf)
        assert stats.bytes == 3 * SMALL.payload_bytes
        assert bytes(buf.numpy()) == bytes(payload)
        pool.put(buf)
        assert pool.get(SMALL.buffer_bytes(match.tokens)).data_ptr() == buf.data_ptr()  # its pages again
        with pytest.raises(InvalidArgument, match="need"):
            client.read(match, bytearray(10))


async def test_writing_blocks_that_are_all_present_commits_nothing(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(3, seed=30)
    payload = os.urandom(SMALL.buffer_bytes(3 * 64))
    async with Client(cluster.meta_address) as client:
        assert (await client.write(NS, tokens, payload, SMALL)).committed == 3
        again = await client.write(NS, tokens, payload, SMALL)  # a writer that lost the race entirely
        assert (again.committed, again.already_present, again.bytes_written) == (0, 3, 0)
        assert (await client.status()).open_allocations == 0
