"""A chunk rewritten behind the metaserver's back is never restored.

The attack (issue "Tenancy you can trust", class (b)): delete a committed chunk
on every replica and write the same chunk id again with other bytes. A worker
cannot (a chunkserver stores a chunk only under the owner record the metaserver
sealed for its id: tests/security/test_write_grants.py), but an attacker with
chunkserver access can: an admin or server certificate lists owner records and
deletes chunks, and the seal grants writing a chunk id, not particular bytes
(it is made at allocation, before there are any). The chunkservers accept the
forged bytes, since their checksums are consistent with themselves, so only the
reader can notice: every transport checks that the chunk's block checksums hash
to the checksum the metaserver committed (kvfs/checksum.py). Written from raw
chunk calls, as such an attacker would.
"""

import os

import pytest

from kvfs.client import ChunkClient, Client
from kvfs.errors import DataLoss
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import restore_all, tokens_for

NS = Namespace("tenant-a", "deepseek-v3")
MLA = BlockLayout.mla()


async def rewrite(raw: ChunkClient, chunk_id: bytes, data: bytes) -> None:
    """Deletes a chunk and writes other bytes under its id, replaying its sealed owner record."""
    owner = [info.owner async for info in raw.list() if info.chunk_id == chunk_id][0]
    assert await raw.delete([chunk_id]) == (1, 0)
    assert await raw.write(chunk_id, data, owner=owner)


async def forge(match, block: int, chunk: int = 0) -> bytes:
    """Replaces one chunk of a matched block on every server holding it; the forged bytes."""
    c = match.blocks[block].chunks[chunk]
    forged = os.urandom(c.length)
    for i in c.replicas:
        async with ChunkClient(match.servers[i].address) as raw:
            await rewrite(raw, c.chunk_id, forged)  # the server computes the forged bytes' checksums
            assert await raw.read_chunk(c.chunk_id) == forged  # and serves them to anyone who asks it
    return forged


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
async def test_a_chunk_rewritten_on_every_replica_is_refused_and_other_blocks_restore(local_cluster, transport):
    cluster = local_cluster()
    victim, other = tokens_for(4, seed=11), tokens_for(4, seed=12)
    payloads = {s: os.urandom(MLA.buffer_bytes(len(t))) for s, t in ((11, victim), (12, other))}
    async with Client(cluster.meta_address, transport=transport) as client:
        await client.write(NS, victim, payloads[11], MLA)
        await client.write(NS, other, payloads[12], MLA)
        match = await client.lookup(NS, victim)
        assert match.matched == 4
        await forge(match, block=2)
        with pytest.raises(DataLoss, match="not the chunk committed"):
            await restore_all(client, await client.lookup(NS, victim), MLA)
        out, _, _ = await restore_all(client, await client.lookup(NS, other), MLA)
        assert bytes(out) == payloads[12]


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_a_chunk_rewritten_on_one_replica_is_read_from_another(local_cluster, transport, caplog):
    cluster = local_cluster()
    tokens = tokens_for(3, seed=21)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport=transport) as client:
        await client.write(NS, tokens, payload, MLA)
        match = await client.lookup(NS, tokens)
        c = match.blocks[0].chunks[0]
        async with ChunkClient(match.servers[c.replicas[0]].address) as raw:
            await rewrite(raw, c.chunk_id, os.urandom(c.length))
        # every read of that chunk tries the forged replica first or second; either way the
        # restore is exact, and whenever the forged copy was read it was refused
        for _ in range(3):
            out, _, _ = await restore_all(client, await client.lookup(NS, tokens), MLA)
            assert bytes(out) == payload
    refused = [r.getMessage() for r in caplog.records if "not the chunk committed" in r.getMessage()]
    assert all(c.chunk_id.hex()[:16] in m for m in refused)  # only the forged copy was ever refused
