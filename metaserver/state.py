"""The metaserver's state, one object over its parts: membership (membership.py),
committed blocks (blocks.py, laid out as records.py says), open allocations
(allocations.py), capacity, and the queue of chunk deletes.

Nothing is loaded per block at start-up and nothing here holds a Python object
per block: opening a database of any size reads the servers, the open
allocations and a few counters. Every method does work bounded by its
arguments; the background passes (lifecycle.py, repair.py) call the
`*_slice` methods a bounded slice at a time between other work on the event
loop. Changes are applied at once and made durable in groups (db.py): a server
awaits `durable()` before it acknowledges a commit. Time comes from an
injectable clock so expiry is testable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from kvfs.config import MiB
from kvfs.errors import InvalidArgument, ResourceExhausted
from kvfs.grants import owner_sealed, parse_owner, read_grant
from kvfs.keys import KEY_BYTES
from kvfs.proto import meta_pb2

from .allocations import COMMIT_PIECE, Allocations, joined_keys, step_seconds
from .blocks import BlockTable, Repair, layout_of
from .config import MetaserverConfig
from . import records
from .db import Batch, MetaDB, OffLoop
from .membership import Membership, ServerState
from .readsfirst import ReadsFirst

log = logging.getLogger(__name__)

EVICT_INLINE = 1024  # blocks a write may evict itself; the rest (down to the low watermark) in the background
EVICT_SLICE = 16  # of those, blocks evicted between two turns of the event loop at most


def run_steps(steps):
    """Runs a generator of steps (allocate_steps, commit_steps, make_room_steps) to
    its end at once; its result. The reads it asks for (db.OffLoop) are made here;
    one that fails raises its error in the steps, whose cleanup runs."""
    answer, error = None, None
    while True:
        try:
            asked = steps.throw(error) if error is not None else steps.send(answer)
        except StopIteration as done:
            return done.value
        answer, error = _answer(asked.fn, asked.args) if isinstance(asked, OffLoop) else (None, None)


def _answer(fn, args) -> tuple:
    """(fn(*args), None), or (None, the error it raised)."""
    try:
        return fn(*args), None
    except Exception as err:  # handed to the steps that asked
        return None, err


@contextlib.asynccontextmanager
async def step_slot(gate: asyncio.Lock, reads: ReadsFirst, kind: str):
    """Holds `gate`, the event loop's one step slot, for a step of synchronous work
    (the body: it must not await). Steps of all the callers sharing the gate take
    turns, at most one per turn of the loop: eight writers each with a step ready
    would otherwise run eight steps between two polls of the sockets, and keep every
    lookup and heartbeat waiting that long. (Releasing the gate at the end of a step
    is not enough for that: a caller that finds it free and nobody waiting takes it in
    the same turn. So it is released in the next turn, before which every other
    caller that came for it queues behind.) The step makes way for lookups first
    (readsfirst.py), and while they keep coming the gate is held through the turns
    after it: spaced steps of one caller would leave those turns to the next one's.
    The step's time is counted under `kind` (readsfirst.StepTimes)."""
    loop = asyncio.get_running_loop()
    await gate.acquire()
    try:
        await reads.before_step()
        began, began_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            reads.steps.record(kind, time.perf_counter() - began, time.thread_time() - began_cpu)
        if reads.coming():  # the turns after a step are the lookups', not another step's
            await reads.after_step()
    finally:
        loop.call_soon(gate.release)


async def run_steps_async(steps, gate: asyncio.Lock, reads: ReadsFirst, kind: str, reader: Executor | None = None):
    """run_steps(), serving the event loop between steps, each in the step slot
    `gate` (step_slot) and counted under `kind`. A read a step asks for (db.OffLoop)
    is made on `reader` (None: the loop's default executor) without the gate: other
    writers' steps go on meanwhile."""
    loop = asyncio.get_running_loop()
    answer, error = None, None
    while True:
        async with step_slot(gate, reads, kind):
            try:
                asked = steps.throw(error) if error is not None else steps.send(answer)
            except StopIteration as done:
                return done.value
        if isinstance(asked, OffLoop):
            answer, error = await loop.run_in_executor(reader, _answer, asked.fn, asked.args)
        else:
            answer, error = None, None
            await asyncio.sleep(0)


