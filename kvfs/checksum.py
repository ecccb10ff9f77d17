"""Chunk checksums, as every part computes them.

A chunk's bytes are checksummed per 64 KiB block (xxh3-64), so a ranged read
verifies only what it touches. The chunk's own checksum, the one its writer
computes, the metaserver commits and lookups return, is xxh3-64 over those
block checksums (little-endian u64s), not over the bytes: a reader of any range
gets the chunk's block checksums from the chunkserver, checks that they hash to
the committed value, then checks its bytes against the blocks it read. A chunk
rewritten behind the metaserver's back (other bytes, their own consistent
checksums) so fails at the reader on every transport, whatever the chunkserver
believes. xxhash is for corruption and for binding bytes to what was committed;
block keys use blake2b (kvfs/keys.py), and who may write at all is
authorization's job.
"""

from __future__ import annotations

import struct

import xxhash

BLOCK = 64 * 1024


def block_checksum(data) -> int:
    """xxh3-64 of one block's bytes."""
    return xxhash.xxh3_64_intdigest(data)


def block_checksums(data) -> list[int]:
    """xxh3-64 of each 64 KiB block of the bytes (the last one may be shorter)."""
    view = memoryview(data)
    return [xxhash.xxh3_64_intdigest(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]


def checksum_of_blocks(sums) -> int:
    """A chunk's checksum from its block checksums."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(sums)}Q", *sums))


def chunk_checksum(data) -> int:
    """A chunk's checksum from its bytes: what WriteChunk expects in its header and
    the metaserver commits."""
    return checksum_of_blocks(block_checksums(data))


def blocks_covering(start: int, length: int) -> slice:
    """Which of a chunk's block checksums cover [start, start + length)."""
    return slice(start // BLOCK, -(-(start + length) // BLOCK))
