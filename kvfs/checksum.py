"""Chunk checksums, as every part computes them: xxh3-64 of a chunk's bytes, and
of each 64 KiB block of it (so a ranged read verifies only what it touches).
xxhash is for disk and transfer corruption; block keys use blake2b (kvfs/keys.py)."""

from __future__ import annotations

import xxhash

BLOCK = 64 * 1024


def chunk_checksum(data) -> int:
    """xxh3-64 of the bytes: what WriteChunk expects in its header and metadata stores."""
    return xxhash.xxh3_64_intdigest(data)


def block_checksums(data) -> list[int]:
    view = memoryview(data)
    return [chunk_checksum(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]