# Chunk copies waiting for deletion (about 100 B of memory each); background removals pause past it
# until the delete pass (started at once) has sent them.
MAX_QUEUED_DELETES = 1 << 18

__all__ = ["MetaState", "Repair", "ServerState"]


class MetaState:
    def __init__(self, cfg: MetaserverConfig, clock: Callable[[], float] = time.time, key: bytes | None = None):
        self.cfg = cfg
        self.key = key  # the cluster key (kvfs.tls): None on an --insecure metaserver, which seals nothing
        self.clock = clock
        self.db = MetaDB(cfg.data_dir, cfg.cache_size, cfg.compaction_nice)
        self.members = Membership(cfg, self.db, clock)
        self.blocks = BlockTable(cfg, self.db, self.members, clock)
        self.allocations = Allocations(cfg, self.db, self.members, self.blocks, clock, key)
        self.undeleted: dict[str, dict[bytes, int]] = {}  # server id -> chunk id -> bytes: deletes to send
        self.undeleted_bytes: dict[str, int] = {}  # server id -> the sum of its undeleted bytes
        self.deletes_left_to_gc = 0  # deletes for servers that were down with full queues (orphan GC's)
        self.gc_deleted_chunks = 0
        self.evicting = False  # between passing the high watermark and reaching the low one
        self.client_calls = 0  # lookups and writes begun (metrics.timed): background passes yield to them
        self.forged_owners = 0  # owner records a rebuild found without a valid seal, and ignored
        self._staged_floor = records.STAGED  # where rebuild_slice's next scan starts
        # The hash slots (kvfs/shards.py) this metaserver answers for: all of them when it is the
        # only one; else those its lease holds (coordination.SlotLease.serves). Chunks whose owner
        # records name another slot are another metaserver's: never collected or rebuilt here.
        self.owns: Callable[[int], bool] = lambda slot: True
        self._step_gate = asyncio.Lock()  # the loop's step slot: allocations', commits' and background passes' steps, one at a time
        self.reads = ReadsFirst()  # lookups under way: writes' and background passes' steps make way
        self.allocations.piece_blocks = lambda: (self.allocations.piece_within(self.slice_seconds())
                                                 if self.reads.coming() else COMMIT_PIECE)
        self.allocations.slice_seconds = self.slice_seconds
        log.info("metadata opened: %d blocks, %d servers, %d open allocations", self.blocks.blocks,
                 len(self.members.servers), len(self.allocations.open))

    def close(self) -> None:
        self.flush_last_used()
        self.flush_usage()
        self.db.close()

    async def durable(self) -> None:
        await self.db.durable()

    # ---- membership ------------------------------------------------------

    @property
    def servers(self) -> dict[str, ServerState]:
        return self.members.servers

    @property
    def chains(self):
        return self.members.chains

    def register(self, req: meta_pb2.RegisterRequest) -> None:
        self.members.register(req)

    def heartbeat(self, req: meta_pb2.HeartbeatRequest) -> bool:
        return self.members.heartbeat(req, self.undeleted_bytes.get(req.server_id, 0))

    def is_live(self, state: ServerState) -> bool:
        return self.members.is_live(state)

    def live_servers(self) -> dict[str, ServerState]:
        return self.members.live_servers()

    def to_reconcile(self) -> list[str]:
        return self.members.to_reconcile()

    def reconciled(self, server_id: str) -> None:
        self.members.reconciled(server_id)

    def refresh_liveness(self) -> None:
        self.members.refresh_liveness()

    @staticmethod
    def free_bytes(state: ServerState) -> int:
        return Membership.free_bytes(state)

    def capacity_bytes(self) -> int:
        return self.members.capacity_bytes()

    # ---- writes and lookups ----------------------------------------------

    def allocate(self, namespace_digest: bytes, keys: list[bytes], layout_msg,
                 parent: bytes = b"", first_key: bytes = b"") -> meta_pb2.AllocateBlocksReply:
        return run_steps(self.allocations.allocate_steps(namespace_digest, keys, layout_msg, parent,
                                                         self.make_room_steps, first_key))

    def slice_seconds(self) -> float:
        """The most the next step of work (a write's, or a background slice) should
        hold the event loop: less while lookups keep coming (allocations.step_seconds)."""
        return step_seconds(self.reads.coming())

    def step_slot(self, kind: str):
        """The loop's step slot (step_slot()), for a slice of synchronous work of `kind`."""
        return step_slot(self._step_gate, self.reads, kind)

    async def allocate_async(self, namespace_digest: bytes, keys: list[bytes], layout_msg,
                             parent: bytes = b"", first_key: bytes = b"") -> meta_pb2.AllocateBlocksReply:
        """allocate(), letting the event loop serve other calls between its pieces."""
        steps = self.allocations.allocate_steps(namespace_digest, keys, layout_msg, parent, self.make_room_steps,
                                                first_key)
        return await run_steps_async(steps, self._step_gate, self.reads, "allocate", self.db.reader)

    def commit(self, namespace_digest: bytes, req: meta_pb2.CommitBlocksRequest) -> tuple[int, int, list]:
        """Commits blocks (Allocations.commit_steps); the chunks that became garbage
        are queued for deletion, a piece at a time, and returned."""
        return run_steps(self.allocations.commit_steps(namespace_digest, req, self.queue_deletes))

    async def commit_async(self, namespace_digest: bytes, req: meta_pb2.CommitBlocksRequest) -> tuple[int, int, list]:
        """commit(), letting the event loop serve other calls between pieces of a large one."""
        return await run_steps_async(self.allocations.commit_steps(namespace_digest, req, self.queue_deletes),
                                     self._step_gate, self.reads, "commit", self.db.reader)

    def match_bytes(self, namespace_digest: bytes, keys, tenant: str = "", joined: bytes = b"") -> bytes:
        """MatchPrefix's reply, serialized, with a read grant for the namespace, which is
        `tenant`'s; with `tenant`, the lookup is metered under it. The keys are `keys`
        or `joined` (MatchPrefixRequest's joined_keys): one of the two."""
        want = joined_keys(keys, joined, "MatchPrefix", self.cfg.max_keys)
        reply, hit, layout_bytes = self.blocks.match(namespace_digest, want)
        if tenant:
            layout = layout_of(meta_pb2.BlockLayout.FromString(layout_bytes)) if hit else None
            self.blocks.usage.lookup(tenant, len(want) // KEY_BYTES, hit, layout.block_tokens if layout else 0,
                                     layout.payload_bytes if layout else 0)
        if self.key is None:
            return reply
        grant = read_grant(self.key, namespace_digest, tenant, self.clock() + self.cfg.read_grant_ttl)
        return reply + b"\x22" + bytes([len(grant)]) + grant  # field 4, under 128 bytes

    def match(self, namespace_digest: bytes, keys: list[bytes]) -> meta_pb2.MatchPrefixReply:
        return meta_pb2.MatchPrefixReply.FromString(self.match_bytes(namespace_digest, keys))

    # ---- capacity --------------------------------------------------------

    @property
    def cache_bytes(self) -> int:
        return self.blocks.cache_bytes

    def over_high(self, incoming: int = 0) -> bool:
        capacity = self.capacity_bytes()
        total = self.blocks.cache_bytes + self.allocations.incoming_bytes() + incoming
        return bool(capacity) and total > self.cfg.evict_high * capacity

    def make_room_steps(self, incoming: int, tenant: str = "", limit: int = EVICT_INLINE):
        """Makes room for a write of `incoming` bytes of cache by `tenant`: within its
        quota first (tenant_room_steps), then in the cache.

        Evicts if cached blocks, open allocations and `incoming` bytes would pass the
        high watermark: leaves, lowest rank first, `incoming` bytes' worth, what the
        write brings and no more (past the high mark the disks may be full, and the
        new chunks must find room in the space this frees), at most `limit` blocks,
        EVICT_SLICE a step; the background pass (`evict_slice`) goes on down to the
        low watermark. The blocks of allocations being placed, the parents of open
        allocations' blocks, and all their ancestors stay. A generator (yields between slices); returns
        blocks evicted. Their chunks go to the delete queue. `incoming` is counted among
        the allocations being placed already (Allocations.placing)."""
        if tenant:
            yield from self.tenant_room_steps(tenant, incoming, limit)
        if not self.over_high():
            return 0
        self.evicting = True
        capacity, before = self.capacity_bytes(), self.blocks.cache_bytes
        evicted = freed = 0
        while evicted < limit and freed < incoming:
            if evicted:
                yield  # other writers commit meanwhile: what this write freed is counted per slice
            step = min(EVICT_SLICE, limit - evicted)
            was = self.blocks.cache_bytes
            n = self._evict(incoming - freed, frozenset(), step, time.perf_counter() + self.slice_seconds())
            freed += was - self.blocks.cache_bytes
            evicted += n
            if not n:
                break
        # a warning when nothing could go: every leaf is under a write in flight
        log.log(logging.INFO if evicted else logging.WARNING,
                "eviction (%s): %d blocks, %.1f MiB for a write of %.1f MiB; cache %.1f%% -> %.1f%% of %.1f MiB, "
                "%.1f MiB being written", self.cfg.eviction_policy, evicted, freed / MiB, incoming / MiB,
                100 * before / capacity, 100 * self.blocks.cache_bytes / capacity, capacity / MiB,
                (incoming + self.allocations.incoming_bytes()) / MiB)
        return evicted

    def tenant_room_steps(self, tenant: str, incoming: int, limit: int = EVICT_INLINE):
        """When `tenant`'s blocks and a write of `incoming` bytes of cache would pass its
        quota, evicts the tenant's own blocks, lowest rank first, down to evict_low of
        the quota (so that the next writes find room), at most `limit` of them,
        EVICT_SLICE a step, never another tenant's. ResourceExhausted if the write
        still does not fit (its blocks are all in use: pinned, or hit in the last
        second). A generator (yields between slices); returns blocks evicted."""
        quota = self.cfg.quota_bytes(tenant, self.capacity_bytes())
        if quota is None:
            return 0
        record = self.blocks.usage.record_of(tenant)
        # its open allocations count as held: blocks allocated and never written must not evict others' for
        # nothing, nor let a tenant past its quota a few allocations at a time (a write over it was refused)
        pending = self.allocations.tenant_incoming(tenant)
        held = (record.cache_bytes if record is not None else 0) + pending
        if held + incoming <= quota:
            return 0
        need = held + incoming - int(self.cfg.evict_low * quota)
        evicted = freed = 0
        while record is not None and evicted < limit and freed < need:
            if evicted:
                yield
            step = min(EVICT_SLICE, limit - evicted)
            was = record.cache_bytes
            n, chunks = self.blocks.evict(need - freed, self.allocations.pinned(), step, tenant=tenant)
            self.queue_deletes(chunks)
            freed += was - record.cache_bytes
            evicted += n
            if n < step:
                break
        log.info("tenant %r over its quota of %.1f MiB: evicted %d of its blocks, %.1f MiB, for a write of %.1f MiB "
                 "(%.1f MiB in its open allocations)", tenant, quota / MiB, evicted, freed / MiB, incoming / MiB,
                 pending / MiB)
        if held - freed + incoming > quota:
            raise ResourceExhausted(f"tenant {tenant!r} holds {held - freed} bytes of its {quota}-byte quota "
                                    f"(tenant_quotas; {pending} of them in allocations not committed yet) and no "
                                    f"more of its blocks can be evicted now (in use by writes in flight, or hit in "
                                    f"the last second); try again")
        return evicted

    def _evict(self, need: int, pinned: set[bytes], limit: int, deadline: float | None = None) -> int:
        """Evicts `need` bytes' worth of blocks, at most `limit` of them (and, with
        `deadline`, a perf_counter time, as many as go by then)."""
        if need <= 0:
            return 0
        held = self.allocations.pinned()  # a live view: copying it per call cost as much as the slice
        n, chunks = self.blocks.evict(need, set(pinned) | held if pinned else held, limit, deadline=deadline)
        self.queue_deletes(chunks)
        return n

    def queue_deletes(self, chunks: Iterable[meta_pb2.StoredChunk]) -> None:
        """Chunks to delete from the servers they list; Lifecycle sends the deletes. A
        server that is not live holds its queue until it is back; past MAX_QUEUED_DELETES
        copies its further deletes are left to orphan GC, which finds them unreferenced."""
        for c in chunks:
            for sid in c.servers:
                queued = self.undeleted.setdefault(sid, {})
                if c.chunk_id in queued:
                    continue
                if len(queued) >= MAX_QUEUED_DELETES and not self._live_id(sid):
                    self.deletes_left_to_gc += 1
                    continue
                queued[c.chunk_id] = c.length
                self.undeleted_bytes[sid] = self.undeleted_bytes.get(sid, 0) + c.length
                if (server := self.servers.get(sid)) is not None:
                    server.freeing_bytes += c.length

    def deletes_backed_up(self) -> bool:
        """Too many deletes queued for live servers: background removals wait for the
        delete pass. (Queues of servers that are down do not count: they wait for their
        server, and would stop eviction for as long.)"""
        return sum(len(q) for sid, q in self.undeleted.items() if self._live_id(sid)) >= MAX_QUEUED_DELETES

    def _live_id(self, server_id: str) -> bool:
        """Whether the server is live as of the last liveness refresh."""
        server = self.servers.get(server_id)
        return server is not None and server.number in self.members.live_numbers

    def deleted(self, server_id: str, chunk_ids: Iterable[bytes]) -> None:
        """A server acknowledged these deletes (its next heartbeat shows the space free)."""
        queued = self.undeleted.get(server_id, {})
        for cid in chunk_ids:
            if (length := queued.pop(cid, None)) is not None:
                self.undeleted_bytes[server_id] -= length
        if not queued:
            self.undeleted.pop(server_id, None)
            self.undeleted_bytes.pop(server_id, None)

    # ---- background slices -----------------------------------------------

    def flush_slice(self, limit: int = 4096, age: float = 0.0) -> int:
        """Writes back up to about `limit` blocks' recorded hits that waited at least `age` seconds."""
        return self.blocks.flush_hits(limit, age)

    def flush_usage(self) -> None:
        """Writes usage records changed by lookups alone (block writes carry theirs)."""
        if self.blocks.usage.dirty:
            batch = Batch()
            self.blocks.usage.stage(batch)
            self.db.write(batch)

    def flush_last_used(self) -> int:
        """Writes every recorded hit (bounded: hits.py)."""
        total = 0
        while n := self.blocks.flush_hits():
            total += n
        return total

    def expire_slice(self, limit: int = 64) -> int:
        """Removes up to `limit` blocks past their TTL, and as many descendants of removed
        blocks; their chunks go to the delete queue. Returns blocks removed."""
        before = self.blocks.expired + self.blocks.stranded_dropped
        self.queue_deletes(self.blocks.expire(limit))
        self.queue_deletes(self.blocks.drop_stranded(limit))
        return self.blocks.expired + self.blocks.stranded_dropped - before

    def expire_blocks(self) -> list[meta_pb2.StoredChunk]:
        """Removes every block past its TTL; returns their chunks for deletion (their
        descendants go too, their chunks straight to the delete queue)."""
        self.flush_last_used()
        chunks = []
        while True:
            n = self.blocks.expired
            got = self.blocks.expire()
            chunks += got
            if self.blocks.expired == n:
                break
        self.drain_stranded()
        return chunks

    def drain_stranded(self) -> None:
        """Drops every queued descendant of removed blocks now (tests and shutdown;
        the server does it a slice at a time, `stranded_slice`)."""
        while self.blocks.stranded:
            self.queue_deletes(self.blocks.drop_stranded())

    def stranded_slice(self, limit: int = 64) -> int:
        """Drops up to `limit` descendants of removed blocks; their chunks go to the delete queue."""
        before = self.blocks.stranded_dropped
        self.queue_deletes(self.blocks.drop_stranded(limit))
        return self.blocks.stranded_dropped - before

    def evict_slice(self, limit: int = 64, seconds: float | None = None) -> int:
        """Background eviction: once past the high watermark, down to the low one, a
        slice at a time (a write evicts only what it brings): at most `limit` blocks,
        and with `seconds`, as many as go in that time."""
        capacity = self.capacity_bytes()
        if not capacity or not (self.evicting or self.over_high()):
            return 0  # no live capacity at all: nothing to measure against, nothing goes
        need = self.blocks.cache_bytes + self.allocations.incoming_bytes() - int(self.cfg.evict_low * capacity)
        n = self._evict(need, frozenset(), limit, time.perf_counter() + seconds if seconds is not None else None)
        # stop at the low watermark, or when nothing more can go now
        self.evicting = n > 0 and self.blocks.cache_bytes + self.allocations.incoming_bytes() > int(
            self.cfg.evict_low * capacity)
        return n

    def expire_allocations(self) -> tuple[int, list]:
        return self.allocations.expire()

    def open_allocation_chunks(self) -> set[bytes]:
        return self.allocations.chunk_ids()

    # ---- replicas, loss and reconciliation -------------------------------

    def chunks_lost(self, server_id: str, lost: list[tuple[bytes, meta_pb2.ChunkOwner | None]]) -> list:
        """`server_id` removed these chunks (they failed their checksums). It leaves
        each one's replicas, so lookups stop sending readers there and repair sees
        the chunk short of copies; a block left with a chunk nobody holds is dropped
        (a cache: the next request recomputes it). Returns the chunks of dropped
        blocks, for deletion. Reports are resent until acknowledged: idempotent."""
        state = self.servers.get(server_id)
        wanted: dict[bytes, set[bytes]] = {}
        for chunk_id, owner in lost:
            if owner is None or not owner.block_key:
                log.warning("chunkserver %s lost chunk %s whose owner record names no block; metadata "
                            "may still list the copy (readers sent there get NOT_FOUND and use another)",
                            server_id, chunk_id.hex()[:16])
                continue
            wanted.setdefault(owner.namespace_digest + owner.block_key, set()).add(chunk_id)
        if not wanted or state is None:
            return []
        removed, dead = self.blocks.lose_copies(state.number, wanted)
        if removed:
            log.warning("chunkserver %s lost %d chunk copies to corruption; %d blocks left with a chunk "
                        "no server holds", server_id, removed, len(dead))
        return self.drop_lost_blocks(dead)

    def drop_lost_blocks(self, full_keys: list[bytes]) -> list:
        """Blocks with a chunk no live server holds: gone from metadata (a cache: the
        next request recomputes them); their descendants follow in background slices
        (`stranded_slice`). Returns the blocks' own chunks, for deletion."""
        if not full_keys:
            return []
        chunks = self.blocks.drop(full_keys)
        self.blocks.lost += len(full_keys)
        log.warning("%d blocks lost every copy of a chunk; dropped from metadata", len(full_keys))
        return chunks

    def replica_slices(self, limit: int = 64):
        """Yields (repairs, lost blocks) a slice of up to `limit` blocks at a time: the
        blocks listed on servers that are not live, then those known short of copies.
        Repairs are chunks with fewer live copies than wanted (fewest first); lost
        blocks have a chunk no live server holds; healthy blocks leave the queue."""
        blocks = self.blocks

        def short(after: bytes) -> tuple[list[bytes], bytes | None]:
            fulls = blocks.short_blocks(limit, after)
            return fulls, fulls[-1] if fulls else None

        # each source: (blocks, where the next slice starts; None: no more)
        sources = [(lambda after, n=n: blocks.blocks_on(n, after, limit)) for n in self.members.dead_numbers()]
        sources.append(short)
        for source in sources:
            fulls, after = source(b"")
            while after is not None:  # a slice of stale index entries only yields nothing
                repairs, lost, whole = blocks.check_replicas(fulls)
                blocks.replicated(whole)
                repairs.sort(key=lambda r: len(r.holders))
                yield repairs, lost
                fulls, after = source(after)

    def under_replicated(self) -> tuple[list[Repair], list[bytes]]:
        """Every slice of `replica_slices` at once (a block on two dead servers counted once)."""
        repairs: dict[tuple[bytes, int], Repair] = {}
        lost: dict[bytes, None] = {}
        for found, lost_here in self.replica_slices():
            repairs.update(((r.full_key, r.index), r) for r in found)
            lost.update(dict.fromkeys(lost_here))
        return sorted(repairs.values(), key=lambda r: len(r.holders)), list(lost)

    def replica_target(self, holders: list[str], nbytes: int) -> str | None:
        """A live server for one more copy: not a holder, in a failure domain no holder
        is in if possible, then the one with most free space."""
        live = self.live_servers()
        domains = {live[h].record.failure_domain for h in holders if h in live}
        choices = [s for sid, s in live.items() if sid not in holders and self.free_bytes(s) >= nbytes]
        if not choices:
            return None
        best = max(choices, key=lambda s: (s.record.failure_domain not in domains, self.free_bytes(s)))
        best.pending_bytes += nbytes
        return best.record.id

    def update_replicas(self, full_key: bytes, chunk_id: bytes, added: list[str], gone: list[str]) -> bool:
        """One chunk of a block gained copies on `added` and lost those on `gone`,
        applied to the row as it is now (a loss report may have come in meanwhile);
        False if the block is gone."""
        numbers = self.members.numbers
        return self.blocks.update_replicas(full_key, chunk_id, numbers(s for s in added if s in self.servers),
                                           numbers(s for s in gone if s in self.servers))

    def is_stale(self, chunk_id: bytes, owner: meta_pb2.ChunkOwner | None, server_id: str) -> bool:
        """Whether a chunk server `server_id` holds belongs to a committed block that lists
        its copies on other servers only (re-replicated while this one was away). Chunks
        metadata knows nothing of are not stale: orphan GC takes them, after its grace."""
        if owner is None or server_id not in self.servers or not self.owns(owner.hash_slot):
            return False
        return self.blocks.holds(owner.namespace_digest + owner.block_key, chunk_id,
                                 self.servers[server_id].number) is False

    def is_referenced(self, chunk_id: bytes, owner: meta_pb2.ChunkOwner | None, open_chunks: set[bytes],
                      server_id: str) -> bool:
        """Whether a chunk server `server_id` holds is one of the copies a committed block
        lists, or part of an open allocation; or is filed under a hash slot another
        metaserver answers for (whose metadata is not here to say)."""
        if chunk_id in open_chunks or (owner is not None and not self.owns(owner.hash_slot)):
            return True
        if owner is None or server_id not in self.servers:
            return False
        return bool(self.blocks.holds(owner.namespace_digest + owner.block_key, chunk_id,
                                      self.servers[server_id].number))

    def forget_slice(self, slots: set[int], after: bytes, limit: int = 16) -> tuple[int, bytes | None]:
        """Forgets (BlockTable.forget) the blocks of hash slots handed to another
        metaserver, up to `limit` row groups from `after`: (blocks, next start or None)."""
        return self.blocks.forget(slots, after, limit)

    # ---- rebuild --------------------------------------------------------

    def rebuild_begin(self) -> None:
        """Forgets what an earlier rebuild staged and did not finish."""
        self.db.db.delete_range(records.STAGED, records.STAGED + b"\xff")
        # where the next slice starts: slices restore the staged blocks in key order and delete
        # them, and a scan from the front stepped over every entry deleted so far (a rebuild of
        # 20,000 blocks took 1.8 s, of 40,000 7.4 s)
        self._staged_floor = records.STAGED

    def rebuild_stage(self, server_id: str, chunks, slots: set[int] | None = None) -> int:
        """Stages chunks (ListChunks entries) a rebuild found on a server, each under its
        block, so that the blocks can then be restored a slice at a time. Returns
        chunks staged (those without an owner record naming a block, or naming a hash slot
        this metaserver does not answer for, or outside `slots` if given: slots taken
        over, which it answers for but does not own until rebuilt, are skipped)."""
        server = self.servers[server_id].number
        batch = Batch()
        n = 0
        for info in chunks:
            owner = parse_owner(info.owner)
            if owner is None or not owner.block_key or owner.chunk_index > 0xFFFF or \
                    (owner.hash_slot not in slots if slots is not None else not self.owns(owner.hash_slot)):
                continue
            if self.key and not owner_sealed(self.key, owner, info.chunk_id):
                self.forged_owners += 1  # not an owner record this metaserver issued for this chunk
                continue
            batch.put(*records.staged_chunk(owner.namespace_digest + owner.block_key, owner.chunk_index, server,
                                            info.chunk_id, info.length, info.checksum, info.created, info.owner,
                                            owner.hash_slot, owner.depth))
            n += 1
        self.db.write(batch)
        return n

    def rebuild_slice(self, limit: int = 64) -> tuple[int, int]:
        """Restores up to `limit` staged blocks whose every chunk was found on some
        server (first copy found wins; the servers holding that same chunk id are its
        replicas) and removes them from the staging table. Returns (restored,
        incomplete); (0, 0) once nothing is staged."""
        groups: dict[bytes, list] = {}
        staged_keys = []
        for key, value in self.db.scan(records.STAGED, start=self._staged_floor):
            entry = records.read_staged(key, value)
            if entry[0] not in groups and len(groups) == limit:
                self._staged_floor = key  # the next block's first entry: nothing is staged below it now
                break
            groups.setdefault(entry[0], []).append(entry)
            staged_keys.append(key)
        if not groups:
            return 0, 0
        restored = incomplete = 0
        now = self.clock()
        # chunks of open allocations belong to writes still under way (or cut short): their
        # writer commits them, or allocation expiry deletes them, so a block made of them
        # here would lose its chunks under it
        open_chunks = self.open_allocation_chunks()
        fulls = list(groups)
        found = []
        for full, raw in zip(fulls, self.blocks.rows(fulls)):
            if raw is not None:
                continue  # metadata has it
            row = self._rebuilt_row(full, groups[full], open_chunks, now)
            if row is None:
                incomplete += 1
            else:
                found.append((full, row))
        # a block goes back under its parent (staged shallower, so restored before it), or not
        # at all: without its prefix no lookup could reach it
        parents = sorted({full[:KEY_BYTES] + row.parent for full, row in found if row.parent})
        stored = dict(zip(parents, self.blocks.live_rows(parents)))
        new, placed = [], {}
        for full, row in found:
            parent = full[:KEY_BYTES] + row.parent if row.parent else None
            if parent is not None:
                raw = stored.get(parent)
                if parent in placed:
                    ok = placed[parent].hash_slot == row.hash_slot and placed[parent].layout == row.layout
                else:
                    ok = raw is not None and records.row_hash_slot(raw) == row.hash_slot and \
                        records.row_layout(raw) == row.layout
                if not ok:
                    incomplete += 1
                    continue
            new.append((full, row))
            placed[full] = row
            restored += 1
        batch = Batch()
        self.blocks.add(batch, new, check_short=True, dense=True)
        for key in staged_keys:
            batch.delete(key)
        self.db.write(batch)
        return restored, incomplete

    def _rebuilt_row(self, full: bytes, entries: list, open_chunks: set[bytes], now: float) -> records.Row | None:
        """A block's row from the chunks a rebuild found of it, or None if some chunk is
        missing, belongs to an open allocation, or does not fit the block's layout."""
        owner = parse_owner(entries[0][7])
        # index -> (chunk id, checksum) -> [chunk id, length, checksum, created, server numbers]: copies
        # of one id with other bytes (written outside a commit) are not replicas of each other
        found: dict[int, dict[tuple[bytes, int], list]] = {}
        for _, index, server, chunk_id, length, checksum, created, _ in entries:
            found.setdefault(index, {}).setdefault((chunk_id, checksum), [chunk_id, length, checksum, created, []])[
                4].append(server)
        # per chunk, the version most servers hold (the first found on a tie)
        chunks = {i: max(versions.values(), key=lambda v: len(v[4])) for i, versions in found.items()}
        if owner is None or any(c[0] in open_chunks for c in chunks.values()) or \
                sorted(chunks) != list(range(owner.chunk_count)):
            return None
        try:
            layout = layout_of(owner.layout)
        except InvalidArgument:
            return None
        spans = layout.chunks(owner.chunk_size or self.cfg.chunk_size)
        if len(spans) != owner.chunk_count or any(chunks[s.index][1] != s.length for s in spans):
            return None
        stored = [(chunks[s.index][0], s.offset, chunks[s.index][1], chunks[s.index][2], chunks[s.index][4])
                  for s in spans]
        ttl_class = owner.ttl_class if owner.ttl_class in self.blocks.ttls else self.cfg.default_ttl_class
        if owner.parent and len(owner.parent) != KEY_BYTES:
            return None
        # records from before owner records named parents name none: such blocks are roots to eviction
        return self.blocks.new_row(full, owner.layout, stored, owner.parent, ttl_class, now,
                                   created=min(c[3] for c in chunks.values()), hash_slot=owner.hash_slot)

    # ---- counters ----------------------------------------------------------

    @property
    def expired_blocks(self) -> int:
        return self.blocks.expired

    @property
    def evicted_blocks(self) -> int:
        return self.blocks.evicted

    @property
    def stranded_blocks(self) -> int:
        return self.blocks.stranded_dropped

    @property
    def blocks_lost(self) -> int:
        return self.blocks.lost

    @property
    def replicas_lost(self) -> int:
        return self.blocks.replicas_lost
