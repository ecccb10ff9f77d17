"""`kvfs-bench trace --simulate`: a Mooncake-format trace through an eviction
policy alone (no cluster), for the token hit ratio it would reach at a capacity.

Requests are replayed in timestamp order, one at a time. A request's hash ids
are chained into block keys (a block is its whole prefix, so equal ids after
different predecessors are different blocks), its cached prefix is the longest
run of leading keys the policy holds, and its hit tokens are
`min(matched * block_tokens, input_length)`: the same count `kvfs-bench trace`
reports (the last hash id of a request may cover a partial block). The matched
blocks are touched, then the missing ones offered in order; the first one the
policy refuses ends the request's inserts, since nothing after it could match.

Capacity is in blocks, every block of size 1, and is a hard limit: a full cache
evicts one victim per insert (the metaserver evicts in batches, from its high
watermark to its low one, in the same order).
Besides the policies the metaserver serves, it runs those on trial
(`arc-tlfu`: ARC with TinyLFU admission), which the metaserver does not offer.
Policy `infinite` never evicts: the ceiling any policy can reach on the trace.
Policy `belady` sees the future: it evicts the leaf whose next use is farthest
(a parent's next use is never later than its children's, so leaves suffice) and
refuses a block used never again, or later than anything it would evict: an
offline reference (Belady's rule, with bypass), not a proven optimum once
prefixes must stay whole, and not a policy a cache can run.

A source is a path to a Mooncake-format trace or `gen:SHAPE[:REQUESTS[:SEED]]`,
a trace generated in memory (bench/workloads.py; 4,000 requests, seed 0 unless
given).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterable

from kvfs.metaserver.eviction import DEFAULT_POLICY, POLICIES, TRIAL_POLICIES, Policy

BLOCK_TOKENS = 512  # of the Mooncake traces' hash ids
INFINITE = "infinite"
BELADY = "belady"
GENERATED = "gen:"


def load_requests(source: str | os.PathLike | Iterable[dict], limit: int | None = None) -> list[dict]:
    """Trace records in timestamp order (stable: equal times keep file order)."""
    if isinstance(source, str) and source.startswith(GENERATED):
        from .workloads import generate

        shape, *rest = source[len(GENERATED):].split(":")
        if len(rest) > 2 or not all(x.isdigit() for x in rest):
            raise ValueError(f"a generated trace is gen:SHAPE[:REQUESTS[:SEED]], not {source!r}")
        records = generate(shape, *map(int, rest))
    elif isinstance(source, (str, os.PathLike)):
        with open(source) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    else:
        records = list(source)
    if limit is not None:
        records = records[:limit]
    return sorted(records, key=lambda r: r["timestamp"])


def _chain(hash_ids: list[int], keys: dict[tuple, int]) -> list[int]:
    """Block keys for a request: small ints interned by (parent key, hash id)."""
    out, parent = [], -1
    for h in hash_ids:
        parent = keys.setdefault((parent, h), len(keys))
        out.append(parent)
    return out


def unique_blocks(source, limit: int | None = None) -> int:
    """Distinct blocks in a trace (distinct prefixes of hash ids)."""
    keys: dict[tuple, int] = {}
    for rec in load_requests(source, limit):
        _chain(rec["hash_ids"], keys)
    return len(keys)


class BeladyPolicy(Policy):
    """The offline reference: rank = minus the next use (farthest first), and no
    room for a block whose next use comes after every cached leaf's."""

    name = BELADY

    def __init__(self, uses: dict[int, list[int]], capacity_blocks: int):
        super().__init__()
        self.uses = uses  # block key -> the requests (indices) that use it, in order
        self.capacity_blocks = capacity_blocks

    def next_use(self, key: int, now: int) -> float:
        u = self.uses[key]
        i = bisect.bisect_right(u, now)
        return u[i] if i < len(u) else math.inf

    def _ranked(self, key, block, now, new):
        return -self.next_use(key, now)

    def admit(self, key, parent, size, now):
        if not super().admit(key, parent, size, now) or (mine := self.next_use(key, now)) == math.inf:
            return False
        if len(self) < self.capacity_blocks:
            return True
        farthest = self._front(self._heap)  # the cached leaf used again last
        return farthest is not None and mine < -farthest[0]


