"""Hash slots and shard maps (kvfs.shards): pure data, no servers."""

import json
import os

import pytest

from kvfs.keys import Namespace, block_keys
from kvfs.shards import HASH_SLOTS, MAX_MAP_BYTES, Owner, ShardMap, balance, hash_slot


def owners(n: int) -> list[Owner]:
    return [Owner(f"m{i}", f"10.0.0.{i}:7000") for i in range(n)]


def test_a_prompts_blocks_share_its_first_keys_slot_and_slots_spread_evenly():
    ns = Namespace("t", "m")
    counts = [0] * 16
    for i in range(4096):
        keys = block_keys(ns, [i] * 64 + [7] * 128, 64)
        slot = hash_slot(keys[0])
        assert 0 <= slot < HASH_SLOTS
        counts[slot * 16 // HASH_SLOTS] += 1
    assert min(counts) > 4096 / 16 * 0.7 and max(counts) < 4096 / 16 * 1.3  # uniform: 256 each, give or take
    with pytest.raises(ValueError, match="at least 2 bytes"):
        hash_slot(b"x")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 256, 300])
def test_even_maps_give_every_slot_one_owner_in_near_equal_contiguous_ranges(n):
    m = ShardMap.even(owners(n))
    counts = m.counts()
    assert sum(counts.values()) == HASH_SLOTS and len(counts) == n
    assert max(counts.values()) - min(counts.values()) <= 1
    assert runs(m) == n


def runs(m: ShardMap) -> int:
    return sum(1 for s in range(1, HASH_SLOTS) if m.slots[s] != m.slots[s - 1]) + 1


def test_adding_an_owner_moves_only_its_share_and_removing_spreads_the_slots_over_the_rest():
    m4 = ShardMap.even(owners(4))
    m5 = m4.adding(Owner("m4", "10.0.0.4:7000"))
    assert m5.epoch == m4.epoch + 1
    moved = sum(last - first + 1 for first, last, _, _ in m4.moves(m5))
    assert moved == HASH_SLOTS // 5 == m5.counts()["m4"]  # nothing moves between the old owners
    assert all(to == "m4" for _, _, _, to in m4.moves(m5))
    assert max(m5.counts().values()) - min(m5.counts().values()) <= 1
    m3 = m4.removing("m1")
    assert [o.id for o in m3.owners] == ["m0", "m2", "m3"] and m3.epoch == m4.epoch + 1
    assert {s: m3.owner_of(s).id for s in range(HASH_SLOTS) if m4.owner_of(s).id != "m1"} == \
        {s: m4.owner_of(s).id for s in range(HASH_SLOTS) if m4.owner_of(s).id != "m1"}  # survivors keep theirs
    assert max(m3.counts().values()) - min(m3.counts().values()) <= 1
    assert {frm for _, _, frm, _ in m4.moves(m3)} == {"m1"}
    assert runs(m3) <= runs(m4) + 2  # the freed range goes out in runs, not slot by slot
    m1 = ShardMap.even(owners(8)).removing("m0", "m3", "m5", "m6", "m7")
    assert [o.id for o in m1.owners] == ["m1", "m2", "m4"]
    assert max(m1.counts().values()) - min(m1.counts().values()) <= 1 and runs(m1) <= 8
    with pytest.raises(ValueError, match="already"):
        m4.adding(Owner("m2", "x:1"))
    with pytest.raises(KeyError):
        m4.removing("nobody")
    with pytest.raises(ValueError, match="at least one owner"):
        ShardMap.even(owners(2)).removing("m0", "m1")


@pytest.mark.parametrize("n", [3, 300])
def test_a_map_survives_json_and_routes_a_key_to_the_owner_of_its_slot(n):
    m = ShardMap.even(owners(n)).adding(Owner("m-new", "h:1")).removing("m0")
    again = ShardMap.from_json(m.to_json())
    assert again == m and len(m.to_json()) < MAX_MAP_BYTES
    key = os.urandom(16)
    assert again.route(key) == m.owner_of(hash_slot(key))
    assert len(m.slots_of("m-new")) == m.counts()["m-new"]


def test_moves_merges_neighbouring_slots_into_ranges():
    m2 = ShardMap.even(owners(2))
    m3 = m2.adding(Owner("m2", "h:1"))
    got = m2.moves(m3)
    assert sum(last - first + 1 for first, last, _, _ in got) == HASH_SLOTS // 3
    assert len(got) == 2 and all(to == "m2" for *_, to in got)  # a run from the end of each old owner's range


def _doc(**change):
    doc = json.loads(ShardMap.even(owners(2)).to_json())
    doc.update(change)
    return json.dumps(doc)


