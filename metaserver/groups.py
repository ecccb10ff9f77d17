"""Block rows are stored 64 slots to a RocksDB value: a row group.

A prompt's blocks take consecutive slots (blocks.py, Slots), so the rows of a
2,000-block prompt fill about 32 groups. A lookup reads a group and handles its
run of blocks with a few slice operations on the value, never a Python step
per block: the blocks' keys lie side by side (one comparison of joined bytes
tells whether the next blocks are the ones asked for), so do their expiry
times (one `min`), and their framed BlockLocations (one slice into the reply).
Reading a row per block cost a 2,000-block hit about 2.5 us per block here, in
Python; a group costs about as much as one row.

Every change of a row is staged in a `Batch` (db.py) and applied to its group
when the batch is written, against the group as it is stored then, in the same
RocksDB write: rows in one group staged by different batches never overwrite
each other's changes, and a batch never written changes nothing.

A group's value:

    keys      64 x 16 bytes   each slot's block key (zeros: no row)
    expires   64 x f64        last use + ttl (0.0: no row)
    loc_ends  65 x u32        where each slot's location ends in `locs` (entry 0 is 0)
    rest_ends 65 x u32        the same for `rests`
    copies    u8              the fewest servers any chunk of the group's rows is on (a lower bound)
    servers   u16 count, then u16 numbers: every server some row of the group names (a superset)
    locs      the rows' framed BlockLocations, in slot order (records.py)
    rests     the rows without their locations, in slot order

so a slot's row as records.Row encodes it is `rests[k] + locs[k]`.

Removing rows (eviction, expiry) cuts them out of the value without repacking
the others (`without`), and leaves `copies` and `servers` as they were: a lower
bound and a superset, which is all lookups need (a server named but used by no
row only sends a lookup down the careful path when it is down). The next row
written into the group packs it whole and exact again.
"""

from __future__ import annotations

import itertools
import struct

from kvfs.keys import KEY_BYTES

from .records import LOOKUP, ROW, SERVERS, USE, USE_AT, location_offset, row_copies, u64

GROUP_SLOTS = 64
_EXPIRES = GROUP_SLOTS * KEY_BYTES
_LOC_ENDS = _EXPIRES + GROUP_SLOTS * 8
_REST_ENDS = _LOC_ENDS + (GROUP_SLOTS + 1) * 4
_COPIES = _REST_ENDS + (GROUP_SLOTS + 1) * 4
_NSERVERS = _COPIES + 1
_SERVERS = _NSERVERS + 2
_EXPIRY_ALL = struct.Struct(f"<{GROUP_SLOTS}d")
_ENDS = struct.Struct(f"<{GROUP_SLOTS + 1}I")
_PAIR = struct.Struct("<II")
_U16 = struct.Struct("<H")
NO_KEY = bytes(KEY_BYTES)


def group_key(namespace_digest: bytes, group: int) -> bytes:
    return ROW + namespace_digest + u64(group)


def pack(rows: list[bytes | None]) -> bytes | None:
    """The value of a group whose 64 slots hold these rows (None: no row); None if it holds none."""
    if not any(rows):
        return None
    keys, expires, locs, rests, servers, copies = [], [], [], [], set(), 255
    loc_ends, rest_ends = [0], [0]
    for raw in rows:
        if raw is None:
            keys.append(NO_KEY)
            expires.append(0.0)
            loc_ends.append(loc_ends[-1])
            rest_ends.append(rest_ends[-1])
            continue
        n, ttl, last_used = LOOKUP.unpack_from(raw, KEY_BYTES)
        at = location_offset(raw)
        keys.append(raw[:KEY_BYTES])
        expires.append(last_used + ttl)
        servers.update(struct.unpack_from(f"<{n}H", raw, SERVERS))
        copies = min(copies, row_copies(raw))
        locs.append(raw[at:])
        rests.append(raw[:at])
        loc_ends.append(loc_ends[-1] + len(raw) - at)
        rest_ends.append(rest_ends[-1] + at)
    numbers = sorted(servers)
    return b"".join((*keys, _EXPIRY_ALL.pack(*expires), _ENDS.pack(*loc_ends), _ENDS.pack(*rest_ends),
                     bytes([copies]), _U16.pack(len(numbers)), struct.pack(f"<{len(numbers)}H", *numbers),
                     *locs, *rests))


def _locs_at(value: bytes) -> int:
    """Where `locs` starts."""
    return _SERVERS + 2 * _U16.unpack_from(value, _NSERVERS)[0]


def _areas(value: bytes) -> tuple[int, int]:
    """Where `locs` and `rests` start."""
    locs = _locs_at(value)
    return locs, locs + _PAIR.unpack_from(value, _LOC_ENDS + 4 * GROUP_SLOTS)[0]


