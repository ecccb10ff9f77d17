import collections
import random

import pytest

from kvfs.errors import Unavailable
from kvfs.metaserver.chains import Member, Placer, build_chains

MiB = 1 << 20


def members(n, domains=None):
    return [Member(f"cs-{i}", f"host-{i % (domains or n)}") for i in range(n)]


@pytest.mark.parametrize("n,domains,replicas", [(3, 3, 2), (3, 3, 3), (6, 3, 2), (8, 4, 3), (5, 5, 2), (12, 4, 2)])
def test_chains_use_distinct_domains_and_share_load_evenly(n, domains, replicas):
    servers = members(n, domains)
    domain = {s.id: s.failure_domain for s in servers}
    chains = build_chains(servers, replicas)
    assert len(chains) == n
    for chain in chains:
        assert len(chain) == replicas
        assert len({domain[s] for s in chain}) == replicas
    share = collections.Counter(s for c in chains for s in c)
    assert set(share) == {s.id for s in servers}
    assert max(share.values()) - min(share.values()) <= 1
    heads = collections.Counter(c[0] for c in chains)
    assert set(heads.values()) == {1}


def test_too_few_domains_gives_no_chains():
    assert build_chains(members(4, domains=1), 2) == []
    assert build_chains(members(2), 3) == []


def test_chains_do_not_depend_on_input_order():
    servers = members(6, 3)
    assert build_chains(servers, 2) == build_chains(list(reversed(servers)), 2)


def test_a_blocks_chunks_land_on_distinct_chains():
    servers = members(4)
    placer = Placer(build_chains(servers, 2), {s.id: 100 * MiB for s in servers})
    placed = placer.place_block([MiB, MiB, MiB])
    assert len(set(placed)) == 3


def test_placement_balances_bytes_across_equal_servers():
    servers = members(6, 3)
    placer = Placer(build_chains(servers, 2), {s.id: 10_000 * MiB for s in servers})
    placed = collections.Counter()
    for _ in range(300):
        for chain in placer.place_block([MiB, MiB // 2]):
            for s in chain:
                placed[s] += 1
    assert max(placed.values()) / min(placed.values()) < 1.05


def test_placement_favours_free_space():
    servers = members(4)
    free = {"cs-0": 100 * MiB, "cs-1": 1000 * MiB, "cs-2": 1000 * MiB, "cs-3": 1000 * MiB}
    placer = Placer(build_chains(servers, 2), free)
    counts = collections.Counter()
    for _ in range(200):
        for chain in placer.place_block([MiB]):
            counts.update(chain)
    assert counts["cs-0"] < 0.5 * min(counts["cs-1"], counts["cs-2"], counts["cs-3"])


def test_full_cluster_and_no_chains_are_unavailable():
    servers = members(3)
    placer = Placer(build_chains(servers, 2), {s.id: MiB for s in servers})
    placer.place_block([MiB])
    with pytest.raises(Unavailable, match="full"):
        for _ in range(3):
            placer.place_block([MiB])
    with pytest.raises(Unavailable, match="failure domains"):
        Placer([], {})


def test_each_block_goes_to_the_chains_with_the_most_room_among_many():
    # 40 servers in 10 domains, uneven free space: every block's chunks go to the chains whose
    # fullest server has the most room left as the block is placed (a chain is re-filed only
    # when a chunk lands on one of its servers, so each pick is checked against all chains)
    rng = random.Random(7)
    servers = members(40, 10)
    chains = build_chains(servers, 2)
    free = {s.id: rng.randrange(1000, 1100) * MiB for s in servers}  # close: each block reorders them
    placer = Placer(chains, free)
    for _ in range(1000):
        room = sorted((min(placer.free[s] for s in c) for c in chains), reverse=True)
        placed = placer.place_block([MiB, MiB // 2])
        assert len(set(placed)) == 2
        got = sorted((min(placer.free[s] + MiB * (s in placed[0]) + MiB // 2 * (s in placed[1]) for s in c)
                      for c in placed), reverse=True)
        assert got == room[:2]
