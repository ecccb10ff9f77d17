"""Background work: TTL and allocation expiry, capacity eviction, chunk deletion,
orphan GC, rebuild.

This is the only part of the metaserver that calls chunkservers (through the
generated stubs; servers never import the client).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2
from kvfs.rpc import CHANNEL_OPTIONS

from .state import MetaState

log = logging.getLogger(__name__)

DELETE_BATCH = 1000
LIST_PAGE = 5000
RPC_TIMEOUT = 30


def parse_owner(raw: bytes) -> meta_pb2.ChunkOwner | None:
    if not raw:
        return None
    try:
        return meta_pb2.ChunkOwner.FromString(raw)
    except DecodeError:
        return None


class Lifecycle:
    def __init__(self, state: MetaState):
        self.state = state
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()
        self._deleting = asyncio.Lock()  # one delete pass at a time
        self._passes: set[asyncio.Task] = set()  # prompt passes in flight (the loop keeps weak references)

    def _stub(self, server_id: str) -> chunk_pb2_grpc.ChunkServiceStub | None:
        state = self.state.servers.get(server_id)
        if state is None:
            return None
        address = state.record.address
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return chunk_pb2_grpc.ChunkServiceStub(self._channels[address])

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    def queue_deletes(self, chunks) -> None:
        self.state.queue_deletes(chunks)

    async def delete_on(self, server_id: str, chunk_ids: list[bytes]) -> int:
        """Deletes chunks on one server, a batch at a time; returns how many it had.
        A failed call raises (AioRpcError) after the batches before it."""
        stub = self._stub(server_id)
        deleted = 0
        for i in range(0, len(chunk_ids), DELETE_BATCH):
            batch = chunk_ids[i : i + DELETE_BATCH]
            reply = await stub.DeleteChunks(chunk_pb2.DeleteChunksRequest(chunk_ids=batch), timeout=RPC_TIMEOUT)
            deleted += reply.deleted
            self.state.gc_deleted_chunks += reply.deleted
            self.state.deleted(server_id, batch)
        return deleted

    async def _delete_queued(self) -> int:
        async with self._deleting:
            deleted = 0
            live = self.state.live_servers()
            for sid in list(self.state.undeleted):
                if sid not in live:
                    continue  # retried when it is back; orphan GC also finds them
                try:
                    deleted += await self.delete_on(sid, sorted(self.state.undeleted.get(sid, ())))
                except grpc.aio.AioRpcError as err:
                    log.warning("deleting chunks on %s failed (%s); will retry", sid, err.code().name)
            return deleted

    def delete_soon(self) -> asyncio.Task:
        """A delete pass now, not at the next round: an eviction's space is wanted by
        the writes that caused it."""
        task = asyncio.create_task(self._prompt_pass())
        self._passes.add(task)
        task.add_done_callback(self._passes.discard)
        return task

    async def _prompt_pass(self) -> None:
        try:
            await self._delete_queued()
        except Exception:  # the next round retries
            log.exception("delete pass failed")

    async def _inventory(self, server_id: str):
        """Every chunk on a server, page by page."""
        stub = self._stub(server_id)
        after = b""
        while True:
            reply = await stub.ListChunks(chunk_pb2.ListChunksRequest(start_after=after, limit=LIST_PAGE),
                                          timeout=RPC_TIMEOUT)
            for info in reply.chunks:
                yield info
            if not reply.next_start_after:
                return
            after = reply.next_start_after

    async def _collect_orphans(self) -> None:
        now = self.state.clock()
        open_chunks = self.state.open_allocation_chunks()
        for sid in self.state.live_servers():
            try:
                async for info in self._inventory(sid):
                    if now - info.created < self.state.cfg.gc_grace:
                        continue
                    if not self.state.is_referenced(info.chunk_id, parse_owner(info.owner), open_chunks, sid):
                        self.queue_deletes([meta_pb2.StoredChunk(chunk_id=info.chunk_id, length=info.length,
                                                                 servers=[sid])])
            except grpc.aio.AioRpcError as err:
                log.warning("listing chunks on %s failed (%s); orphan GC skips it this round", sid, err.code().name)

    async def run_once(self) -> meta_pb2.RunLifecycleReply:
        """One round: expire blocks and allocations, evict past the high watermark,
        find orphans, delete garbage."""
        async with self._lock:
            self.state.refresh_liveness()
            self.state.flush_last_used()
            expired = self.state.expire_blocks()
            n_expired = len({c.chunk_id for c in expired})
            n_allocs, abandoned = self.state.expire_allocations()
            self.queue_deletes(expired)
            self.queue_deletes(abandoned)
            self.state.make_room()  # capacity may have shrunk (a server left) since the last write
            await self._collect_orphans()
            deleted = await self._delete_queued()
            if expired or n_allocs or deleted:
                log.info("lifecycle: %d chunks of expired blocks, %d expired allocations, %d chunks deleted",
                         n_expired, n_allocs, deleted)
            return meta_pb2.RunLifecycleReply(expired_blocks=self.state.expired_blocks, expired_allocations=n_allocs,
                                              deleted_chunks=deleted)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.state.cfg.lifecycle_interval)
            try:
                await self.run_once()
            except Exception:  # keep the loop alive; the next round retries
                log.exception("lifecycle round failed")

    async def flush_forever(self, every: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every)
            self.state.flush_last_used()
            self.state.refresh_liveness()

    async def rebuild(self) -> meta_pb2.RebuildReply:
        """Reconstructs committed blocks from the live servers' inventories."""
        async with self._lock:
            found: dict[bytes, dict] = {}
            seen = 0
            for sid in self.state.live_servers():
                async for info in self._inventory(sid):
                    seen += 1
                    owner = parse_owner(info.owner)
                    if owner is None or not owner.block_key:
                        continue
                    entry = found.setdefault(owner.namespace_digest + owner.block_key,
                                             {"owner": owner, "chunks": {}})
                    have = entry["chunks"].get(owner.chunk_index)
                    if have is None:
                        entry["chunks"][owner.chunk_index] = (info.chunk_id, info.length, info.checksum,
                                                              info.created, [sid])
                    elif have[0] == info.chunk_id:
                        have[4].append(sid)
            restored, incomplete = self.state.restore_blocks(found)
            log.info("rebuild: %d chunks seen, %d blocks restored, %d incomplete", seen, restored, incomplete)
            return meta_pb2.RebuildReply(blocks_restored=restored, blocks_incomplete=incomplete, chunks_seen=seen)
