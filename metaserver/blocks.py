"""Committed blocks: rows and their indexes (records.py), and every operation
that reads or changes them.

Each method does work bounded by its arguments (a request's keys, a `limit`),
never by the size of the cache, so the event loop can run it between other
work: background passes call them a slice at a time (lifecycle.py, repair.py).

The cached set stays closed under "parent of" where it matters: only leaves
(blocks without children) are eviction candidates, and a block that expires or
is lost queues its descendants, which nothing can reach any more, to be dropped
in later slices (`drop_stranded`). A hit is recorded in memory (bounded) and
written back in batches once `hit_flush_delay` old (`flush_hits`, hits.py):
losing those seconds of hits to a crash costs only ranking and TTL precision.
"""

from __future__ import annotations

import heapq
import logging
import math
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfs.errors import InvalidArgument
from kvfs.grants import TENANT_ID_BYTES, tenant_id
from kvfs.keys import KEY_BYTES
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2

from .config import MetaserverConfig
from .db import Batch, MetaDB
from .membership import Membership
from . import groups
from .groups import GROUP_SLOTS, group_key
from .hits import PendingHits
from .eviction import ArcPolicy
from .records import (BLOCK, CHILD, COUNTER, EXPIRY, FULL, GHOST, GHOST_ORDER, LOOKUP, ROW, SHORT, TENANT_VICTIM,
                      VICTIM, Row, child_key, expiry_group, expiry_key, frame, location_offset, read_u64, reframe_live,
                      replica_group, replica_key, replica_prefix, reply_layout, reply_tail, row_hash_slot, row_layout,
                      row_parent, row_slot, sortable, u64, victim_key)
from .usage import Usage

log = logging.getLogger(__name__)

LOOKUP_GROUP_BYTES = 8 << 20  # groups one lookup keeps once read
SLOT_SPAN = 1 << 16  # slots between two prompts' first blocks: room for a prompt to grow in place
GHOST_TRIM = 256  # ghosts one commit may forget
REMOVAL_WRITE_S = 20e-6  # BlockTable.removal_write_s before the first slice measured it
WRITE_COST_WEIGHT = 0.2  # weight of the newest slice in that running mean
# Blocks an eviction slice removes (where it needs as many) before its deadline may end it. A
# slice's fixed cost (its read of the index, its row groups rewritten, its batch write) is
# 0.3-0.4 ms at 10M blocks, so beside lookups (0.5 ms steps) a write's slices remove about one
# block each. A floor of 4 evicted faster (in-process 0.14-0.19 ms a block against 0.22-0.28; in
# `kvfs-bench meta --reuse` at 10M an eviction phase of 468-588 s against 687-861) but made the
# allocations' steps longer, and lookups wait behind those: the 2,000-block hit's p99 there was
# 6.0-7.6 ms in three runs against 5.4-6.1 in four with one block (docs/operations.md).
MIN_EVICT_SLICE = 1


def slot_bytes(length: int) -> int:
    """What a chunk takes of a chunkserver's capacity: the power-of-two slot of at
    least 64 KiB it is stored in (chunkserver/slots.py). Eviction counts these, not
    payload bytes: 48 KiB chunks in 64 KiB slots would fill the disks at 75%."""
    return max(64 * 1024, 1 << (length - 1).bit_length())


def footprint(chunks) -> int:
    return sum(slot_bytes(c.length) for c in chunks)


def layout_of(msg: meta_pb2.BlockLayout) -> BlockLayout:
    try:
        return BlockLayout(msg.layers, msg.block_tokens, msg.kv_dim, msg.dtype)
    except ValueError as err:
        raise InvalidArgument(f"bad block layout: {err}") from None


@dataclass(slots=True)
class Repair:
    """A chunk with fewer live copies than wanted."""

    full_key: bytes  # namespace digest + block key
    index: int
    count: int  # chunks in the block
    chunk: meta_pb2.StoredChunk  # servers: ids of every listed copy, live or not
    holders: list[str]  # live servers that have it
    layout: meta_pb2.BlockLayout
    ttl_class: str
    hash_slot: int  # its prompt's, sealed into the new copy's owner record
    parent: bytes = b""  # the block's parent key (sealed too) and depth, for a rebuild
    depth: int = 0


RECENT, FREQUENT = ArcPolicy.RECENT, ArcPolicy.FREQUENT
FREQUENT_VICTIMS = VICTIM + sortable(FREQUENT)  # under arc, the frequent segment's part of the eviction index
ARC_STATE = COUNTER + b"arc"  # arc's target share, blocks in the recent segment, ghosts from it


class Ranks:
    """Eviction ranks, lowest evicted first, by the rules of eviction.py's policies
    (which the trace simulator runs): lru ranks by last use; lfuda by L +
    log2(hits), L rising to each victim's rank, with the hit counts of evicted
    blocks remembered (the ghost, in RocksDB: at most `ghost_factor` x the most
    blocks ever cached) so a prefix that returns resumes its count.

    arc ranks a block RECENT (used once) or FREQUENT: the eviction index then holds
    the recent segment's leaves, least recently used first, before the frequent
    one's (from FREQUENT_VICTIMS on). Which one gives up the next victims is
    ArcPolicy's rule (BlockTable._frequent_first), with the cache's sizes in blocks
    (the most it ever held for the whole), decided once per eviction call, not per
    victim.
    The ghost (twice the most blocks ever cached) tells which segment a returning
    block left from by its hit count. A metaserver switched to arc from another
    policy starts its counts afresh; its old ranks give way as blocks are used."""

    def __init__(self, policy: str, db: MetaDB, ghost_factor: float = 4.0):
        self.policy = policy
        self.db = db
        self.arc = policy == "arc"
        self.remembers = policy in ("lfuda", "arc")
        self.ghost_factor = 2.0 if self.arc else ghost_factor
        raw = db.get(COUNTER + b"aging")
        self.aging = struct.unpack(">d", raw)[0] if raw else 0.0
        raw = db.get(ARC_STATE)
        self.target, self.recent, self.recent_ghosts = struct.unpack(">dqq", raw) if raw and self.arc else (0.5, 0, 0)
        self._stale_arc_state = raw is not None and not self.arc  # other policies delete it (once): stale now

    def rank(self, hits: int, now: float) -> float:
        if self.arc:
            return RECENT if hits < 2 else FREQUENT
        return now if self.policy == "lru" else self.aging + math.log2(max(1, hits))

    def counted(self, rank: float, n: int) -> None:
        """`n` blocks of this rank came (+) or went (-)."""
        if self.arc and rank == RECENT:
            self.recent = max(0, self.recent + n)

    def within_share(self, peak_blocks: int) -> bool:
        """Under arc, whether the recent segment is within its share of the cache."""
        return self.arc and self.recent <= self.target * peak_blocks

    def stage(self, batch: Batch) -> None:
        batch.put(COUNTER + b"aging", struct.pack(">d", self.aging))
        if self.arc:
            batch.put(ARC_STATE, struct.pack(">dqq", self.target, self.recent, self.recent_ghosts))
        elif self._stale_arc_state:
            batch.delete(ARC_STATE)
            self._stale_arc_state = False

    def evicted(self, batch: Batch, full: bytes, row: Row, table: BlockTable) -> None:
        if not self.remembers:
            return
        if self.arc:
            self.recent_ghosts += row.hits < 2
        else:
            self.aging = max(self.aging, row.rank)  # persisted with the batch's counters
        table.ghost_seq += 1
        batch.put(GHOST + full, struct.pack(">IQ", row.hits, table.ghost_seq))
        batch.put(GHOST_ORDER + u64(table.ghost_seq) + full, b"")
        table.ghosts += 1

    def forgotten(self, hits: int, table: BlockTable, returned: bool) -> None:
        """A ghost (of a block evicted with `hits`) is gone: the block `returned`, or
        the ghost was the oldest past the bound. A returning block teaches arc its
        target: ArcPolicy._learn."""
        table.ghosts -= 1
        if not self.arc:
            return
        recent = hits < 2
        self.recent_ghosts = max(0, self.recent_ghosts - recent)
        if returned:
            mine = (self.recent_ghosts if recent else table.ghosts - self.recent_ghosts) + 1
            other = table.ghosts - self.recent_ghosts if recent else self.recent_ghosts
            step = max(other / mine, 1.0) / max(1, table.peak_blocks)
            self.target = min(1.0, self.target + step) if recent else max(0.0, self.target - step)

    def remembered(self, fulls: list[bytes]) -> list[tuple[int, int] | None]:
        """(hit count, ghost sequence) the ghost holds for each of these blocks, or None."""
        if not self.remembers or not fulls:
            return [None] * len(fulls)
        return [struct.unpack(">IQ", raw) if raw else None for raw in self.db.db.get([GHOST + f for f in fulls])]


