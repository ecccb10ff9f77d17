"""arc-tlfu: ARC with TinyLFU-style admission, as pure bookkeeping: the frequency
sketch (counting, aging, a fixed size), and admission over the prefix tree (a
one-off tail may not push out a frequent block; what is refused takes its
descendants along; a next turn still displaces recent blocks)."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.bench.simulate import SIMULATED, simulate
from kvfs.bench.simulate import serve as serve_request
from kvfs.metaserver.eviction import (DEFAULT_POLICY, POLICIES, TRIAL_POLICIES, ArcPolicy, ArcTinyLfuPolicy,
                                      FrequencySketch)


def serve(p, chain, now, capacity):
    """One request through `p` as the simulator replays it; how many leading blocks matched."""
    return serve_request(p, chain, now, capacity)[0]


# ---- the sketch ------------------------------------------------------------

def test_the_sketch_counts_each_sighting():
    s = FrequencySketch(1024)
    assert [s.add("a") for _ in range(3)] == [1, 2, 3]
    s.add("b")
    assert (s.estimate("a"), s.estimate("b"), s.estimate("never seen")) == (3, 1, 0)


def test_counts_saturate_at_four_bits():
    s = FrequencySketch(1024)
    for _ in range(40):
        s.add(7)
    assert s.estimate(7) == FrequencySketch.MAX == 15
    assert s.additions == 15  # saturated sightings are not counted towards aging


def test_counts_halve_once_the_sketch_has_counted_its_width():
    s = FrequencySketch(1024)
    for _ in range(12):
        s.add("hot")
    for k in range(1024 - 12 - 1):  # one short of the width: no aging yet
        s.add(k)
    assert (s.estimate("hot"), s.halvings) == (12, 0)
    s.add("one more")
    assert (s.estimate("hot"), s.halvings) == (6, 1)
    assert s.estimate(5) == 0  # a count of 1 halves to nothing
    assert s.additions == 512


def test_growing_keeps_every_estimate():
    s = FrequencySketch(1024)
    for k in range(300):
        for _ in range(k % 5):
            s.add(k)
    before = [s.estimate(k) for k in range(300)]
    s.grow(3000)
    assert s.width == 4096 and s.nbytes() == 4 * 4096
    assert [s.estimate(k) for k in range(300)] == before


def test_the_policy_state_is_fixed_size_whatever_goes_through_it():
    p = ArcTinyLfuPolicy()
    capacity = 100
    for now in range(5000):  # 20,000 distinct blocks through a cache of 100
        serve(p, [(now, j) for j in range(4)], now, capacity)
    assert len(p) <= capacity
    assert p.sketch.width == 1024 and p.sketch.nbytes() == 4 * 1024  # set by the cache, not by the keys
    assert len(p.ghost) <= 2 * max(1024, p.peak_blocks)  # ArcPolicy's own bound


def test_the_sketch_grows_with_the_cache_not_with_traffic():
    p = ArcTinyLfuPolicy()
    for now in range(3000):
        serve(p, [(now, j) for j in range(2)], now, capacity=5000)  # 6,000 blocks: fills to 5,000
    assert p.peak_blocks == 5000 and p.sketch.width == 8192


# ---- admission -------------------------------------------------------------

HOT = ["h1", "h2"]


def warm(p, capacity):
    """A hot prefix used four times (frequent), then one-block one-offs until the cache
    has evicted (one of them: the recent segment is past its share); returns the
    one-offs still cached."""
    for now in range(4):
        serve(p, HOT, now, capacity)
    one_offs = []
    while not p.ghost and len(one_offs) < 2 * capacity:  # ghost: what was evicted
        one_offs.append(f"o{len(one_offs)}")
        serve(p, one_offs[-1:], 4 + len(one_offs), capacity)
    assert set(HOT) <= set(p.blocks) and len(p) == capacity
    return [k for k in one_offs if k in p.blocks]


def test_a_one_off_tail_may_not_push_out_a_frequent_block():
    capacity = 5
    tail = [f"x{i}" for i in range(8)]
    tlfu, arc = ArcTinyLfuPolicy(), ArcPolicy()
    for p in (tlfu, arc):
        warm(p, capacity)
        serve(p, tail, 20, capacity)
    # ARC takes the long tail's room from the frequent segment: each new block is the
    # next one's pinned parent, so the recent segment has no leaf to give up
    assert not set(HOT) & set(arc.blocks)
    # the sketch says h1 and h2 are used more than any block of the tail: refused instead
    assert set(HOT) <= set(tlfu.blocks) and tlfu.refusals >= 1
    assert serve(tlfu, HOT, 21, capacity) == 2 and serve(arc, HOT, 21, capacity) == 0


def test_what_follows_a_refused_block_is_not_stored_but_is_counted():
    capacity = 5
    p = ArcTinyLfuPolicy()
    warm(p, capacity)
    tail = [f"x{i}" for i in range(8)]
    serve(p, tail, 20, capacity)
    assert p.refusals == 1
    cut = next(i for i, k in enumerate(tail) if k not in p.blocks)
    assert cut > 0 and not set(tail[cut:]) & set(p.blocks)  # nothing after the first refusal
    assert not p.admit(tail[cut + 1], tail[cut], 1, 21)  # the policy itself refuses an orphan
    assert not p.touch(tail[cut + 1], tail[cut], 1, 21)
    assert all(p.sketch.estimate(k) >= 1 for k in tail)  # offered, so seen
    assert all(p.blocks[k].parent in p.blocks for k in p.blocks if p.blocks[k].parent is not None)


def test_a_block_seen_often_is_admitted_where_a_one_off_is_not():
    capacity = 5
    p = ArcTinyLfuPolicy()
    warm(p, capacity)
    now = 10
    # a prefix refused (or evicted) before, offered again and again: its count climbs
    # past the hot blocks' and it gets in, pushing the hot ones out
    back = ["b1", "b2", "b3", "b4"]
    for _ in range(8):
        now += 1
        serve(p, back, now, capacity)
        if set(back) <= set(p.blocks):
            break
    assert set(back) <= set(p.blocks)
    assert p.sketch.estimate("b1") >= p.sketch.estimate("h1")


def test_a_next_turn_still_displaces_a_recent_block():
    """A conversation's new tail is a first sighting; where the recent segment has a
    leaf to give up (another conversation's old turn), it goes in whatever the sketch
    says: a doorkeeper would cost every next-turn hit."""
    capacity = 6
    p = ArcTinyLfuPolicy()
    one_offs = warm(p, capacity)
    for k in one_offs:  # the old one-offs are counted often (refusals, retries) ...
        for _ in range(5):
            p.sketch.add(k)
    serve(p, ["c1", "c2"], 20, capacity)  # ... yet a new turn displaces it, not refused
    assert {"c1", "c2"} <= set(p.blocks) and p.refusals == 0
    assert serve(p, ["c1", "c2", "c3"], 21, capacity) == 2  # the next turn hits


def test_nothing_is_refused_before_the_cache_first_evicts():
    p = ArcTinyLfuPolicy()
    for now in range(6):
        serve(p, HOT, now, capacity=100)
    for k in range(50):
        assert p.admit(("new", k), None, 1, 10)
    assert p.refusals == 0


# ---- in the simulator ------------------------------------------------------

def write_trace(tmp_path, requests):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(h), "output_length": 1,
                                        "hash_ids": h}) + "\n" for t, h in enumerate(requests)))
    return path


def test_the_simulator_runs_it_and_the_metaserver_does_not_offer_it(tmp_path):
    assert "arc-tlfu" in TRIAL_POLICIES and "arc-tlfu" in SIMULATED
    assert "arc-tlfu" not in POLICIES and DEFAULT_POLICY == "arc"  # config choices are POLICIES
    # a hot prefix, one-offs until the cache has evicted, a long one-off, the hot prefix again
    path = write_trace(tmp_path, [[1, 2]] * 4 + [[20], [21], [22], [23]] + [list(range(10, 18)), [1, 2]])
    tlfu, arc = simulate(path, 5, "arc-tlfu"), simulate(path, 5, "arc")
    assert tlfu["hit_tokens"] == 3 * 1024 + 1024 > arc["hit_tokens"] == 3 * 1024  # the last [1, 2] hits
    assert tlfu["refused"] == 5  # the long one-off's last 5 blocks (arc's cache ends up all its path: 3 refused)
    assert tlfu["admitted"] + tlfu["refused"] + tlfu["hit_blocks"] == 4 * 2 + 4 + 8 + 2


ops = st.lists(st.one_of(
    st.tuples(st.just("request"), st.lists(st.integers(0, 6), min_size=1, max_size=6)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, capacity=st.integers(2, 8))
def test_the_cache_stays_prefix_closed_and_within_capacity(ops, capacity):
    p = ArcTinyLfuPolicy()
    for now, (op, arg) in enumerate(ops):
        if op == "request":
            chain, parent = [], None
            for h in arg:  # keys are whole prefixes, as the simulator chains them
                parent = (parent, h)
                chain.append(parent)
            serve(p, chain, now, capacity)
        elif p.blocks:
            key = sorted(p.blocks, key=repr)[arg % len(p.blocks)]
            p.remove(key)
        assert len(p) <= capacity
        assert all(b.parent is None or b.parent in p.blocks for b in p.blocks.values())
        assert p.recent_bytes == sum(b.size for b in p.blocks.values() if b.rank == ArcPolicy.RECENT)
