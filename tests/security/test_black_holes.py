"""A commit must name chunks that were stored: CommitBlocks checks the receipt every
chunkserver sealed for each copy it stored (WriteChunkReply.receipt), so a worker
cannot commit a prefix it never wrote (a black hole every later lookup would keep
alive), nor one copy short, nor with a checksum other than what was stored. From
raw metaserver and chunkserver stubs, against a real secure cluster."""

from __future__ import annotations

import os

import grpc

from kvfs import tls
from kvfs.checksum import chunk_checksum
from kvfs.grants import owner_record
from kvfs.keys import Namespace, block_keys
from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2, meta_pb2_grpc

from test_attacks import LAYOUT, NS_A, NS_A_MSG, refused, write_and_restore

LAYOUT_MSG = meta_pb2.BlockLayout(layers=LAYOUT.layers, block_tokens=LAYOUT.block_tokens, kv_dim=LAYOUT.kv_dim,
                                  dtype=LAYOUT.dtype)
NS_A_DIGEST = Namespace(NS_A_MSG.tenant, NS_A_MSG.model, NS_A_MSG.cache_format).digest  # as the metaserver has it


async def store(creds, address: str, chunk_id: bytes, data: bytes, checksum: int, owner: bytes) -> bytes:
    header = chunk_pb2.ChunkHeader(chunk_id=chunk_id, length=len(data), checksum=checksum, owner=owner)
    async with tls.aio_channel(address, creds) as channel:
        reply = await chunk_pb2_grpc.ChunkServiceStub(channel).WriteChunk(
            iter([chunk_pb2.WriteChunkRequest(header=header, data=data)]), timeout=10)
    return reply.receipt


async def test_a_commit_needs_a_receipt_for_every_copy_it_names(cluster, who):
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as channel:
        meta = meta_pb2_grpc.MetaServiceStub(channel)

        async def allocate(seed: int):
            keys = block_keys(NS_A, [seed] * 64, 64)
            return await meta.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
                namespace=NS_A_MSG, keys=keys, layout=LAYOUT_MSG), timeout=10)

        def commit(alloc, checksums, receipts):
            block = alloc.blocks[0]
            return meta.CommitBlocks(meta_pb2.CommitBlocksRequest(
                namespace=NS_A_MSG, allocation_id=alloc.allocation_id,
                blocks=[meta_pb2.CommitBlock(key=block.key, chunk_checksums=checksums, receipts=receipts)]),
                timeout=10)

        # nothing written at all
        alloc = await allocate(1)
        placement = alloc.blocks[0].chunks[0]
        data = os.urandom(placement.length)
        owner = owner_record(NS_A_DIGEST, alloc.blocks[0].key, 0, 1, LAYOUT_MSG, alloc.chunk_size,
                             placement.owner_seal, alloc.hash_slot)  # the write grant its placement carries
        err = await refused(commit(alloc, [chunk_checksum(data)], []), grpc.StatusCode.FAILED_PRECONDITION)
        assert "no receipt" in err.details()
        # one copy of two written
        receipts = [await store(who.worker_a, placement.addresses[0], placement.chunk_id, data, chunk_checksum(data),
                                owner)]
        await refused(commit(alloc, [chunk_checksum(data)], receipts), grpc.StatusCode.FAILED_PRECONDITION)
        # both written, but the commit claims other bytes than were stored
        receipts.append(await store(who.worker_a, placement.addresses[1], placement.chunk_id, data,
                                    chunk_checksum(data), owner))
        await refused(commit(alloc, [chunk_checksum(data) ^ 1], receipts), grpc.StatusCode.FAILED_PRECONDITION)
        # a receipt made up by the worker, or one for another chunk, is no receipt
        await refused(commit(alloc, [chunk_checksum(data)], [os.urandom(16), receipts[0]]),
                      grpc.StatusCode.FAILED_PRECONDITION)
        # nothing of it was committed: the prefix is not cached
        reply = await meta.MatchPrefix(meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[alloc.blocks[0].key]),
                                       timeout=10)
        assert reply.matched == 0
        # with every receipt, the same commit goes through
        done = await commit(alloc, [chunk_checksum(data)], receipts)
        assert done.committed == 1
    # and the SDK's own writes carry their receipts
    await write_and_restore(cluster, who.worker_a, NS_A, seed=7)
