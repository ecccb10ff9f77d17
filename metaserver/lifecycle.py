"""Background work: last-use flushes, TTL and allocation expiry, capacity
eviction, chunk deletion, orphan GC, rebuild.

Every pass runs on the event loop in slices of bounded work (MetaState's
`*_slice` methods), yielding between them, so lookups and heartbeats are served
in the gaps whatever the size of the cache. (A thread would not run beside the
loop: rocksdict holds the GIL through its calls, so a thread only takes turns
with the loop, at the interpreter's 5 ms switch interval.)

This is the only part of the metaserver that calls chunkservers (through the
generated stubs; servers never import the client).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time

import grpc

from kvfs import tls
from kvfs.grants import parse_owner
from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2
from kvfs.rpc import CHANNEL_OPTIONS

from . import records
from .state import MetaState

log = logging.getLogger(__name__)

DELETE_BATCH = 1000
LIST_PAGE = 1000
STAGE_PIECE = 128  # inventory entries a rebuild stages per turn: about a slice's time
RPC_TIMEOUT = 30
# Blocks one slice of a background pass touches: 1-2 ms of work at the slowest. (Eviction's
# slices are bounded by time as well, MetaState.slice_seconds(): its cost per block grows with the database.)
# Measured side by side with `kvfs-bench meta --blocks 1M` on an idle machine, 16 against 64:
# steady 2,000-block hit p99 9.0 vs 17.4 ms, 32-block 4.8 vs 13.9 ms, health-check wait p99
# 8.4 vs 16.6 ms; a whole RunLifecycle 40.6 vs 27.2 s (more turns, each with its pause).
SLICE = int(os.environ.get("KVFS_METASERVER_TEST_SLICE", 16))
IDLE_PAUSE = 0.25  # of a slice's time: the pause after it when no lookup or write came meanwhile
FLUSH_EVERY = 1.0  # seconds between rounds of writing recorded hits back (those hit_flush_delay old)
ORPHAN_SWEEP_RATE = 20_000  # chunks per second the background orphan sweep checks
# Test hook: each background slice also blocks the event loop this many seconds, as
# a pass over a huge cache on a slow disk might (tests/faults/test_slow_passes.py).
SLICE_STALL = float(os.environ.get("KVFS_METASERVER_TEST_SLICE_STALL", 0))




class Lifecycle:
    def __init__(self, state: MetaState):
        self.state = state
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()
        self._deleting = asyncio.Lock()  # one delete pass at a time
        self._passes: set[asyncio.Task] = set()  # prompt passes in flight (the loop keeps weak references)
        self._gate = asyncio.Lock()
        self._calls_seen = 0  # state.client_calls after the last turn's pause

    @contextlib.asynccontextmanager
    async def turn(self, kind: str):
        """One slice of a background pass (`kind`: its name, in the steps' times).
        Passes take turns (asyncio.Lock is fair), and after each slice the loop is left
        to RPCs for as long as the slice took: while lookups or writes come in, all
        background passes together take at most half of the event loop's time, so a
        slow disk slows them, never lookups or heartbeats.
        While none came since the last slice, the pause is a quarter of that: the passes
        get most of an idle loop (an eviction after a burst of writes settles sooner).

        A slice also takes the writers' step slot (MetaState.step_slot): a turn of the
        loop runs one step, a write's or a pass's, never both, and while lookups keep
        coming the turns after it are theirs. A lookup's first turns on the loop, before
        any code of ours sees it, waited behind a writer's step and a slice in the same
        turns: `kvfs-bench meta --blocks 1M` measured 1.4 ms (p50) and 5.1-5.7 ms (p99) from
        a lookup's send to its handler during the eviction phase, nearly all of it steps."""
        async with self._gate:
            async with self.state.step_slot(kind):
                yield
                if SLICE_STALL:
                    time.sleep(SLICE_STALL)
            took = self.state.reads.steps.last  # the slice's time, as the step slot counted it
            idle = self.state.client_calls == self._calls_seen
            await asyncio.sleep(took * IDLE_PAUSE if idle else took)
            self._calls_seen = self.state.client_calls

    async def each_in_turns(self, kind: str, items, fn) -> None:
        """fn(item) for each of `items` (a page of an inventory: each check reads a
        block's row), in turns of at most slice_seconds(), one item at least."""
        at = 0
        while at < len(items):
            async with self.turn(kind):
                deadline = time.perf_counter() + self.state.slice_seconds()
                while at < len(items):
                    fn(items[at])
                    at += 1
                    if time.perf_counter() > deadline:
                        break

    async def drain(self, kind: str, step, *args, most: int | None = None, room: bool = False) -> int:
        """Runs `step(*args)` (returning work done) a turn at a time until it does none,
        or, with `most`, until that much is done (work that keeps arriving, such as
        hits, must not keep a pass from the rest of its round), or, with `room`, until
        the delete queue is full (removals wait for the delete pass). The turns are
        counted under `kind` in the steps' times."""
        total = 0
        while (most is None or total < most) and not (room and self.state.deletes_backed_up()):
            async with self.turn(kind):
                n = step(*args)
            if not n:
                break
            total += n
        return total

    def _evict_slice(self) -> int:
        """One slice of background eviction, bounded by time too."""
        return self.state.evict_slice(4 * SLICE, self.state.slice_seconds())

    def _stub(self, server_id: str) -> chunk_pb2_grpc.ChunkServiceStub | None:
        state = self.state.servers.get(server_id)
        if state is None:
            return None
        address = state.record.address
        if address not in self._channels:
            self._channels[address] = tls.aio_channel(address, tls.from_config(self.state.cfg), CHANNEL_OPTIONS)
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
            # the removals that queued these deletes must be on disk first: a crash must not
            # bring back a block whose chunks are gone
            await self.state.durable()
            deleted = 0
            live = self.state.live_servers()
            for sid in list(self.state.undeleted):
                if sid not in live:
                    continue  # retried when it is back; orphan GC also finds them
                try:
                    # a batch at a time off the front of its queue (delete_on takes them off)
                    while queued := self.state.undeleted.get(sid):
                        deleted += await self.delete_on(sid, list(itertools.islice(queued, DELETE_BATCH)))
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

    async def _inventory_pages(self, server_id: str):
        """Every chunk on a server, a page (LIST_PAGE chunks) at a time; the next page is
        asked for before this one is handed out (the server lists it while we work)."""
        stub = self._stub(server_id)

        def ask(after: bytes):
            return asyncio.ensure_future(stub.ListChunks(
                chunk_pb2.ListChunksRequest(start_after=after, limit=LIST_PAGE), timeout=RPC_TIMEOUT))

        pending = ask(b"")
        try:
            while True:
                reply = await pending
                pending = ask(reply.next_start_after) if reply.next_start_after else None
                yield reply.chunks
                if pending is None:
                    return
        finally:
            if pending is not None:
                pending.cancel()

    async def _collect_orphans(self, server_id: str, pace: float = 0.0) -> int:
        """Queues for deletion the chunks on one server that no committed block lists
        there and no open allocation holds, once older than `gc_grace` (a writer that
        crashed). A page at a time, `pace` seconds apart. Returns chunks checked."""
        now = self.state.clock()
        open_chunks = self.state.open_allocation_chunks()
        checked = 0

        def unreferenced(info) -> None:
            if now - info.created >= self.state.cfg.gc_grace and not self.state.is_referenced(
                    info.chunk_id, parse_owner(info.owner), open_chunks, server_id):
                self.queue_deletes([meta_pb2.StoredChunk(chunk_id=info.chunk_id, length=info.length,
                                                         servers=[server_id])])

        try:
            async for page in self._inventory_pages(server_id):
                await self.each_in_turns("orphans", page, unreferenced)
                checked += len(page)
                await asyncio.sleep(pace)
        except grpc.aio.AioRpcError as err:
            log.warning("listing chunks on %s failed (%s); orphan GC skips it this time", server_id,
                        err.code().name)
        return checked

    async def sweep_orphans_forever(self) -> None:
        """Orphan GC in the background: one live server after another, at most
        ORPHAN_SWEEP_RATE chunks checked per second, so a full sweep of a large
        cluster takes a while and never crowds out lookups."""
        while True:
            await asyncio.sleep(self.state.cfg.lifecycle_interval)
            for sid in list(self.state.live_servers()):
                try:
                    await self._collect_orphans(sid, pace=LIST_PAGE / ORPHAN_SWEEP_RATE)
                    await self._delete_queued()
                except Exception:  # the next sweep retries
                    log.exception("orphan sweep of %s failed", sid)

    async def run_once(self, orphans: bool = True) -> meta_pb2.RunLifecycleReply:
        """One round: expire blocks and allocations, evict past the high watermark,
        (with `orphans`) find orphans on every live server, delete garbage."""
        async with self._lock:
            self.state.refresh_liveness()
            await self.drain("flush", self.state.flush_slice, 4 * SLICE, most=len(self.state.blocks.hits))
            n_expired = await self.drain("expire", self.state.expire_slice, SLICE, room=True)
            n_allocs, abandoned = self.state.expire_allocations()
            self.queue_deletes(abandoned)
            # capacity may have shrunk (a server left) since the last write
            await self.drain("evict", self._evict_slice, room=True)
            if orphans:
                for sid in list(self.state.live_servers()):
                    await self._collect_orphans(sid)
            deleted = await self._delete_queued()
            if n_expired or n_allocs or deleted:
                log.info("lifecycle: %d expired blocks and descendants, %d expired allocations, %d chunks deleted",
                         n_expired, n_allocs, deleted)
            return meta_pb2.RunLifecycleReply(expired_blocks=self.state.expired_blocks,
                                              expired_allocations=n_allocs, deleted_chunks=deleted)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.state.cfg.lifecycle_interval)
            try:
                await self.run_once(orphans=False)  # orphans: sweep_orphans_forever, at its own pace
            except Exception:  # keep the loop alive; the next round retries
                log.exception("lifecycle round failed")

    async def flush_forever(self) -> None:
        """Writes recorded hits back once they waited hit_flush_delay, checks liveness,
        and keeps eviction going between the watermarks: a slice at a time, every
        FLUSH_EVERY seconds."""
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            try:
                await self.drain("flush", self.state.flush_slice, 4 * SLICE, self.state.cfg.hit_flush_delay,
                                 most=len(self.state.blocks.hits))
                self.state.flush_usage()
                await self.drain("stranded", self.state.stranded_slice, SLICE)
                self.state.refresh_liveness()
                evicted = await self.drain("evict", self._evict_slice, room=True)
                # a full delete queue stops eviction until a delete pass empties it: that pass now,
                # not at the next lifecycle round (eviction waited up to lifecycle_interval for it)
                if (evicted or self.state.deletes_backed_up()) and not self._deleting.locked():
                    self.delete_soon()
            except Exception:
                log.exception("flush round failed")

    async def forget(self, slots: set[int]) -> int:
        """Forgets the blocks of hash `slots` handed to another metaserver (their rows,
        not their chunks), a slice of row groups per turn: one pass over the table."""
        t0, after, forgotten = time.monotonic(), records.ROW, 0
        while after is not None:
            async with self.turn("forget"):
                n, after = self.state.forget_slice(slots, after, SLICE)
            forgotten += n
        log.info("forgot %d blocks of %d hash slots handed to another metaserver, in %.1f s", forgotten, len(slots),
                 time.monotonic() - t0)
        return forgotten

    async def rebuild(self, slots: set[int] | None = None) -> meta_pb2.RebuildReply:
        """Reconstructs committed blocks from the live servers' inventories (of the hash
        `slots` only, if given: those a metaserver took over): every chunk found is
        staged in RocksDB under its block (a page at a time), then the staged blocks are
        restored a slice at a time, so memory and each turn on the event loop stay
        bounded whatever the size of the inventories."""
        async with self._lock:
            t0 = time.monotonic()
            self.state.rebuild_begin()
            seen = 0
            for sid in self.state.live_servers():
                async for page in self._inventory_pages(sid):
                    for at in range(0, len(page), STAGE_PIECE):  # a page is 1,000 chunks: ~10 ms of work
                        async with self.turn("rebuild"):
                            self.state.rebuild_stage(sid, page[at : at + STAGE_PIECE], slots)
                    seen += len(page)
            staged = time.monotonic()
            restored = incomplete = 0
            while True:
                async with self.turn("rebuild"):
                    r, i = self.state.rebuild_slice(SLICE)
                if not r and not i:
                    break
                restored, incomplete = restored + r, incomplete + i
            log.info("rebuild%s: %d chunks seen, %d blocks restored, %d incomplete, in %.1f s (%.1f s listing and "
                     "staging inventories)", f" of {len(slots)} hash slots" if slots is not None else "", seen,
                     restored, incomplete, time.monotonic() - t0, staged - t0)
            if self.state.forged_owners:
                log.warning("rebuild: ignored %d chunks whose owner records the metaserver did not seal (written "
                            "outside an allocation, or under another cluster key)", self.state.forged_owners)
            return meta_pb2.RebuildReply(blocks_restored=restored, blocks_incomplete=incomplete, chunks_seen=seen)
