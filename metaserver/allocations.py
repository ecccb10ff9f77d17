"""Writes: allocate chunks for new blocks, then commit them once every replica is written.

Open allocations are few (writes in flight, each gone within
`allocation_timeout`), so they are kept in memory as well as in RocksDB.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field

from kvfs.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvfs.grants import owner_seal
from kvfs.keys import KEY_BYTES
from kvfs.pacing import Gcra
from kvfs.shards import hash_slot
from kvfs.tls import RECEIPT, seal
from kvfs.proto import meta_pb2

from .blocks import BlockTable, footprint, layout_of
from .chains import Placer
from .config import MetaserverConfig
from .db import Batch, MetaDB, OffLoop
from .groups import NO_KEY
from .membership import Membership, ServerState
from .records import ALLOC, ALLOC_SETTLED, Row, read_u64, row_hash_slot, row_layout, u64

log = logging.getLogger(__name__)

COMMIT_PIECE = 64  # blocks a commit decides and writes in one batch, between two turns of the event loop
# ... while lookups keep coming (readsfirst.py), so that a lookup waits less for a piece under way.
# Most of a piece is fixed cost (its reads, its RocksDB write of ~2.4 entries a block, ~7 when this was
# measured, before the replica and expiry indexes named row groups): in-process
# at 300K blocks a 16-block piece took 0.67 ms (p50), an 8-block one 0.51. Pieces of 8 were tried:
# at 1M (kvfs-bench meta) fewer commit steps over 2 ms and the same write rate, but at 10M the
# eviction phase's writes fell from 2,747 to 1,826 blocks/s (each step is followed by the turns and
# the poll gap lookups get) while its 2,000-block hit p99 stayed at 7.7-7.9 ms
COMMIT_PIECE_BESIDE_LOOKUPS = 16
# ... at most: beside lookups a piece is as many blocks as its running mean cost per block says fit in
# a step (slice_seconds()), and no fewer than this. A piece's fixed cost (half a dozen multi-gets, its
# batch write) is most of a small one's: in-process at 200K blocks, 4 blocks took 0.46-0.49 ms (p50),
# 16 took 0.63-0.88 ms. Timed in `kvfs-bench meta --blocks 1M`, 16-block pieces held the loop 1.0-1.2 ms
# on average beside lookups (p90 1.4-1.7), twice the steps' 0.5 ms. With a floor of 4 the pieces
# took 0.62 ms and the writes beside lookups halved (docs/operations.md): 8 is a middle
MIN_COMMIT_PIECE = 8
SETTLE_S_PER_BLOCK = 60e-6  # Allocations.settle_s before a piece measured it
PIECE_COST_WEIGHT = 0.2  # weight of the newest piece in that running mean
# The most one step of work should hold the event loop (checked between blocks): a commit
# building its rows, an allocation placing its blocks, a slice of eviction (state.py)
SLICE_SECONDS = 0.0015
# ... while lookups keep coming (readsfirst.py): a lookup that comes during a step waits for
# its end, so the steps then are shorter, as commit pieces are
SLICE_SECONDS_BESIDE_LOOKUPS = 0.0005


def step_seconds(lookups_coming: bool) -> float:
    """The most the next step should hold the event loop."""
    return SLICE_SECONDS_BESIDE_LOOKUPS if lookups_coming else SLICE_SECONDS

LIVE_ROWS_PIECE = 128  # keys an allocation looks up at a time, off the event loop (two multi-gets)


@dataclass(slots=True)
class Allocation:
    record: meta_pb2.AllocationRecord
    chunk_ids: set[bytes] = field(default_factory=set)
    footprint: int = 0  # what its unsettled blocks will take of capacity once committed, per replica
    committing: bool = False  # a commit of it is under way
    # what it keeps from eviction until it closes (Allocations.pinned): its blocks' parents, which
    # its commit needs. Placed by this process, it holds its placement's pins (its parent and all
    # its keys, those of blocks found present included); read back at start-up, its record's parents.
    pins: Collection[bytes] = ()

    @classmethod
    def of(cls, record: meta_pb2.AllocationRecord) -> Allocation:
        alloc = cls(record, {c.chunk_id for c in record.chunks},
                    pins=[record.namespace_digest + p for p in record.parents if p])
        alloc.footprint = footprint(alloc.unsettled_chunks())
        return alloc

    @staticmethod
    def per_block(record: meta_pb2.AllocationRecord) -> int:
        return len(record.chunks) // max(1, len(record.keys))

    def unsettled_chunks(self) -> list[meta_pb2.StoredChunk]:
        """The chunks of the blocks no commit has settled: garbage if it expires."""
        return list(self.record.chunks[self.record.settled * self.per_block(self.record) :])


class _Allocated:
    """An allocation record's blocks by key: their chunks and parents, read from the
    record when asked for (a commit of 500 blocks spent 1.5 ms making lists up front)."""

    def __init__(self, record: meta_pb2.AllocationRecord):
        self.record = record
        self.per_block = Allocation.per_block(record)
        self.order = {k: i for i, k in enumerate(record.keys)}

    def chunks(self, key: bytes) -> list[meta_pb2.StoredChunk]:
        i = self.order[key] * self.per_block
        return list(self.record.chunks[i : i + self.per_block])

    def parent(self, key: bytes) -> bytes:
        """The key before it (empty: a prompt's first block, or a record from before
        parents were recorded)."""
        i = self.order[key]
        return self.record.parents[i] if i < len(self.record.parents) else b""


def check_keys(keys, what: str, max_keys: int) -> list[bytes]:
    """The keys as a list, once they are few enough (counted before a Python object is
    made for each: a request just under the byte limit holds millions) and well formed."""
    if hasattr(keys, "__len__") and len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys in one {what}; at most {max_keys}")
    keys = list(keys)
    if len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys in one {what}; at most {max_keys}")
    if set(map(len, keys)) - {KEY_BYTES}:
        bad = next(k for k in keys if len(k) != KEY_BYTES)
        raise InvalidArgument(f"block keys must be {KEY_BYTES} bytes; got one of {len(bad)}")
    if NO_KEY in keys:
        raise _no_key(what)
    return keys


def joined_keys(keys, joined: bytes, what: str, max_keys: int) -> bytes:
    """A request's keys joined, from its repeated `keys` (check_keys) or from its
    `joined_keys` (one of the two may be set), once they are few enough and well
    formed. The joined form costs no Python object per key: a 2,000-key
    MatchPrefix's keys took 0.4 ms to check one by one, 10 us joined."""
    if not joined:
        return b"".join(check_keys(keys, what, max_keys))
    if len(keys):
        raise InvalidArgument(f"{what} sets both keys ({len(keys)}) and joined_keys; one of the two")
    n, rest = divmod(len(joined), KEY_BYTES)
    if rest:
        raise InvalidArgument(f"{what}: joined_keys holds {len(joined)} bytes, not a whole number of "
                              f"{KEY_BYTES}-byte keys")
    if n > max_keys:
        raise InvalidArgument(f"{n} keys in one {what}; at most {max_keys}")
    # zero bytes anywhere are rare: only then is each key looked at
    if NO_KEY in joined and any(joined[i : i + KEY_BYTES] == NO_KEY for i in range(0, len(joined), KEY_BYTES)):
        raise _no_key(what)
    return joined