@dataclass
class Staged:
    """One batch of removals: what it deletes, and what to do once written."""

    batch: Batch = field(default_factory=Batch)
    removed: dict[bytes, Row] = field(default_factory=dict)
    gone_children: dict[bytes, set[bytes]] = field(default_factory=dict)  # parent -> its child keys deleted here
    chunks: list[meta_pb2.StoredChunk] = field(default_factory=list)
    parents: dict[bytes, bytes] = field(default_factory=dict)  # parents' rows read here (eviction pops them next)
    # eviction index entries of parents left without children here, put when the batch is written:
    # an eviction walking back through a prompt removes most of them in the same batch, and an
    # entry put and deleted in one batch would still leave a deleted entry (a tombstone) that
    # every later scan of the index steps over (30 us a step at 1M blocks, from such trails)
    leaves: set[bytes] = field(default_factory=set)


class Reader:
    """The reads of one batch of removals, as the database stood when it began (the
    batch is written at its end): each row group read once, and one iterator for
    every children check. An eviction's victims walk back through a prompt's
    consecutive slots, so one group read serves a run of them, and a parent is
    looked for first in the slot before its child's."""

    __slots__ = ("db", "groups", "_it")

    def __init__(self, db: MetaDB):
        self.db = db
        self.groups: dict[bytes, bytes | None] = {}
        self._it = None

    def row(self, full: bytes, near: int | None = None) -> bytes | None:
        """A block's row as stored (None: not committed); `near`: the slot it likely has."""
        if near is not None and near >= 0 and (raw := self._at(full, near)) is not None:
            return raw
        slot = self.db.get(BLOCK + full)
        return self._at(full, read_u64(slot)) if slot is not None else None

    def _at(self, full: bytes, slot: int) -> bytes | None:
        name = group_key(full[:KEY_BYTES], slot // GROUP_SLOTS)
        try:
            value = self.groups[name]
        except KeyError:
            value = self.groups[name] = self.db.get(name)
        offset = slot % GROUP_SLOTS
        if value is None or value[KEY_BYTES * offset : KEY_BYTES * (offset + 1)] != full[KEY_BYTES:]:
            return None
        return groups.row_at(value, offset)

    def has_children(self, full: bytes, skip: set[bytes]) -> bool:
        """Whether a block has a child other than those in `skip` (child index keys)."""
        prefix = CHILD + full
        if self._it is None:
            self._it = self.db.db.iter()
        it = self._it
        it.seek(prefix)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                return False
            if key not in skip:
                return True
            it.next()
        return False


class Slots:
    """Gives the blocks of one commit their slots (records.py): the slot after the
    parent's when no row holds it, else the start of a fresh run. Blocks come
    parents first, so a prompt written in one or many commits fills consecutive
    slots until it branches from a prompt that took them first."""

    def __init__(self, table: BlockTable):
        self.table = table
        self.of: dict[bytes, int] = {}  # full key -> slot: the commit's parents and the blocks placed so far
        self.claimed: set[tuple[bytes, int]] = set()
        self.free: dict[bytes, tuple[int, int]] = {}  # namespace -> a range of slots known to hold no row

    def place(self, full: bytes, parent: bytes | None, after: int | None = None) -> int:
        """`after`: the slot to follow where the block has no parent here to follow."""
        ns = full[:KEY_BYTES]
        if parent is not None:
            after = self.of.get(parent)
        if after is not None and self._free(ns, after + 1):
            slot = after + 1
        else:
            table = self.table
            while not self._free(ns, table.next_slot):  # a long prompt grew into this run
                table.next_slot += SLOT_SPAN
            slot = table.next_slot
            table.next_slot += SLOT_SPAN
        self.claimed.add((ns, slot))
        return slot

    def _free(self, ns: bytes, slot: int) -> bool:
        if (ns, slot) in self.claimed:
            return False
        lo, hi = self.free.get(ns, (0, 0))
        if not lo <= slot < hi:
            hi = self.table.next_taken(ns, slot)
            self.free[ns] = (slot, hi)
            lo = slot
        return lo <= slot < hi


def _per_namespace(rows: list[tuple[bytes, Row]]) -> dict[bytes, tuple[int, int, int]]:
    """Blocks, payload bytes and footprint per namespace."""
    out: dict[bytes, tuple[int, int, int]] = {}
    for full, row in rows:
        n, nbytes, fp = out.get(full[:KEY_BYTES], (0, 0, 0))
        out[full[:KEY_BYTES]] = (n + 1, nbytes + row.nbytes, fp + row.footprint)
    return out


class BlockTable:
    def __init__(self, cfg: MetaserverConfig, db: MetaDB, members: Membership, clock: Callable[[], float]):
        self.cfg = cfg
        self.db = db
        self.members = members
        self.clock = clock
        self.ttls = cfg.ttls
        self.ranks = Ranks(cfg.eviction_policy, db)
        self.blocks = db.counter(b"blocks")
        self.payload_bytes = db.counter(b"payload")
        self.cache_bytes = db.counter(b"footprint")  # slot bytes per replica: what eviction counts
        self.peak_blocks = db.counter(b"peak")
        self.ghost_seq = db.counter(b"ghost_seq")
        self.ghosts = db.counter(b"ghosts")
        self.next_slot = db.counter(b"next_slot")  # where the next run of slots starts
        # Expiry, eviction and the ghost's order are queues, consumed from the front:
        # in an LSM tree their front is a run of deleted entries (tombstones) until a
        # compaction, and a scan from the start would step over every one of them
        # (0.3 ms per scan after 3,000 evictions; tens of ms after a large eviction).
        # Each scan starts from its floor instead: no entry sorts below it, as every
        # new entry lowers it (leaf(), expires()).
        self.victim_floor, self.expiry_floor, self.ghost_floor = VICTIM, EXPIRY, GHOST_ORDER
        # the same, per tenant index evicted from and for arc's frequent segment
        self.index_floors: dict[bytes, bytes] = {FREQUENT_VICTIMS: FREQUENT_VICTIMS}
        self.hits = PendingHits()  # since the last flush, a run of blocks an entry
        self.stranded: deque[bytes] = deque()  # removed blocks whose children are still to be dropped
        self.expired = self.evicted = self.stranded_dropped = self.lost = self.replicas_lost = 0
        # Seconds an eviction slice's batch write takes per block it removes (a running mean over
        # slices): a slice with a deadline stops removing while its write can still end by then.
        # The write comes after the last removal, and on the event loop it took about as long as
        # the removals before it (a 0.5 ms slice held the loop 0.9 ms, `kvfs-bench meta --blocks 1M`)
        self.removal_write_s = REMOVAL_WRITE_S
        # Whether this metaserver answers for a hash slot now (sharded.Shards.answers): a block
        # filed under one it does not leaves without its chunks, which are another's now
        self.answers: Callable[[int], bool] = lambda slot: True
        self.forgotten = 0  # blocks of slots handed to another metaserver, removed without their chunks
        self.dense_tail: dict[bytes, int] = {}  # per namespace, the slot of the last block a rebuild placed
        self.usage = Usage(db, clock, cfg.usage_max_tenants)  # per tenant, moved with the blocks
        # lookups answered, the keys they asked for and the blocks they matched (metrics.py)
        self.lookups = self.lookup_blocks_requested = self.lookup_blocks_matched = 0

    def __len__(self) -> int:
        return self.blocks

    def _counters(self, batch: Batch) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks)
        for name, value in ((b"blocks", self.blocks), (b"payload", self.payload_bytes),
                            (b"footprint", self.cache_bytes), (b"peak", self.peak_blocks),
                            (b"ghost_seq", self.ghost_seq), (b"ghosts", self.ghosts),
                            (b"next_slot", self.next_slot)):
            batch.put(COUNTER + name, u64(value))
        self.ranks.stage(batch)
        self.usage.stage(batch)

    def ttl_of(self, ttl_class: str) -> float:
        return self.ttls.get(ttl_class, self.ttls[self.cfg.default_ttl_class])

    def rows(self, fulls: list[bytes]) -> list[bytes | None]:
        """These blocks' rows as stored (None for a block not committed). Safe off the
        event loop (db.OffLoop): a slot read before its block was removed and the slot
        given to another block holds that block's key, and counts as no row."""
        if not fulls:
            return []
        slots = [read_u64(s) if s is not None else None for s in self.db.db.get([BLOCK + f for f in fulls])]
        names = list({group_key(f[:KEY_BYTES], s // GROUP_SLOTS) for f, s in zip(fulls, slots) if s is not None})
        values = dict(zip(names, self.db.db.get(names) if names else []))
        out = []
        for full, slot in zip(fulls, slots):
            value = values.get(group_key(full[:KEY_BYTES], slot // GROUP_SLOTS)) if slot is not None else None
            raw = groups.row_at(value, slot % GROUP_SLOTS) if value is not None else None
            out.append(raw if raw is not None and raw[:KEY_BYTES] == full[KEY_BYTES:] else None)
        return out

    def next_taken(self, ns: bytes, slot: int) -> int:
        """The first slot from `slot` on, within its row group, that holds a row of the
        namespace; the slot after the group's last if none does. One point read of the
        group: a scan from it to the next group that holds rows cost a commit piece
        0.1 ms at 10M blocks (its seek reads a data block in every level)."""
        group, offset = divmod(slot, GROUP_SLOTS)
        value = self.db.get(group_key(ns, group))
        base = group * GROUP_SLOTS
        if value is not None:
            for k in groups.occupied(value):
                if k >= offset:
                    return base + k
        return base + GROUP_SLOTS

    def last_use(self, ns: bytes, raw: bytes) -> float:
        """A block's last use: the one its row (as stored) holds, or a hit recorded
        since (not flushed yet)."""
        _, _, stored = LOOKUP.unpack_from(raw, KEY_BYTES)
        hit = self.hits.of(ns, row_slot(raw), raw[:KEY_BYTES])
        return max(stored, hit[1]) if hit else stored

    def hit_since_flush(self, full: bytes, raw: bytes) -> bool:
        """Whether a block (its row as stored) was hit since the last flush."""
        return self.hits.of(full[:KEY_BYTES], row_slot(raw), raw[:KEY_BYTES]) is not None

    def live_rows(self, fulls: list[bytes], stored: list[bytes | None] | None = None) -> list[bytes | None]:
        """rows(), with None also for blocks past their TTL that expiry has not removed yet."""
        now = self.clock()
        out = []
        for full, raw in zip(fulls, self.rows(fulls) if stored is None else stored):
            if raw is not None:
                _, ttl, last_used = LOOKUP.unpack_from(raw, KEY_BYTES)
                if now > last_used + ttl and now > self.last_use(full[:KEY_BYTES], raw) + ttl:
                    raw = None
            out.append(raw)
        return out

    def row(self, full: bytes) -> Row | None:
        (raw,) = self.rows([full])
        return Row.decode(raw) if raw is not None else None

    def leaf(self, batch: Batch, victim: bytes) -> None:
        """Stages an eviction index entry (`victim_key`), and its tenant's copy."""
        batch.put(victim, b"")
        self.victim_floor = min(self.victim_floor, victim)
        if victim.startswith(FREQUENT_VICTIMS):
            self.index_floors[FREQUENT_VICTIMS] = min(self.index_floors[FREQUENT_VICTIMS], victim)
        mine = self.tenant_victim(victim)
        batch.put(mine, b"")
        tid = mine[: len(TENANT_VICTIM) + TENANT_ID_BYTES]
        if tid in self.index_floors:
            self.index_floors[tid] = min(self.index_floors[tid], mine)

    def unleaf(self, batch: Batch, victim: bytes) -> None:
        """Stages the deletion of an eviction index entry and its tenant's copy."""
        batch.delete(victim)
        batch.delete(self.tenant_victim(victim))

    def tenant_victim(self, victim: bytes) -> bytes:
        """An eviction index entry's copy in its tenant's eviction index."""
        return TENANT_VICTIM + self.usage.tenant_id(victim[-FULL:][:KEY_BYTES]) + victim[1:]

    def put_row(self, batch: Batch, full: bytes, row: Row) -> None:
        """Stages a row, and its group's index entries, each put once per batch: one
        per server its chunks are on (records.replica_key), and one at its expiry
        (records.expiry_key). A removal leaves them; repair and expiry trim them."""
        ns, group = full[:KEY_BYTES], row.slot // GROUP_SLOTS
        batch.put_row(ns, row.slot, row.encode())
        batch.marks.update(replica_key(n, ns, group) for n in row.servers)
        expiry = expiry_key(row.last_used + row.ttl, ns, group)
        batch.marks.add(expiry)
        self.expiry_floor = min(self.expiry_floor, expiry)

    def stored_chunks(self, row: Row) -> list[meta_pb2.StoredChunk]:
        return [meta_pb2.StoredChunk(chunk_id=c.chunk_id, offset=c.offset, length=c.length, checksum=c.checksum,
                                     servers=self.members.ids(c.replicas))
                for c in row.block_location().chunks]

    # ---- lookup ----------------------------------------------------------

    def match(self, namespace_digest: bytes, want: bytes) -> tuple[bytes, int, bytes]:
        """The serialized MatchPrefixReply for the longest run of present, unexpired,
        readable blocks from the first of the keys joined in `want`, how many blocks
        that is, and their layout (the first one's, serialized; b"" when none). The reply names the layout once and
        no block's key: every block of a prompt has its parent's layout, and the keys
        are the request's.

        Rows are read a group of 64 slots at a time (groups.py) in slot order from
        the first block's slot: while a prompt's blocks lie in consecutive slots,
        each group's run of them is checked and copied into the reply with a few
        slice operations; where the next key is not in the next slot (a branch),
        one point read finds where that block is. Each block's stored location goes
        into the reply as it is unless one of its group's servers is down."""
        now = self.clock()
        self.members.refresh_liveness()
        live = self.members.live_numbers
        parts: list[bytes] = []
        referenced: set[int] = set()
        db = self.db.db
        n = len(want) // KEY_BYTES

        def key(i: int) -> bytes:
            return want[KEY_BYTES * i : KEY_BYTES * (i + 1)]

        matched, slot, guessed, layout = 0, None, False, b""
        hit: list[tuple[int, int, bytes]] = []  # runs matched: (group, first slot in it, their keys joined)
        value, at = None, -1  # the group last read, and its number
        # groups read, kept for a request that comes back to one (a branch, or keys out of any
        # prompt's order): each is read once, not once per key
        seen: dict[int, bytes] = {}
        seen_bytes = 0
        while matched < n:
            branch = slot is None
            if branch:  # not known to be in the next slot: look up where it is
                raw = db.get(BLOCK + namespace_digest + key(matched))
                if raw is None:
                    break
                slot, guessed = read_u64(raw), False
            group, offset = divmod(slot, GROUP_SLOTS)
            if group != at:
                value, at = seen.get(group) or db.get(group_key(namespace_digest, group)), group
                if value is not None and group not in seen and seen_bytes + len(value) <= LOOKUP_GROUP_BYTES:
                    seen[group], seen_bytes = value, seen_bytes + len(value)
            most = min(GROUP_SLOTS - offset, n - matched)
            run = groups.run_length(value, offset, want, matched, most) if value is not None else 0
            if run == 0:
                if guessed:
                    slot = None
                    continue
                log.error("block %s points at slot %d, which holds no row of it", key(matched).hex(), slot)
                break
            if branch and matched and row_parent(groups.row_at(value, offset)) not in (key(matched - 1), b""):
                break  # the child of another block than the one before it: no prompt goes on here
            readable = self._readable(namespace_digest, value, offset, run, now, live, parts, referenced)
            if readable and not matched:
                layout = row_layout(groups.row_at(value, offset))
            if readable:
                hit.append((group, offset, want[KEY_BYTES * matched : KEY_BYTES * (matched + readable)]))
            matched += readable
            if readable < run:
                break
            slot, guessed = (slot + run, True) if offset + run == GROUP_SLOTS else (None, False)
        self.lookups += 1
        self.lookup_blocks_requested += n
        self.lookup_blocks_matched += matched
        if hit:
            self.hits.record(namespace_digest, hit, now)
        return self._reply(parts, referenced, matched, layout), matched, layout

    def _readable(self, ns: bytes, value: bytes, offset: int, run: int, now: float, live: frozenset[int],
                  parts: list[bytes], referenced: set[int]) -> int:
        """Of the `run` blocks from slot `offset` of a group, how many from the first are
        unexpired and readable; their locations go into `parts`, their servers into
        `referenced`."""
        expires = groups.expiry_times(value, offset, run)
        if now > min(expires):  # past its TTL, unless hit since the last flush
            for k, expiry in enumerate(expires):
                if now > expiry:
                    raw = groups.row_at(value, offset + k)
                    if now > self.last_use(ns, raw) + LOOKUP.unpack_from(raw, KEY_BYTES)[1]:
                        run = k
                        break
        if run == 0:
            return 0
        numbers = groups.server_numbers(value)
        down = len(numbers) - len(live.intersection(numbers))
        if down < groups.fewest_copies(value) or not down:
            # every chunk keeps a live copy: the locations as stored (the reply's server
            # table has an empty entry for a server that is down, which readers skip)
            referenced.update(numbers)
            parts.append(groups.locations(value, offset, run))
            return run
        for k in range(offset, offset + run):  # some chunk may have no live copy: block by block
            raw = groups.row_at(value, k)
            at = location_offset(raw)
            servers = Row.decode(raw).servers
            if live.issuperset(servers):
                parts.append(raw[at:])
            else:
                framed = reframe_live(raw, at, live)
                if framed is None:  # a chunk no live server holds
                    return k - offset
                parts.append(framed)
            referenced.update(live.intersection(servers))
        return run

    def _reply(self, parts: list[bytes], referenced: set[int], matched: int, layout: bytes) -> bytes:
        return (b"".join(parts) + self.members.server_table(referenced) + (reply_layout(layout) if matched else b"")
                + reply_tail(matched))

    def flush_hits(self, limit: int = 4096, age: float = 0.0) -> int:
        """Writes the hits recorded for some groups, those waiting at least `age`
        seconds, at least `limit` blocks' worth where there are as many, into their rows
        and indexes: a later last use (the TTL counts from it) and a new rank. Returns
        blocks written. The rows' fields are written over the old ones in their groups'
        values (groups.with_uses), not decoded and packed again: a 64-block group's
        flush took 2.5 ms that way, 1.4 ms in place (40K blocks, in-process)."""
        if not self.hits:
            return 0
        now = self.clock()
        taken = self.hits.take(limit, now - (0.0 if self.hits.filling else age), now)
        names = [group_key(ns, group) for ns, group, _ in taken]
        values = self.db.db.get(names)
        updates = []  # (group, full key, slot in group, (ttl, last use, depth, hits, created, rank), lookups, last hit)
        blocks = 0
        rests = {}  # group -> where its rows' fields are (groups.uses_at)
        for g, ((ns, group, per_block), value) in enumerate(zip(taken, values)):
            blocks += len(per_block)
            if value is None:
                continue
            rests[g] = groups.uses_at(value)
            for (k, key), (count, last) in per_block.items():
                if value[KEY_BYTES * k : KEY_BYTES * (k + 1)] == key:  # else gone meanwhile
                    updates.append((g, ns + key, k, groups.uses(value, rests[g], k), count, last))
        batch = Batch()
        old_victims = [victim_key(rank, last_used, depth, f)
                       for _, f, _, (_, last_used, depth, _, _, rank), _, _ in updates]
        is_leaf = self.db.db.get(old_victims) if old_victims else []
        changes: dict[int, list] = {}
        for (g, full, k, old, count, last), old_victim, leaf in zip(updates, old_victims, is_leaf):
            ttl, last_used, depth, hits, created, _ = old
            last, hits = max(last, last_used), min(hits + count, 0xFFFF_FFFF)
            rank = self.ranks.rank(hits, last)
            self.ranks.counted(old[5], -1)
            self.ranks.counted(rank, 1)
            if leaf is not None:
                self.unleaf(batch, old_victim)
                self.leaf(batch, victim_key(rank, last, depth, full))
            changes.setdefault(g, []).append((k, (ttl, last, depth, hits, created, rank)))
        for g, changed in changes.items():  # rows rewritten in place: no other change of them is in this batch
            batch.put(names[g], groups.with_uses(values[g], rests[g], changed))
        self.ranks.stage(batch)  # arc's segment sizes moved with the ranks
        self.db.write(batch)
        return blocks

    # ---- commit ----------------------------------------------------------

    def add(self, batch: Batch, new: list[tuple[bytes, Row]], replaced: dict[bytes, Row] | None = None,
            check_short: bool = False, dense: bool = False, child_next: bytes | None = None,
            no_leaf: bytes | None = None) -> list[meta_pb2.StoredChunk]:
        """Stages newly committed blocks (parents before children; each one's parent
        is committed or among `new`) with their index entries. `replaced` are the
        expired rows some of them take the place of (their children stay theirs);
        returns the replaced blocks' chunks, for deletion. With `check_short`, blocks
        with a chunk on fewer than `replicas` servers join repair's queue (placement
        never makes such blocks; a rebuild can find them). With `dense` (a rebuild,
        whose blocks come without parents), blocks without a parent take consecutive
        slots, not a run each: a run of its own per block was a row group per block
        (about 2 KiB of disk, and a group packed whole per block).

        `child_next`: a block of `new` whose child the caller adds in its next batch (a
        commit's next piece): it is not entered in the eviction index (it is pinned
        meanwhile, and soon no leaf), and the next batch passes it as `no_leaf`, a
        committed parent known to have no entry there. Both spare a seek for child
        entries (which no filter rules out: one data block read in every level, 0.12 ms
        at 10M blocks), two of each commit piece's fixed cost. A caller that ends
        without that next batch gives the block its entry (`leaf_if_childless`)."""
        replaced = replaced or {}
        garbage = []
        fresh = dict(new)
        parents_of_new = {f[:KEY_BYTES] + r.parent for f, r in new if r.parent}
        gone_children: set[bytes] = set()  # child entries this batch deletes
        for full, old in replaced.items():
            if old.parent and old.parent != fresh[full].parent:  # written again under another parent
                old_parent = full[:KEY_BYTES] + old.parent
                gone_children.add(child_key(old_parent, full))
                batch.delete(child_key(old_parent, full))
                if old_parent not in fresh and old_parent not in parents_of_new and \
                        not self.db.has_prefix(CHILD + old_parent, gone_children):
                    prow = self.row(old_parent)  # left without children: a leaf again
                    if prow is not None:
                        self.leaf(batch, victim_key(prow.rank, prow.last_used, prow.depth, old_parent))
            self.unleaf(batch, victim_key(old.rank, old.last_used, old.depth, full))
            self.unqueue(batch, full)
            garbage += self.stored_chunks(old)
            self.ranks.counted(old.rank, -1)
            self.blocks -= 1
            self.payload_bytes -= old.nbytes
            self.cache_bytes -= old.footprint
            self.usage.stored(full[:KEY_BYTES], -1, -old.nbytes, -old.footprint)
        # committed parents: a leaf until now leaves the eviction index; depth from its row
        known = [p for p in parents_of_new if p not in fresh]
        depth: dict[bytes, int] = {}
        slots = Slots(self)
        for parent, raw in zip(known, self.rows(known)):
            if raw is None:
                continue
            prow = Row.decode(raw)
            depth[parent] = prow.depth
            slots.of[parent] = prow.slot
            if parent != no_leaf and not self.db.has_prefix(CHILD + parent):
                self.unleaf(batch, victim_key(prow.rank, prow.last_used, prow.depth, parent))
        remembered = self.ranks.remembered([f for f, _ in new])
        consumed = set()
        for (full, row), ghost in zip(new, remembered):
            parent = full[:KEY_BYTES] + row.parent if row.parent else None
            row.depth = depth[full] = depth.get(parent, -1) + 1 if parent else 0
            if ghost is not None:
                row.hits += ghost[0]
                batch.delete(GHOST + full)
                batch.delete(GHOST_ORDER + u64(ghost[1]) + full)
                consumed.add(full)
                self.ranks.forgotten(ghost[0], self, returned=True)
            row.rank = self.ranks.rank(row.hits, row.last_used)
            self.ranks.counted(row.rank, 1)
            old = replaced.get(full)
            tail = self.dense_tail.get(full[:KEY_BYTES]) if dense and parent is None else None
            row.slot = old.slot if old is not None else slots.place(full, parent, tail)
            if dense and parent is None:
                self.dense_tail[full[:KEY_BYTES]] = row.slot
            slots.of[full] = row.slot
            if old is None:
                batch.put(BLOCK + full, u64(row.slot))
            self.put_row(batch, full, row)
            if parent is not None:
                batch.put(child_key(parent, full), b"")
            # a leaf, unless children of an earlier life of this block are still stored
            if full not in parents_of_new and full != child_next and \
                    not self.db.has_prefix(CHILD + full, gone_children):
                self.leaf(batch, victim_key(row.rank, row.last_used, row.depth, full))
            if check_short and any(len(c.replicas) < self.cfg.replicas for c in row.block_location().chunks):
                batch.put(SHORT + full, b"")  # found short of copies: repair adds them
            self.blocks += 1
            self.payload_bytes += row.nbytes
            self.cache_bytes += row.footprint
        for ns, (n, nbytes, fp) in _per_namespace(new).items():
            self.usage.stored(ns, n, nbytes, fp)
        self._trim_ghosts(batch, consumed)
        self._counters(batch)
        return garbage

    def leaf_if_childless(self, full: bytes) -> None:
        """Enters a committed block without children in the eviction index (add()'s
        `child_next` whose child never came); nothing for one that has children or is gone."""
        raw = self.rows([full])[0]
        if raw is None or self.db.has_prefix(CHILD + full):
            return
        row = Row.decode(raw)
        batch = Batch()
        self.leaf(batch, victim_key(row.rank, row.last_used, row.depth, full))
        self.db.write(batch)

    def _trim_ghosts(self, batch: Batch, consumed: set[bytes]) -> None:
        """Forgets the oldest ghosts past the bound, at most GHOST_TRIM per call (a
        commit's worth of work; the next commits take the rest)."""
        over = min(GHOST_TRIM, self.ghosts - max(1024, int(self.ranks.ghost_factor * self.peak_blocks)))
        if over <= 0:
            return
        for key, _ in self.db.scan(GHOST_ORDER, start=self.ghost_floor, limit=over):
            full = key[-FULL:]
            batch.delete(key)
            self.ghost_floor = key + b"\x00"  # sequence numbers only grow: nothing comes in below
            if full in consumed:
                continue
            raw = self.db.get(GHOST + full)
            if raw is not None and struct.unpack(">IQ", raw)[1] == struct.unpack_from(">Q", key, 1)[0]:
                batch.delete(GHOST + full)
                self.ranks.forgotten(struct.unpack(">IQ", raw)[0], self, returned=False)

    # ---- removal ---------------------------------------------------------

    def remove(self, staged: Staged, full: bytes, row: Row, *, stranding: bool,
               reader: Reader | None = None) -> bytes | None:
        """Stages the removal of one block: its row, its index entries, its place among
        its parent's children. With `stranding`, its children (if any) are queued to
        be dropped after it. Returns its parent's eviction index key if the parent
        is left without children (a leaf now, an eviction candidate). `reader`: the
        batch's reads, where one serves many removals (eviction); else one for this one."""
        b = staged.batch
        b.delete(BLOCK + full)
        b.delete_row(full[:KEY_BYTES], row.slot)
        vkey = victim_key(row.rank, row.last_used, row.depth, full)
        if vkey in staged.leaves:
            staged.leaves.discard(vkey)  # a leaf since earlier in this batch: never stored
        else:
            self.unleaf(b, vkey)
        self.unqueue(b, full)
        staged.removed[full] = row
        if self.answers(row.hash_slot):
            staged.chunks += self.stored_chunks(row)
        self.ranks.counted(row.rank, -1)
        self.blocks -= 1
        self.payload_bytes -= row.nbytes
        self.cache_bytes -= row.footprint
        self.usage.stored(full[:KEY_BYTES], -1, -row.nbytes, -row.footprint)
        if stranding and self.db.has_prefix(CHILD + full):
            self.stranded.append(full)
        if not row.parent:
            return None
        parent = full[:KEY_BYTES] + row.parent
        ck = child_key(parent, full)
        b.delete(ck)
        gone = staged.gone_children.setdefault(parent, set())
        gone.add(ck)
        reader = reader or Reader(self.db)
        if parent in staged.removed or reader.has_children(parent, gone):
            return None
        raw = reader.row(parent, near=row.slot - 1)  # a prompt's blocks take consecutive slots
        if raw is None:
            return None
        staged.parents[parent] = raw
        prow = Row.decode(raw)
        vkey = victim_key(prow.rank, prow.last_used, prow.depth, parent)
        staged.leaves.add(vkey)
        return vkey

    def write(self, staged: Staged) -> None:
        for vkey in staged.leaves:
            self.leaf(staged.batch, vkey)
        staged.leaves.clear()
        self._counters(staged.batch)
        self.db.write(staged.batch)

    def drop(self, fulls: list[bytes]) -> list[meta_pb2.StoredChunk]:
        """Removes these blocks now (their descendants in later slices); their chunks."""
        staged = Staged()
        for full, raw in zip(fulls, self.rows(fulls)):
            if raw is not None and full not in staged.removed:
                self.remove(staged, full, Row.decode(raw), stranding=True)
        self.write(staged)
        return staged.chunks

    def forget(self, slots: set[int], after: bytes = ROW, limit: int = 16) -> tuple[int, bytes | None]:
        """Removes the rows filed under hash `slots` that this metaserver no longer
        answers for, and none of their chunks (another metaserver holds those slots and
        serves the chunks now), scanning up to `limit` row groups from `after`. A
        prompt's blocks share its slot, so its whole tree goes. Returns (blocks
        forgotten, where the next scan starts; None once every group was looked at)."""
        staged, reader = Staged(), Reader(self.db)
        at: bytes | None = None
        for i, (name, value) in enumerate(self.db.scan(ROW, start=after)):
            if i == limit:
                at = name
                break
            ns = name[len(ROW) : len(ROW) + KEY_BYTES]
            for k in groups.occupied(value):
                raw = groups.row_at(value, k)
                slot = row_hash_slot(raw)
                if slot in slots and not self.answers(slot) and ns + raw[:KEY_BYTES] not in staged.removed:
                    self.remove(staged, ns + raw[:KEY_BYTES], Row.decode(raw), stranding=False, reader=reader)
        self.write(staged)
        self.forgotten += len(staged.removed)
        return len(staged.removed), at

    def drop_stranded(self, limit: int = 1024) -> list[meta_pb2.StoredChunk]:
        """Drops up to `limit` descendants of removed blocks (unreachable without them);
        their chunks. A removed block committed again meanwhile keeps its children."""
        staged = Staged()
        while self.stranded and len(staged.removed) < limit:
            parent = self.stranded[0]
            if self.db.get(BLOCK + parent) is not None:
                self.stranded.popleft()  # committed again: its children are reachable
                continue
            room = limit - len(staged.removed)
            children = [parent[:KEY_BYTES] + k[-KEY_BYTES:] for k, _ in self.db.scan(CHILD + parent, limit=room)]
            for child, raw in zip(children, self.rows(children)):
                staged.batch.delete(child_key(parent, child))
                if raw is not None and child not in staged.removed:
                    self.remove(staged, child, Row.decode(raw), stranding=True)
            if len(children) < room:
                self.stranded.popleft()
            self.write(staged)  # before the next scan, which must not see these children again
            staged.batch = Batch()
        self.write(staged)
        self.stranded_dropped += len(staged.removed)
        return staged.chunks

    def expire(self, limit: int = 1024) -> list[meta_pb2.StoredChunk]:
        """Removes blocks past their TTL, soonest due first, a row group at a time from
        the expiry index, until `limit` blocks went or `limit` entries were read; their
        chunks. Each entry read is deleted, and one put for its group at the soonest
        expiry of the rows left (a row hit since the last flush stays, its group to be
        visited again from the next second: the flush moves its expiry)."""
        now = self.clock()
        due_keys = [k for k, _ in self.db.scan(EXPIRY, start=self.expiry_floor, limit=limit,
                                               stop=EXPIRY + u64(int(now)))]
        if due_keys:
            self.expiry_floor = due_keys[0]  # what lies below is deleted entries only
        staged = Staged()
        again: dict[tuple[bytes, int], float] = {}  # group -> when to visit it next
        for key in due_keys:
            ns, group = expiry_group(key)
            staged.batch.delete(key)
            value = self.db.get(group_key(ns, group))
            if value is None:
                continue  # every row of the group went meanwhile
            soonest = math.inf
            for k, expires_at in groups.expiries(value):
                full = ns + value[KEY_BYTES * k : KEY_BYTES * (k + 1)]
                if full in staged.removed:
                    continue
                if now > expires_at:
                    raw = groups.row_at(value, k)
                    if not self.hit_since_flush(full, raw):
                        self.remove(staged, full, Row.decode(raw), stranding=True)
                        continue
                    expires_at = now + 1  # hit meanwhile: flush_hits moves its expiry
                soonest = min(soonest, expires_at)
            if soonest < math.inf:
                again[(ns, group)] = min(again.get((ns, group), math.inf), soonest)
            if len(staged.removed) >= limit:
                break
        for (ns, group), at in again.items():
            staged.batch.marks.add(expiry_key(at, ns, group))
        self.write(staged)
        self.expired += len(staged.removed)
        return staged.chunks

    def evict(self, nbytes: int, pinned: set[bytes], limit: int, tenant: str | None = None,
              deadline: float | None = None) -> tuple[int, list[meta_pb2.StoredChunk]]:
        """Evicts leaves, lowest rank first, each before its parent, until `nbytes`
        are freed or `limit` blocks went, or (with `deadline`, a perf_counter time)
        time is up, MIN_EVICT_SLICE blocks at least (or 64 candidates looked at).
        Blocks in `pinned`, their ancestors and blocks hit since the last flush stay.
        With `tenant`, only that tenant's blocks go, taken from its own index (under
        arc, its recent segment first). Returns (blocks, their chunks)."""
        if tenant is None and self._frequent_first():
            n, chunks, freed = self._evict(FREQUENT_VICTIMS, nbytes, pinned, limit, None, deadline)
            if freed >= nbytes or n >= limit or (n and deadline is not None and time.perf_counter() > deadline):
                return n, chunks
            # no frequent block is a leaf (or none could go): the recent segment gives up the rest
            more, more_chunks, _ = self._evict(VICTIM, nbytes - freed, pinned, limit - n, None, deadline)
            return n + more, chunks + more_chunks
        index = VICTIM if tenant is None else TENANT_VICTIM + tenant_id(tenant)
        n, chunks, _ = self._evict(index, nbytes, pinned, limit, tenant, deadline)
        return n, chunks

    def _frequent_first(self) -> bool:
        """Whether arc's frequent segment gives up the next victims: the recent one is
        within its share and the frequent one's oldest leaf is older than its own
        (their index entries' last use, as sortable bytes: byte order is time order)."""
        if not self.ranks.within_share(self.peak_blocks):
            return False
        frequent = next(self.db.scan(FREQUENT_VICTIMS, start=self.index_floors[FREQUENT_VICTIMS], limit=1), None)
        if frequent is None:
            return False
        recent = next(self.db.scan(VICTIM, start=self.victim_floor, stop=FREQUENT_VICTIMS, limit=1), None)
        at = slice(len(FREQUENT_VICTIMS), len(FREQUENT_VICTIMS) + 8)
        return recent is None or frequent[0][at] < recent[0][at]

    def _evict(self, index: bytes, nbytes: int, pinned: set[bytes], limit: int, tenant: str | None,
               deadline: float | None) -> tuple[int, list[meta_pb2.StoredChunk], int]:
        """evict(), from the entries under `index` (the eviction index, arc's frequent
        part of it, or a tenant's) and the parents they leave as leaves; also the
        bytes freed."""
        staged = Staged()
        reader = Reader(self.db)
        floor = self.victim_floor if index == VICTIM else self.index_floors.get(index, index)
        entries = (k for k, _ in self.db.scan(index, start=floor))  # read one at a time, as needed
        ahead, unread = next(entries, None), False  # the index's next entry not yet taken
        if ahead is not None:  # what lies below is deleted entries only
            if index == VICTIM:
                self.victim_floor = ahead
            else:
                self.index_floors[index] = ahead
        base = VICTIM if tenant is None else index  # where an entry's rank begins
        run = len(base) + 16  # an entry's rank and last use: a commit's run of blocks shares them
        last = b""  # the candidate taken last
        freed = 0
        heap: list[bytes] = []  # candidates: parents that became leaves
        became: set[bytes] = set()  # those parents (their entries are in the batch, not the database yet)
        examined = 0
        while freed < nbytes and len(staged.removed) < limit:
            # out of time once MIN_EVICT_SLICE blocks went, or once many candidates could not go (hit,
            # pinned): those stay at the front of the index until their hits are flushed, and are not
            # to be read again and again within one slice
            if deadline is not None and (len(staged.removed) >= MIN_EVICT_SLICE or examined >= 64) and \
                    time.perf_counter() + len(staged.removed) * self.removal_write_s > deadline:
                break
            examined += 1
            # the lowest candidate: a parent from the heap, or the index's next entry if that sorts lower.
            # A parent of the run just taken from goes first without reading the index on: stepping to
            # the index's next live entry crosses the deleted entries of the runs evicted before (a
            # RocksDB iterator steps over each), and no other entry sorts inside the run
            if heap and last and heap[0][:run] == last[:run]:
                key = heapq.heappop(heap)
            else:
                if unread:
                    ahead, unread = next(entries, None), False
                if ahead is not None and (not heap or ahead < heap[0]):
                    key, unread = ahead, True
                elif heap:
                    key = heapq.heappop(heap)
                else:
                    break
            last = key
            vkey = key if tenant is None else VICTIM + key[len(index) :]
            full = vkey[-FULL:]
            if full in pinned or full in staged.removed:
                continue
            if tenant is not None and self.usage.tenant_of(full[:KEY_BYTES]) != tenant:
                continue  # another tenant whose name hashes alike: not ours to evict
            raw = staged.parents.pop(full, None) or reader.row(full)
            if raw is not None and self.hit_since_flush(full, raw):
                continue
            row = Row.decode(raw) if raw is not None else None
            # a tenant's copy must have its entry in the main index: a leaf still (copies can outlive
            # their entries where a namespace's tenant became known after its blocks were cached)
            if row is None or (tenant is not None and vkey not in became and self.db.get(vkey) is None):
                self.unleaf(staged.batch, vkey)  # a stale entry
                continue
            leaf = self.remove(staged, full, row, stranding=False, reader=reader)
            if leaf is not None:
                became.add(leaf)
                heapq.heappush(heap, leaf if tenant is None else self.tenant_victim(leaf))
            self.ranks.evicted(staged.batch, full, row, self)
            freed += row.footprint
        began = time.perf_counter()
        self.write(staged)
        if staged.removed:
            per_block = (time.perf_counter() - began) / len(staged.removed)
            self.removal_write_s += WRITE_COST_WEIGHT * (per_block - self.removal_write_s)
        self.evicted += len(staged.removed)
        return len(staged.removed), staged.chunks, freed

    # ---- replicas --------------------------------------------------------

    def blocks_on(self, server: int, after: bytes = b"", limit: int = 1024) -> tuple[list[bytes], bytes | None]:
        """Blocks with a copy of some chunk on server number `server`, a row group at a
        time from the replica index entry after `after`, until `limit` blocks or groups:
        (blocks, the last entry read, None once there is none). An entry whose group
        holds no such block any more (its blocks went, or moved their copies) is deleted."""
        prefix = replica_prefix(server)
        start = after + b"\x00" if after else prefix
        fulls, stale, last = [], [], None
        for key, _ in self.db.scan(prefix, start=start, limit=limit):
            ns, group = replica_group(key)
            value = self.db.get(group_key(ns, group))
            keys = groups.keys_on(value, server) if value is not None else []
            if not keys:
                stale.append(key)
            fulls += [ns + k for k in keys]
            last = key
            if len(fulls) >= limit:
                break
        if stale:
            batch = Batch()
            for key in stale:
                batch.delete(key)
            self.db.write(batch)
        return fulls, last

    def unqueue(self, batch: Batch, full: bytes) -> None:
        """Takes a removed block off repair's queue, if it is on it. Never a blind
        delete: every removed block leaving a tombstone at the queue's front made each
        repair round's scan of it (short_blocks) step over all of them, ~100 ms on the
        event loop every 2 s after 400K evictions at 10M blocks."""
        if self.db.get(SHORT + full) is not None:
            batch.delete(SHORT + full)

    def short_blocks(self, limit: int = 1024, after: bytes = b"") -> list[bytes]:
        """Blocks known short of copies (repair's queue), in key order after `after`."""
        start = SHORT + after + b"\x00" if after else SHORT
        return [k[1:] for k, _ in self.db.scan(SHORT, start=start, limit=limit)]

    def check_replicas(self, fulls: list[bytes]) -> tuple[list[Repair], list[bytes], list[bytes]]:
        """For these blocks: the chunks short of live copies, the blocks with a chunk
        no live server holds, and the blocks fully replicated (off repair's queue)."""
        live = self.members.live_numbers
        repairs, lost, whole = [], [], []
        for full, raw in zip(fulls, self.rows(fulls)):
            if raw is None:
                whole.append(full)
                continue
            row = Row.decode(raw)
            loc = row.block_location()
            wanting = []
            for index, c in enumerate(loc.chunks):
                holders = [n for n in c.replicas if n in live]
                if not holders:
                    lost.append(full)
                    break
                if len(holders) < self.cfg.replicas:
                    chunk = meta_pb2.StoredChunk(chunk_id=c.chunk_id, offset=c.offset, length=c.length,
                                                 checksum=c.checksum, servers=self.members.ids(c.replicas))
                    wanting.append(Repair(full, index, len(loc.chunks), chunk, self.members.ids(holders),
                                          loc.layout, row.ttl_class, row.hash_slot, row.parent, row.depth))
            else:
                if wanting:
                    repairs += wanting
                else:
                    whole.append(full)
        return repairs, lost, whole

    def replicated(self, fulls: list[bytes]) -> None:
        """Takes blocks off repair's queue."""
        if fulls:
            batch = Batch()
            for f in fulls:
                batch.delete(SHORT + f)
            self.db.write(batch)

    def update_replicas(self, full: bytes, chunk_id: bytes, added: list[int], gone: list[int]) -> bool:
        """One chunk of a block gained copies on `added` and lost those on `gone` (server
        numbers), applied to the row as it is now; False if the block is gone."""
        row = self.row(full)
        if row is None:
            return False
        loc = row.block_location()
        for c in loc.chunks:
            if c.chunk_id == chunk_id:
                servers = [s for s in c.replicas if s not in gone] + [s for s in added if s not in c.replicas]
                del c.replicas[:]
                c.replicas.extend(servers)
        self._rewrite(full, row, loc)
        return True

    def _rewrite(self, full: bytes, row: Row, loc: meta_pb2.BlockLocation, batch: Batch | None = None) -> None:
        own = batch is None
        batch = Batch() if own else batch
        row.set_location(loc)
        if any(len(c.replicas) < self.cfg.replicas for c in loc.chunks):
            batch.put(SHORT + full, b"")
        self.put_row(batch, full, row)
        if own:
            self.db.write(batch)

    def lose_copies(self, server: int, wanted: dict[bytes, set[bytes]]) -> tuple[int, list[bytes]]:
        """Server number `server` removed these chunks (full key -> chunk ids). Returns
        (copies removed, blocks left with a chunk nobody holds)."""
        fulls = list(wanted)
        batch = Batch()
        removed, dead = 0, []
        for full, raw in zip(fulls, self.rows(fulls)):
            if raw is None:
                continue  # expired, evicted or dropped already, or never committed
            row = Row.decode(raw)
            loc = row.block_location()
            gone = [c for c in loc.chunks if c.chunk_id in wanted[full] and server in c.replicas]
            for c in gone:
                c.replicas.remove(server)
            if gone:
                removed += len(gone)
                self._rewrite(full, row, loc, batch)
                if any(not c.replicas for c in loc.chunks):
                    dead.append(full)
        self.db.write(batch)
        self.replicas_lost += removed
        return removed, dead

    def holds(self, full: bytes, chunk_id: bytes, server: int) -> bool | None:
        """Whether the block lists a copy of `chunk_id` on server number `server`;
        None if the block or the chunk is unknown."""
        row = self.row(full)
        if row is None:
            return None
        for c in row.block_location().chunks:
            if c.chunk_id == chunk_id:
                return server in c.replicas
        return None

    def new_row(self, full: bytes, layout: meta_pb2.BlockLayout, chunks, parent: bytes, ttl_class: str,
                now: float, created: float | None = None, hash_slot: int = 0) -> Row:
        """A row for a block about to be committed; `chunks` are (chunk_id, offset,
        length, checksum, server numbers); `hash_slot`, its prompt's."""
        loc = meta_pb2.BlockLocation(chunks=[meta_pb2.ChunkLocation(chunk_id=cid, offset=offset, length=length,
                                                                    checksum=checksum, replicas=servers)
                                             for cid, offset, length, checksum, servers in chunks])
        return Row(ttl=int(self.ttl_of(ttl_class)), depth=0, hits=1, created=now if created is None else created,
                   last_used=now, rank=0.0, footprint=sum(slot_bytes(c[2]) for c in chunks),
                   nbytes=sum(c[2] for c in chunks), parent=parent,
                   servers=tuple(sorted({s for c in chunks for s in c[4]})), ttl_class=ttl_class,
                   location=frame(loc), layout=layout.SerializeToString(), key=full[KEY_BYTES:],
                   copies=min((len(c[4]) for c in chunks), default=0), hash_slot=hash_slot)
