"""Hash slots: how the block key space is split over several metaservers.

The key space is cut into `HASH_SLOTS` (16,384, as Redis Cluster) slots, and a
shard map gives every slot to exactly one metaserver. A prefix is routed by its
chain's first key, `block_keys(...)[0]`: every block of a prompt, and of every
prompt that shares its first block, lives on one shard, so a lookup is one RPC
and a prefix tree is never split between two metaservers. Block keys are keyed
blake2b digests, so their first bytes are uniform and the slot is simply the
first two bytes, masked (no CRC as Redis needs for arbitrary strings).

A shard map is plain data: which metaserver (an id and its address) holds which
slots, and an epoch that grows with every change, so a client that cached an
older map knows to fetch the newer one when a metaserver answers "moved". Maps
arrive from the network or a coordination store, so `ShardMap.from_json` checks
everything before anything is believed: every slot held exactly once, by a known
owner, within bounds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HASH_SLOTS = 16384
MAX_OWNERS = 1024
MAX_ID_BYTES = 128
MAX_EPOCH = (1 << 63) - 1
MAX_MAP_BYTES = 1 << 20  # a serialized map: 16,384 one-slot ranges take about 400 KB
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ADDRESS = re.compile(r"(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")


def valid_address(address) -> bool:
    """Whether `address` is a host:port a shard map may list."""
    return isinstance(address, str) and bool(_ADDRESS.fullmatch(address)) and \
        0 < int(address.rsplit(":", 1)[1]) < 65536


def hash_slot(first_key: bytes) -> int:
    """The slot of a prefix whose chain starts with `first_key` (a block key)."""
    if len(first_key) < 2:
        raise ValueError(f"a block key has at least 2 bytes, got {len(first_key)}")
    return int.from_bytes(first_key[:2], "big") & (HASH_SLOTS - 1)


@dataclass(frozen=True, slots=True)
class Owner:
    """A metaserver that may hold slots: its id (stable across restarts; letters,
    digits, '.', '_' and '-') and its address (host:port)."""

    id: str
    address: str

    def __post_init__(self):
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise ValueError(f"an owner id is 1 to {MAX_ID_BYTES} letters, digits, '.', '_' or '-', got {self.id!r}")
        if not valid_address(self.address):
            raise ValueError(f"owner {self.id}: an address is host:port, got {self.address!r}"[:300])


class ShardMap:
    """Every hash slot's owner, and the map's epoch.

    `slots[s]` is the index in `owners` of slot s's owner. Build one with `even`,
    change it with `adding` or `removing` (each returns a new map, one epoch on).
    """

    __slots__ = ("epoch", "owners", "slots")

    def __init__(self, epoch: int, owners: Sequence[Owner], slots: Sequence[int]):
        if not 0 <= epoch <= MAX_EPOCH:
            raise ValueError(f"a shard map's epoch is 0 to 2**63 - 1, got {epoch}")
        if not owners or len(owners) > MAX_OWNERS:
            raise ValueError(f"a shard map has 1 to {MAX_OWNERS} owners, got {len(owners)}")
        ids = [o.id for o in owners]
        if len(set(ids)) != len(ids):
            raise ValueError(f"owner ids repeat in the shard map: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        if len(slots) != HASH_SLOTS:
            raise ValueError(f"a shard map assigns {HASH_SLOTS} slots, got {len(slots)}")
        if any(not 0 <= s < len(owners) for s in slots):
            raise ValueError("a shard map assigns a slot to an owner it does not list")
        self.epoch = epoch
        self.owners = tuple(owners)
        self.slots = bytes(slots) if len(owners) <= 256 else tuple(slots)

    # ---- reading --------------------------------------------------------

    def owner_of(self, slot: int) -> Owner:
        return self.owners[self.slots[slot]]

    def route(self, first_key: bytes) -> Owner:
        """The metaserver holding the prefix that starts with `first_key`."""
        return self.owner_of(hash_slot(first_key))

    def slots_of(self, owner_id: str) -> list[int]:
        i = self._index(owner_id)
        return [s for s, o in enumerate(self.slots) if o == i]

    def counts(self) -> dict[str, int]:
        """Slots held, per owner id (every owner listed, with 0 if it holds none)."""
        n = [0] * len(self.owners)
        for o in self.slots:
            n[o] += 1
        return {owner.id: k for owner, k in zip(self.owners, n)}

    def _index(self, owner_id: str) -> int:
        for i, o in enumerate(self.owners):
            if o.id == owner_id:
                return i
        raise KeyError(f"no owner {owner_id!r} in the shard map")

    # ---- building and changing ------------------------------------------

    @classmethod
    def even(cls, owners: Sequence[Owner], epoch: int = 1) -> ShardMap:
        """Contiguous ranges of (nearly) equal size, in the owners' order."""
        n = len(owners)
        if n == 0:
            raise ValueError("a shard map needs an owner")
        return cls(epoch, owners, [s * n // HASH_SLOTS for s in range(HASH_SLOTS)])

    def adding(self, owner: Owner) -> ShardMap:
        """A map with `owner` added, given an equal share of the slots, taken from the
        owners that hold the most (a slot moves only if it must: about 1/(n+1) of them)."""
        if any(o.id == owner.id for o in self.owners):
            raise ValueError(f"owner {owner.id!r} is already in the shard map")
        owners = [*self.owners, owner]
        new = len(owners) - 1
        slots = list(self.slots)
        held: dict[int, list[int]] = {i: [] for i in range(len(self.owners))}
        for s, o in enumerate(slots):
            held[o].append(s)
        for _ in range(HASH_SLOTS // len(owners)):
            richest = max(held, key=lambda i: (len(held[i]), -i))
            slots[held[richest].pop()] = new  # from the end of its ranges: ranges stay contiguous
        return ShardMap(self.epoch + 1, owners, slots)

    def removing(self, *owner_ids: str) -> ShardMap:
        """A map without `owner_ids` (failover, or metaservers taken out): their slots,
        in order, go in runs to the others, each topped up to an equal share, the
        ones holding fewest first."""
        gone = {self._index(i) for i in owner_ids}
        keep = [i for i in range(len(self.owners)) if i not in gone]
        if not keep:
            raise ValueError("a shard map keeps at least one owner")
        count = {i: 0 for i in keep}
        for o in self.slots:
            if o in count:
                count[o] += 1
        freed = [s for s, o in enumerate(self.slots) if o in gone]
        share, extra = divmod(HASH_SLOTS, len(keep))
        slots = list(self.slots)
        at = 0
        for rank, i in enumerate(sorted(keep, key=lambda i: (count[i], i))):
            want = share + (rank < extra) - count[i]
            for s in freed[at : at + max(0, want)]:
                slots[s] = i
            at += max(0, want)  # the wants above zero add up to at least len(freed)
        renumber = {old: new for new, old in enumerate(keep)}
        return ShardMap(self.epoch + 1, [self.owners[i] for i in keep], [renumber[o] for o in slots])

    def moves(self, newer: ShardMap) -> list[tuple[int, int, str, str]]:
        """The slots whose owner differs in `newer`, as ranges (first, last, from id, to id)."""
        out: list[tuple[int, int, str, str]] = []
        for s in range(HASH_SLOTS):
            a, b = self.owner_of(s).id, newer.owner_of(s).id
            if a == b:
                continue
            if out and out[-1][1] == s - 1 and out[-1][2:] == (a, b):
                out[-1] = (out[-1][0], s, a, b)
            else:
                out.append((s, s, a, b))
        return out

    # ---- on the wire ----------------------------------------------------

    def to_json(self) -> str:
        """Owners, and runs of slots as [first, last, owner index]."""
        runs: list[list[int]] = []
        for s, o in enumerate(self.slots):
            if runs and runs[-1][2] == o:
                runs[-1][1] = s
            else:
                runs.append([s, s, o])
        return json.dumps({"epoch": self.epoch, "owners": [[o.id, o.address] for o in self.owners], "ranges": runs},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ShardMap:
        """A map from `to_json`'s form; ValueError saying what is wrong with anything else."""
        if len(raw) > MAX_MAP_BYTES:
            raise ValueError(f"a shard map is at most {MAX_MAP_BYTES} bytes, got {len(raw)}")
        try:
            doc = json.loads(raw)
            epoch, owners, ranges = doc["epoch"], doc["owners"], doc["ranges"]
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise ValueError(f"not a shard map: {type(err).__name__}: {err}"[:300]) from None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"a shard map's epoch is an integer, got {epoch!r}")
        if not isinstance(owners, list) or not all(_pair(o) for o in owners):
            raise ValueError("a shard map's owners are [id, address] string pairs")
        if not 1 <= len(owners) <= MAX_OWNERS:
            raise ValueError(f"a shard map has 1 to {MAX_OWNERS} owners, got {len(owners)}")
        if not isinstance(ranges, list) or len(ranges) > HASH_SLOTS:
            raise ValueError(f"a shard map has at most {HASH_SLOTS} slot ranges")
        slots = [-1] * HASH_SLOTS
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r)):
                raise ValueError(f"a slot range is [first, last, owner index], got {r!r}")
            first, last, owner = r
            if not 0 <= owner < len(owners):
                raise ValueError(f"slot range {first}..{last}: owner index {owner} is not one of the {len(owners)} owners")
            if not 0 <= first <= last < HASH_SLOTS:
                raise ValueError(f"slot range {first}..{last} is outside 0..{HASH_SLOTS - 1}")
            if any(slots[s] != -1 for s in range(first, last + 1)):
                raise ValueError(f"slot range {first}..{last} overlaps another")
            slots[first : last + 1] = [owner] * (last - first + 1)
        if -1 in slots:
            raise ValueError(f"slot {slots.index(-1)} has no owner")
        return cls(epoch, [Owner(i, a) for i, a in owners], slots)  # Owner checks ids and addresses

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardMap) and (self.epoch, self.owners, tuple(self.slots)) == \
            (other.epoch, other.owners, tuple(other.slots))

    def __repr__(self) -> str:
        return f"ShardMap(epoch={self.epoch}, slots={self.counts()})"


def _pair(o) -> bool:
    return isinstance(o, list) and len(o) == 2 and all(isinstance(x, str) for x in o)


def balance(loads: Iterable[float]) -> dict:
    """How even per-shard loads are: max and min over the mean (1.0 is perfect)."""
    loads = list(loads)
    mean = sum(loads) / len(loads) if loads else 0.0
    return {"max_over_mean": max(loads) / mean if mean else 0.0, "min_over_mean": min(loads) / mean if mean else 0.0}
