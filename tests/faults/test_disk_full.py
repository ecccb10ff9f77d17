"""Full disks and full capacity: RESOURCE_EXHAUSTED, nothing half-written, reads unaffected."""

import os
import subprocess

import pytest

from kvfs.client import ChunkClient
from kvfs.errors import ResourceExhausted

MiB = 1 << 20


async def fill_until_exhausted(address: str, limit: int) -> dict[bytes, bytes]:
    stored: dict[bytes, bytes] = {}
    async with ChunkClient(address) as client:
        for i in range(limit):
            data = os.urandom(MiB)
            try:
                await client.write(b"fill-%d" % i, data)
            except ResourceExhausted as err:
                print(f"write {i} refused: {err.message}")
                return stored
            stored[b"fill-%d" % i] = data
    raise AssertionError(f"{limit} writes and never RESOURCE_EXHAUSTED")


async def assert_all_readable_and_nothing_extra(address: str, stored: dict[bytes, bytes]):
    async with ChunkClient(address) as client:
        ids = list(stored)
        for i in range(0, len(ids), 8):
            results = await client.read([(c, 0, 0) for c in ids[i : i + 8]])
            assert [r.data for r in results] == [stored[c] for c in ids[i : i + 8]]
        assert {info.chunk_id async for info in client.list()} == set(stored)


async def test_capacity_limit_refuses_writes_and_keeps_reads(chunkservers):
    server = chunkservers(capacity="20MiB")
    stored = await fill_until_exhausted(server.address, 64)
    assert len(stored) == 20
    await assert_all_readable_and_nothing_extra(server.address, stored)
    async with ChunkClient(server.address) as client:  # deleting makes room again
        await client.delete([b"fill-0"])
        await client.write(b"after-delete", b"y" * MiB)
        stored.pop(b"fill-0")
        stored[b"after-delete"] = b"y" * MiB
    await assert_all_readable_and_nothing_extra(server.address, stored)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 48 MiB tmpfs (mounting needs root: tests using it are marked `root`)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.root
async def test_full_filesystem_refuses_writes_and_keeps_reads(chunkservers, small_tmpfs):
    # capacity far above the disk: the filesystem, not the limit, runs out
    server = chunkservers(data_dir=small_tmpfs / "cs-1", capacity="10GiB", extra=["--reserve", "8MiB"])
    stored = await fill_until_exhausted(server.address, 64)
    assert 30 <= len(stored) <= 40  # 48 MiB less the 8 MiB reserve and the index
    print(f"filled a 48 MiB tmpfs with {len(stored)} chunks of 1 MiB before RESOURCE_EXHAUSTED")
    await assert_all_readable_and_nothing_extra(server.address, stored)
    assert "disk full" in server.log_path.read_text()