def row_at(value: bytes, offset: int) -> bytes | None:
    """The row in slot `offset` of a group (None: none)."""
    if value[KEY_BYTES * offset : KEY_BYTES * (offset + 1)] == NO_KEY:
        return None
    locs, rests = _areas(value)
    l0, l1 = _PAIR.unpack_from(value, _LOC_ENDS + 4 * offset)
    r0, r1 = _PAIR.unpack_from(value, _REST_ENDS + 4 * offset)
    return value[rests + r0 : rests + r1] + value[locs + l0 : locs + l1]


def uses_at(value: bytes) -> tuple[int, tuple[int, ...]]:
    """Where a group's `rests` start, and each slot's start of its rest in it: what
    `uses` and `with_uses` take."""
    return _areas(value)[1], _ENDS.unpack_from(value, _REST_ENDS)


def uses(value: bytes, rests: tuple[int, tuple[int, ...]], offset: int) -> tuple[int, float, int, int, float, float]:
    """The (ttl, last use, depth, hits, created, rank) of the row in slot `offset`,
    read in place (`rests`: uses_at's)."""
    return USE.unpack_from(value, rests[0] + rests[1][offset] + USE_AT)


def with_uses(value: bytes, rests: tuple[int, tuple[int, ...]],
              changes: list[tuple[int, tuple[int, float, int, int, float, float]]]) -> bytes:
    """A group's value with each changed slot's (ttl, last use, depth, hits, created,
    rank) and its expiry time to match written over the old bytes: a flush of hits
    repacks nothing (`changes`: (slot in the group, those fields))."""
    out = bytearray(value)
    for offset, fields in changes:
        USE.pack_into(out, rests[0] + rests[1][offset] + USE_AT, *fields)
        struct.pack_into("<d", out, _EXPIRES + 8 * offset, fields[1] + fields[0])
    return bytes(out)


def unpack(value: bytes | None) -> list[bytes | None]:
    """The 64 slots' rows of a group's value."""
    if value is None:
        return [None] * GROUP_SLOTS
    return [row_at(value, k) for k in range(GROUP_SLOTS)]


def occupied(value: bytes) -> list[int]:
    """The slots of a group that hold a row."""
    return [k for k in range(GROUP_SLOTS) if value[KEY_BYTES * k : KEY_BYTES * (k + 1)] != NO_KEY]


def run_length(value: bytes, offset: int, want: bytes, at: int, most: int) -> int:
    """How many slots from `offset` on hold, in order, the keys joined in `want`
    from key number `at` on (at most `most`)."""
    def same(m: int) -> bool:
        return value[KEY_BYTES * offset : KEY_BYTES * (offset + m)] == want[KEY_BYTES * at : KEY_BYTES * (at + m)]

    if same(most):
        return most
    lo, hi = 0, most - 1  # same(lo) holds, same(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def expiry_times(value: bytes, offset: int, m: int) -> tuple[float, ...]:
    return struct.unpack_from(f"<{m}d", value, _EXPIRES + 8 * offset)


def server_numbers(value: bytes) -> tuple[int, ...]:
    """The numbers of every server some row of the group names."""
    return struct.unpack_from(f"<{_U16.unpack_from(value, _NSERVERS)[0]}H", value, _SERVERS)


def expiries(value: bytes) -> list[tuple[int, float]]:
    """(slot in the group, last use + ttl) of each of the group's rows."""
    times = _EXPIRY_ALL.unpack_from(value, _EXPIRES)
    return [(k, times[k]) for k in occupied(value)]


def keys_on(value: bytes, server: int) -> list[bytes]:
    """The block keys of the group's rows with a chunk on server number `server`."""
    if server not in server_numbers(value):
        return []
    rests, starts = uses_at(value)
    keys = []
    for k in occupied(value):
        at = rests + starts[k]
        n = LOOKUP.unpack_from(value, at + KEY_BYTES)[0]
        if server in struct.unpack_from(f"<{n}H", value, at + SERVERS):
            keys.append(value[KEY_BYTES * k : KEY_BYTES * (k + 1)])
    return keys


def fewest_copies(value: bytes) -> int:
    """The fewest servers any chunk of the group's rows is on."""
    return value[_COPIES]


def locations(value: bytes, offset: int, m: int) -> bytes:
    """The framed locations of slots offset .. offset + m - 1, joined."""
    locs = _locs_at(value)
    start = _PAIR.unpack_from(value, _LOC_ENDS + 4 * offset)[0]
    end = _PAIR.unpack_from(value, _LOC_ENDS + 4 * (offset + m))[0]
    return value[locs + start : locs + end]