def _no_key(what: str) -> InvalidArgument:  # NO_KEY marks an empty slot in a row group
    return InvalidArgument(f"{what}: a key of {KEY_BYTES} zero bytes is not a block key (keys are blake2b "
                           f"digests, kvfs/keys.py)")


def hash_slot_of(first: bytes, parent: bytes, parent_row: bytes | None, first_key: bytes) -> int:
    """The hash slot of the prompt an allocation's keys (from `first` on) belong to: the
    slot of the prompt's first key (kvfs/shards.py), so that its blocks are all where a
    lookup of it goes. A prompt's first block gives it; else the parent's row as stored,
    where the parent is cached, or else the first key the writer names."""
    if first_key and len(first_key) != KEY_BYTES:
        raise InvalidArgument(f"first_key must be a {KEY_BYTES}-byte block key; got {len(first_key)} bytes")
    if not parent:
        if first_key and first_key != first:
            raise InvalidArgument("first_key differs from keys[0] where parent is empty: keys[0] is the prompt's "
                                  "first block")
        return hash_slot(first)
    if parent_row is not None:
        slot = row_hash_slot(parent_row)
        if first_key and hash_slot(first_key) != slot:
            raise InvalidArgument(f"first_key is not in the hash slot of parent block {parent.hex()[:16]}'s prompt "
                                  f"({hash_slot(first_key)} against {slot})")
        return slot
    if not first_key:
        raise InvalidArgument(f"parent block {parent.hex()[:16]} is not cached and first_key is empty: name the "
                              f"prompt's first key, whose hash slot the blocks go to")
    return hash_slot(first_key)


