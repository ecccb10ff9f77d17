"""The metaserver's state: blocks, allocations and servers in RocksDB.

Keys: b"b" + namespace digest + block key -> BlockRecord; b"a" + allocation id
-> AllocationRecord; b"s" + server id -> ServerRecord. Commits, registrations
and allocations are synced RocksDB batches, so an acknowledged commit survives a
crash. What changes on every lookup (a block's last use) is kept in memory and
flushed in batches: losing the last seconds of it costs only TTL precision.

Capacity: an eviction policy (eviction.py) holds every committed block with its
parent, the block before it in its prompt. The set stays closed under "parent
of", since a block is reachable only through its ancestors: eviction takes
leaves first, and a block that expires or is lost takes its descendants along.
Allocations and commits that would take the cache past the high watermark evict
down to the low one first, so a write under pressure displaces old blocks
instead of failing. The delete queue lives here too, so that placement counts
the space of queued deletes as free before heartbeats report it.

All methods are called from the server's event loop; nothing here does network
I/O, and time comes from an injectable clock so expiry is testable.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from kvfs.config import KiB, MiB
from kvfs.errors import FailedPrecondition, InvalidArgument, NotFound
from kvfs.keys import KEY_BYTES
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2

from .chains import Chain, Member, Placer, build_chains
from .config import MetaserverConfig
from .eviction import POLICIES, Policy, Watermarks

log = logging.getLogger(__name__)

_BLOCK, _ALLOC, _SERVER = b"b", b"a", b"s"


def slot_bytes(length: int) -> int:
    """What a chunk takes of a chunkserver's capacity: the power-of-two slot of at
    least 64 KiB it is stored in (chunkserver/slots.py). Eviction counts these, not
    payload bytes: 48 KiB chunks in 64 KiB slots would fill the disks at 75%."""
    return max(64 * KiB, 1 << (length - 1).bit_length())


def footprint(chunks) -> int:
    return sum(slot_bytes(c.length) for c in chunks)


@dataclass(slots=True)
class ServerState:
    record: meta_pb2.ServerRecord
    last_heartbeat: float
    used_bytes: int = 0
    allocated_bytes: int = 0
    chunk_count: int = 0
    pending_bytes: int = 0  # allocated to writers, not yet seen in heartbeats
    # queued for deletion, or deleted since the last heartbeat: placement counts it as
    # free, or writes right after an eviction would be refused until heartbeats catch up
    freeing_bytes: int = 0
    # False from when a server that had gone silent checks in again until its
    # inventory was reconciled against metadata (stale copies deleted); not live meanwhile
    reconciled: bool = True


@dataclass(slots=True)
class Repair:
    """A chunk with fewer live copies than wanted."""

    full_key: bytes  # namespace digest + block key
    index: int
    count: int  # chunks in the block
    chunk: meta_pb2.StoredChunk
    holders: list[str]  # live servers that have it
    record: meta_pb2.BlockRecord


@dataclass(slots=True)
class BlockInfo:
    """What lifecycle needs of every block, kept in memory."""

    last_used: float
    ttl: float
    nbytes: int
    dirty: bool = False


@dataclass(slots=True)
class Allocation:
    record: meta_pb2.AllocationRecord
    chunk_ids: set[bytes] = field(default_factory=set)
    footprint: int = 0  # what its blocks will take of capacity once committed, per replica

    @classmethod
    def of(cls, record: meta_pb2.AllocationRecord) -> Allocation:
        return cls(record, {c.chunk_id for c in record.chunks}, footprint(record.chunks))


def layout_of(msg: meta_pb2.BlockLayout) -> BlockLayout:
    try:
        return BlockLayout(msg.layers, msg.block_tokens, msg.kv_dim, msg.dtype)
    except ValueError as err:
        raise InvalidArgument(f"bad block layout: {err}") from None


class MetaState:
    def __init__(self, cfg: MetaserverConfig, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.clock = clock
        self.ttls = cfg.ttls
        os.makedirs(cfg.data_dir, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self.db = Rdict(os.path.join(cfg.data_dir, "meta"), opts)
        self._sync = WriteOptions()
        self._sync.sync = True
        self.servers: dict[str, ServerState] = {}
        self.blocks: dict[bytes, BlockInfo] = {}
        self.allocations: dict[bytes, Allocation] = {}
        self.chains: list[Chain] = []
        self.policy: Policy = POLICIES[cfg.eviction_policy](Watermarks(cfg.evict_high, cfg.evict_low))
        self.undeleted: dict[str, dict[bytes, int]] = {}  # server id -> chunk id -> bytes: deletes to send
        self.expired_blocks = 0
        self.evicted_blocks = 0
        self.stranded_blocks = 0  # dropped because an ancestor expired or was lost
        self.gc_deleted_chunks = 0
        self.blocks_lost = 0
        self.replicas_lost = 0  # chunk copies servers removed as corrupt
        self._load()

    def _load(self) -> None:
        now = self.clock()
        cached: dict[bytes, tuple[bytes | None, int, float]] = {}  # full key -> (parent, footprint, last use)
        for key, raw in self.db.items():
            kind = key[:1]
            if kind == _SERVER:
                rec = meta_pb2.ServerRecord.FromString(raw)
                # after a restart every known server gets one heartbeat timeout to check in
                self.servers[rec.id] = ServerState(rec, now)
            elif kind == _BLOCK:
                rec = meta_pb2.BlockRecord.FromString(raw)
                full = key[1:]
                self.blocks[full] = BlockInfo(rec.last_used, self._ttl(rec.ttl_class),
                                              sum(c.length for c in rec.chunks))
                parent = full[:-KEY_BYTES] + rec.parent if rec.parent else None
                cached[full] = (parent, footprint(rec.chunks), rec.last_used)
            elif kind == _ALLOC:
                rec = meta_pb2.AllocationRecord.FromString(raw)
                self.allocations[key[1:]] = Allocation.of(rec)
        self._admit_loaded(cached)
        self._rebuild_chains()
        log.info("metadata loaded: %d blocks, %d servers, %d open allocations",
                 len(self.blocks), len(self.servers), len(self.allocations))

    def _admit_loaded(self, cached: dict[bytes, tuple[bytes | None, int, float]]) -> None:
        """Fills the policy with the stored blocks, parents before children, each at
        its last use. Blocks whose parent is gone (nothing could reach them) are dropped."""
        depth: dict[bytes, int | None] = {}  # None: an ancestor is missing
        for full in cached:
            path, k = [], full
            while k is not None and k not in depth and k in cached and len(path) <= len(cached):
                path.append(k)
                k = cached[k][0]
            d = -1 if k is None else depth.get(k) if k in depth else None
            for p in reversed(path):
                d = None if d is None else d + 1
                depth[p] = d
        for full in sorted((k for k, d in depth.items() if d is not None), key=lambda k: (depth[k], cached[k][2])):
            parent, size, last_used = cached[full]
            self.policy.touch(full, parent, size, last_used)
        stranded = [k for k, d in depth.items() if d is None]
        if stranded:
            self.queue_deletes(c for chunks in self._delete_records(stranded).values() for c in chunks)
            self.stranded_blocks += len(stranded)
            log.warning("%d stored blocks had lost an ancestor (unreachable); dropped", len(stranded))

    def close(self) -> None:
        self.flush_last_used()
        self.db.close()

    def _ttl(self, ttl_class: str) -> float:
        return self.ttls.get(ttl_class, self.ttls[self.cfg.default_ttl_class])

    # ---- membership ------------------------------------------------------

    def register(self, req: meta_pb2.RegisterRequest) -> None:
        if not req.server_id or not req.address:
            raise InvalidArgument("Register needs a server_id and an address")
        rec = meta_pb2.ServerRecord(id=req.server_id, address=req.address,
                                    failure_domain=req.failure_domain or "default",
                                    capacity_bytes=req.capacity_bytes, data_address=req.data_address)
        known = self.servers.get(req.server_id)
        if known is None or known.record != rec:
            self.db.put(_SERVER + req.server_id.encode(), rec.SerializeToString(), self._sync)
            log.info("chunkserver %s registered at %s (domain %s, capacity %d)", rec.id, rec.address,
                     rec.failure_domain, rec.capacity_bytes)
        state = self.servers.setdefault(req.server_id, ServerState(rec, self.clock()))
        if not self.is_live(state) and state.reconciled:
            state.reconciled = False  # a restart after silence: same as a heartbeat after silence
            log.info("chunkserver %s is back; it serves again once its chunks are reconciled", req.server_id)
        state.record = rec
        state.last_heartbeat = self.clock()
        self._rebuild_chains()

    def heartbeat(self, req: meta_pb2.HeartbeatRequest) -> bool:
        state = self.servers.get(req.server_id)
        if state is None:
            return False
        was_live = self.is_live(state)
        state.last_heartbeat = self.clock()
        state.used_bytes, state.allocated_bytes = req.used_bytes, req.allocated_bytes
        state.chunk_count = req.chunk_count
        state.record.capacity_bytes = req.capacity_bytes or state.record.capacity_bytes
        state.pending_bytes = 0  # what was pending is in used_bytes now, or was abandoned
        state.freeing_bytes = sum(self.undeleted.get(req.server_id, {}).values())  # the rest is in used_bytes
        if not was_live and state.reconciled:
            # its disk may hold copies re-replicated elsewhere or of blocks dropped meanwhile
            state.reconciled = False
            log.info("chunkserver %s is back; it serves again once its chunks are reconciled", req.server_id)
        return True

    def is_live(self, state: ServerState) -> bool:
        return state.reconciled and self.clock() - state.last_heartbeat <= self.cfg.heartbeat_timeout

    def to_reconcile(self) -> list[str]:
        """Servers back from silence, heartbeating, waiting for reconciliation."""
        now = self.clock()
        return [sid for sid, s in self.servers.items()
                if not s.reconciled and now - s.last_heartbeat <= self.cfg.heartbeat_timeout]

    def reconciled(self, server_id: str) -> None:
        self.servers[server_id].reconciled = True
        log.info("chunkserver %s reconciled; live again", server_id)
        self._rebuild_chains()

    @staticmethod
    def free_bytes(state: ServerState) -> int:
        """Capacity less what the server reported used and what was placed on it since,
        plus what is being deleted from it."""
        return max(0, state.record.capacity_bytes - state.used_bytes - state.pending_bytes + state.freeing_bytes)

    def live_servers(self) -> dict[str, ServerState]:
        return {sid: s for sid, s in self.servers.items() if self.is_live(s)}

    def _rebuild_chains(self) -> None:
        live = self.live_servers()
        chains = build_chains([Member(s.record.id, s.record.failure_domain) for s in live.values()],
                              self.cfg.replicas)
        if chains != self.chains:
            self.chains = chains
            log.info("chain table: %d chains of %d over %d live servers", len(chains), self.cfg.replicas, len(live))

    def refresh_liveness(self) -> None:
        """Drops servers that went silent from the chain table."""
        live = set(self.live_servers())
        if any(s not in live for c in self.chains for s in c) or \
                len(live) != len({s for c in self.chains for s in c}):
            self._rebuild_chains()

    # ---- allocation and commit -------------------------------------------

    def _check(self, keys: Iterable[bytes], what: str) -> list[bytes]:
        keys = list(keys)
        if len(keys) > self.cfg.max_keys:
            raise InvalidArgument(f"{len(keys)} keys in one {what}; at most {self.cfg.max_keys}")
        bad = [k for k in keys if len(k) != KEY_BYTES]
        if bad:
            raise InvalidArgument(f"block keys must be {KEY_BYTES} bytes; got one of {len(bad[0])}")
        return keys

    def allocate(self, namespace_digest: bytes, keys: list[bytes], layout_msg,
                 parent: bytes = b"") -> meta_pb2.AllocateBlocksReply:
        """Places the chunks of the keys not committed yet. `parent` is the key before
        keys[0] (empty: keys[0] is a prompt's first block)."""
        keys = self._check(keys, "AllocateBlocks")
        if parent and len(parent) != KEY_BYTES:
            raise InvalidArgument(f"parent must be a {KEY_BYTES}-byte block key; got {len(parent)} bytes")
        layout = layout_of(layout_msg)
        self.refresh_liveness()
        spans = layout.chunks(self.cfg.chunk_size)
        present = self.db.get([_BLOCK + namespace_digest + k for k in keys])
        new = sum(p is None for p in present)
        # room first: placement then counts the evicted chunks' space as free
        self.make_room(new * footprint(spans), pinned={namespace_digest + k for k in (parent, *keys) if k})
        live = self.live_servers()
        placer = Placer(self.chains, {sid: self.free_bytes(s) for sid, s in live.items()})
        alloc_id = os.urandom(16)
        reply = meta_pb2.AllocateBlocksReply(allocation_id=alloc_id, expires_in_s=self.cfg.allocation_timeout,
                                             chunk_size=self.cfg.chunk_size)
        record = meta_pb2.AllocationRecord(namespace_digest=namespace_digest, layout=layout_msg,
                                           expires_at=self.clock() + self.cfg.allocation_timeout)
        prev = parent
        for key, existing in zip(keys, present):
            block = reply.blocks.add(key=key)
            block_parent, prev = prev, key
            if existing is not None:
                block.already_present = True
                continue
            record.keys.append(key)
            record.parents.append(block_parent)
            for span, chain in zip(spans, placer.place_block([s.length for s in spans])):
                cid = os.urandom(16)
                block.chunks.add(chunk_id=cid, offset=span.offset, length=span.length, servers=chain,
                                 addresses=[live[s].record.address for s in chain])
                record.chunks.add(chunk_id=cid, offset=span.offset, length=span.length, servers=chain)
                for s in chain:
                    live[s].pending_bytes += span.length
        if record.keys:
            self.db.put(_ALLOC + alloc_id, record.SerializeToString(), self._sync)
            self.allocations[alloc_id] = Allocation.of(record)
        return reply

    def commit(self, namespace_digest: bytes, req: meta_pb2.CommitBlocksRequest) -> tuple[int, int, list]:
        """Commits blocks of an allocation; returns (committed, already present,
        chunks that became garbage: those of blocks someone else committed first,
        and of blocks whose parent expired meanwhile, which nothing could reach)."""
        alloc = self.allocations.get(req.allocation_id)
        if alloc is None:
            raise NotFound("allocation not found: it expired or was committed already; allocate again")
        if alloc.record.namespace_digest != namespace_digest:
            raise FailedPrecondition("allocation belongs to another namespace")
        ttl_class = req.ttl_class or self.cfg.default_ttl_class
        if ttl_class not in self.ttls:
            raise InvalidArgument(f"unknown TTL class {ttl_class!r}; known: {', '.join(self.ttls)}")
        chunks_by_key: dict[bytes, list] = {}
        parents: dict[bytes, bytes] = {}  # allocations from before parents were recorded have none: roots
        per_block = len(alloc.record.chunks) // max(1, len(alloc.record.keys))
        for i, key in enumerate(alloc.record.keys):
            chunks_by_key[key] = list(alloc.record.chunks[i * per_block : (i + 1) * per_block])
            parents[key] = alloc.record.parents[i] if i < len(alloc.record.parents) else b""
        keys = self._check((b.key for b in req.blocks), "CommitBlocks")
        unknown = [k for k in keys if k not in chunks_by_key]
        if unknown:
            raise InvalidArgument(f"block {unknown[0].hex()} is not part of this allocation")
        order = {k: i for i, k in enumerate(alloc.record.keys)}
        blocks = sorted(req.blocks, key=lambda b: order[b.key])  # parents before their children
        present = self.db.get([_BLOCK + namespace_digest + b.key for b in blocks])
        now = self.clock()
        batch = WriteBatch(raw_mode=True)
        committed, already, garbage = 0, 0, []
        new_blocks: dict[bytes, tuple[BlockInfo, bytes | None, int]] = {}  # key -> info, full parent, footprint
        for block, existing in zip(blocks, present):
            chunks = chunks_by_key.pop(block.key)
            if len(block.chunk_checksums) != len(chunks):
                raise InvalidArgument(f"block {block.key.hex()}: {len(block.chunk_checksums)} checksums "
                                      f"for {len(chunks)} chunks")
            if existing is not None or block.key in new_blocks:
                already += 1  # first writer wins; this writer's chunks are garbage
                garbage += chunks
                continue
            parent = parents[block.key]
            full_parent = namespace_digest + parent if parent else None
            size = footprint(chunks)
            if parent not in new_blocks and not self.policy.admit(namespace_digest + block.key, full_parent,
                                                                  size, now):
                garbage += chunks  # its parent expired or was lost since the allocation
                continue
            rec = meta_pb2.BlockRecord(ttl_class=ttl_class, created=now, last_used=now, parent=parent)
            for c, xxh in zip(chunks, block.chunk_checksums):
                rec.chunks.add(chunk_id=c.chunk_id, offset=c.offset, length=c.length, checksum=xxh,
                               servers=c.servers)
            rec.layout.CopyFrom(alloc.record.layout)
            batch.put(_BLOCK + namespace_digest + block.key, rec.SerializeToString())
            new_blocks[block.key] = (BlockInfo(now, self._ttl(ttl_class), sum(c.length for c in chunks)),
                                     full_parent, size)
            committed += 1
        for leftover in chunks_by_key.values():  # allocated but not committed: abandoned
            garbage += leftover
        # this allocation still counts as incoming; room was made for it when it was placed,
        # so this evicts only if capacity shrank or other writers got in first
        self.make_room(pinned={p for _, p, _ in new_blocks.values() if p is not None})
        batch.delete(_ALLOC + req.allocation_id)
        self.db.write(batch, self._sync)
        del self.allocations[req.allocation_id]
        for key, (info, full_parent, size) in new_blocks.items():
            self.blocks[namespace_digest + key] = info
            self.policy.touch(namespace_digest + key, full_parent, size, now)
        return committed, already, garbage

    # ---- lookup ----------------------------------------------------------

    def match(self, namespace_digest: bytes, keys: list[bytes]) -> meta_pb2.MatchPrefixReply:
        keys = self._check(keys, "MatchPrefix")
        reply = meta_pb2.MatchPrefixReply()
        if not keys:
            return reply
        now = self.clock()
        live = self.live_servers()
        index: dict[str, int] = {}
        for key, raw in zip(keys, self.db.get([_BLOCK + namespace_digest + k for k in keys])):
            full = namespace_digest + key
            info = self.blocks.get(full)
            if raw is None or info is None or now > info.last_used + info.ttl:
                break
            rec = meta_pb2.BlockRecord.FromString(raw)
            loc = meta_pb2.BlockLocation(key=key, layout=rec.layout)
            readable = True
            for c in rec.chunks:
                replicas = []
                for sid in c.servers:
                    if sid in live:
                        if sid not in index:
                            index[sid] = len(reply.servers)
                            s = live[sid].record
                            reply.servers.add(id=s.id, address=s.address, failure_domain=s.failure_domain,
                                              data_address=s.data_address)
                        replicas.append(index[sid])
                if not replicas:
                    readable = False
                    break
                loc.chunks.add(chunk_id=c.chunk_id, offset=c.offset, length=c.length, checksum=c.checksum,
                               replicas=replicas)
            if not readable:
                break
            reply.blocks.append(loc)
            info.last_used = now
            info.dirty = True
            if full in self.policy:
                self.policy.touch(full, None, 0, now)  # a hit, once per request: eviction keeps what is used
        reply.matched = len(reply.blocks)
        return reply

    def flush_last_used(self) -> int:
        """Persists refreshed last-use times (batched, not synced)."""
        dirty = [k for k, info in self.blocks.items() if info.dirty]
        if not dirty:
            return 0
        batch = WriteBatch(raw_mode=True)
        for full, raw in zip(dirty, self.db.get([_BLOCK + k for k in dirty])):
            info = self.blocks[full]
            info.dirty = False
            if raw is None:
                continue
            rec = meta_pb2.BlockRecord.FromString(raw)
            rec.last_used = info.last_used
            batch.put(_BLOCK + full, rec.SerializeToString())
        self.db.write(batch)
        return len(dirty)

    # ---- chunks lost to corruption -----------------------------------------

    def chunks_lost(self, server_id: str, lost: list[tuple[bytes, meta_pb2.ChunkOwner | None]]) -> list:
        """`server_id` removed these chunks (they failed their checksums). It leaves
        each one's replicas, so lookups stop sending readers there and repair sees
        the chunk short of copies; a block left with a chunk nobody holds is dropped
        (a cache: the next request recomputes it). Returns the chunks of dropped
        blocks, for deletion. Reports are resent until acknowledged: idempotent."""
        wanted: dict[bytes, set[bytes]] = {}
        for chunk_id, owner in lost:
            if owner is None or not owner.block_key:
                log.warning("chunkserver %s lost chunk %s whose owner record names no block; metadata "
                            "may still list the copy (readers sent there get NOT_FOUND and use another)",
                            server_id, chunk_id.hex()[:16])
                continue
            wanted.setdefault(owner.namespace_digest + owner.block_key, set()).add(chunk_id)
        if not wanted:
            return []
        full_keys = list(wanted)
        batch = WriteBatch(raw_mode=True)
        removed, dead = 0, []
        for full, raw in zip(full_keys, self.db.get([_BLOCK + k for k in full_keys])):
            if raw is None:
                continue  # expired, evicted or dropped already, or never committed
            rec = meta_pb2.BlockRecord.FromString(raw)
            gone = [c for c in rec.chunks if c.chunk_id in wanted[full] and server_id in c.servers]
            for c in gone:
                c.servers.remove(server_id)
            if gone:
                removed += len(gone)
                batch.put(_BLOCK + full, rec.SerializeToString())
                if any(not c.servers for c in rec.chunks):
                    dead.append(full)
        if removed:
            self.db.write(batch, self._sync)
            self.replicas_lost += removed
            log.warning("chunkserver %s lost %d chunk copies to corruption; %d blocks left with a chunk "
                        "no server holds", server_id, removed, len(dead))
        return self.drop_lost_blocks(dead)

    # ---- lifecycle -------------------------------------------------------

    def expire_blocks(self) -> list[meta_pb2.StoredChunk]:
        """Removes blocks past their TTL; returns their chunks for deletion (their
        descendants go too, their chunks straight to the delete queue)."""
        now = self.clock()
        expired = [k for k, info in self.blocks.items() if now > info.last_used + info.ttl]
        self.expired_blocks += len(expired)
        return self._drop_blocks(expired)

    def _delete_records(self, full_keys: list[bytes]) -> dict[bytes, list]:
        """Deletes block records in one synced batch; returns each one's chunks."""
        chunks = {}
        batch = WriteBatch(raw_mode=True)
        for full, raw in zip(full_keys, self.db.get([_BLOCK + k for k in full_keys])):
            if raw is not None:
                chunks[full] = list(meta_pb2.BlockRecord.FromString(raw).chunks)
            batch.delete(_BLOCK + full)
            self.blocks.pop(full, None)
        self.db.write(batch, self._sync)
        return chunks

    def _drop_blocks(self, full_keys: list[bytes]) -> list:
        """Removes blocks and, in the same batch, their descendants, which nothing can
        reach without them. Returns the blocks' chunks; the descendants' are queued."""
        if not full_keys:
            return []
        given, stranded = set(full_keys), []
        for full in full_keys:
            stranded += [k for k in self.policy.remove(full) if k not in given]
        chunks = self._delete_records(full_keys + stranded)
        if stranded:
            self.queue_deletes(c for k in stranded for c in chunks.get(k, ()))
            self.stranded_blocks += len(stranded)
            log.info("%d blocks dropped with an ancestor that expired or was lost", len(stranded))
        return [c for k in full_keys for c in chunks.get(k, ())]

    # ---- capacity --------------------------------------------------------

    def capacity_bytes(self) -> int:
        """What blocks may take of the live servers, per replica."""
        return sum(s.record.capacity_bytes for s in self.live_servers().values()) // self.cfg.replicas

    def make_room(self, incoming: int = 0, pinned: set[bytes] = frozenset()) -> int:
        """Evicts if cached blocks, open allocations and `incoming` bytes would pass
        the high watermark: blocks go, leaves first, until all of it is at the low
        one. Blocks in `pinned`, the parents of open allocations' blocks (which
        their commits need), and all their ancestors stay. Returns blocks evicted;
        their records go in one synced batch, their chunks to the delete queue."""
        capacity = self.capacity_bytes()
        incoming += sum(a.footprint for a in self.allocations.values())
        if not capacity or not self.policy.over_high(capacity, incoming):
            return 0
        before = self.policy.used_bytes
        pinned = set(pinned) | {a.record.namespace_digest + p for a in self.allocations.values()
                                for p in a.record.parents if p}
        victims = self.policy.victims(self.policy.bytes_to_low(capacity, incoming), pinned)
        chunks = self._delete_records(victims)
        self.queue_deletes(c for cs in chunks.values() for c in cs)
        self.evicted_blocks += len(victims)
        after = self.policy.used_bytes
        # a warning when nothing could go: every leaf is under a write in flight
        log.log(logging.INFO if victims else logging.WARNING,
                "eviction (%s): %d blocks, %.1f MiB; cache %.1f%% -> %.1f%% of %.1f MiB, %.1f MiB being written",
                self.policy.name, len(victims), (before - after) / MiB, 100 * before / capacity,
                100 * after / capacity, capacity / MiB, incoming / MiB)
        return len(victims)

    def queue_deletes(self, chunks: Iterable[meta_pb2.StoredChunk]) -> None:
        """Chunks to delete from the servers they list; Lifecycle sends the deletes."""
        for c in chunks:
            for sid in c.servers:
                queued = self.undeleted.setdefault(sid, {})
                if c.chunk_id not in queued:
                    queued[c.chunk_id] = c.length
                    if sid in self.servers:
                        self.servers[sid].freeing_bytes += c.length

    def deleted(self, server_id: str, chunk_ids: Iterable[bytes]) -> None:
        """A server acknowledged these deletes (its next heartbeat shows the space free)."""
        queued = self.undeleted.get(server_id, {})
        for cid in chunk_ids:
            queued.pop(cid, None)
        if not queued:
            self.undeleted.pop(server_id, None)

    def expire_allocations(self) -> tuple[int, list]:
        now = self.clock()
        expired = [a for a, alloc in self.allocations.items() if now > alloc.record.expires_at]
        garbage = []
        if expired:
            batch = WriteBatch(raw_mode=True)
            for a in expired:
                garbage += self.allocations.pop(a).record.chunks
                batch.delete(_ALLOC + a)
            self.db.write(batch, self._sync)
        return len(expired), garbage

    def open_allocation_chunks(self) -> set[bytes]:
        return set().union(*(a.chunk_ids for a in self.allocations.values()))

    def is_stale(self, chunk_id: bytes, owner: meta_pb2.ChunkOwner | None, server_id: str) -> bool:
        """Whether a chunk server `server_id` holds belongs to a committed block that lists
        its copies on other servers only (re-replicated while this one was away). Chunks
        metadata knows nothing of are not stale: orphan GC takes them, after its grace."""
        if owner is None:
            return False
        raw = self.db.get(_BLOCK + owner.namespace_digest + owner.block_key)
        if raw is None:
            return False
        return any(c.chunk_id == chunk_id and server_id not in c.servers
                   for c in meta_pb2.BlockRecord.FromString(raw).chunks)

    def is_referenced(self, chunk_id: bytes, owner: meta_pb2.ChunkOwner | None, open_chunks: set[bytes],
                      server_id: str) -> bool:
        """Whether a chunk server `server_id` holds is one of the copies a committed block
        lists, or part of an open allocation."""
        if chunk_id in open_chunks:
            return True
        if owner is None:
            return False
        raw = self.db.get(_BLOCK + owner.namespace_digest + owner.block_key)
        if raw is None:
            return False
        return any(c.chunk_id == chunk_id and server_id in c.servers
                   for c in meta_pb2.BlockRecord.FromString(raw).chunks)

    # ---- replication ----------------------------------------------------

    def under_replicated(self) -> tuple[list[Repair], list[bytes]]:
        """Chunks of committed blocks with fewer live copies than `replicas` (fewest
        first), and the blocks with a chunk that has no live copy at all."""
        live = self.live_servers()
        repairs, lost = [], []
        keys = list(self.blocks)
        for i in range(0, len(keys), 1024):
            part = keys[i : i + 1024]
            for full, raw in zip(part, self.db.get([_BLOCK + k for k in part])):
                if raw is None:
                    continue
                rec = meta_pb2.BlockRecord.FromString(raw)
                wanting = []
                for index, c in enumerate(rec.chunks):
                    holders = [sid for sid in c.servers if sid in live]
                    if not holders:
                        lost.append(full)
                        break
                    if len(holders) < self.cfg.replicas:
                        wanting.append(Repair(full, index, len(rec.chunks), c, holders, rec))
                else:
                    repairs += wanting
        repairs.sort(key=lambda r: len(r.holders))
        return repairs, lost

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
        applied to the record as it is now (a loss report may have come in meanwhile);
        False if the block is gone."""
        raw = self.db.get(_BLOCK + full_key)
        if raw is None:
            return False
        rec = meta_pb2.BlockRecord.FromString(raw)
        for c in rec.chunks:
            if c.chunk_id == chunk_id:
                servers = [s for s in c.servers if s not in gone] + [s for s in added if s not in c.servers]
                del c.servers[:]
                c.servers.extend(servers)
        self.db.put(_BLOCK + full_key, rec.SerializeToString(), self._sync)
        return True

    def drop_lost_blocks(self, full_keys: list[bytes]) -> list:
        """Blocks with a chunk no live server holds: gone from metadata (a cache: the
        next request recomputes them), with their descendants; returns their chunks,
        for deletion (the descendants' are queued here)."""
        garbage = self._drop_blocks(full_keys)
        self.blocks_lost += len(full_keys)
        if full_keys:
            log.warning("%d blocks lost every copy of a chunk; dropped from metadata", len(full_keys))
        return garbage

    def restore_blocks(self, found: dict[bytes, dict]) -> tuple[int, int]:
        """Rebuild: commits blocks whose every chunk was found on some server.

        `found` maps namespace digest + key to {"owner": ChunkOwner, "chunks":
        {index: (chunk_id, length, checksum, created, [server ids])}}.
        """
        restored = incomplete = 0
        batch = WriteBatch(raw_mode=True)
        now = self.clock()
        # chunks of open allocations belong to writes still under way (or cut short): their
        # writer commits them, or allocation expiry deletes them, so a block made of them
        # here would lose its chunks under it
        open_chunks = self.open_allocation_chunks()
        for full, entry in found.items():
            owner, chunks = entry["owner"], entry["chunks"]
            if full in self.blocks:
                continue
            if any(c[0] in open_chunks for c in chunks.values()):
                incomplete += 1
                continue
            if sorted(chunks) != list(range(owner.chunk_count)):
                incomplete += 1
                continue
            layout = layout_of(owner.layout)
            spans = layout.chunks(owner.chunk_size or self.cfg.chunk_size)
            if len(spans) != owner.chunk_count or any(chunks[s.index][1] != s.length for s in spans):
                incomplete += 1
                continue
            rec = meta_pb2.BlockRecord(layout=owner.layout, ttl_class=owner.ttl_class or self.cfg.default_ttl_class,
                                       created=min(c[3] for c in chunks.values()), last_used=now)
            for s in spans:
                cid, length, xxh, _, servers = chunks[s.index]
                rec.chunks.add(chunk_id=cid, offset=s.offset, length=length, checksum=xxh, servers=servers)
            batch.put(_BLOCK + full, rec.SerializeToString())
            self.blocks[full] = BlockInfo(now, self._ttl(rec.ttl_class), layout.payload_bytes)
            # chunk owner records do not name the parent: rebuilt blocks are roots to eviction
            self.policy.touch(full, None, footprint(rec.chunks), now)
            restored += 1
        self.db.write(batch, self._sync)
        return restored, incomplete