def without(value: bytes, offsets: set[int]) -> bytes | None:
    """A group's value with the rows in slots `offsets` removed, the others as
    they are (see the module docstring); None if no row is left."""
    keys = bytearray(value[:_EXPIRES])
    expires = list(_EXPIRY_ALL.unpack_from(value, _EXPIRES))
    for k in offsets:
        keys[KEY_BYTES * k : KEY_BYTES * (k + 1)] = NO_KEY
        expires[k] = 0.0
    if not any(keys):
        return None
    loc_ends, rest_ends = _ENDS.unpack_from(value, _LOC_ENDS), _ENDS.unpack_from(value, _REST_ENDS)
    locs, rests = _areas(value)
    cut = [k in offsets for k in range(GROUP_SLOTS)]
    new_locs = list(itertools.accumulate((0 if c else b - a for c, a, b in zip(cut, loc_ends, loc_ends[1:])),
                                         initial=0))
    new_rests = list(itertools.accumulate((0 if c else b - a for c, a, b in zip(cut, rest_ends, rest_ends[1:])),
                                          initial=0))
    kept_locs, kept_rests, start = [], [], 0
    for k in [*sorted(offsets), GROUP_SLOTS]:  # the runs of slots between the removed ones
        if k > start:
            kept_locs.append(value[locs + loc_ends[start] : locs + loc_ends[k]])
            kept_rests.append(value[rests + rest_ends[start] : rests + rest_ends[k]])
        start = k + 1
    return b"".join((keys, _EXPIRY_ALL.pack(*expires), _ENDS.pack(*new_locs), _ENDS.pack(*new_rests),
                     value[_COPIES:locs], *kept_locs, *kept_rests))


def appended(value: bytes, new: list[tuple[int, bytes]]) -> bytes | None:
    """A group's value with the rows `new` ((slot, row), slots in increasing order)
    added, when every slot of them lies after the group's last row; None otherwise
    (pack the group whole). The rows already in the value are not parsed again."""
    loc_ends, rest_ends = list(_ENDS.unpack_from(value, _LOC_ENDS)), list(_ENDS.unpack_from(value, _REST_ENDS))
    last = max((k for k in range(GROUP_SLOTS) if rest_ends[k + 1] > rest_ends[k]), default=-1)
    if new[0][0] <= last:
        return None
    keys = bytearray(value[:_EXPIRES])
    expires = list(_EXPIRY_ALL.unpack_from(value, _EXPIRES))
    servers = set(server_numbers(value))
    copies = value[_COPIES]
    locs_at, rests_at = _areas(value)
    locs, rests = [value[locs_at:rests_at]], [value[rests_at : rests_at + rest_ends[-1]]]
    loc_end, rest_end, at = loc_ends[-1], rest_ends[-1], last + 1
    for k, raw in new:
        for j in range(at, k + 1):  # the empty slots before it end where the last row did
            loc_ends[j], rest_ends[j] = loc_end, rest_end
        n, ttl, last_used = LOOKUP.unpack_from(raw, KEY_BYTES)
        split = location_offset(raw)
        keys[KEY_BYTES * k : KEY_BYTES * (k + 1)] = raw[:KEY_BYTES]
        expires[k] = last_used + ttl
        servers.update(struct.unpack_from(f"<{n}H", raw, SERVERS))
        copies = min(copies, row_copies(raw))
        locs.append(raw[split:])
        rests.append(raw[:split])
        loc_end, rest_end, at = loc_end + len(raw) - split, rest_end + split, k + 1
    for j in range(at, GROUP_SLOTS + 1):
        loc_ends[j], rest_ends[j] = loc_end, rest_end
    numbers = sorted(servers)
    return b"".join((keys, _EXPIRY_ALL.pack(*expires), _ENDS.pack(*loc_ends), _ENDS.pack(*rest_ends),
                     bytes([copies]), _U16.pack(len(numbers)), struct.pack(f"<{len(numbers)}H", *numbers),
                     *locs, *rests))


def stage(db, changes: dict[tuple[bytes, int], bytes | None], batch) -> None:
    """Adds to `batch` (a rocksdict WriteBatch) the groups these row changes
    ((namespace digest, slot) -> row, None: removed) make of the groups as stored now."""
    by_group: dict[bytes, list[tuple[int, bytes | None]]] = {}
    for (ns, slot), raw in changes.items():
        by_group.setdefault(group_key(ns, slot // GROUP_SLOTS), []).append((slot % GROUP_SLOTS, raw))
    names = list(by_group)
    for name, value in zip(names, db.get(names)):
        changed = by_group[name]
        if value is not None and all(raw is None for _, raw in changed):
            packed = without(value, {offset for offset, _ in changed})
        else:
            adding = value is not None and all(raw is not None for _, raw in changed)
            packed = appended(value, sorted(changed)) if adding else None
            if packed is None:
                rows = unpack(value)
                for offset, raw in changed:
                    rows[offset] = raw
                packed = pack(rows)
        if packed is None:
            batch.delete(name)
        else:
            batch.put(name, packed)
