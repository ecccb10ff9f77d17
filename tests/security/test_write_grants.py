"""Write grants: a chunkserver stores a chunk only under the owner record the
metaserver sealed for that chunk id at allocation (kvfs.grants), checked from the
header, before any of the chunk's bytes are read. From raw chunkserver stubs,
against a real secure cluster: a worker of another tenant cannot plant bytes
under a chunk id it was not allocated, with no owner record, a made-up seal, a
real seal moved onto another id, or a sealed record edited (another block, or
another hash slot); the allocated writer
can."""

from __future__ import annotations

import os

import grpc

from kvfs import tls
from kvfs.checksum import chunk_checksum
from kvfs.grants import owner_record
from kvfs.keys import block_keys
from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2, meta_pb2_grpc
from kvfs.shards import HASH_SLOTS, hash_slot

from test_attacks import NS_A, NS_A_MSG, refused, write_and_restore
from test_black_holes import LAYOUT_MSG, NS_A_DIGEST


def write(stub, chunk_id: bytes, data: bytes, owner: bytes, length: int | None = None):
    header = chunk_pb2.ChunkHeader(chunk_id=chunk_id, length=len(data) if length is None else length,
                                   checksum=chunk_checksum(data), owner=owner)
    return stub.WriteChunk(iter([chunk_pb2.WriteChunkRequest(header=header, data=data)]), timeout=10)


async def test_a_chunk_is_stored_only_under_the_owner_record_sealed_for_its_id(cluster, who):
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as channel:
        alloc = await meta_pb2_grpc.MetaServiceStub(channel).AllocateBlocks(meta_pb2.AllocateBlocksRequest(
            namespace=NS_A_MSG, keys=block_keys(NS_A, [5] * 128, 64), layout=LAYOUT_MSG), timeout=10)
    (first, second) = alloc.blocks
    placement, other = first.chunks[0], second.chunks[0]
    slot = alloc.hash_slot
    assert slot == hash_slot(first.key)  # the prompt's first key's
    granted = owner_record(NS_A_DIGEST, first.key, 0, 1, LAYOUT_MSG, alloc.chunk_size, placement.owner_seal, slot)
    edited = owner_record(NS_A_DIGEST, second.key, 0, 1, LAYOUT_MSG, alloc.chunk_size, placement.owner_seal, slot)
    made_up = owner_record(NS_A_DIGEST, first.key, 0, 1, LAYOUT_MSG, alloc.chunk_size, os.urandom(16), slot)
    # A's seal on its record filed under another hash slot (another metaserver's rebuild would take it in)
    moved = owner_record(NS_A_DIGEST, first.key, 0, 1, LAYOUT_MSG, alloc.chunk_size, placement.owner_seal,
                         (slot + 1) % HASH_SLOTS)
    forged = os.urandom(placement.length)
    address = placement.addresses[0]
    async with tls.aio_channel(address, who.worker_b) as channel:
        stub = chunk_pb2_grpc.ChunkServiceStub(channel)
        for chunk_id, owner in ((placement.chunk_id, b""),  # no owner record
                                (placement.chunk_id, made_up),  # a seal the metaserver never made
                                (placement.chunk_id, edited),  # A's seal on a record naming another block
                                (placement.chunk_id, moved),  # ... or another hash slot
                                (other.chunk_id, granted)):  # A's sealed record, moved onto another chunk id
            err = await refused(write(stub, chunk_id, forged, owner), grpc.StatusCode.PERMISSION_DENIED)
            assert "owner record sealed by the metaserver" in err.details()
        # refused from the header: a 64 MiB chunk announced and never sent is not waited for
        await refused(write(stub, placement.chunk_id, b"", b"", length=64 << 20), grpc.StatusCode.PERMISSION_DENIED)
    async with tls.aio_channel(address, who.admin) as channel:
        listed = await chunk_pb2_grpc.ChunkServiceStub(channel).ListChunks(chunk_pb2.ListChunksRequest(), timeout=10)
    assert {placement.chunk_id, other.chunk_id}.isdisjoint(c.chunk_id for c in listed.chunks)  # nothing planted
    # the grant works for whoever holds it, for its own chunk id and record only
    data = os.urandom(placement.length)
    async with tls.aio_channel(address, who.worker_a) as channel:
        reply = await write(chunk_pb2_grpc.ChunkServiceStub(channel), placement.chunk_id, data, granted)
    assert reply.created and reply.receipt
    # the SDK's own writes carry their grants
    await write_and_restore(cluster, who.worker_a, NS_A, seed=53)
