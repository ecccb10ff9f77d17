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
        freed = 0
        while freed < bytes_to_free and (got := self._next_victim(pinned)) is not None:
            key, block = got
            out.append(key)
            freed += block.size
            self._drop(key, block, evicted=True)
        return out

    # ---- where candidates wait (a policy with segments keeps a heap each) --

    def _next_victim(self, pinned: Collection[Key]) -> tuple[Key, _Block] | None:
        return self._pop_leaf(self._heap, pinned)

    def _heap_of(self, block: _Block) -> list:
        return self._heap

    def _entry(self, key: Key, block: _Block) -> tuple:
        return block.rank, block.last_used, -block.depth, block.stamp, key

    def _all_heaps(self) -> tuple[list, ...]:
        return (self._heap,)

    def _live(self, entry: tuple) -> _Block | None:
        """The block a heap entry stands for, if the entry is its current one and it is a leaf."""
        block = self.blocks.get(entry[-1])
        return block if block is not None and block.stamp == entry[-2] and not block.children else None

    def _front(self, heap: list) -> tuple | None:
        """The entry of the first leaf on `heap`, left on it (stale entries dropped)."""
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _pop_leaf(self, heap: list, pinned: Collection[Key]) -> tuple[Key, _Block] | None:
        """The first leaf on `heap` not in `pinned`, taken off it (stale entries dropped)."""
        held = []
        try:
            while heap:
                entry = heapq.heappop(heap)
                block = self._live(entry)
                if block is None:
                    continue
                if entry[-1] in pinned:
                    held.append(entry)
                    continue
                return entry[-1], block
            return None
        finally:
            for entry in held:
                heapq.heappush(heap, entry)

    def over_high(self, capacity: int, incoming: int = 0) -> bool:
        """Would `incoming` more bytes take usage past the high watermark?"""
        return self.used_bytes + incoming > self.watermarks.high * capacity

    def bytes_to_low(self, capacity: int, incoming: int = 0) -> int:
        """Bytes to evict so usage, `incoming` included, is at the low watermark."""
        return max(0, math.ceil(self.used_bytes + incoming - self.watermarks.low * capacity))

    def _push(self, key: Key, block: _Block) -> None:
        block.stamp = next(self._stamps)
        heapq.heappush(self._heap_of(block), self._entry(key, block))
        if sum(map(len, self._all_heaps())) > 4 * len(self.blocks) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drops stale entries, so a long-lived cache's heaps stay its own size."""
        for heap in self._all_heaps():
            heap[:] = [entry for entry in heap if self._live(entry)]
            heapq.heapify(heap)

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


