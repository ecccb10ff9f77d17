"""How the metaserver's state is laid out in RocksDB: one table per key prefix.

Nothing here is held in memory per block. A block is one row plus a few index
entries, each a key whose order does a job, so every background pass is a
range scan that starts where the work is:

    b ns key                  -> slot   where a block's row is (8 bytes)
    l ns group                -> the rows of slots 64 x group .. 64 x group + 63 (groups.py)
    c ns parent child         -> b""   children of a block: leaves, descendants
    x expiry ns group         -> b""   TTL: row groups to visit for rows due by then, soonest first
    v rank last depth ns key  -> b""   eviction: cached leaves, first victim first
    w tenant rank last depth ns key -> b""   the same, per tenant (an 8-byte hash of its name): quotas
    r server ns group         -> b""   row groups that may hold a block with a copy on a server
    u ns key                  -> b""   blocks known short of copies (repair's queue)
    g ns key                  -> hits  ghost: hit counts of evicted blocks (LFU-DA)
    h seq ns key              -> b""   the ghost's order, oldest first (trimmed from the front)
    t ns key index server     -> chunk  rebuild's staging: chunks found in inventories, a block's together
    a allocation id           -> AllocationRecord
    s server id               -> ServerRecord (with its number)
    m name                    -> a counter (blocks, bytes, cache footprint, aging)
    n ns                      -> tenant   whose namespace it is (usage.py)
    p tenant                  -> TenantUsage   what a tenant used (usage.py)

`ns` is the 16-byte namespace digest and `key` the 16-byte block key, so `ns key`
(FULL bytes) names a block. Block keys are chained hashes, random by design, so
rows are not stored under them: a block's row sits at a slot, a number given at
commit, and a block takes the slot after its parent's when that one is free.
A prompt's blocks so lie next to each other, 64 slots to a RocksDB value, and a
lookup reads a group per 64 blocks (a branch costs one more point read) instead
of a point read per block into random places. Numbers in keys are big-endian so
byte order is numeric order; `rank` and `last` are floats mapped to sortable
integers.

A block row is the block key, a fixed header (what a lookup checks first), the
distinct server numbers its chunks are on, its ttl class and layout, then its
chunks' locations already framed as field 2 of a MatchPrefixReply (a
BlockLocation without key or layout, chunk replicas as server numbers): a
lookup checks the header and copies the rest into its reply without parsing a
message per chunk. A reply names the layout once (a block's layout is its
parent's, allocations.py) and the keys not at all: they are the request's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvfs.keys import KEY_BYTES
from kvfs.proto import meta_pb2

FULL = 2 * KEY_BYTES  # namespace digest + block key

BLOCK, ROW, CHILD, EXPIRY, VICTIM, REPLICA, SHORT = b"b", b"l", b"c", b"x", b"v", b"r", b"u"
GHOST, GHOST_ORDER, STAGED = b"g", b"h", b"t"
ALLOC, SERVER, COUNTER = b"a", b"s", b"m"
# an open allocation's count of settled keys, beside its record: a commit piece writes
# these 8 bytes, not the whole record again (tens of KB for 500 blocks, per piece)
ALLOC_SETTLED = b"e"
NAMESPACE, USAGE, TENANT_VICTIM = b"n", b"p", b"w"

FORMAT = 7  # of this layout; a database of another format is refused at start (7: `r`, `x` per row group)
FORMAT_KEY = COUNTER + b"format"

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")


def sortable(x: float) -> bytes:
    """8 bytes whose byte order is the order of the floats (IEEE 754 with the sign flipped)."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", x))
    return _U64.pack(bits ^ 0xFFFF_FFFF_FFFF_FFFF if bits >> 63 else bits | 1 << 63)


def child_key(parent_full: bytes, child_full: bytes) -> bytes:
    return CHILD + parent_full + child_full[KEY_BYTES:]


def expiry_key(expires_at: float, namespace_digest: bytes, group: int) -> bytes:
    """Row group `group` of a namespace is to be visited at second `expires_at` for rows
    due by then: one entry per group and second, put with the rows (every row of the
    group is due no sooner than some entry of its group says). Never deleted with a row,
    nor moved when a hit pushes a row's expiry out: expiry (BlockTable.expire) visits the
    group, removes what is due, and puts one entry at the soonest expiry left."""
    return EXPIRY + _U64.pack(max(0, int(expires_at))) + namespace_digest + _U64.pack(group)


def expiry_of(index_key: bytes) -> int:
    return _U64.unpack_from(index_key, 1)[0]


def victim_key(rank: float, last_used: float, depth: int, full: bytes) -> bytes:
    # equal ranks: least recently used first, then deepest first
    return VICTIM + sortable(rank) + sortable(last_used) + _U32.pack(0xFFFF_FFFF - min(depth, 0xFFFF_FFFF)) + full


def replica_key(server: int, namespace_digest: bytes, group: int) -> bytes:
    """Row group `group` of a namespace may hold a block with a chunk on server number
    `server`: one entry per server and group, not per block (a commit put three a
    block, half of all its entries). Never deleted with a block: a superset, which
    repair (BlockTable.blocks_on) checks row by row and trims where a group holds no
    such block any more."""
    return REPLICA + _U16.pack(server) + namespace_digest + _U64.pack(group)


