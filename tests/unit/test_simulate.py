"""The offline trace simulator: exact ratios on hand-made traces, consistent
counts on the shipped one."""

import json
import pathlib

import pytest

from kvfs.bench.simulate import load_requests, report_rows, simulate, simulate_all, unique_blocks
from kvfs.metaserver.eviction import POLICIES

SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_first500.jsonl"


def write_trace(tmp_path, requests):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": h}) + "\n"
                            for t, n, h in requests))
    return path


# (timestamp, input tokens, hash ids); file order differs from time order on purpose
SMALL = [(1, 1536, [1, 2, 3]), (0, 1024, [1, 2]), (2, 1024, [4, 5]), (3, 1000, [1, 2])]
TOTAL = 1024 + 1536 + 1024 + 1000


def test_infinite_cache_on_a_small_trace(tmp_path):
    r = simulate(write_trace(tmp_path, SMALL), None, "infinite")
    # [1,2] misses; [1,2,3] hits 2 blocks; [4,5] misses; [1,2] hits its 1,000 tokens
    assert (r["hit_tokens"], r["prompt_tokens"]) == (1024 + 1000, TOTAL)
    assert r["token_hit_ratio"] == pytest.approx(2024 / TOTAL)
    assert (r["hit_requests"], r["hit_blocks"], r["admitted"], r["evictions"]) == (2, 4, 5, 0)
    assert r["unique_blocks"] == 5


def test_lru_on_a_small_trace(tmp_path):
    r = simulate(write_trace(tmp_path, SMALL), 3, "lru")
    # {1,2} -> {1,2,3} -> [4,5] evicts 3 then 2 -> {1,4,5}; [1,2] matches 1 block,
    # evicts 5 (1 is its own path) to store 2 again
    assert r["hit_tokens"] == 1024 + 512
    assert r["token_hit_ratio"] == pytest.approx(1536 / TOTAL)
    assert (r["evictions"], r["admitted"], r["refused"], r["cached_blocks"]) == (3, 6, 0, 3)


def test_lfuda_keeps_a_hot_prefix_that_lru_loses(tmp_path):
    hot, one_offs = [1, 2], [[10, 11], [12, 13]]
    path = write_trace(tmp_path, [(0, 1024, hot), (1, 1024, hot), (2, 1024, one_offs[0]), (3, 1024, one_offs[1]),
                                  (4, 1024, hot)])
    assert simulate(path, 4, "lru")["hit_tokens"] == 1024  # the one-offs pushed [1, 2] out
    assert simulate(path, 4, "lfuda")["hit_tokens"] == 2048  # they only displaced each other


def test_a_hash_id_after_another_predecessor_is_another_block(tmp_path):
    path = write_trace(tmp_path, [(0, 1024, [1, 2]), (1, 1024, [9, 2]), (2, 1024, [9, 2])])
    assert unique_blocks(path) == 4
    r = simulate(path, None, "infinite")
    assert r["hit_tokens"] == 1024  # only the third request, on [9, 2]


def test_a_capacity_smaller_than_a_request_caches_its_head(tmp_path):
    path = write_trace(tmp_path, [(0, 2048, [1, 2, 3, 4]), (1, 2048, [1, 2, 3, 4])])
    r = simulate(path, 2, "lru")
    # once 1 and 2 fill the cache, the only leaf is 2, pinned as 3's parent:
    # the request's tail is refused rather than its head evicted
    assert (r["cached_blocks"], r["evictions"], r["refused"]) == (2, 0, 4)
    assert r["hit_tokens"] == 1024
    assert r["admitted"] + r["refused"] + r["hit_blocks"] == 8


def test_bad_arguments(tmp_path):
    path = write_trace(tmp_path, SMALL)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(path, 3, "fifo")
    with pytest.raises(ValueError, match="at least 1"):
        simulate(path, 0, "lru")


def test_records_are_replayed_in_time_order(tmp_path):
    assert [r["timestamp"] for r in load_requests(write_trace(tmp_path, SMALL))] == [0, 1, 2, 3]
    assert len(load_requests(write_trace(tmp_path, SMALL), limit=2)) == 2


def test_first_500_requests_of_the_shipped_trace_add_up():
    records = load_requests(SHIPPED, limit=500)
    blocks = sum(len(r["hash_ids"]) for r in records)
    unique = unique_blocks(records)
    summary = simulate_all(records, [unique // 20, unique // 5], sorted(POLICIES))
    best = summary["infinite"]
    assert summary["unique_blocks"] == unique and best["evictions"] == 0
    assert best["admitted"] == unique and best["cached_blocks"] == unique
    assert len(summary["results"]) == 2 * len(POLICIES)
    for r in [best, *summary["results"]]:
        assert r["requests"] == 500
        assert 0 <= r["hit_tokens"] <= r["prompt_tokens"] == best["prompt_tokens"]
        assert r["token_hit_ratio"] <= best["token_hit_ratio"]
        assert r["admitted"] + r["refused"] + r["hit_blocks"] == blocks
        assert r["hit_requests"] <= r["requests"]
        if r is not best:
            assert r["cached_blocks"] == r["admitted"] - r["evictions"] <= r["capacity_blocks"]
    rows = report_rows(summary)
    assert len(rows) == len(summary["results"]) + 1 and rows[-1][0] == "infinite"
    json.dumps(summary)  # JSON-friendly


def test_belady_keeps_what_comes_back_soonest_and_never_stores_what_never_does(tmp_path):
    # [1,2] returns at the end, [3,4] never: the offline reference keeps [1,2] and refuses [3,4]
    path = write_trace(tmp_path, [(0, 1024, [1, 2]), (1, 1024, [3, 4]), (2, 1024, [5, 6]), (3, 1024, [5, 6]),
                                  (4, 1024, [1, 2])])
    b, lru = simulate(path, 4, "belady"), simulate(path, 4, "lru")
    assert b["hit_tokens"] == 2048 > lru["hit_tokens"] == 1024
    assert b["refused"] == 2 and b["evictions"] == 0  # [3,4], used never again; [5,6] fits beside [1,2]
    assert b["admitted"] + b["refused"] + b["hit_blocks"] == 10


def test_belady_bounds_every_policy_on_the_shipped_trace():
    records = load_requests(SHIPPED, limit=500)
    unique = unique_blocks(records)
    for capacity in (unique // 20, unique // 5):
        bound = simulate(records, capacity, "belady")["hit_tokens"]
        for name in POLICIES:
            assert simulate(records, capacity, name)["hit_tokens"] <= bound


def test_a_generated_source_is_a_seeded_trace():
    a = load_requests("gen:chat:60:3")
    assert len(a) == 60 and a == load_requests("gen:chat:60:3") != load_requests("gen:chat:60:4")
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)
    for bad in ("gen:chat:many", "gen:chat:1:2:3"):
        with pytest.raises(ValueError, match="gen:SHAPE"):
            load_requests(bad)
    with pytest.raises(ValueError, match="unknown workload shape"):
        load_requests("gen:tweets")