class ArcPolicy(Policy):
    """Adaptive replacement (ARC, Megiddo and Modha, FAST'03) over the prefix tree.

    Blocks used by one request so far form the recent segment (T1), blocks used by
    two or more the frequent one (T2); each is least recently used first, leaves
    first as everywhere here. Which segment gives up the next victim depends on a
    target share of the cache for T1: past it, T1's least recently used leaf goes;
    within it, the least recently used leaf of either (ARC would take T2's however
    fresh: a block hit a second ago would go before one-offs untouched for an hour,
    until enough misses taught it otherwise; on the traces here the two rules are
    within 0.3 points). The cache learns that share from its mistakes: two
    ghost lists remember recent victims of each segment, and a request for a block
    evicted from T1 (it would have hit, had T1 been larger) raises the target, one
    for a block evicted from T2 lowers it, each by ARC's step (the other ghost list's
    size over this one's, at least one block). So a workload whose reuse comes once,
    soon (a conversation's next turn, an agent's next step) pushes the cache towards
    LRU, and one where popular heads return among one-off tails (shared system
    prompts, documents) shields what proved itself, with no constant to tune for
    either. The target starts at half: from zero (ARC's usual start), conversations'
    first minutes cost a point of hit ratio against LRU on the generated chat trace.

    A block's parent is used by every request that uses it, so a parent is at least
    as frequent as its children: T1 always holds a leaf, while T2's blocks may all
    have children (then T1 gives up the victim). Sizes count in the cache's units
    (bytes, or 1 a block), the target as a share of the most the cache ever held.
    The ghosts are one list of keys, oldest forgotten first, at most twice that many
    blocks (ARC bounds T1's ghost at one cache's worth as well; on the generated and
    shipped traces the one list did as well or better, and the metaserver keeps its
    ghosts in one order).
    """

    name = "arc"
    RECENT, FREQUENT = 1.0, 2.0  # ranks: the segment (its blocks' order within is last use)

    def __init__(self, watermarks: Watermarks = Watermarks()):
        super().__init__(watermarks)
        self.target = 0.5  # T1's share of `peak_bytes`
        self.recent_bytes = 0  # in T1
        self.peak_bytes = 0
        self.peak_blocks = 0
        self.ghost: OrderedDict[Key, float] = OrderedDict()  # evicted key -> its segment, oldest first
        self.ghosts = {self.RECENT: 0, self.FREQUENT: 0}  # of them, from each segment
        self._heaps = {self.RECENT: [], self.FREQUENT: []}

    def _ranked(self, key, block, now, new):
        if new:
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            self.peak_blocks = max(self.peak_blocks, len(self.blocks))
            segment = self.ghost.pop(key, None)
            if segment is not None:  # evicted from `segment`, and wanted again
                self.ghosts[segment] -= 1
                self._learn(segment)
                block.hits += 1  # its use before the eviction: frequent now
        rank = self.RECENT if block.hits < 2 else self.FREQUENT
        if rank == self.RECENT and new:
            self.recent_bytes += block.size
        elif rank == self.FREQUENT and block.rank == self.RECENT:
            self.recent_bytes -= block.size
        return rank

    def _learn(self, segment: float) -> None:
        mine, other = self.ghosts[segment] + 1, self.ghosts[3.0 - segment]  # +1: the one just hit
        step = max(other / mine, 1.0) / max(1, self.peak_blocks)
        self.target = min(1.0, self.target + step) if segment == self.RECENT else max(0.0, self.target - step)

    def _next_victim(self, pinned: Collection[Key]) -> tuple[Key, _Block] | None:
        first = self.RECENT
        if self.recent_bytes <= self.target * self.peak_bytes:
            recent, frequent = self._front(self._heaps[self.RECENT]), self._front(self._heaps[self.FREQUENT])
            if frequent is not None and (recent is None or frequent[0] < recent[0]):
                first = self.FREQUENT
        return self._pop_leaf(self._heaps[first], pinned) or self._pop_leaf(self._heaps[3.0 - first], pinned)

    def _heap_of(self, block: _Block) -> list:
        return self._heaps[block.rank]

    def _entry(self, key: Key, block: _Block) -> tuple:
        return block.last_used, -block.depth, block.stamp, key  # the heap is the rank

    def _all_heaps(self) -> tuple[list, ...]:
        return tuple(self._heaps.values())

    def _forgotten(self, key, block, evicted):
        if block.rank == self.RECENT:
            self.recent_bytes -= block.size
        if not evicted:
            return
        self.ghost[key] = block.rank
        self.ghosts[block.rank] += 1
        while len(self.ghost) > 2 * max(1024, self.peak_blocks):
            self.ghosts[self.ghost.popitem(last=False)[1]] -= 1


class FrequencySketch:
    """How often each key was seen lately, approximately, in a fixed space (TinyLFU's
    sketch: Einziger, Friedman and Manes, ACM ToS 2017).

    A count-min sketch: `DEPTH` rows of one-byte counters, saturating at 15 (four
    bits' worth, as Caffeine keeps them); a key's estimate is the least of its
    counters, so collisions only ever overstate it, and an increment raises only
    the counters at that least value (conservative update). After `width` counted
    increments every counter halves (aging), so the counts follow the recent past.
    The size depends on the cache, never on the keys seen: `grow(blocks)` doubles the
    width until it is at least `blocks`, copying each row into both halves (an index
    is the low bits of a hash, so a key's new counter is a copy of its old one and
    every estimate stays an upper bound).
    """

    DEPTH = 4
    MAX = 15
    _HALF = bytes(v >> 1 for v in range(256))
    _SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
    _M64 = (1 << 64) - 1

    def __init__(self, width: int = 1024):
        if width < 1 or width & (width - 1):
            raise ValueError(f"the sketch's width must be a power of two, got {width}")
        self.width = width
        self.rows = [bytearray(width) for _ in range(self.DEPTH)]
        self.additions = 0  # since the last halving
        self.halvings = 0

    def _indexes(self, key: Key) -> list[int]:
        x = (hash(key) * self._SEEDS[0]) & self._M64
        x ^= x >> 31
        mask = self.width - 1
        return [((x * seed) >> 32) & mask for seed in self._SEEDS]

    def estimate(self, key: Key) -> int:
        return min(row[i] for row, i in zip(self.rows, self._indexes(key)))

    def add(self, key: Key) -> int:
        """Counts one sighting of `key`; returns its estimate, this one included."""
        indexes = self._indexes(key)
        low = min(row[i] for row, i in zip(self.rows, indexes))
        if low >= self.MAX:
            return low
        for row, i in zip(self.rows, indexes):
            if row[i] == low:
                row[i] = low + 1
        self.additions += 1
        if self.additions >= self.width:
            self.rows = [row.translate(self._HALF) for row in self.rows]
            self.additions //= 2
            self.halvings += 1
        return low + 1

    def grow(self, blocks: int) -> None:
        while self.width < blocks:
            self.rows = [row + row for row in self.rows]
            self.width *= 2

    def nbytes(self) -> int:
        return sum(map(len, self.rows))


