"""The gRPC face of the chunk store: one servicer, the logic lives in ChunkStore."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvfs import tls
from kvfs.auth import caller_of
from kvfs.errors import DataLoss, InvalidArgument, KvfsError, from_code, from_rpc_error
from kvfs.grants import granted, require_owner, require_read_grant, write_receipt
from kvfs.proto import chunk_pb2, chunk_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS, abort, handles_errors

from .metrics import ChunkMetrics
from .store import ChunkStore, short_id

DEFAULT_PAGE = 1000
MAX_PAGE = 10000
COPY_TIMEOUT = 60


class ChunkServicer(chunk_pb2_grpc.ChunkServiceServicer):
    def __init__(self, store: ChunkStore, metrics: ChunkMetrics, data_address: str = "",
                 creds: tls.Credentials | None = None, cluster_key: bytes | None = None):
        self.store = store
        self.reads = metrics.reads["grpc"]
        self.write_seconds = metrics.write_seconds["grpc"]
        self.creds = creds  # presented to CopyChunk sources
        self.cluster_key = cluster_key  # checks write grants, seals receipts; None: --insecure, neither
        self.data_address = data_address
        self._peers: dict[str, grpc.aio.Channel] = {}  # CopyChunk sources

    async def close(self) -> None:
        for channel in self._peers.values():
            await channel.close()

    def on_error(self, err: KvfsError) -> None:
        if err.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.store.counters.rejected_requests += 1

    @handles_errors
    async def WriteChunk(self, request_iterator, context):
        with self.write_seconds.time():  # failed calls too
            return await self._write_chunk(request_iterator, context)

    async def _write_chunk(self, request_iterator, context) -> chunk_pb2.WriteChunkReply:
        header = None
        pieces: list[bytes] = []
        received = 0
        max_len = self.store.cfg.max_chunk_size
        async for msg in request_iterator:
            if header is None:
                if not msg.HasField("header"):
                    raise InvalidArgument("the first WriteChunk message must carry the header")
                header = msg.header
                if not 0 < header.length <= max_len:
                    raise InvalidArgument(f"chunk length must be 1..{max_len} bytes, got {header.length}")
                self._check_grant(header, context)
            elif msg.HasField("header"):
                raise InvalidArgument("only the first WriteChunk message may carry a header")
            received += len(msg.data)
            if received > header.length:
                raise InvalidArgument(f"chunk {short_id(header.chunk_id)}: more data than the "
                                      f"{header.length} bytes its header announced")
            pieces.append(msg.data)
        if header is None:
            raise InvalidArgument("empty WriteChunk stream: no header")
        if received != header.length:
            raise InvalidArgument(f"chunk {short_id(header.chunk_id)}: got {received} bytes, "
                                  f"header announced {header.length}")
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # one message: no copy
        created = await self.store.write(header.chunk_id, data, header.checksum, header.owner)
        # what the writer shows the metaserver at commit: this server stored these bytes
        receipt = (write_receipt(self.cluster_key, header.chunk_id, header.checksum, self.store.cfg.id)
                   if self.cluster_key else b"")
        return chunk_pb2.WriteChunkReply(created=created, receipt=receipt)

    def _asks_grants(self, context) -> bool:
        """Whether the caller must show grants: a worker, when the server holds the
        cluster key. A caller that is also an admin or a server is not asked: it may
        list and delete any chunk already."""
        if self.cluster_key is None:
            return False
        caller = caller_of(context)
        return caller is None or not caller.roles & {tls.ADMIN, tls.SERVER}

    def _granted(self, grant: bytes, context) -> tuple[bytes | None, bytes]:
        """The namespace a read may touch (None: any; a worker must show a grant for
        one) and the tenant whose pace it keeps (b"": none; an admin's or a server's
        read is paced only by a grant it brings)."""
        if self.cluster_key is None:
            return None, b""
        if self._asks_grants(context):
            shown = require_read_grant(self.cluster_key, grant, time.time())
            return shown.namespace, shown.tenant
        shown = granted(self.cluster_key, grant, time.time())
        return None, shown.tenant if shown else b""

    def _check_grant(self, header: chunk_pb2.ChunkHeader, context) -> None:
        """A worker writes a chunk only under the owner record the metaserver sealed
        for its id at allocation (kvfs.grants), checked before any of its bytes are read."""
        if self._asks_grants(context):
            require_owner(self.cluster_key, header.owner, header.chunk_id)

    async def ReadChunks(self, request, context):
        arrived = time.perf_counter()
        # A streaming handler cannot use @handles_errors's return path: errors abort here.
        try:
            namespace, tenant = self._granted(request.read_grant, context)
            results = await self.store.read([(r.chunk_id, r.offset, r.length) for r in request.ranges],
                                            namespace=namespace)
        except KvfsError as err:
            self.on_error(err)
            self.reads.served(0, time.perf_counter() - arrived)
            await abort(context, "ReadChunks", err)
        nbytes = sum(len(r.data) for r in results)
        # the tenant's pace: charged once the size is known, before the bytes go out
        await asyncio.sleep(self.store.pacer.delay(tenant, nbytes))
        for i, r in enumerate(results):
            yield chunk_pb2.RangeResult(code=r.code.value[0], message=r.message, data=r.data,
                                        chunk_length=r.length, chunk_checksum=r.checksum, index=i,
                                        block_checksums=r.blocks)
        self.reads.served(nbytes, time.perf_counter() - arrived)

    @handles_errors
    async def DeleteChunks(self, request, context):
        deleted, not_found = await self.store.delete(list(request.chunk_ids))
        return chunk_pb2.DeleteChunksReply(deleted=deleted, not_found=not_found)

    @handles_errors
    async def ListChunks(self, request, context):
        if request.limit > MAX_PAGE:
            raise InvalidArgument(f"page limit {request.limit} is over {MAX_PAGE}")
        page, after = self.store.list(request.start_after, request.limit or DEFAULT_PAGE)
        return chunk_pb2.ListChunksReply(
            chunks=[chunk_pb2.ChunkInfo(chunk_id=cid, length=r.length, checksum=r.checksum,
                                        created=r.created, owner=r.owner) for cid, r in page],
            next_start_after=after)

    @handles_errors
    async def CopyChunk(self, request, context):
        if not request.source or not 0 < request.length <= self.store.cfg.max_chunk_size:
            raise InvalidArgument(f"CopyChunk needs a source and a length of 1..{self.store.cfg.max_chunk_size}")
        have = self.store.get(request.chunk_id)
        if have is not None and have.checksum == request.checksum:
            return chunk_pb2.CopyChunkReply(created=False, bytes=0)
        channel = self._peers.get(request.source)
        if channel is None:
            # the source must present a server certificate for the address it is named by
            channel = self._peers[request.source] = tls.aio_channel(request.source, self.creds, CHANNEL_OPTIONS)
        stub = chunk_pb2_grpc.ChunkServiceStub(channel)
        try:
            (res,) = [r async for r in stub.ReadChunks(chunk_pb2.ReadChunksRequest(
                ranges=[chunk_pb2.ReadRange(chunk_id=request.chunk_id)]), timeout=COPY_TIMEOUT)]
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, request.source) from None
        if res.code:
            raise from_code(res.code, f"copy of chunk {short_id(request.chunk_id)} from {request.source}: "
                                      f"{res.message}")
        if len(res.data) != request.length:
            raise DataLoss(f"copy of chunk {short_id(request.chunk_id)}: {request.source} sent {len(res.data)} "
                           f"bytes, expected {request.length}")
        # the write checks the bytes against the metaserver's checksum, not only the source's
        created = await self.store.write(request.chunk_id, res.data, request.checksum, request.owner)
        return chunk_pb2.CopyChunkReply(created=created, bytes=len(res.data))

    @handles_errors
    async def Stat(self, request, context):
        c = self.store.counters
        return chunk_pb2.StatReply(
            server_id=self.store.cfg.id, failure_domain=self.store.cfg.failure_domain,
            data_address=self.data_address,
            counters=chunk_pb2.IoCounters(
                reads=c.reads, read_bytes=c.read_bytes, writes=c.writes, write_bytes=c.write_bytes,
                deletes=c.deletes, checksum_errors=c.checksum_errors, rejected_requests=c.rejected_requests,
                scrubbed_bytes=c.scrubbed_bytes, scrub_passes=c.scrub_passes,
                corrupt_chunks_removed=c.corrupt_chunks_removed, reads_paced=c.reads_paced,
                paced_seconds=c.paced_seconds, writes_deferred=c.writes_deferred,
                deferred_seconds=c.deferred_seconds),
            tenant_reads=[chunk_pb2.TenantReadStats(tenant_id=t, reads=s.reads, bytes=s.bytes, reads_paced=s.paced,
                                                    paced_seconds=s.paced_seconds)
                          for t, s in self.store.pacer.snapshot()],
            **self.store.stat())
