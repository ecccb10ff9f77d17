"""Hits recorded since the last flush: what lookups owe the rows' last use and hit counts.

A lookup matches runs of consecutive slots, up to a row group's 64 at a time
(groups.py), and records one entry per run rather than one per block: the run's
group, its first slot in the group and the joined keys of its blocks, with how
many lookups hit it and the last time one did. Repeated lookups of the same
prompt add to the same entries. The keys make an entry exact: a hit stays its
block's even if the slot is given to another block before the flush.

A group's hits wait to be written until they are `hit_flush_delay` old (blocks.py),
so a hot prompt's rows are rewritten once per delay, not once per lookup.

Bounded: past `max_runs` entries or `max_blocks` blocks in them (past half of
either, hits are written back without waiting), a lookup's hits are not recorded (its blocks
still served; only their ranking and TTL refresh are lost), and logged.
"""

from __future__ import annotations

import logging

from kvfs.keys import KEY_BYTES

from .groups import GROUP_SLOTS

log = logging.getLogger(__name__)

MAX_PENDING_RUNS = 100_000  # entries: about 330 bytes each, and 16 per block
MAX_PENDING_BLOCKS = 1_000_000


class PendingHits:
    def __init__(self, max_runs: int = MAX_PENDING_RUNS, max_blocks: int = MAX_PENDING_BLOCKS):
        self.max_runs, self.max_blocks = max_runs, max_blocks
        # (namespace digest, group) -> (first slot in the group, joined keys) -> [lookups, last hit];
        # in the order the groups' hits began waiting
        self._groups: dict[tuple[bytes, int], dict[tuple[int, bytes], list]] = {}
        self._since: dict[tuple[bytes, int], float] = {}  # when each group's hits began waiting
        self.runs = 0  # entries
        self.blocks = 0  # blocks over all entries (a block in two entries counts twice)
        self.dropped = 0  # lookups whose hits went unrecorded

    def __len__(self) -> int:
        return self.blocks

    def __bool__(self) -> bool:
        return bool(self._groups)

    def record(self, ns: bytes, runs: list[tuple[int, int, bytes]], now: float) -> None:
        """One lookup's hits: runs of (group, first slot in it, joined keys)."""
        if self.runs + len(runs) > self.max_runs or self.blocks > self.max_blocks:
            self.dropped += 1
            if self.dropped in (1, 1000, 1000_000):
                log.warning("%d lookups' hits not recorded: %d runs of blocks wait to be flushed", self.dropped,
                            self.runs)
            return
        for group, offset, keys in runs:
            entries = self._groups.get((ns, group))
            if entries is None:
                entries = self._groups[(ns, group)] = {}
                self._since[(ns, group)] = now
            entry = entries.get((offset, keys))
            if entry is None:
                entries[(offset, keys)] = [1, now]
                self.runs += 1
                self.blocks += len(keys) // KEY_BYTES
            else:
                entry[0] += 1
                entry[1] = max(entry[1], now)

    def of(self, ns: bytes, slot: int, key: bytes) -> tuple[int, float] | None:
        """(lookups, last hit) recorded for the block `key` in `slot`, or None."""
        entries = self._groups.get((ns, slot // GROUP_SLOTS))
        if not entries:
            return None
        at = slot % GROUP_SLOTS
        count, last = 0, 0.0
        for (offset, keys), (n, t) in entries.items():
            k = at - offset
            if 0 <= k and keys[KEY_BYTES * k : KEY_BYTES * (k + 1)] == key:
                count, last = count + n, max(last, t)
        return (count, last) if count else None

    @property
    def filling(self) -> bool:
        """Past half the bounds: time to write hits back without waiting for them to age."""
        return self.runs > self.max_runs // 2 or self.blocks > self.max_blocks // 2

    def take(self, limit: int, before: float = float("inf"),
             now: float = float("inf")) -> list[tuple[bytes, int, dict[tuple[int, bytes], list]]]:
        """Removes whole groups' hits that began waiting by `before` (or after `now`:
        the clock stepped back), the longest waiting first, at least `limit` blocks'
        worth where there are as many: (namespace digest, group, (slot in group, key)
        -> [lookups, last hit])."""
        out, blocks = [], 0
        while self._groups and blocks < limit:
            ns, group = name = next(iter(self._groups))
            if before < self._since[name] <= now:
                break
            entries = self._groups.pop(name)
            del self._since[name]
            per_block: dict[tuple[int, bytes], list] = {}
            for (offset, keys), (n, t) in entries.items():
                for k in range(len(keys) // KEY_BYTES):
                    have = per_block.setdefault((offset + k, keys[KEY_BYTES * k : KEY_BYTES * (k + 1)]), [0, t])
                    have[0] += n
                    have[1] = max(have[1], t)
                self.runs -= 1
                self.blocks -= len(keys) // KEY_BYTES
            blocks += len(per_block)
            out.append((ns, group, per_block))
        return out
