"""The chain table and chunk placement: pure functions, no I/O.

A chain is an ordered tuple of `replicas` chunkservers in distinct failure
domains. Every live server heads one chain and follows in others, so each
carries a similar share. Placements record the servers each chunk went to, not
the chain, so rebuilding the table when membership changes moves nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfs.errors import Unavailable

Chain = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    failure_domain: str


def build_chains(servers: Sequence[Member], replicas: int) -> list[Chain]:
    """One chain per server, each of `replicas` servers in distinct domains.

    Servers are interleaved by failure domain before chaining, so a chain's
    followers come from the domains after its head's and load spreads evenly.
    Returns [] when there are fewer distinct domains than `replicas`.
    """
    domains = sorted({s.failure_domain for s in servers})
    if replicas < 1 or len(domains) < replicas:
        return []
    by_domain = {d: sorted((s for s in servers if s.failure_domain == d), key=lambda s: s.id) for d in domains}
    ring: list[Member] = []
    for i in range(max(len(v) for v in by_domain.values())):
        ring += [by_domain[d][i] for d in domains if i < len(by_domain[d])]
    chains: list[Chain] = []
    for head in range(len(ring)):
        chain = [ring[head]]
        step = 1
        while len(chain) < replicas:
            candidate = ring[(head + step) % len(ring)]
            if candidate.failure_domain not in {m.failure_domain for m in chain}:
                chain.append(candidate)
            step += 1
        chains.append(tuple(m.id for m in chain))
    return chains


class Placer:
    """Chooses chains for the chunks of new blocks, balancing by free space.

    Each block's chunks go to distinct chains (while there are enough), the
    chains with the most free space first (a chain has what its fullest server
    has), the one used longest ago among equals; bytes placed but not yet
    reported by heartbeats count against a server, so a burst of allocations
    spreads out. A block costs a few heap operations per chunk, whatever the
    number of chains: the chains are kept in a heap by free space, and placing
    a chunk re-files only the chains that share a server with it (sorting every
    chain for every block made an allocation 5.6x dearer per block at 128
    servers than at 4).
    """

    def __init__(self, chains: Sequence[Chain], free: Mapping[str, int]):
        if not chains:
            raise Unavailable("no chains: not enough live chunkservers in distinct failure domains")
        self.chains = list(chains)
        self.free = dict(free)
        self._of_server: dict[str, list[int]] = {}  # server -> the chains it is in
        for i, chain in enumerate(self.chains):
            for s in chain:
                self._of_server.setdefault(s, []).append(i)
        self._used = [0] * len(self.chains)  # when each chain last took a chunk (a placement count)
        self._placed = 0
        self._version = [0] * len(self.chains)  # changes whenever the chain's entry is filed again
        # (-room, last used, chain, version): the entry whose version is no longer the chain's is
        # stale, and is dropped when it comes up
        self._heap = [(-self._room(i), 0, i, 0) for i in range(len(self.chains))]
        heapq.heapify(self._heap)

    def _room(self, i: int) -> int:
        return min(map(self.free.__getitem__, self.chains[i]))

    def _best(self, k: int) -> list[int]:
        """The k chains with the most room (fewer if there are fewer), out of the heap."""
        out: list[int] = []
        heap, version = self._heap, self._version
        while heap and len(out) < k:
            _, _, i, v = heapq.heappop(heap)
            if v == version[i]:
                out.append(i)
        return out

    def place_block(self, chunk_lengths: Sequence[int]) -> list[Chain]:
        order = self._best(len(chunk_lengths))
        placed, touched = [], set(order)
        try:
            for j, length in enumerate(chunk_lengths):
                i = order[j % len(order)]
                chain = self.chains[i]
                if self._room(i) < length:
                    raise Unavailable(f"no room for a {length}-byte chunk: every chain is full")
                for s in chain:
                    self.free[s] -= length
                    touched.update(self._of_server[s])
                self._placed += 1
                self._used[i] = self._placed
                placed.append(chain)
        finally:  # every chain whose room or use changed, and those taken out, filed again
            for i in touched:
                self._version[i] += 1
                heapq.heappush(self._heap, (-self._room(i), self._used[i], i, self._version[i]))
        return placed