def same_layout(raw: bytes, layout: meta_pb2.BlockLayout) -> bool:
    """Whether a row (as stored) has this layout."""
    return meta_pb2.BlockLayout.FromString(row_layout(raw)) == layout


class Allocations:
    def __init__(self, cfg: MetaserverConfig, db: MetaDB, members: Membership, blocks: BlockTable,
                 clock: Callable[[], float], key: bytes | None = None):
        self.cfg = cfg
        self.key = key  # the cluster key: seals owner records, checks write receipts; None: --insecure
        self.db = db
        self.members = members
        self.blocks = blocks
        self.clock = clock
        self.piece_blocks: Callable[[], int] = lambda: COMMIT_PIECE  # the next commit piece's size (MetaState's)
        self.settle_s = SETTLE_S_PER_BLOCK  # seconds a commit piece takes per block (running mean)
        self.slice_seconds: Callable[[], float] = lambda: step_seconds(False)  # the next step's time (MetaState's)
        self.open: dict[bytes, Allocation] = {}
        # raises unless this metaserver answers for a hash slot now (sharded.Shards.check): alone, it does
        self.check_slot: Callable[[int], None] = lambda slot: None
        # allocations between their first step and their last: (bytes, blocks to keep), so that
        # writers and eviction running between their steps count them and leave their parents
        self.placing: dict[bytes, tuple[int, set[bytes]]] = {}
        # what both of them pin, counted: eviction asks about a key per victim, and rebuilding the
        # set per call cost 131K steps (40 ms) with 262 allocations of 500 blocks open. A dict, not a
        # Counter: counting 500 keys in and out took 0.45 ms through a Counter, 0.08 through a dict
        self._pins: dict[bytes, int] = {}
        self.write_pace = Gcra(cfg.tenant_write_rate)  # per tenant, in payload bytes of new blocks
        for key, raw in db.scan(ALLOC):
            record = meta_pb2.AllocationRecord.FromString(raw)
            settled = db.get(ALLOC_SETTLED + key[1:])
            if settled is not None:
                record.settled = max(record.settled, read_u64(settled))
            self._opened(key[1:], Allocation.of(record))

    def _opened(self, alloc_id: bytes, alloc: Allocation) -> None:
        self.open[alloc_id] = alloc
        self._pin(alloc.pins, +1)

    def _close(self, alloc_ids: list[bytes]) -> list[Allocation]:
        """Forgets open allocations (their records deleted in one batch, their pins
        counted out); the allocations."""
        batch = Batch()
        for a in alloc_ids:
            batch.delete(ALLOC + a)
            batch.delete(ALLOC_SETTLED + a)
        self.db.write(batch)
        closed = [self.open.pop(a) for a in alloc_ids]
        for alloc in closed:
            self._pin(alloc.pins, -1)
        return closed

    def _pin(self, keys, delta: int) -> None:
        pins, count = self._pins, self._pins.get
        for k in keys:
            if n := count(k, 0) + delta:
                pins[k] = n
            else:
                del pins[k]

    def incoming_bytes(self) -> int:
        """What open allocations, and allocations still being placed, will add to the cache."""
        return sum(a.footprint for a in self.open.values()) + sum(n for n, _ in self.placing.values())

    def tenant_incoming(self, tenant: str) -> int:
        """What a tenant's open allocations will add to the cache once committed."""
        tenant_of = self.blocks.usage.tenant_of
        return sum(a.footprint for a in self.open.values() if tenant_of(a.record.namespace_digest) == tenant)

    def pinned(self) -> set[bytes]:
        """The parents of open allocations' blocks (their commits need them), and the
        blocks of allocations still being placed: a live view (`in` is all it offers
        cheaply), kept up to date as allocations open and close."""
        return self._pins.keys()

    def chunk_ids(self) -> set[bytes]:
        return set().union(*(a.chunk_ids for a in self.open.values()))

    def allocate_steps(self, namespace_digest: bytes, keys: list[bytes], layout_msg, parent: bytes,
                       make_room: Callable[[int], Generator], first_key: bytes = b""):
        """Places the chunks of the keys not committed yet. `parent` is the key before
        keys[0] (empty: keys[0] is a prompt's first block); `first_key`, the prompt's
        first key, whose hash slot holds the prompt (hash_slot_of). A generator that yields
        between steps of placement of at most slice_seconds() (and between eviction slices), so
        a server serves other calls meanwhile; returns the AllocateBlocksReply. Each
        piece places against the servers' free space as it is then, this and other
        allocations' chunks placed so far included."""
        keys = check_keys(keys, "AllocateBlocks", self.cfg.max_keys)
        if parent and len(parent) != KEY_BYTES:
            raise InvalidArgument(f"parent must be a {KEY_BYTES}-byte block key; got {len(parent)} bytes")
        distinct = set(keys)
        if len(distinct) != len(keys) or parent in distinct:  # a block would be its own ancestor
            raise InvalidArgument("a block key appears twice in one AllocateBlocks, or as its parent too: a "
                                  "prompt's chained keys never repeat")
        layout = layout_of(layout_msg)
        if layout.layers > self.cfg.max_layers or layout.payload_bytes > self.cfg.max_block_bytes:
            raise InvalidArgument(f"block layout of {layout.layers} layers and {layout.payload_bytes} bytes; at most "
                                  f"{self.cfg.max_layers} layers and {self.cfg.max_block_bytes} bytes "
                                  f"(max_layers, max_block_bytes)")
        parent_row = None
        if parent:
            (parent_row,) = self.blocks.live_rows([namespace_digest + parent])
            if parent_row is not None and not same_layout(parent_row, layout_msg):
                raise InvalidArgument(f"block layout {layout} differs from the layout of parent block "
                                      f"{parent.hex()[:16]}: a prompt's blocks share one layout")
        slot = hash_slot_of(keys[0], parent, parent_row, first_key) if keys else 0
        self.check_slot(slot)
        self.members.refresh_liveness()
        capacity = self.members.capacity_bytes()
        if not capacity:
            raise Unavailable("no live chunkservers to place blocks on")
        spans = layout.chunks(self.cfg.chunk_size)
        alloc_id = os.urandom(16)
        # its parent and keys pinned from here on: eviction between the steps below must not take a
        # block found present (the reply tells the writer not to write it)
        self.placing[alloc_id] = (0, {namespace_digest + k for k in (parent, *keys) if k})
        self._pin(self.placing[alloc_id][1], +1)
        placed: list[tuple[ServerState, int]] = []  # pending bytes added, undone if this never finishes
        opened = False
        try:
            # an expired block not removed yet is written again (commit replaces it)
            present = yield from self._live_rows_steps([namespace_digest + k for k in keys])
            new = sum(p is None for p in present)
            incoming = new * footprint(spans)
            room = int(self.cfg.evict_high * capacity)
            if incoming > room:  # refused before anything is evicted for it
                raise ResourceExhausted(f"AllocateBlocks of {new} blocks needs {incoming} bytes of cache; the "
                                        f"cache holds {room} bytes below its high watermark")
            tenant = self.blocks.usage.tenant_of(namespace_digest)
            quota = self.cfg.quota_bytes(tenant, capacity)
            if quota is not None and incoming > quota:  # refused before anything is evicted for it, too
                raise ResourceExhausted(f"AllocateBlocks of {new} blocks needs {incoming} bytes of cache; tenant "
                                        f"{tenant!r} may hold {quota} (tenant_quotas)")
            if new and (over := self.write_pace.charge(tenant, new * layout.payload_bytes, self.clock(),
                                                       refuse=True)):
                log.info("tenant %r past its write rate: an allocation of %d blocks refused", tenant, new)
                raise ResourceExhausted(f"tenant {tenant!r} is writing faster than {self.cfg.tenant_write_rate} "
                                        f"bytes/s (tenant_write_rate): AllocateBlocks of {new} blocks refused; "
                                        f"retry in {over:.2f} s")
            self.placing[alloc_id] = (incoming, self.placing[alloc_id][1])
            yield
            # room first: placement then counts the evicted chunks' space as free
            yield from make_room(incoming, tenant)
            reply = yield from self._place(alloc_id, namespace_digest, keys, present, parent, layout_msg, spans,
                                           placed, slot)
            opened = alloc_id in self.open  # with its placement's pins (none if every block was present)
        except BaseException:  # an error, or the call cancelled between steps (GeneratorExit)
            for server, n in placed:
                server.pending_bytes = max(0, server.pending_bytes - n)
            raise
        finally:
            pins = self.placing.pop(alloc_id)[1]
            if not opened:
                self._pin(pins, -1)
        return reply

    def _live_rows_steps(self, fulls: list[bytes]):
        """BlockTable.live_rows(fulls), LIVE_ROWS_PIECE at a time, each piece's rows
        read off the event loop (db.OffLoop: 500 keys not committed yet took 10 ms at
        1M blocks, and a page read from the disk can take a hundred times that). A
        block committed by another writer meanwhile is found absent and allocated
        again, as when it commits between two pieces: the first commit wins."""
        out: list[bytes | None] = []
        for i in range(0, len(fulls), LIVE_ROWS_PIECE):
            piece = fulls[i : i + LIVE_ROWS_PIECE]
            stored = yield OffLoop(self.blocks.rows, (piece,))
            out += self.blocks.live_rows(piece, stored)
        return out

    def _place(self, alloc_id: bytes, namespace_digest: bytes, keys: list[bytes], present, parent: bytes,
               layout_msg, spans, placed: list, slot: int):
        """allocate_steps' placement, a step of at most slice_seconds() at a time, each with the
        chains and free space as of its start; the reply."""
        reply = meta_pb2.AllocateBlocksReply(allocation_id=alloc_id, expires_in_s=self.cfg.allocation_timeout,
                                             chunk_size=self.cfg.chunk_size, hash_slot=slot)
        record = meta_pb2.AllocationRecord(namespace_digest=namespace_digest, layout=layout_msg,
                                           expires_at=self.clock() + self.cfg.allocation_timeout, hash_slot=slot)
        prev = parent
        chunk_ids: set[bytes] = set()
        deadline, fresh = time.perf_counter() + self.slice_seconds(), False
        for i, (key, existing) in enumerate(zip(keys, present)):
            if i and time.perf_counter() > deadline:
                yield
                deadline, fresh = time.perf_counter() + self.slice_seconds(), False
            if not fresh:
                fresh = True
                # servers may have gone silent while other calls ran: chains and free space as of now
                self.members.refresh_liveness()
                live = self.members.live_servers()
                placer = Placer(self.members.chains, {sid: self.members.free_bytes(s) for sid, s in live.items()})
            block = reply.blocks.add(key=key)
            block_parent, prev = prev, key
            if existing is not None:
                block.already_present = True
                continue
            record.keys.append(key)
            record.parents.append(block_parent)
            for index, (span, chain) in enumerate(zip(spans, placer.place_block([s.length for s in spans]))):
                cid = os.urandom(16)
                chunk_ids.add(cid)
                seal = (owner_seal(self.key, namespace_digest + key, index, len(spans), layout_msg,
                                   self.cfg.chunk_size, cid, slot, block_parent) if self.key else b"")
                block.chunks.add(chunk_id=cid, offset=span.offset, length=span.length, servers=chain,
                                 addresses=[live[s].record.address for s in chain],
                                 data_addresses=[live[s].record.data_address for s in chain], owner_seal=seal)
                record.chunks.add(chunk_id=cid, offset=span.offset, length=span.length, servers=chain)
                for s in chain:
                    live[s].pending_bytes += span.length
                    placed.append((live[s], span.length))
        if record.keys:
            yield  # the record's write, in a step of its own
            self.db.put(ALLOC + alloc_id, record.SerializeToString())
            # the placement's pins (its parent, its keys) are the allocation's now: counting 500
            # keys out and their parents back in took 0.4-0.5 ms of this step
            self.open[alloc_id] = Allocation(record, chunk_ids, len(record.keys) * footprint(spans),
                                             pins=self.placing[alloc_id][1])
        return reply

    def commit_steps(self, namespace_digest: bytes, req: meta_pb2.CommitBlocksRequest,
                     discard: Callable[[list], None] = lambda chunks: None,
                     ) -> Generator[None, None, tuple[int, int, list]]:
        """Commits blocks of an allocation; returns (committed, already present, chunks
        that became garbage: those of blocks someone else committed first, and of
        blocks whose parent expired meanwhile, which nothing could reach; each
        piece's are also passed to `discard` as soon as the piece is written, so a
        commit cut short after some pieces does not leave theirs undeleted). A
        generator that yields between steps of at most slice_seconds() building rows,
        then between pieces of piece_blocks() blocks deciding and writing them, and
        before the step that closes the allocation, so a server can serve other calls
        while a large commit builds its rows, then decides and writes them. Each
        piece's decision (first writer wins, parent present) is made in one step with
        its write, so interleaving cannot change it; a commit another call
        interleaves with may see part of this one, a prefix of its blocks, like a
        lookup does."""
        deadline = time.perf_counter() + self.slice_seconds()  # the checks below count towards the first step
        alloc = self.open.get(req.allocation_id)
        if alloc is None:
            raise NotFound("allocation not found: it expired or was committed already; allocate again")
        if alloc.record.namespace_digest != namespace_digest:
            raise FailedPrecondition("allocation belongs to another namespace")
        if alloc.committing:
            raise Aborted("another CommitBlocks of this allocation is under way")
        self.check_slot(alloc.record.hash_slot)  # the slot may have moved since it was allocated
        ttl_class = req.ttl_class or self.cfg.default_ttl_class
        if ttl_class not in self.blocks.ttls:
            raise InvalidArgument(f"unknown TTL class {ttl_class!r}; known: {', '.join(self.blocks.ttls)}")
        record = alloc.record
        of = _Allocated(record)
        if len(req.blocks) > self.cfg.max_keys:
            raise InvalidArgument(f"{len(req.blocks)} blocks in one CommitBlocks; at most {self.cfg.max_keys}")
        keys = check_keys((b.key for b in req.blocks), "CommitBlocks", self.cfg.max_keys)
        order = of.order
        unknown = [k for k in keys if k not in order]
        if unknown:
            raise InvalidArgument(f"block {unknown[0].hex()} is not part of this allocation")
        named = set(keys)
        if len(named) != len(keys):
            raise InvalidArgument("a block key appears twice in one CommitBlocks")
        for block in req.blocks:
            if len(block.chunk_checksums) != of.per_block:
                raise InvalidArgument(f"block {block.key.hex()}: {len(block.chunk_checksums)} checksums "
                                      f"for {of.per_block} chunks")
        blocks = sorted(req.blocks, key=lambda b: order[b.key])  # parents before their children
        # an earlier commit of this allocation, cut short, settled the blocks before
        # `settled`: committed them (their chunks are theirs now; reported as already
        # present) or made them garbage (and queued their chunks for deletion)
        before = sum(order[b.key] < record.settled for b in blocks)
        already = sum(row is not None for row in self.blocks.live_rows([namespace_digest + b.key
                                                                        for b in blocks[:before]]))
        blocks = blocks[before:]
        alloc.committing = True
        try:
            now = self.clock()
            deferred = None  # the last piece's last block, committed with its child to follow (child_next)
            rows: dict[bytes, Row] = {}  # each block's row, should it be committed
            for block in blocks:
                if time.perf_counter() > deadline:
                    yield
                    deadline = time.perf_counter() + self.slice_seconds()
                full = namespace_digest + block.key
                chunks = of.chunks(block.key)
                if self.key:
                    self._check_receipts(block, chunks)
                stored = [(c.chunk_id, c.offset, c.length, xxh, self.members.numbers(c.servers))
                          for c, xxh in zip(chunks, block.chunk_checksums)]
                rows[full] = self.blocks.new_row(full, record.layout, stored, of.parent(block.key), ttl_class, now,
                                                 hash_slot=record.hash_slot)
            # Deciding and writing go a piece at a time too. Each piece is decided against
            # the metadata as it is then and written in one batch with the allocation's
            # count of settled keys: after every piece the metadata is whole, a block is
            # only ever committed over a present parent, and the allocation's expiry, or
            # a retried commit, leaves alone what the pieces so far settled. Room was
            # made when the allocation was placed (it counts as incoming until settled);
            # should capacity have shrunk since, the background pass evicts, not a commit.
            committed, garbage, i, last = 0, [], 0, False
            while not last:
                yield
                n = self.piece_blocks()
                last = i + n >= len(blocks)
                piece, piece_garbage = blocks[i : i + n], []
                # the piece's last block, should the next piece begin with its child, enters no
                # eviction index now, nor is it looked up as that child's parent (BlockTable.add)
                child_next = not last and of.parent(blocks[i + n].key) == piece[-1].key
                began = time.perf_counter()
                added, present, deferred = self._settle(namespace_digest, req.allocation_id, alloc, piece, of,
                                                        named, rows, piece_garbage, last=last,
                                                        child_next=child_next, no_leaf=deferred)
                per_block = (time.perf_counter() - began) / max(1, len(piece))
                self.settle_s += PIECE_COST_WEIGHT * (per_block - self.settle_s)
                discard(piece_garbage)
                garbage += piece_garbage
                committed += added
                already += present
                i += n
            yield  # closing the allocation (its record deleted, its pins counted out) in a step of its own
            self._close_settled(req.allocation_id, alloc)
            return committed, already, garbage
        finally:
            alloc.committing = False
            if deferred is not None:  # cut short before its child's piece (an error, the call cancelled)
                self.blocks.leaf_if_childless(deferred)

    def _close_settled(self, alloc_id: bytes, alloc: Allocation) -> None:
        """Forgets an allocation its commit settled every key of. Should it have expired
        since its last piece, it is gone already, and its expiry freed nothing: nothing
        of it was unsettled."""
        if self.open.get(alloc_id) is alloc:
            self._close([alloc_id])

    def piece_within(self, seconds: float) -> int:
        """Blocks a commit piece settles to end within `seconds` by the running mean of the
        pieces so far: MIN_COMMIT_PIECE to COMMIT_PIECE_BESIDE_LOOKUPS."""
        return max(MIN_COMMIT_PIECE, min(COMMIT_PIECE_BESIDE_LOOKUPS, int(seconds / self.settle_s)))

    def _settle(self, namespace_digest: bytes, alloc_id: bytes, alloc: Allocation, blocks, of: _Allocated,
                named: set[bytes], rows: dict[bytes, Row], garbage: list, last: bool, child_next: bool = False,
                no_leaf: bytes | None = None) -> tuple[int, int, bytes | None]:
        """Decides and writes one piece of a commit (`blocks`, parents before children):
        first writer wins, and a block whose parent is gone is garbage. Returns blocks
        committed, blocks another writer committed first, and, with `child_next` (the
        next piece begins with the child of this one's last block), that block if
        committed: the next piece's `no_leaf` (BlockTable.add). Adds the chunks that
        became garbage to `garbage`, with those of blocks the commit did not name
        (abandoned) up to the piece's end; the `last` piece settles every key of the allocation
        (commit_steps then closes it, in a step of its own)."""
        if self.open.get(alloc_id) is not alloc:
            raise NotFound("allocation not found: it expired while being committed; allocate again")
        fulls = [namespace_digest + b.key for b in blocks]
        stored = self.blocks.rows(fulls)
        present = self.blocks.live_rows(fulls, stored)
        parents = {b.key: of.parent(b.key) for b in blocks}
        outside = sorted({p for p in parents.values() if p})
        parent_present = dict(zip(outside, self.blocks.live_rows([namespace_digest + p for p in outside])))
        new: dict[bytes, Row] = {}
        already = 0
        for block, full, existing, old in zip(blocks, fulls, present, stored):
            if existing is not None:
                already += 1  # first writer wins; this writer's chunks are garbage
                garbage += of.chunks(block.key)
                continue
            if old is not None and not same_layout(old, alloc.record.layout):
                # expired, not removed yet, and its children (which a replacement keeps) have the old
                # layout: a lookup would serve them under this one. Written again once expiry removed it
                garbage += of.chunks(block.key)
                continue
            parent = parents[block.key]
            if parent and namespace_digest + parent not in new and (
                    parent_present.get(parent) is None or not same_layout(parent_present[parent], alloc.record.layout)
                    or row_hash_slot(parent_present[parent]) != alloc.record.hash_slot):
                # its parent expired, was lost, or was written again otherwise (another layout; for the
                # slot: committed meanwhile by a writer that named another first key, so one of them lied)
                garbage += of.chunks(block.key)
                continue
            new[full] = rows[full]
        replaced = {f: Row.decode(raw) for f, raw, live in zip(fulls, stored, present)
                    if raw is not None and live is None and f in new}
        batch = Batch()
        record = alloc.record
        if new:
            layout = layout_of(record.layout)
            self.blocks.usage.written(namespace_digest, len(new), layout.block_tokens, layout.payload_bytes)
        follows = fulls[-1] if child_next and fulls[-1] in new else None
        garbage += self.blocks.add(batch, list(new.items()), replaced, child_next=follows, no_leaf=no_leaf)
        settled = len(record.keys) if last else of.order[blocks[-1].key] + 1
        for key in record.keys[record.settled : settled]:
            if key not in named:
                garbage += of.chunks(key)  # allocated, not named by the commit: abandoned
        alloc.footprint -= footprint(record.chunks[record.settled * of.per_block : settled * of.per_block])
        record.settled = settled
        batch.put(ALLOC_SETTLED + alloc_id, u64(settled))
        self.db.write(batch)
        return len(new), already, follows

    def _check_receipts(self, block: meta_pb2.CommitBlock, chunks) -> None:
        """Every server a chunk of the block was placed on must have sealed a receipt
        for it with the committed checksum (WriteChunkReply.receipt): no block is
        committed whose chunks were never written, or were written with other bytes."""
        receipts = set(block.receipts)
        for c, xxh in zip(chunks, block.chunk_checksums):
            for server in c.servers:
                if seal(self.key, RECEIPT, c.chunk_id, xxh, server) not in receipts:
                    raise FailedPrecondition(f"block {block.key.hex()}: no receipt from {server} for chunk "
                                             f"{c.chunk_id.hex()[:16]} with checksum {xxh:#018x}: it was not "
                                             f"stored there as committed; nothing of this commit was committed")

    def expire(self) -> tuple[int, list]:
        now = self.clock()
        expired = [a for a, alloc in self.open.items() if now > alloc.record.expires_at]
        if not expired:
            return 0, []
        closed = self._close(expired)
        for alloc in closed:
            # a commit cut short between two pieces by a crash may have left the last block it
            # settled out of the eviction index, its child to follow (commit_steps' child_next);
            # one another allocation pins may be that one's, its child to follow still
            r = alloc.record
            if 0 < r.settled < len(r.keys) and r.settled < len(r.parents) \
                    and r.parents[r.settled] == r.keys[r.settled - 1] \
                    and (full := r.namespace_digest + r.keys[r.settled - 1]) not in self._pins:
                self.blocks.leaf_if_childless(full)
        return len(expired), [c for alloc in closed for c in alloc.unsettled_chunks()]