@pytest.mark.parametrize("raw, message", [
    ("{", "not a shard map"),
    ("[]", "not a shard map"),
    (_doc(epoch="1"), "epoch is an integer"),
    (_doc(epoch=-1), "0 to 2"),
    (_doc(owners=[["m0"]]), "string pairs"),
    (_doc(owners=[]), "1 to"),
    (_doc(owners=[["m0", "a:1"], ["m0", "b:1"]]), "repeat"),
    (_doc(owners=[["", "a:1"], ["m1", "b:1"]]), "an owner id is"),
    (_doc(owners=[["m" * 200, "a:1"], ["m1", "b:1"]]), "an owner id is"),
    (_doc(owners=[["m0/x", "a:1"], ["m1", "b:1"]]), "an owner id is"),
    (_doc(owners=[["m0\n", "a:1"], ["m1", "b:1"]]), "an owner id is"),
    (_doc(owners=[["m0", "not an address"], ["m1", "b:1"]]), "host:port"),
    (_doc(owners=[["m0", "a:99999"], ["m1", "b:1"]]), "host:port"),
    (_doc(epoch=1 << 63), "2\\*\\*63"),
    (_doc(ranges=[[0, HASH_SLOTS - 1, 2]]), "owner index 2 is not one of the 2"),
    (_doc(ranges=[[0, HASH_SLOTS - 1, -1]]), "owner index -1"),
    ("[" * 100_000 + "]" * 100_000, "not a shard map"),
    (_doc(ranges=[[0, HASH_SLOTS, 0]]), "outside"),
    (_doc(ranges=[[5, 4, 0], [0, HASH_SLOTS - 1, 1]]), "outside"),
    (_doc(ranges=[[0, 100, 0], [100, HASH_SLOTS - 1, 1]]), "overlaps"),
    (_doc(ranges=[[0, 100, 0], [102, HASH_SLOTS - 1, 1]]), "slot 101 has no owner"),
    (_doc(ranges=[[0, HASH_SLOTS - 1, True]]), "first, last, owner index"),
    (_doc(ranges=[[0, 1]]), "first, last, owner index"),
    (_doc(ranges=[[s, s, 0] for s in range(HASH_SLOTS + 1)]), "at most"),
    ("x" * (MAX_MAP_BYTES + 1), "at most"),
])
def test_a_bad_map_is_refused_saying_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        ShardMap.from_json(raw)


def test_balance_is_max_and_min_over_the_mean():
    assert balance([10, 20, 30]) == {"max_over_mean": 1.5, "min_over_mean": 0.5}
    assert balance([0, 0]) == {"max_over_mean": 0.0, "min_over_mean": 0.0}


def test_shard_balance_counts_each_prefix_trees_blocks_and_lookups_on_its_first_blocks_shard(tmp_path):
    from kvfs.bench.shards import root_slots, shard_balance
    from kvfs.keys import Namespace

    # three roots: 1 (two requests, blocks 1, 1-2, 1-2-3, 1-5), 4 (one request, 4, 4-2), 9 (one request, 9)
    trace = tmp_path / "t.jsonl"
    reqs = [[1, 2, 3], [1, 5], [4, 2], [9], []]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(h), "output_length": 1,
                                         "hash_ids": h}) + "\n" for i, h in enumerate(reqs)))
    r = shard_balance(str(trace), [1, 2, 3], block_tokens=64)
    assert (r["requests"], r["roots"], r["blocks"]) == (4, 3, 7)
    assert r["hottest_root_lookup_share"] == 0.5 and r["largest_root_block_share"] == 4 / 7
    slot = root_slots({1, 4, 9}, 64, Namespace("bench", "shards"))
    per_root_blocks, per_root_lookups = {1: 4, 4: 2, 9: 1}, {1: 2, 4: 1, 9: 1}
    for x in r["results"]:
        m = ShardMap.even(owners(x["metaservers"]))  # the same even split, whatever the owners' names
        want_blocks, want_lookups = [0] * len(m.owners), [0] * len(m.owners)
        for root in (1, 4, 9):
            i = m.slots[slot[root]]
            want_blocks[i] += per_root_blocks[root]
            want_lookups[i] += per_root_lookups[root]
        assert (x["blocks"], x["lookups"]) == (want_blocks, want_lookups)
        assert x["blocks_balance"] == balance(want_blocks)
    assert r["results"][0]["blocks"] == [7] and r["results"][0]["lookups"] == [4]
    with pytest.raises(ValueError, match="block_tokens"):
        shard_balance(str(trace), [2], block_tokens=513)