class ArcTinyLfuPolicy(ArcPolicy):
    """ARC over the prefix tree (ArcPolicy, unchanged) with TinyLFU-style admission:
    a new block may not push out a frequent block the sketch says is used more.

    The sketch (FrequencySketch, at least 1,024 counters a row, else the most blocks
    the cache held rounded up to a power of two) counts every request's pass through
    every block: a hit's touch, and each missing block offered, the ones offered after
    a refusal too. A request through a block passes through all its ancestors, so a
    block's count is also what its descendants' requests are worth, and shallow shared
    blocks count more than the deep private ones after them.

    Until the cache first evicts, everything is admitted. After, a new block is
    compared with the victim it would cost only where that victim is forced out of
    the frequent segment (T2): when the recent segment (T1) has no leaf to give up
    but the candidate's own parent, which is what happens when a request's long new
    tail arrives (each block of it becomes the next one's pinned parent, so ARC takes
    every one's room from T2, a scan through the frequent blocks). There a candidate
    estimated less frequent than that victim is refused, and so is everything chained
    after it in that request. Elsewhere ARC's own rule chooses the victim and the
    block is admitted: a first sighting of a conversation's next turn only displaces
    another recent block or a frequent one ARC judged stale, so chat and agent traces
    keep their next-turn hits (comparing with every victim, TinyLFU's rule, cost the
    generated chat trace up to 20 points at 10-20% capacity: frequent blocks of
    finished conversations keep their counts for a while and outvote every new turn).

    Beyond ArcPolicy's state this keeps the sketch alone: 4 bytes a counter column,
    its size set by the cache's, not by how many blocks go through it. A simulator
    policy: the metaserver does not serve it (see TRIAL_POLICIES).
    """

    name = "arc-tlfu"

    def __init__(self, watermarks: Watermarks = Watermarks()):
        super().__init__(watermarks)
        self.sketch = FrequencySketch()
        self.evicting = False  # has the cache evicted yet (then every admission costs a victim)
        self.refusals = 0

    def admit(self, key, parent, size, now):
        freq = self.sketch.add(key)
        if not super().admit(key, parent, size, now):
            return False
        if not self.evicting:
            return True
        victim = self._forced_frequent_victim(parent)
        if victim is None or freq >= self.sketch.estimate(victim):
            return True
        self.refusals += 1
        return False

    def _forced_frequent_victim(self, parent: Key | None) -> Key | None:
        """The T2 leaf a new block under `parent` would evict because T1 has no other
        leaf to give up; None when ARC's rule takes a T1 leaf or chooses T2 itself."""
        recent = self._front(self._heaps[self.RECENT])
        if recent is not None and recent[-1] != parent:
            return None  # T1 can give up a leaf, or ARC's rule prefers T2's: not forced
        frequent = self._front(self._heaps[self.FREQUENT])
        if frequent is None or frequent[-1] == parent:
            return None
        return frequent[-1]

    def touch(self, key, parent, size, now):
        if key in self.blocks:  # a hit; a new block was counted when offered
            self.sketch.add(key)
        return super().touch(key, parent, size, now)

    def _ranked(self, key, block, now, new):
        rank = super()._ranked(key, block, now, new)
        if new and self.peak_blocks > self.sketch.width:
            self.sketch.grow(self.peak_blocks)
        return rank

    def _forgotten(self, key, block, evicted):
        self.evicting = self.evicting or evicted
        super()._forgotten(key, block, evicted)


POLICIES: dict[str, type[Policy]] = {"lru": LruPolicy, "lfuda": LfuDaPolicy, "arc": ArcPolicy}
# chosen by `kvfs-bench trace --simulate` on the shipped trace and five generated ones: the one policy
# not below LRU on any of them but for a tie on the agent trace (docs/operations.md has the figures)
DEFAULT_POLICY = "arc"
# policies the trace simulator runs beside the served ones, for comparison; the metaserver does not
# offer them (its ranks implement POLICIES only)
TRIAL_POLICIES: dict[str, type[Policy]] = {"arc-tlfu": ArcTinyLfuPolicy}
