"""`kvfs-bench shards`: how evenly hash slots spread a trace over N metaservers.

Each request's prefix is routed by its chain's first key (kvfs.shards), the real
key: the first hash id becomes its deterministic 512-token run (as `kvfs-bench
trace` replays it), and its first `block_tokens` tokens are keyed under a bench
namespace. A metaserver's blocks are the distinct 512-token blocks (chained
hash-id prefixes) of the prefixes routed to it; its lookups are the requests
routed to it. Slots are spread evenly (ShardMap.even), so what is left uneven is
the trace's: a root many requests share cannot be split, and the hottest root's
share of all lookups is a floor under the busiest metaserver's.
"""

from __future__ import annotations

import random
from collections import Counter

from kvfs.keys import Namespace, block_keys
from kvfs.shards import Owner, ShardMap, balance, hash_slot

from .simulate import BLOCK_TOKENS, _chain, load_requests

VOCAB = 32000


def root_slots(first_ids: set[int], block_tokens: int, namespace: Namespace) -> dict[int, int]:
    """The hash slot of each first hash id's prefix, from its real first block key."""
    out = {}
    for h in first_ids:
        rng = random.Random(f"block-{h}")  # bench/restore.load_trace's tokens for hash id h
        tokens = [rng.randrange(VOCAB) for _ in range(block_tokens)]
        out[h] = hash_slot(block_keys(namespace, tokens, block_tokens)[0])
    return out


def shard_balance(source, counts: list[int], block_tokens: int = 64, limit: int | None = None) -> dict:
    """Blocks and lookups per metaserver for each metaserver count in `counts`."""
    if not 1 <= block_tokens <= BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be 1..{BLOCK_TOKENS} (the first key covers part of a trace block)")
    records = [r for r in load_requests(source, limit) if r["hash_ids"]]
    keys: dict[tuple, int] = {}
    root_of_block: dict[int, int] = {}
    lookups_per_root: Counter = Counter()
    for rec in records:
        root = rec["hash_ids"][0]
        lookups_per_root[root] += 1
        for k in _chain(rec["hash_ids"], keys):
            root_of_block.setdefault(k, root)
    blocks_per_root = Counter(root_of_block.values())
    slot = root_slots(set(lookups_per_root), block_tokens, Namespace("bench", "shards"))
    hottest = lookups_per_root.most_common(1)[0][1] / len(records) if records else 0.0
    largest = blocks_per_root.most_common(1)[0][1] / len(root_of_block) if root_of_block else 0.0
    out = []
    for n in counts:
        shard_map = ShardMap.even([Owner(f"meta-{i}", f"meta-{i}:7000") for i in range(n)])
        blocks, lookups = Counter(), Counter()
        for root, k in blocks_per_root.items():
            blocks[shard_map.owner_of(slot[root]).id] += k
        for root, k in lookups_per_root.items():
            lookups[shard_map.owner_of(slot[root]).id] += k
        ids = [o.id for o in shard_map.owners]
        out.append({"metaservers": n, "blocks": [blocks[i] for i in ids], "lookups": [lookups[i] for i in ids],
                    "blocks_balance": balance(blocks[i] for i in ids),
                    "lookups_balance": balance(lookups[i] for i in ids)})
    return {"requests": len(records), "blocks": len(root_of_block), "roots": len(lookups_per_root),
            "block_tokens": block_tokens, "hottest_root_lookup_share": hottest,
            "largest_root_block_share": largest, "results": out}
