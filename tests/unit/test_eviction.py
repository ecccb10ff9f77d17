"""The eviction policies as pure bookkeeping: leaves first, ranks, watermarks,
stranded descendants, and a closed-under-parent cache whatever the caller does."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.metaserver.eviction import DEFAULT_POLICY, POLICIES, ArcPolicy, LfuDaPolicy, LruPolicy, Watermarks


def chain(policy, keys, now, size=1):
    """Touches `keys` as one request's path, root first."""
    parent = None
    for k in keys:
        assert policy.touch(k, parent, size, now)
        parent = k


def test_registry_names_the_default():
    assert DEFAULT_POLICY in POLICIES
    assert set(POLICIES) >= {"lru", DEFAULT_POLICY}
    for name, cls in POLICIES.items():
        assert cls().name == name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_leaves_go_before_their_parents(name):
    p = POLICIES[name]()
    chain(p, ["a", "b", "c"], now=0)
    chain(p, ["x"], now=1)
    out = p.victims(4)
    assert sorted(out) == ["a", "b", "c", "x"]
    assert out.index("c") < out.index("b") < out.index("a")
    assert len(p) == 0 and p.used_bytes == 0


def test_lru_takes_the_least_recently_used_leaf():
    p = LruPolicy()
    chain(p, ["a", "a1"], now=0)
    chain(p, ["b", "b1"], now=1)
    chain(p, ["a", "a1"], now=2)  # a hit refreshes the whole path
    assert p.victims(1) == ["b1"]
    assert p.victims(1) == ["b"]
    assert p.victims(2) == ["a1", "a"]


def test_an_old_parent_waits_for_its_newer_child():
    p = LruPolicy()
    p.touch("a", None, 1, now=0)
    p.touch("c", None, 1, now=1)
    p.touch("b", "a", 1, now=5)  # a is older than c, but has a cached child
    assert p.victims(1) == ["c"]
    assert p.victims(2) == ["b", "a"]


def test_victims_free_at_least_the_bytes_asked_when_they_can():
    p = LruPolicy()
    for i, size in enumerate([100, 300, 50, 700]):
        p.touch(f"k{i}", None, size, now=i)
    out = p.victims(350)
    assert out == ["k0", "k1"]  # 400 bytes: the oldest until enough
    assert p.used_bytes == 750
    assert sorted(p.victims(10_000)) == ["k2", "k3"]  # asked for more than there is: all of it
    assert p.used_bytes == 0 and p.victims(1) == []


def test_pinned_blocks_and_their_ancestors_stay():
    p = LruPolicy()
    chain(p, ["a", "b"], now=0)
    chain(p, ["c"], now=1)
    assert p.victims(3, pinned={"b"}) == ["c"]
    assert set(p.blocks) == {"a", "b"}
    assert p.victims(2) == ["b", "a"]  # pins last one call


def test_watermarks():
    p = LruPolicy(Watermarks(high=0.9, low=0.8))
    p.touch("a", None, 85, now=0)
    assert not p.over_high(100)
    assert p.over_high(100, incoming=10)
    assert p.bytes_to_low(100, incoming=10) == 15
    assert p.bytes_to_low(1000) == 0
    assert Watermarks() == Watermarks(high=0.90, low=0.80)
    for high, low in [(0.7, 0.8), (1.1, 0.5), (0.9, 0.0)]:
        with pytest.raises(ValueError):
            Watermarks(high=high, low=low)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_removing_a_parent_reports_its_stranded_descendants(name):
    p = POLICIES[name]()
    chain(p, ["a", "b", "c"], now=0)
    chain(p, ["a", "d"], now=1)
    chain(p, ["z"], now=2)
    stranded = p.remove("a")
    assert sorted(stranded) == ["b", "c", "d"]
    assert stranded.index("c") < stranded.index("b")  # children before parents
    assert set(p.blocks) == {"z"} and p.used_bytes == 1
    assert p.remove("a") == []  # already gone
    assert p.victims(5) == ["z"]