def serve(policy: Policy, chain: list, now: int, capacity_blocks: int | None) -> tuple[int, int, int]:
    """One request through `policy`, as the metaserver serves it: its leading cached
    blocks are matched and touched, the rest offered in order and stored while admitted
    and room is made (`capacity_blocks`, a hard limit in blocks of size 1; None: never
    full). Returns (blocks matched, blocks stored, blocks evicted)."""
    matched = 0
    while matched < len(chain) and chain[matched] in policy:
        matched += 1
    for i in range(matched):
        policy.touch(chain[i], chain[i - 1] if i else None, 1, now)
    stored, admitted, evictions = True, 0, 0
    for i in range(matched, len(chain)):
        key, parent = chain[i], chain[i - 1] if i else None
        # after a refusal every later block is refused too (its parent is not
        # cached), but still offered: a policy may learn from what it is offered
        stored = policy.admit(key, parent, 1, now) and stored
        if stored and capacity_blocks is not None and len(policy) >= capacity_blocks:
            # the parent is the request's own deepest block: keep it
            evictions += len(policy.victims(len(policy) + 1 - capacity_blocks, pinned=(parent,)))
            stored = len(policy) < capacity_blocks  # else every cached block is on this path
        if stored:
            policy.touch(key, parent, 1, now)
            admitted += 1
    return matched, admitted, evictions


def simulate(source, capacity_blocks: int | None, policy_name: str, limit: int | None = None) -> dict:
    """One replay; `capacity_blocks` is ignored for policy `infinite`."""
    records = load_requests(source, limit)
    infinite = policy_name == INFINITE
    if not infinite and (capacity_blocks is None or capacity_blocks < 1):
        raise ValueError(f"capacity_blocks must be at least 1 for policy {policy_name!r}")
    if policy_name not in SIMULATED:
        raise ValueError(f"unknown policy {policy_name!r}; known: {', '.join(SIMULATED)}")
    keys: dict[tuple, int] = {}
    chains = [_chain(rec["hash_ids"], keys) for rec in records]
    if policy_name == BELADY:
        uses: dict[int, list[int]] = {}
        for i, chain in enumerate(chains):
            for k in chain:
                uses.setdefault(k, []).append(i)
        policy: Policy = BeladyPolicy(uses, capacity_blocks)
    else:
        policy = RUNNABLE["lru" if infinite else policy_name]()  # infinite: never asked to evict
    prompt_tokens = hit_tokens = hit_requests = hit_blocks = admitted = refused = evictions = 0
    for now, (rec, chain) in enumerate(zip(records, chains)):
        matched, stored, evicted = serve(policy, chain, now, None if infinite else capacity_blocks)
        prompt_tokens += rec["input_length"]
        hit_tokens += min(matched * BLOCK_TOKENS, rec["input_length"])
        hit_requests += matched > 0
        hit_blocks += matched
        admitted += stored
        refused += len(chain) - matched - stored
        evictions += evicted
    return {"policy": policy_name, "capacity_blocks": None if infinite else capacity_blocks,
            "requests": len(records), "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
            "token_hit_ratio": hit_tokens / max(1, prompt_tokens), "hit_requests": hit_requests,
            "hit_blocks": hit_blocks, "admitted": admitted, "refused": refused, "evictions": evictions,
            "cached_blocks": len(policy), "unique_blocks": len(keys)}


RUNNABLE: dict[str, type[Policy]] = {**POLICIES, **TRIAL_POLICIES}  # served ones, then ones on trial
SIMULATED = (*RUNNABLE, BELADY, INFINITE)  # the policies a replay can run


def simulate_all(source, capacities: list[int], policies: list[str], limit: int | None = None) -> dict:
    """Every policy at every capacity, plus the infinite cache, on one trace."""
    records = load_requests(source, limit)
    ceiling = simulate(records, None, INFINITE)
    results = [simulate(records, c, p) for c in capacities for p in policies if p != INFINITE]
    return {"requests": len(records), "unique_blocks": ceiling["unique_blocks"],
            "prompt_tokens": ceiling["prompt_tokens"], "infinite": ceiling, "results": results}


def report_rows(summary: dict) -> list[list[str]]:
    """Table rows (policy, capacity, % of unique blocks, token hit ratio, points
    above LRU's at that capacity, share of the infinite cache's ratio, evictions,
    refused blocks), infinite last. The default policy is marked."""
    unique, best = summary["unique_blocks"], summary["infinite"]["token_hit_ratio"]
    lru = {r["capacity_blocks"]: r["token_hit_ratio"] for r in summary["results"] if r["policy"] == "lru"}
    rows = [[r["policy"] + (" (default)" if r["policy"] == DEFAULT_POLICY else ""), str(r["capacity_blocks"]),
             f"{r['capacity_blocks'] / max(1, unique):.1%}", f"{r['token_hit_ratio']:.1%}",
             f"{100 * (r['token_hit_ratio'] - lru[r['capacity_blocks']]):+.1f}" if r["capacity_blocks"] in lru else "-",
             f"{r['token_hit_ratio'] / best:.0%}" if best else "-", str(r["evictions"]), str(r["refused"])]
            for r in summary["results"]]
    rows.append([INFINITE, "-", "-", f"{best:.1%}", "-", "100%", "0", "0"])
    return rows