def replica_group(key: bytes) -> tuple[bytes, int]:
    """The (namespace digest, group) a replica index key names."""
    return key[3 : 3 + KEY_BYTES], _U64.unpack_from(key, 3 + KEY_BYTES)[0]


def expiry_group(key: bytes) -> tuple[bytes, int]:
    """The (namespace digest, group) an expiry index key names."""
    return key[9 : 9 + KEY_BYTES], _U64.unpack_from(key, 9 + KEY_BYTES)[0]


def replica_prefix(server: int) -> bytes:
    return REPLICA + _U16.pack(server)


_STAGED = struct.Struct(">16sQQd")  # chunk id, length, checksum, created; then the owner record
_ORDER = struct.Struct(">HI")  # a staged block's hash slot and depth


def staged_chunk(full: bytes, index: int, server: int, chunk_id: bytes, length: int, checksum: int,
                 created: float, owner: bytes, hash_slot: int = 0, depth: int = 0) -> tuple[bytes, bytes]:
    """A chunk a rebuild found on a server: its staging key and value. Staged blocks
    sort by their prompt's hash slot, then their depth in it: restored in key order,
    a block's parent (in its slot) is back before it, and a slot's few prompts are
    restored together, a run of each at a time (by depth alone, every block of a
    slice was another prompt's, placed and packed on its own: half the speed)."""
    return (STAGED + _ORDER.pack(hash_slot & 0xFFFF, min(depth, 0xFFFFFFFF)) + full + _U16.pack(index) +
            _U16.pack(server), _STAGED.pack(chunk_id, length, checksum, created) + owner)


def read_staged(key: bytes, value: bytes) -> tuple[bytes, int, int, bytes, int, int, float, bytes]:
    """(full key, chunk index, server number, chunk id, length, checksum, created, owner record)."""
    chunk_id, length, checksum, created = _STAGED.unpack_from(value)
    at = 1 + _ORDER.size
    index, server = _U16.unpack_from(key, at + FULL)[0], _U16.unpack_from(key, at + 2 + FULL)[0]
    return key[at : at + FULL], index, server, chunk_id, length, checksum, created, value[_STAGED.size :]


def u64(n: int) -> bytes:
    return _U64.pack(n)


def read_u64(raw: bytes | None) -> int:
    return _U64.unpack(raw)[0] if raw else 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# key; then version, flags, servers in the row, ttl, last use (what a lookup reads);
# then depth, hits, created, rank, footprint, payload bytes, slot, parent, copies, hash slot
_KEY = KEY_BYTES
LOOKUP = struct.Struct("<2xHId")  # (servers in the row, ttl, last use), read at offset KEY_BYTES
_HEAD = struct.Struct("<BBHIdIIddQQQ16sBH")
# the header's fields a hit changes, and those it is computed from: (ttl, last use, depth,
# hits, created, rank), fixed-width at USE_AT, so a flush of hits rewrites them in place
USE = struct.Struct("<IdIIdd")
USE_AT = _KEY + struct.calcsize("<BBH")  # after the version, flags and server count
_SLOT = struct.Struct("<Q")
_HASH_SLOT = struct.Struct("<H")
_SLOT_AT = _KEY + struct.calcsize("<BBHIdIIddQQ")  # where the header holds the slot
_PARENT_AT = _SLOT_AT + 8  # the parent's key
_COPIES_AT = _PARENT_AT + KEY_BYTES  # and the fewest copies of a chunk
_HASH_SLOT_AT = _COPIES_AT + 1  # and the prompt's hash slot (kvfs/shards.py)
SERVERS = _KEY + _HEAD.size  # where the server numbers start, 2 bytes each; then the ttl class name
_HAS_PARENT = 1
_REPLY_BLOCK = b"\x12"  # MatchPrefixReply.blocks: field 2, length-delimited