def test_removing_a_leaf_makes_its_parent_a_candidate():
    p = LruPolicy()
    chain(p, ["a", "b"], now=0)
    assert p.remove("b") == []
    assert p.victims(1) == ["a"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_block_whose_parent_is_not_cached_is_refused(name):
    p = POLICIES[name]()
    assert not p.admit("b", "a", 1, now=0)
    assert not p.touch("b", "a", 1, now=0)
    assert len(p) == 0 and p.used_bytes == 0
    assert p.admit("a", None, 1, now=0)
    p.touch("a", None, 1, now=0)
    assert p.admit("b", "a", 1, now=0)


def test_lfuda_evicts_a_newcomer_before_a_block_hit_again():
    p = LfuDaPolicy()
    chain(p, ["hot"], now=0)
    chain(p, ["hot"], now=1)
    chain(p, ["new"], now=2)  # more recent, but seen once
    assert p.victims(1) == ["new"]
    chain(p, ["new2"], now=3)
    chain(p, ["new3"], now=4)
    assert p.victims(1) == ["new2"]  # newcomers among themselves: oldest first


def test_lfuda_ghost_gives_a_returning_block_its_count_back():
    p = LfuDaPolicy()
    for now in range(3):
        chain(p, ["back"], now)
    chain(p, ["hot"], now=3)
    chain(p, ["hot"], now=4)
    p.remove("hot")  # not an eviction: forgotten, not remembered
    assert p.victims(1) == ["back"]
    chain(p, ["back"], now=5)  # stored again: a fourth hit, not a first
    chain(p, ["hot"], now=6)  # stored again: a first sighting
    chain(p, ["once"], now=7)
    assert p.victims(2) == ["hot", "once"]
    assert set(p.blocks) == {"back"}


def test_lfuda_ages_out_a_block_that_stopped_being_hit():
    p = LfuDaPolicy()
    for now in range(4):
        chain(p, ["stale"], now)  # rank log2(4) = 2
    evicted, now = [], 4
    while "stale" not in evicted and now < 100:
        chain(p, [f"b{now}"], now)  # each hit twice, then the cache holds two blocks
        chain(p, [f"b{now}"], now + 1)
        evicted += p.victims(len(p) - 2 + 1) if len(p) > 2 else []
        now += 2
    assert "stale" in evicted
    assert now < 20  # L rose past it within a few rounds of proven blocks


def test_lfuda_newcomers_alone_do_not_flush_a_proven_block():
    p = LfuDaPolicy()
    chain(p, ["hot"], now=0)
    chain(p, ["hot"], now=1)
    for now in range(2, 200):
        chain(p, [f"once{now}"], now)
        assert p.victims(1) == [f"once{now}"]
    assert "hot" in p


def test_arc_takes_victims_from_the_segment_past_its_target():
    p = ArcPolicy()
    chain(p, ["hot"], now=0)
    chain(p, ["hot"], now=1)  # used twice: the frequent segment
    for now, key in enumerate(["n1", "n2", "n3"], start=2):
        chain(p, [key], now)
    assert p.recent_bytes == 3 and p.peak_bytes == 4 and p.target == 0.5
    assert p.victims(1) == ["n1"]  # 3 recent blocks, over half the cache: the oldest of them
    assert p.victims(1) == ["hot"]  # 2, not over: the older of the two segments' oldest, unlike LFU-DA
    chain(p, ["fresh"], now=5)
    chain(p, ["fresh"], now=6)
    assert p.victims(1) == ["n2"]  # within its share still, but older than the frequent segment's oldest
    assert p.victims(1) == ["n3"]  # the same
    assert p.victims(1) == ["fresh"]  # nothing left in the recent segment


def test_arc_learns_its_target_from_blocks_wanted_after_their_eviction():
    p = ArcPolicy()
    chain(p, ["hot"], now=0)
    chain(p, ["hot"], now=1)
    for now, key in enumerate(["n1", "n2", "n3"], start=2):
        chain(p, [key], now)
    assert p.victims(2) == ["n1", "hot"]
    chain(p, ["n1"], now=5)  # evicted from the recent segment, wanted again: it should have been larger
    assert p.target == 0.75  # by ARC's step: max(1 frequent ghost / 1 recent ghost, 1) / 4 blocks
    assert p.blocks["n1"].rank == ArcPolicy.FREQUENT and p.recent_bytes == 2  # a second use, in effect
    chain(p, ["hot"], now=6)  # the frequent segment's victim wanted again: smaller
    assert p.target == 0.5


def test_arc_takes_a_recent_leaf_when_no_frequent_block_is_a_leaf():
    p = ArcPolicy()
    chain(p, ["sys"], now=0)
    chain(p, ["sys", "q1"], now=1)  # sys used twice, with a child used once
    assert p.blocks["sys"].rank == ArcPolicy.FREQUENT and p.recent_bytes == 1 <= p.target * p.peak_bytes
    assert p.victims(1) == ["q1"]


def test_stale_heap_entries_are_compacted():
    p = LruPolicy()
    p.touch("a", None, 1, now=0)
    for now in range(1, 10_000):
        p.touch("a", None, 1, now=now)
    assert len(p._heap) <= 4 * len(p) + 1024
    assert p.victims(1) == ["a"]


# ---- any sequence of operations keeps the cache closed under "parent of" ----

ops = st.lists(st.one_of(
    st.tuples(st.just("new"), st.integers(0, 40), st.integers(1, 5)),  # parent index (past the end: a root), size
    st.tuples(st.just("hit"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("evict"), st.integers(0, 12), st.integers(0, 40)),  # bytes, a block to pin
), max_size=120)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_the_caller_applying_what_the_policy_reports_stays_prefix_closed(name, ops):
    p = POLICIES[name]()
    store: dict[int, int | None] = {}  # what the caller holds: key -> parent
    sizes: dict[int, int] = {}
    next_key = 0
    for now, (op, a, b) in enumerate(ops):
        cached = sorted(store)
        if op == "new":
            parent = cached[a] if a < len(cached) else None
            if p.admit(next_key, parent, b, now):
                assert p.touch(next_key, parent, b, now)
                store[next_key], sizes[next_key] = parent, b
            next_key += 1
        elif op == "hit" and cached:
            key = cached[a % len(cached)]
            assert p.touch(key, store[key], sizes[key], now)
        elif op == "remove" and cached:
            key = cached[a % len(cached)]
            stranded = p.remove(key)
            for k in [*stranded, key]:
                del store[k]
        elif op == "evict":
            pinned = {cached[b]} if b < len(cached) else set()
            before = sum(sizes[k] for k in store)
            out = p.victims(a, pinned=pinned)
            assert not pinned & set(out)
            for i, k in enumerate(out):
                assert store[k] not in out[:i]  # its parent was not evicted before it
                del store[k]
            freed = before - sum(sizes[k] for k in store)
            if freed < a:  # only a pinned path may be left
                pin_path = set()
                for k in pinned:
                    while k is not None:
                        pin_path.add(k)
                        k = store[k]
                assert set(store) <= pin_path
        assert set(store) == set(p.blocks)
        if name == "arc":  # the recent segment's size is kept as a running sum: it must stay the sum
            assert p.recent_bytes == sum(b.size for b in p.blocks.values() if b.rank == ArcPolicy.RECENT)
        assert all(parent is None or parent in store for parent in store.values())
        assert p.used_bytes == sum(sizes[k] for k in store)
