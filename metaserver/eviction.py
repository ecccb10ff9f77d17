"""Which blocks to keep: capacity eviction and admission, as pure bookkeeping.

Blocks form a forest: a block's key is chained on its parent's, so a block is
only reachable (a prefix match stops at the first missing key) while every
ancestor is cached. The policies here therefore keep the cached set closed
under "parent of": only a block without cached children is an eviction
candidate, and removing a parent (TTL expiry) hands back its now-stranded
descendants so the caller drops them too.

Nothing here does I/O or reads a clock: callers pass `now` (any non-decreasing
number) and apply the victims themselves, so a trace can be replayed offline
(`kvfs.bench.simulate`) through exactly the code the metaserver runs.

Protocol, for a caller holding a policy `p` and a capacity in bytes:
  - a match of a cached block: `p.touch(key, parent, size, now)`, once per
    request that uses it (frequency-aware policies count touches);
  - a new block: `if p.admit(key, parent, size, now)`, make room
    (`p.victims(p.bytes_to_low(capacity, size))` when `p.over_high(capacity,
    size)`), store it, then `p.touch(...)`; a refused block is simply not
    stored, nor is anything chained after it (it would be unreachable);
  - a block removed for another reason: `p.remove(key)`, then drop the
    descendants it returns.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

Key = Hashable


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Evict once usage passes `high` of capacity, down to `low`: the gap makes
    eviction a batch every so often instead of a block on every write, and
    leaves room for writes in flight. 90/80 keeps a tenth of the disk as that
    headroom while using most of it."""

    high: float = 0.90
    low: float = 0.80

    def __post_init__(self):
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={self.low} high={self.high}")


@dataclass(slots=True)
class _Block:
    parent: Key | None
    size: int
    depth: int
    children: set = field(default_factory=set)
    hits: int = 0  # touches while cached (a policy may carry some over)
    rank: float = 0.0  # lower is evicted first; set by the policy
    last_used: float = 0.0
    stamp: int = -1  # of this block's live heap entry; older entries are stale


class Policy:
    """Leaves-first eviction by a rank each policy defines; admits everything.

    Candidates sit in a heap of (rank, last use, -depth, stamp, key): equal
    ranks go oldest first, then deepest first (a request touches its whole
    path at one `now`, and its tail is what the next request is least likely
    to share). Entries are invalidated lazily by `stamp`.
    """

    name = "base"

    def __init__(self, watermarks: Watermarks = Watermarks()):
        self.watermarks = watermarks
        self.blocks: dict[Key, _Block] = {}
        self.used_bytes = 0
        self._heap: list[tuple] = []
        self._stamps = itertools.count()

    # ---- what a policy decides ------------------------------------------

    def _ranked(self, key: Key, block: _Block, now: float, new: bool) -> float:
        raise NotImplementedError

    def _forgotten(self, key: Key, block: _Block, evicted: bool) -> None:
        """Called for every block that leaves the cache."""

    def admit(self, key: Key, parent: Key | None, size: int, now: float) -> bool:
        """Should a new block be cached? Never when its parent is not."""
        return parent is None or parent in self.blocks

    # ---- bookkeeping ----------------------------------------------------

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: Key) -> bool:
        return key in self.blocks

    def touch(self, key: Key, parent: Key | None, size: int, now: float) -> bool:
        """Records a hit on a cached block, or a newly stored one. False (and
        nothing recorded) for a new block whose parent is not cached: it could
        never be matched, so the caller should not keep it."""
        block = self.blocks.get(key)
        new = block is None
        if new:
            depth = 0
            if parent is not None:
                up = self.blocks.get(parent)
                if up is None:
                    return False
                up.children.add(key)
                depth = up.depth + 1
            block = self.blocks[key] = _Block(parent, size, depth)
            self.used_bytes += size
        block.hits += 1
        block.rank = self._ranked(key, block, now, new)
        block.last_used = now
        if not block.children:
            self._push(key, block)
        return True

    def remove(self, key: Key) -> list[Key]:
        """Forgets a block removed by the caller (expired, lost); returns its
        cached descendants, deepest first, which are forgotten too: without
        their ancestor they are unreachable, so the caller must drop them."""
        block = self.blocks.get(key)
        if block is None:
            return []
        stranded: list[Key] = []
        stack = list(block.children)
        while stack:  # preorder; reversed below gives children before parents
            k = stack.pop()
            stranded.append(k)
            stack.extend(self.blocks[k].children)
        stranded.reverse()
        for k in stranded:
            self._drop(k, self.blocks[k], evicted=False)
        self._drop(key, block, evicted=False)
        return stranded

    def victims(self, bytes_to_free: int, pinned: Collection[Key] = ()) -> list[Key]:
        """Chooses blocks worth at least `bytes_to_free` (fewer if not enough
        can go), each one before its parent, and forgets them: the caller
        deletes exactly these. `pinned` blocks (in use by a request) stay,
        and so do their ancestors."""
        out: list[Key] = []
        held = []
        freed = 0
        while freed < bytes_to_free and self._heap:
            entry = heapq.heappop(self._heap)
            key, stamp = entry[-1], entry[-2]
            block = self.blocks.get(key)
            if block is None or block.stamp != stamp or block.children:
                continue
            if key in pinned:
                held.append(entry)
                continue
            out.append(key)
            freed += block.size
            self._drop(key, block, evicted=True)
        for entry in held:
            heapq.heappush(self._heap, entry)
        return out

    def over_high(self, capacity: int, incoming: int = 0) -> bool:
        """Would `incoming` more bytes take usage past the high watermark?"""
        return self.used_bytes + incoming > self.watermarks.high * capacity

    def bytes_to_low(self, capacity: int, incoming: int = 0) -> int:
        """Bytes to evict so usage, `incoming` included, is at the low watermark."""
        return max(0, math.ceil(self.used_bytes + incoming - self.watermarks.low * capacity))

    def _push(self, key: Key, block: _Block) -> None:
        block.stamp = next(self._stamps)
        heapq.heappush(self._heap, (block.rank, block.last_used, -block.depth, block.stamp, key))
        if len(self._heap) > 4 * len(self.blocks) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drops stale entries, so a long-lived cache's heap stays its own size."""
        live = []
        for entry in self._heap:
            block = self.blocks.get(entry[-1])
            if block is not None and block.stamp == entry[-2] and not block.children:
                live.append(entry)
        heapq.heapify(live)
        self._heap = live

    def _drop(self, key: Key, block: _Block, evicted: bool) -> None:
        del self.blocks[key]
        self.used_bytes -= block.size
        if block.parent is not None:
            up = self.blocks.get(block.parent)
            if up is not None:
                up.children.discard(key)
                if not up.children:
                    self._push(block.parent, up)
        self._forgotten(key, block, evicted)