@dataclass(slots=True)
class Row:
    """One block's row. Decoded only where a pass needs its fields; lookups read
    the header in place (`LOOKUP`)."""

    ttl: int
    depth: int
    hits: int
    created: float
    last_used: float  # as indexed: the block expires at last_used + ttl
    rank: float  # as indexed, while it is a leaf
    footprint: int  # slot bytes per replica
    nbytes: int  # payload bytes
    parent: bytes  # the parent's block key; b"": a prompt's first block
    servers: tuple[int, ...]  # distinct numbers of the servers holding a copy of some chunk
    ttl_class: str
    location: bytes  # framed BlockLocation: its chunks only (see the module docstring)
    layout: bytes = b""  # serialized BlockLayout
    key: bytes = b""  # the block key
    slot: int = -1  # where the row is stored (its group and place in it); given at commit
    copies: int = 0  # the fewest servers any of its chunks is on (at most 255)
    hash_slot: int = 0  # its prompt's (kvfs/shards.py): the slot of the prompt's first key

    def encode(self) -> bytes:
        n = len(self.servers)
        head = _HEAD.pack(1, _HAS_PARENT if self.parent else 0, n, self.ttl, self.last_used, self.depth, self.hits,
                          self.created, self.rank, self.footprint, self.nbytes, self.slot,
                          self.parent or bytes(KEY_BYTES), min(self.copies, 255), self.hash_slot)
        name = self.ttl_class.encode()
        return b"".join((self.key, head, struct.pack(f"<{n}H", *self.servers), bytes([len(name)]), name,
                         _U16.pack(len(self.layout)), self.layout, self.location))

    @classmethod
    def decode(cls, raw: bytes) -> Row:
        (_, flags, n, ttl, last_used, depth, hits, created, rank, footprint, nbytes, slot,
         parent, copies, hash_slot) = _HEAD.unpack_from(raw, _KEY)
        servers = struct.unpack_from(f"<{n}H", raw, SERVERS)
        at = SERVERS + 2 * n
        name = raw[at + 1 : at + 1 + raw[at]].decode()
        layout_at, location_at = _layout_span(raw)
        return cls(ttl, depth, hits, created, last_used, rank, footprint, nbytes,
                   parent if flags & _HAS_PARENT else b"", servers, name, raw[location_at:],
                   raw[layout_at + 2 : location_at], raw[:_KEY], slot, copies, hash_slot)

    def block_location(self) -> meta_pb2.BlockLocation:
        """The block's location with its key and layout (a lookup's reply carries neither per block)."""
        loc = meta_pb2.MatchPrefixReply.FromString(self.location).blocks[0]
        loc.key = self.key
        loc.layout.ParseFromString(self.layout)
        return loc

    def set_location(self, loc: meta_pb2.BlockLocation) -> None:
        self.location = frame(loc, chunks_only=True)
        self.servers = tuple(sorted({s for c in loc.chunks for s in c.replicas}))
        self.copies = min((len(c.replicas) for c in loc.chunks), default=0)


def _layout_span(raw: bytes) -> tuple[int, int]:
    """Where a row (as stored) holds its layout's length, and where its framed location starts."""
    at = SERVERS + 2 * LOOKUP.unpack_from(raw, KEY_BYTES)[0]  # the ttl class name
    layout_at = at + 1 + raw[at]
    return layout_at, layout_at + 2 + _U16.unpack_from(raw, layout_at)[0]


def location_offset(raw: bytes) -> int:
    """Where a row (as stored) holds its framed location."""
    return _layout_span(raw)[1]


def row_layout(raw: bytes) -> bytes:
    """A row's (as stored) serialized BlockLayout."""
    layout_at, location_at = _layout_span(raw)
    return raw[layout_at + 2 : location_at]


def row_slot(raw: bytes) -> int:
    """The slot of a row as stored."""
    return _SLOT.unpack_from(raw, _SLOT_AT)[0]


def row_parent(raw: bytes) -> bytes:
    """The parent's block key of a row as stored (b"": a prompt's first block)."""
    return raw[_PARENT_AT : _PARENT_AT + KEY_BYTES] if raw[_KEY + 1] & _HAS_PARENT else b""


def row_copies(raw: bytes) -> int:
    """The fewest servers a chunk of a row (as stored) is on."""
    return raw[_COPIES_AT]


def row_hash_slot(raw: bytes) -> int:
    """The hash slot of a row's (as stored) prompt."""
    return _HASH_SLOT.unpack_from(raw, _HASH_SLOT_AT)[0]


def frame(loc: meta_pb2.BlockLocation, chunks_only: bool = False) -> bytes:
    """A location framed as one MatchPrefixReply.blocks entry; `chunks_only`: without
    its key and layout, as rows store it and lookups send it."""
    if chunks_only and (loc.key or loc.HasField("layout")):
        loc = meta_pb2.BlockLocation(chunks=loc.chunks)
    body = loc.SerializeToString()
    return _REPLY_BLOCK + _varint(len(body)) + body


def reframe_live(raw: bytes, offset: int, live: frozenset[int]) -> bytes | None:
    """A block's framed location keeping only replicas on `live` servers; None if
    some chunk has none left (the block is unreadable now)."""
    loc = meta_pb2.MatchPrefixReply.FromString(raw[offset:]).blocks[0]
    for c in loc.chunks:
        kept = [s for s in c.replicas if s in live]
        if not kept:
            return None
        del c.replicas[:]
        c.replicas.extend(kept)
    return frame(loc, chunks_only=True)


def reply_layout(layout: bytes) -> bytes:
    """MatchPrefixReply.layout (field 5) from a serialized BlockLayout."""
    return b"\x2a" + _varint(len(layout)) + layout


def reply_tail(matched: int) -> bytes:
    """MatchPrefixReply.matched (field 1, varint)."""
    return b"\x08" + _varint(matched) if matched else b""


def server_entry(record: meta_pb2.ServerRecord | None) -> bytes:
    """A MatchPrefixReply.servers entry (field 3); an empty one stands in for a
    number no block in the reply refers to."""
    if record is None:
        return b"\x1a\x00"
    body = meta_pb2.Server(id=record.id, address=record.address, failure_domain=record.failure_domain,
                           data_address=record.data_address).SerializeToString()
    return b"\x1a" + _varint(len(body)) + body
