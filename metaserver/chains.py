"""The chain table and chunk placement: pure functions, no I/O.

A chain is an ordered tuple of `replicas` chunkservers in distinct failure
domains. Every live server heads one chain and follows in others, so each
carries a similar share. Placements record the servers each chunk went to, not
the chain, so rebuilding the table when membership changes moves nothing.
"""

from __future__ import annotations

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
    chains with the most free space first; bytes placed but not yet reported by
    heartbeats count against a server, so a burst of allocations spreads out.
    """

    def __init__(self, chains: Sequence[Chain], free: Mapping[str, int]):
        if not chains:
            raise Unavailable("no chains: not enough live chunkservers in distinct failure domains")
        self.chains = list(chains)
        self.free = dict(free)
        self._rotor = 0

    def place_block(self, chunk_lengths: Sequence[int]) -> list[Chain]:
        n = len(self.chains)
        order = sorted(range(n), key=lambda i: (-min(self.free[s] for s in self.chains[i]),
                                                (i - self._rotor) % n))
        self._rotor = (self._rotor + 1) % n
        placed = []
        for j, length in enumerate(chunk_lengths):
            chain = self.chains[order[j % n]]
            if min(self.free[s] for s in chain) < length:
                raise Unavailable(f"no room for a {length}-byte chunk: every chain is full")
            for s in chain:
                self.free[s] -= length
            placed.append(chain)
        return placed
