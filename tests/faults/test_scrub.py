"""Flip bytes in chunks at rest: the scrubber (or a client read) finds them, the
chunkserver removes them and reports them lost, the metaserver stops listing
that copy, and a block with no good copy left leaves lookups. Repair is paused
(--repair-interval 1h) so what is asserted is the report, not the re-copy."""

import os

import pytest

from kvfs.client import ChunkClient, Client
from kvfs.errors import DataLoss, NotFound
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import flip_stored_byte, layer_major, restore_all, tokens_for, until

NS = Namespace("acme", "scrub")
LAYOUT = BlockLayout(layers=4, block_tokens=64, kv_dim=512)  # 256 KiB blocks: one chunk each
BLOCKS = 8
SCRUB_FAST = ["--scrub-rate", "256MiB", "--scrub-interval", "300ms"]
NO_REPAIR = ["--repair-interval", "1h"]


async def written(cluster, client):
    tokens = tokens_for(BLOCKS, seed=41)
    blocks = [os.urandom(LAYOUT.payload_bytes) for _ in range(BLOCKS)]
    await client.write(NS, tokens, layer_major(LAYOUT, blocks), LAYOUT)
    match = await client.lookup(NS, tokens)
    assert match.matched == BLOCKS and all(len(b.chunks) == 1 for b in match.blocks)
    return tokens, blocks, match


def holders(match, block: int) -> list[str]:
    (chunk,) = match.blocks[block].chunks
    return sorted(s.id for s in match.holders(chunk))


def server(cluster, sid: str):
    return cluster.chunkservers[int(sid.removeprefix("cs-"))]


async def stat(cluster, sid: str):
    async with ChunkClient(server(cluster, sid).address) as c:
        return await c.stat()


async def test_scrub_removes_a_corrupt_copy_and_the_metaserver_stops_listing_it(local_cluster):
    cluster = local_cluster(chunk_extra=SCRUB_FAST, meta_extra=NO_REPAIR)
    async with Client(cluster.meta_address) as client:
        tokens, blocks, match = await written(cluster, client)
        bad, good = holders(match, 3)
        chunk_id = match.blocks[3].chunks[0].chunk_id
        where = flip_stored_byte(cluster.root / bad, blocks[3], 64 * 1024 + 100)
        assert where is not None, f"block 3's chunk not found in {bad}'s slot files"
        print(f"injected: flipped a byte in block 1 of chunk {chunk_id.hex()[:16]} (key 3) on {bad} at {where}")

        await until(lambda: _removed(cluster, bad), 30, f"{bad} to remove the corrupt chunk", interval=0.1)
        s = await stat(cluster, bad)
        assert s.counters.checksum_errors >= 1 and s.counters.corrupt_chunks_removed == 1
        log = server(cluster, bad).log_path.read_text()
        assert "checksum mismatch in block 1" in log and "found by scrub" in log
        assert f"chunk 0x{chunk_id.hex()[:16]}… removed from {bad}" in log
        async with ChunkClient(server(cluster, bad).address) as c:
            with pytest.raises(NotFound):
                await c.read_chunk(chunk_id)

        async def metaserver_dropped_it():
            m = await client.lookup(NS, tokens)
            return m if m.matched == BLOCKS and holders(m, 3) == [good] else None

        match = await until(metaserver_dropped_it, 30, f"MatchPrefix to stop listing {bad}", interval=0.1)
        status = await client.status()
        assert (status.replicas_lost, status.blocks_lost) == (1, 0)
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == layer_major(LAYOUT, blocks)
        # the other servers scrubbed everything they hold and found nothing wrong
        for sid in {s.id for s in status.servers} - {bad}:
            await until(lambda sid=sid: _passes(cluster, sid), 30, f"a scrub pass on {sid}", interval=0.1)
            assert (await stat(cluster, sid)).counters.checksum_errors == 0
        print(f"saw: {bad} logged, counted and removed the chunk; MatchPrefix lists only {good} for it; "
              f"restore exact; replicas_lost 1, no false positives elsewhere")


async def test_corrupting_every_copy_drops_the_block_from_lookups(local_cluster):
    cluster = local_cluster(chunk_extra=SCRUB_FAST, meta_extra=NO_REPAIR)
    async with Client(cluster.meta_address) as client:
        tokens, blocks, match = await written(cluster, client)
        for sid in holders(match, 5):
            where = flip_stored_byte(cluster.root / sid, blocks[5], 200 * 1024)
            assert where is not None, f"block 5's chunk not found in {sid}'s slot files"
        print(f"injected: flipped a byte of block 5's only chunk on both {holders(match, 5)}")

        async def dropped():
            m = await client.lookup(NS, tokens)
            return m if m.matched == 5 else None

        match = await until(dropped, 30, "the block to leave MatchPrefix", interval=0.1)
        status = await client.status()
        assert (status.blocks_lost, status.replicas_lost) == (1, 2)

        async def descendants_dropped():
            st = await client.status()
            return st if st.blocks == 5 else None

        # the blocks after it were reachable only through it: the background pass drops them
        status = await until(descendants_dropped, 10, "the lost block's descendants to be dropped", interval=0.1)
        assert status.stranded_blocks == BLOCKS - 6
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == layer_major(LAYOUT, blocks[:5])
        print(f"saw: MatchPrefix matches {match.matched} blocks (those before it), blocks_lost 1; restore exact")


async def test_a_client_read_that_fails_its_checksum_also_removes_and_reports(local_cluster):
    cluster = local_cluster(chunk_extra=["--scrub-rate", "0"], meta_extra=NO_REPAIR)  # no background passes
    async with Client(cluster.meta_address) as client:
        tokens, blocks, match = await written(cluster, client)
        bad, good = holders(match, 2)
        chunk_id = match.blocks[2].chunks[0].chunk_id
        where = flip_stored_byte(cluster.root / bad, blocks[2], 10)
        assert where is not None, f"block 2's chunk not found in {bad}'s slot files"
        print(f"injected: flipped a byte of block 2's chunk on {bad}; scrubbing off")
        async with ChunkClient(server(cluster, bad).address) as c:
            with pytest.raises(DataLoss):
                await c.read_chunk(chunk_id)
        await until(lambda: _removed(cluster, bad), 30, f"{bad} to remove the chunk", interval=0.1)
        assert "found by a read" in server(cluster, bad).log_path.read_text()

        async def metaserver_dropped_it():
            m = await client.lookup(NS, tokens)
            return m if m.matched == BLOCKS and holders(m, 2) == [good] else None

        match = await until(metaserver_dropped_it, 30, f"MatchPrefix to stop listing {bad}", interval=0.1)
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert bytes(out) == layer_major(LAYOUT, blocks)
        assert (await stat(cluster, bad)).counters.scrub_passes == 0
        print(f"saw: the read answered DATA_LOSS, {bad} re-verified and removed the chunk, "
              f"MatchPrefix lists only {good}; restore exact")


async def _removed(cluster, sid: str) -> bool:
    return (await stat(cluster, sid)).counters.corrupt_chunks_removed >= 1


async def _passes(cluster, sid: str) -> bool:
    return (await stat(cluster, sid)).counters.scrub_passes >= 1
