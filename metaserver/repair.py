"""Healing: servers that come back are reconciled before they serve, chunks short
of copies are copied server to server, blocks that lost every copy of a chunk
are dropped from metadata.

One round (every `repair_interval`):
  1. a server that went silent and checks in again lists its chunks; the copies
     committed blocks no longer list on it (re-created elsewhere meanwhile) are
     deleted, and only then is it live again (chunks of blocks metadata does not
     know are orphan GC's, after its grace: metadata may be mid-rebuild);
  2. chunks of committed blocks with fewer live copies than `replicas` get new
     ones: a live server without a copy (another failure domain first, then the
     most free space) pulls it from a live holder (CopyChunk), which verifies it
     on the way; the block then lists the live holders and the new copies;
  3. a block with a chunk no live server holds, for two heartbeat timeouts while
     at least `replicas` servers are live, is dropped (it is a cache: the next
     request recomputes it) and counted.
Copies are paced to `repair_rate` bytes/s so that restores keep the disks and
network, and stop when a server comes back (it is reconciled first; it may hold
them). Nothing is repaired in the first rounds after the metaserver starts, or
after it stalled past a heartbeat timeout, while servers are still checking in.

A round looks only where copies may be missing: the blocks listed on servers
that are not live (the replica index) and the blocks known short of copies
(placed short, or a copy reported lost), a slice of SLICE blocks at a time with
the event loop served between slices.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc

from kvfs.grants import owner_seal, parse_owner
from kvfs.keys import KEY_BYTES
from kvfs.proto import chunk_pb2, meta_pb2

from .lifecycle import RPC_TIMEOUT, SLICE, Lifecycle
from .state import MetaState, Repair

log = logging.getLogger(__name__)

COPIES_IN_FLIGHT = 4  # 16 halves the time to full replication here but doubles restore p99 meanwhile


class Repairer:
    def __init__(self, state: MetaState, lifecycle: Lifecycle):
        self.state = state
        self.lifecycle = lifecycle
        self.started = state.clock()
        self.copied_chunks = 0
        self.copied_bytes = 0
        self.failed_copies = 0
        self.under_replicated = 0  # chunks short of copies at the last round's start
        self.last_round = self.started
        self._lost_since: dict[bytes, float] = {}  # block -> when it was first seen with a chunk nobody holds
        self._lock = asyncio.Lock()

    async def run_once(self) -> None:
        async with self._lock:
            try:
                await self._round()
            finally:
                self.last_round = self.state.clock()

    async def _round(self) -> None:
        now = self.state.clock()
        timeout = self.state.cfg.heartbeat_timeout
        if now - self.last_round > max(timeout, 2 * self.state.cfg.repair_interval):
            # this process stalled (or slept) past a heartbeat timeout since the last
            # round ended: the servers' heartbeats wait to be handled, so their silence
            # means nothing yet
            log.warning("repair: %.1fs since the last round; waiting for heartbeats first", now - self.last_round)
            self.started = now
        for sid in self.state.to_reconcile():
            await self._reconcile(sid)
        # after a start (or a stall) every server has heartbeat timeouts to check in
        if now - self.started < 2 * timeout:
            return
        self.state.refresh_liveness()
        lost, wanting = [], 0
        work = self.state.replica_slices(SLICE)
        while True:
            async with self.lifecycle.turn("repair"):
                found = next(work, None)
            if found is None:
                break
            repairs, lost_here = found
            lost += lost_here
            wanting += len(repairs)
            if repairs:
                await self._copy_all(repairs)  # paced RPCs: other passes take their turns meanwhile
            if self.state.to_reconcile():
                break  # reconcile it first (it may hold copies), then look again
        await self._drop_lost(self._lost_for_good(lost, now))
        if wanting:
            log.info("repair: %d chunks were short of copies this round; %d copied so far", wanting,
                     self.copied_chunks)
        self.under_replicated = wanting

    async def _drop_lost(self, candidates: list[bytes]) -> None:
        """Drops the blocks still without a live copy of some chunk, a slice at a time,
        each slice checked again just before it goes (copies may have come back while
        the round copied); nothing is dropped while a returning server awaits
        reconciliation (it may hold the copies)."""
        for i in range(0, len(candidates), SLICE):
            async with self.lifecycle.turn("repair"):
                if self.state.to_reconcile():
                    return
                _, still_lost, _ = self.state.blocks.check_replicas(candidates[i : i + SLICE])
                self.lifecycle.queue_deletes(self.state.drop_lost_blocks(still_lost))
                for k in still_lost:
                    self._lost_since.pop(k, None)

    def _lost_for_good(self, lost: list[bytes], now: float) -> list[bytes]:
        """Of the blocks with a chunk no live server holds, those that have been so for
        two heartbeat timeouts, while at least `replicas` servers are live. Everything
        looking lost at once is likelier this metaserver's trouble than the disks'."""
        self._lost_since = {k: self._lost_since.get(k, now) for k in lost}
        if lost and len(self.state.live_servers()) < self.state.cfg.replicas:
            log.warning("repair: %d blocks have no live copy of a chunk, but fewer than %d servers are live; "
                        "not dropping them", len(lost), self.state.cfg.replicas)
            return []
        grace = 2 * self.state.cfg.heartbeat_timeout
        return [k for k, since in self._lost_since.items() if now - since >= grace]

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.state.cfg.repair_interval)
            try:
                await self.run_once()
            except Exception:  # keep healing; the next round retries
                log.exception("repair round failed")

    async def _reconcile(self, sid: str) -> None:
        stale = []
        try:
            def check(info) -> None:
                if self.state.is_stale(info.chunk_id, parse_owner(info.owner), sid):
                    stale.append(info.chunk_id)

            async for page in self.lifecycle._inventory_pages(sid):
                await self.lifecycle.each_in_turns("repair", page, check)
            await self.lifecycle.delete_on(sid, stale)
        except grpc.aio.AioRpcError as err:
            log.warning("reconciling %s failed (%s); it stays out until the next round", sid, err.code().name)
            return
        log.info("reconciled %s: %d stale chunks deleted", sid, len(stale))
        self.state.reconciled(sid)

    async def _copy_all(self, repairs: list[Repair]) -> None:
        loop = asyncio.get_running_loop()
        t0, moved = loop.time(), 0
        slots = asyncio.Semaphore(COPIES_IN_FLIGHT)

        async def one(r: Repair) -> None:
            nonlocal moved
            async with slots:
                if self.state.to_reconcile():
                    return  # a server is back: reconcile it first (it may hold these chunks), then recount
                moved += await self._copy(r)
                # pace: never ahead of repair_rate since the round began
                ahead = moved / self.state.cfg.repair_rate - (loop.time() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)

        await asyncio.gather(*(one(r) for r in repairs))
        log.debug("repair: %d chunks short of copies; %d bytes copied in %.1fs", len(repairs), moved,
                  loop.time() - t0)

    async def _copy(self, r: Repair) -> int:
        """New copies of one chunk until it has `replicas` live ones; bytes copied."""
        servers = list(r.holders)
        copied = 0
        while len(servers) < self.state.cfg.replicas:
            target = self.state.replica_target(servers, r.chunk.length)
            if target is None:
                break  # nowhere to put it now; a later round retries
            source = self.state.servers[random.choice(r.holders)].record.address
            owner = meta_pb2.ChunkOwner(namespace_digest=r.full_key[:-KEY_BYTES], block_key=r.full_key[-KEY_BYTES:],
                                        chunk_index=r.index, chunk_count=r.count, layout=r.layout,
                                        ttl_class=r.ttl_class, chunk_size=self.state.cfg.chunk_size,
                                        hash_slot=r.hash_slot, parent=r.parent, depth=r.depth)
            if self.state.key:
                owner.seal = owner_seal(self.state.key, r.full_key, r.index, r.count, r.layout,
                                        self.state.cfg.chunk_size, r.chunk.chunk_id, r.hash_slot, r.parent)
            try:
                await self.lifecycle._stub(target).CopyChunk(chunk_pb2.CopyChunkRequest(
                    chunk_id=r.chunk.chunk_id, source=source, length=r.chunk.length, checksum=r.chunk.checksum,
                    owner=owner.SerializeToString()), timeout=RPC_TIMEOUT)
            except grpc.aio.AioRpcError as err:
                self.failed_copies += 1
                log.warning("copying chunk %s from %s to %s failed (%s: %s)", r.chunk.chunk_id.hex()[:16], source,
                            target, err.code().name, err.details())
                break
            servers.append(target)
            copied += r.chunk.length
        if copied:
            # the block now lists its live copies: a dead server's copy is stale, and it is
            # deleted when that server comes back and is reconciled. A turn of its own: copies
            # finish many at a time, each rewriting its block's row group (~0.5 ms at 1M blocks)
            gone = [s for s in r.chunk.servers if s not in r.holders]
            added = servers[len(r.holders):]
            new_copies = [meta_pb2.StoredChunk(chunk_id=r.chunk.chunk_id, servers=added)]
            updated = None
            try:
                async with self.lifecycle.turn("repair"):
                    updated = self.state.update_replicas(r.full_key, r.chunk.chunk_id, added, gone)
                    if not updated:  # the block expired meanwhile: the new copies are orphans
                        self.lifecycle.queue_deletes(new_copies)
            except asyncio.CancelledError:
                if updated is None:  # stopped waiting for the turn, before the row listed them: orphans too
                    self.lifecycle.queue_deletes(new_copies)
                raise
            if updated:
                self.copied_chunks += len(added)
                self.copied_bytes += copied
        return copied