class LruPolicy(Policy):
    """Least recently used first (leaves first)."""

    name = "lru"

    def _ranked(self, key, block, now, new):
        return now


class LfuDaPolicy(Policy):
    """Least frequently used with dynamic aging, a probation for newcomers, and
    a ghost memory of evicted blocks' hit counts.

    rank = L + log2(hits), where L is the rank of the last victim: a block
    must keep being hit to stay ahead of a rising L, so a prefix that was hot
    long ago ages out (LFU-DA). A block's first sighting ranks exactly L,
    below anything that has been hit since it was stored: most blocks are never
    read again (58% of the shipped trace's), and this way they only displace
    each other, oldest first, and one-off traffic alone never raises L, so it
    cannot flush what has proved itself. log2 makes a hot block's lead grow slowly, so it
    does not outlive its popularity by much.

    Reuse in a prefix cache comes back after long gaps (hundreds of requests
    in the shipped trace, longer than a small cache keeps a newcomer), so the
    ghost keeps the hit counts of the last `ghost_factor` x (most blocks ever
    cached) victims: a prefix that returns resumes its count instead of
    starting over as a newcomer. Without the ghost this does worse than LRU.

    Admission is the probation, not a refusal: refusing first sightings (a
    doorkeeper) halved the writes in simulation but lost hit ratio at 10% of
    the trace's blocks and above, where second requests of a prefix can hit.
    """

    name = "lfuda"

    def __init__(self, watermarks: Watermarks = Watermarks(), ghost_factor: float = 4.0):
        super().__init__(watermarks)
        self.ghost_factor = ghost_factor
        self.ghost: OrderedDict[Key, int] = OrderedDict()  # evicted key -> its hits
        self.aging = 0.0  # L
        self.peak_blocks = 0

    def _ranked(self, key, block, now, new):
        if new:
            block.hits += self.ghost.pop(key, 0)
            self.peak_blocks = max(self.peak_blocks, len(self.blocks))
        return self.aging + math.log2(block.hits)

    def _forgotten(self, key, block, evicted):
        if evicted:
            self.aging = max(self.aging, block.rank)
            self.ghost[key] = block.hits
            self.ghost.move_to_end(key)
            while len(self.ghost) > max(1024, self.ghost_factor * self.peak_blocks):
                self.ghost.popitem(last=False)


POLICIES: dict[str, type[Policy]] = {"lru": LruPolicy, "lfuda": LfuDaPolicy}
DEFAULT_POLICY = "lfuda"  # chosen by `kvfs-bench trace --simulate` on the shipped trace
