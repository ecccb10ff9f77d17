"""ChunkClient: talks to one chunkserver (writes, batched reads, inventory).

The SDK's Client builds on this; tools and tests use it directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from kvfs import tls
from kvfs.checksum import chunk_checksum
from kvfs.errors import from_code, from_rpc_error
from kvfs.proto import chunk_pb2, chunk_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS

from kvfs.config import MiB

from .config import resolve_credentials

WRITE_PIECE = 4 * MiB  # bytes per message of a streamed WriteChunk


class ChunkClient:
    """An async client of one chunkserver. Errors come back as kvfs.errors types
    whose message names the server. `credentials` / `insecure`: as Client's."""

    def __init__(self, address: str, *, credentials: tls.Credentials | None = None, insecure: bool = False):
        self.address = address
        self._channel = tls.aio_channel(address, resolve_credentials(credentials, insecure), CHANNEL_OPTIONS)
        self._stub = chunk_pb2_grpc.ChunkServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ChunkClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, coro):
        try:
            return await coro
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.address) from None

    async def write(self, chunk_id: bytes, data: bytes | bytearray | memoryview,
                    owner: bytes = b"", checksum: int | None = None, timeout: float = 60) -> bool:
        """Writes a chunk durably; returns False if an identical one was there."""
        return (await self.store(chunk_id, data, owner, checksum, timeout)).created

    async def store(self, chunk_id: bytes, data: bytes | bytearray | memoryview,
                    owner: bytes = b"", checksum: int | None = None, timeout: float = 60) -> chunk_pb2.WriteChunkReply:
        """write(), returning the server's reply: with its receipt for CommitBlocks."""
        view = memoryview(data)
        header = chunk_pb2.ChunkHeader(
            chunk_id=chunk_id, length=len(view), owner=owner,
            checksum=chunk_checksum(view) if checksum is None else checksum)

        def messages():
            yield chunk_pb2.WriteChunkRequest(header=header, data=bytes(view[:WRITE_PIECE]))
            for pos in range(WRITE_PIECE, len(view), WRITE_PIECE):
                yield chunk_pb2.WriteChunkRequest(data=bytes(view[pos : pos + WRITE_PIECE]))

        return await self._call(self._stub.WriteChunk(messages(), timeout=timeout))

    async def read(self, ranges: Sequence[tuple[bytes, int, int]], timeout: float = 60,
                   read_grant: bytes = b"") -> list[chunk_pb2.RangeResult]:
        """Reads (chunk id, offset, length) ranges in one call; each result has
        its own `code` (0 is OK) so one bad chunk does not fail the rest. A worker
        passes the read grant of the lookup that found the chunks."""
        request = chunk_pb2.ReadChunksRequest(
            ranges=[chunk_pb2.ReadRange(chunk_id=c, offset=o, length=n) for c, o, n in ranges], read_grant=read_grant)
        try:
            results = [r async for r in self._stub.ReadChunks(request, timeout=timeout)]
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.address) from None
        if [r.index for r in results] != list(range(len(ranges))):
            raise from_code(13, f"{self.address} answered {len(results)} results out of order "
                                f"for {len(ranges)} ranges")
        return results

    async def read_chunk(self, chunk_id: bytes, offset: int = 0, length: int = 0) -> bytes:
        """One range's bytes, or the typed error of its status."""
        (result,) = await self.read([(chunk_id, offset, length)])
        if result.code:
            raise from_code(result.code, result.message)
        return result.data

    async def delete(self, chunk_ids: Sequence[bytes]) -> tuple[int, int]:
        reply = await self._call(self._stub.DeleteChunks(
            chunk_pb2.DeleteChunksRequest(chunk_ids=list(chunk_ids))))
        return reply.deleted, reply.not_found

    async def list(self, page_size: int = 1000) -> AsyncIterator[chunk_pb2.ChunkInfo]:
        """Every chunk on the server, in id order, page by page."""
        after = b""
        while True:
            reply = await self._call(self._stub.ListChunks(
                chunk_pb2.ListChunksRequest(start_after=after, limit=page_size)))
            for info in reply.chunks:
                yield info
            if not reply.next_start_after:
                return
            after = reply.next_start_after

    async def stat(self) -> chunk_pb2.StatReply:
        return await self._call(self._stub.Stat(chunk_pb2.StatRequest()))
