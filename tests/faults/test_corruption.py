"""Flip bytes in slot files: the server answers DATA_LOSS, never the bytes."""

import os

import pytest

from kvfs.client import ChunkClient
from kvfs.errors import DataLoss

from helpers import flip_stored_byte

MiB = 1 << 20
BLOCK = 64 * 1024


@pytest.mark.parametrize("extra", [[], ["--io-mode", "buffered"], ["--io-engine", "preadv"]],
                         ids=["uring-direct", "uring-buffered", "preadv-direct"])
async def test_flipped_byte_is_data_loss_and_other_data_still_served(chunkservers, tmp_path, extra):
    server = chunkservers(extra=extra)
    good, victim = os.urandom(MiB), os.urandom(MiB)
    async with ChunkClient(server.address) as client:
        await client.write(b"good", good)
        await client.write(b"victim", victim)
        stat = await client.stat()
        assert stat.counters.checksum_errors == 0
    where = flip_stored_byte(tmp_path / "cs-1", victim, 3 * BLOCK + 17)
    assert where is not None, "chunk 'victim' not found in cs-1's slot files"
    print(f"injected: flipped one byte in block 3 of chunk 'victim' at {where}")
    async with ChunkClient(server.address) as client:
        with pytest.raises(DataLoss, match="checksum mismatch on cs-1"):
            await client.read_chunk(b"victim")
        with pytest.raises(DataLoss):
            await client.read_chunk(b"victim", 3 * BLOCK + 10, 20)
        # ranges that do not touch the bad block verify on their own and are served
        assert await client.read_chunk(b"victim", 0, 3 * BLOCK) == victim[: 3 * BLOCK]
        assert await client.read_chunk(b"victim", 4 * BLOCK, 0) == victim[4 * BLOCK :]
        results = await client.read([(b"good", 0, 0), (b"victim", 0, 0)])
        assert results[0].code == 0 and results[0].data == good
        assert results[1].code == 15 and results[1].data == b""  # DATA_LOSS, no bytes
        assert (await client.stat()).counters.checksum_errors >= 3
    log = server.log_path.read_text()
    assert "checksum mismatch in block 3" in log
    print("saw: DATA_LOSS for the corrupt block, exact bytes for everything else")
