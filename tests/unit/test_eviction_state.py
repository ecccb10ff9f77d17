"""Capacity eviction in MetaState, in-process with a fake clock: RocksDB on disk, no sockets.

Every block here is one 256-byte chunk, which a chunkserver stores in a 64 KiB
slot; three servers of 2 MiB with two replicas hold 48 such blocks, so the
high watermark (90%) is at 43.2 blocks and the low one (80%) at 38.4.

After every scenario the database is checked whole: each row's index entries
(expiry, eviction for leaves only, children, replicas) exist and nothing else
does, the counters add up, and every block's parent is stored.
"""

import dataclasses
import functools
import time

import pytest

from kvfs.metaserver.blocks import FREQUENT, MIN_EVICT_SLICE
from kvfs.metaserver.config import MetaserverConfig
from kvfs.keys import Namespace, block_keys
from kvfs.metaserver import records
from kvfs.metaserver.db import Batch
from kvfs.metaserver.eviction import DEFAULT_POLICY, POLICIES
from kvfs.proto import meta_pb2

from helpers import Clock, assert_metadata_consistent as assert_consistent, block_rows as rows, keys_under

NS = Namespace("t", "evict")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256-byte blocks
BLOCK = 64 * 1024  # the slot each block's one chunk takes
SYSTEM = list(range(16))  # a 4-block prefix every conversation shares



@pytest.fixture
def make_state(make_state):
    # small servers: a few dozen blocks fill them
    return functools.partial(make_state, capacity=2 << 20)


def conversation(i: int) -> list[bytes]:
    return block_keys(NS, SYSTEM + [1000 * i + j for j in range(16)], 4)


def write(state, keys, first=0, ttl_class="chat"):
    """What Client.write does: allocate keys[first:] (naming the block before them), commit all."""
    alloc = state.allocate(NS.digest, keys[first:], LAYOUT_MSG, keys[first - 1] if first else b"")
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class=ttl_class)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return state.commit(NS.digest, req) if req.blocks else (0, len(alloc.blocks), [])


def serve(state, keys, ttl_class="chat"):
    """A request: look up its prefix, write back what was missing."""
    matched = state.match(NS.digest, keys).matched
    return write(state, keys, matched, ttl_class)


def cached(state, keys) -> list[bool]:
    return [state.blocks.row(NS.digest + k) is not None for k in keys]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_write_past_the_high_watermark_evicts_old_leaves_first_down_to_the_low_one(make_state, policy):
    clock = Clock()
    state = make_state(clock, policy)
    assert state.capacity_bytes() == 48 * BLOCK
    for i in range(9):  # 4 + 9 * 4 = 40 blocks: under the high watermark
        clock.now = 1000 + i
        assert serve(state, conversation(i))[0] == (8 if i == 0 else 4)
    assert state.evicted_blocks == 0 and state.cache_bytes == 40 * BLOCK
    clock.now = 1009.5
    assert state.match(NS.digest, conversation(0)).matched == 8  # the oldest conversation, used again
    state.flush_last_used()
    clock.now = 1010
    assert serve(state, conversation(9))[0] == 4  # 44 blocks would pass 43.2: eviction, not failure
    # the write itself evicts what it brings (4 blocks), which takes the cache under the high mark
    assert state.evicted_blocks == 4 and state.cache_bytes == 40 * BLOCK
    while state.evict_slice(limit=2):  # the background pass: on down to the low watermark (38.4 blocks)
        pass
    # 6 blocks went in all, the least recently used leaves first, each block after its children
    c1, c2 = conversation(1), conversation(2)
    assert state.evicted_blocks == 6
    assert cached(state, c1) == [True] * 4 + [False] * 4 and cached(state, c2) == [True] * 6 + [False] * 2
    assert state.cache_bytes == 38 * BLOCK <= 0.8 * state.capacity_bytes()
    assert_consistent(state)
    queued = {cid for q in state.undeleted.values() for cid in q}
    assert len(queued) == 6  # their chunks wait for the lifecycle's delete pass
    assert state.match(NS.digest, conversation(0)).matched == 8  # recently matched: kept
    assert state.match(NS.digest, conversation(1)).matched == 4  # only the shared system prompt is left
    assert state.match(NS.digest, conversation(2)).matched == 6
    assert state.match(NS.digest, conversation(9)).matched == 8


def past_the_high_watermark(make_state):
    """A state with 40 blocks cached: ten conversations, 44 blocks, the last write passed
    the high watermark (43.2) and evicted 4."""
    clock = Clock()
    state = make_state(clock)
    for i in range(10):
        clock.now = 1000 + i
        write(state, conversation(i))
    assert state.evicted_blocks == 4 and state.cache_bytes == 40 * BLOCK
    return state


def test_a_background_slice_out_of_time_stops_after_one_block_and_the_next_slices_go_on(make_state):
    state = past_the_high_watermark(make_state)
    slices = []
    while n := state.evict_slice(limit=64, seconds=-1.0):  # a deadline already past
        slices.append(n)
    # MIN_EVICT_SLICE (one) block a slice, the least recently used leaves first, down to the low
    # watermark (38.4)
    assert slices == [MIN_EVICT_SLICE] * 2 == [1, 1] and state.cache_bytes == 38 * BLOCK
    assert cached(state, conversation(0)) == [True] * 4 + [False] * 4
    assert cached(state, conversation(1)) == [True] * 6 + [False] * 2
    assert_consistent(state)
    # with time to spare, the count bounds a slice: nothing left above the low mark
    assert state.evict_slice(limit=64, seconds=10.0) == 0


def test_a_slice_stops_removing_while_its_batch_write_can_still_end_by_its_deadline(make_state):
    state = past_the_high_watermark(make_state)
    state.blocks.removal_write_s = 10.0  # each removal's share of the slice's write, as if measured
    slices = []
    while n := state.evict_slice(limit=64, seconds=5.0):  # time for the removals, not for such a write
        slices.append(n)
    assert slices == [1, 1] and state.cache_bytes == 38 * BLOCK  # one block a slice, as if out of time
    # each slice timed its write, and the estimate moved towards what it took
    assert state.blocks.removal_write_s < 10.0 * (1 - 0.2) ** 2 + 0.01
    # with time for the estimated write too, the need bounds a slice: the 2 blocks asked for
    assert state._evict(2 * BLOCK, frozenset(), 64, deadline=time.perf_counter() + 60.0) == 2
    assert_consistent(state)


def test_expiry_of_a_parent_drops_its_descendants_and_their_pending_commits(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = conversation(0)
    write(state, keys[:4], ttl_class="short")
    write(state, keys, 4, ttl_class="chat")  # longer-lived children of a short-lived prefix
    other = block_keys(NS, list(range(100, 116)), 4)
    write(state, other)
    pending = state.allocate(NS.digest, block_keys(NS, SYSTEM + [5] * 4, 4)[4:], LAYOUT_MSG, keys[3])
    clock.now += 11
    garbage = state.expire_blocks()
    assert len(garbage) == 4  # the expired blocks' chunks, for the caller to delete
    assert (state.expired_blocks, state.stranded_blocks) == (4, 4)
    assert len({cid for q in state.undeleted.values() for cid in q}) == 4  # the descendants' chunks, queued
    assert state.match(NS.digest, keys).matched == 0 and state.match(NS.digest, other).matched == 4
    assert set(rows(state)) == {NS.digest + k for k in other}
    assert_consistent(state)
    # a write that allocated under the expired prefix: nothing could reach its block, so it is not kept
    req = meta_pb2.CommitBlocksRequest(allocation_id=pending.allocation_id)
    req.blocks.add(key=pending.blocks[0].key, chunk_checksums=[7])
    committed, already, garbage = state.commit(NS.digest, req)
    assert (committed, already) == (0, 0) and {c.chunk_id for c in garbage} == {pending.blocks[0].chunks[0].chunk_id}
    assert_consistent(state)


def test_a_lost_block_takes_its_descendants_along(make_state):
    state = make_state(Clock())
    keys = conversation(0)
    write(state, keys)
    garbage = state.drop_lost_blocks([NS.digest + keys[5]])
    state.drain_stranded()  # the background pass drops the descendants a slice at a time
    assert len(garbage) == 1 and (state.blocks_lost, state.stranded_blocks) == (1, 2)
    assert state.match(NS.digest, keys).matched == 5
    assert_consistent(state)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reopening_keeps_the_cached_set_and_keeps_evicting_leaves_first(make_state, policy):
    clock = Clock()
    state = make_state(clock, policy)
    for i in range(12):
        clock.now = 1000 + i
        serve(state, conversation(i))
    assert state.evicted_blocks > 0
    state.flush_last_used()  # what close() does too: recorded hits are written back
    before = {f: (r.parent, r.rank, r.hits) for f, r in rows(state).items()}
    used = state.cache_bytes
    state.close()
    state = make_state(clock, policy, register=False)  # servers come back from the database
    assert {f: (r.parent, r.rank, r.hits) for f, r in rows(state).items()} == before
    assert state.cache_bytes == used and state.capacity_bytes() == 48 * BLOCK
    for i in range(12, 20):
        clock.now = 1000 + i
        assert serve(state, conversation(i))[0] == 4
        assert state.cache_bytes <= 0.9 * state.capacity_bytes()
    assert state.match(NS.digest, conversation(19)).matched == 8
    assert_consistent(state)


def test_blocks_stranded_by_a_crash_are_never_matched_and_go_at_their_ttl(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = conversation(0)
    write(state, keys[:4], ttl_class="chat")
    write(state, keys, 4, ttl_class="short")
    # a crash between removing a block and dropping its children (drop_stranded) leaves them
    # in the database without their parent: as if keys[5] had gone alone
    gone = NS.digest + keys[5]
    row = state.blocks.row(gone)
    for key in (records.BLOCK + gone, records.child_key(NS.digest + keys[4], gone)):
        del state.db.db[key]
    batch = Batch()
    batch.delete_row(NS.digest, row.slot)
    state.db.write(batch)
    state.close()
    state = make_state(clock, register=False)
    assert state.match(NS.digest, keys).matched == 5  # keys[6] and keys[7] are unreachable
    clock.now += 11
    state.expire_blocks()
    assert not any(cached(state, keys[4:])) and all(cached(state, keys[:4]))
    assert not keys_under(state, records.CHILD + gone)  # the stranded blocks' own index entries went too


def test_placement_counts_queued_deletes_as_free_until_a_heartbeat_shows_them_gone(make_state):
    clock = Clock()
    state = make_state(clock)
    for i in range(9):
        clock.now = 1000 + i
        serve(state, conversation(i))
    for sid, s in state.servers.items():  # every disk reported full
        state.heartbeat(meta_pb2.HeartbeatRequest(server_id=sid, used_bytes=s.record.capacity_bytes))
    assert all(state.free_bytes(s) == 0 for s in state.servers.values())
    clock.now = 1010
    assert serve(state, conversation(9))[0] == 4  # evicts; placed on the space being freed
    while state.evict_slice():
        pass
    freeing = {sid: sum(q.values()) for sid, q in state.undeleted.items()}
    assert sum(freeing.values()) == 6 * 2 * 256
    for sid, s in state.servers.items():
        assert s.freeing_bytes == freeing.get(sid, 0)
        state.deleted(sid, list(state.undeleted.get(sid, {})))  # the lifecycle's delete pass
        assert s.freeing_bytes == freeing.get(sid, 0)  # still counted until a heartbeat reports it
        state.heartbeat(meta_pb2.HeartbeatRequest(server_id=sid, used_bytes=s.record.capacity_bytes // 2))
        assert s.freeing_bytes == 0
    assert state.undeleted == {}


def test_open_allocations_pin_their_parents(make_state):
    clock = Clock()
    state = make_state(clock, "lru")
    keys = conversation(0)
    write(state, keys[:4])
    clock.now += 1
    # a writer allocated the rest of the prompt under keys[3] and has not committed yet
    alloc = state.allocate(NS.digest, keys[4:], LAYOUT_MSG, keys[3])
    for i in range(1, 12):
        clock.now += 1
        write(state, block_keys(NS, [i] * 16, 4))
    assert state.evicted_blocks > 0 and all(cached(state, keys[:4]))
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    for b in alloc.blocks:
        req.blocks.add(key=b.key, chunk_checksums=[7])
    assert state.commit(NS.digest, req)[0] == 4
    assert state.match(NS.digest, keys).matched == 8
    assert_consistent(state)


def test_blocks_an_allocation_finds_present_stay_while_it_looks_up_the_rest(make_state, monkeypatch):
    """An allocation looks its keys up a piece at a time, in steps: eviction between two
    of them must not take a block already found present (the reply tells the writer
    not to write it, and its children would be garbage at commit)."""
    from kvfs.metaserver import allocations

    monkeypatch.setattr(allocations, "SLICE_SECONDS", 0.0)  # a step per piece of keys
    monkeypatch.setattr(allocations, "LIVE_ROWS_PIECE", 2)
    clock = Clock()
    state = make_state(clock, "lru")
    keys = conversation(0)
    write(state, keys[:4])  # the oldest blocks: eviction's first victims
    clock.now += 1
    steps = state.allocations.allocate_steps(NS.digest, keys, LAYOUT_MSG, b"", state.make_room_steps)
    next(steps)  # keys[:2] found present, the rest still to look up
    for i in range(1, 12):  # other writers fill the cache meanwhile
        clock.now += 1
        write(state, block_keys(NS, [i] * 16, 4))
    assert state.evicted_blocks > 0 and all(cached(state, keys[:4]))
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
    assert [b.already_present for b in done.value.value.blocks] == [True] * 4 + [False] * 4
    assert_consistent(state)


def test_config_choices_are_the_policies():
    field = {f.name: f for f in dataclasses.fields(MetaserverConfig)}["eviction_policy"]
    assert set(field.metadata["choices"]) == set(POLICIES)
    assert MetaserverConfig().eviction_policy == DEFAULT_POLICY
    with pytest.raises(ValueError, match="evict_low"):
        MetaserverConfig(evict_high=0.5, evict_low=0.7)
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        MetaserverConfig(eviction_policy="fifo")


def test_a_parent_that_is_not_a_key_is_refused(make_state):
    from kvfs.errors import InvalidArgument

    state = make_state(Clock())
    with pytest.raises(InvalidArgument, match="parent must be a 16-byte block key"):
        state.allocate(NS.digest, conversation(0)[1:], LAYOUT_MSG, b"short")


def test_an_allocation_naming_a_key_twice_or_its_parent_among_its_keys_is_refused(make_state):
    """A block would be its own ancestor: nothing of it could be committed, and the
    chunks placed for its first copy would wait for orphan GC."""
    from kvfs.errors import InvalidArgument

    state = make_state(Clock())
    keys = conversation(0)[:3]
    for bad, parent in (([keys[0], keys[1], keys[0]], b""), (keys[1:], keys[2])):
        with pytest.raises(InvalidArgument, match="appears twice in one AllocateBlocks, or as its parent"):
            state.allocate(NS.digest, bad, LAYOUT_MSG, parent)
    assert not state.allocations.open and not state.allocations.placing
    assert write(state, keys)[0] == 3  # the same keys, well formed, go in


def test_a_block_committed_again_while_its_children_wait_to_be_dropped_is_no_leaf(make_state):
    clock = Clock()
    state = make_state(clock)
    a, b = conversation(0)[:2]
    write(state, [a], ttl_class="short")
    write(state, [a, b], 1)  # b under a, longer-lived
    clock.now += 11
    state.blocks.expire()  # a expires; b waits in the stranded queue
    assert len(state.blocks.stranded) == 1
    write(state, [a, b])  # the prompt is written again before the queue drains: a new, b present
    state.drain_stranded()  # a is back: b is reachable and stays
    assert state.match(NS.digest, [a, b]).matched == 2
    assert_consistent(state)  # a has a child, so it is not an eviction candidate
    state.flush_last_used()
    evicted, _ = state.blocks.evict(1 << 40, {NS.digest + b}, 10)  # b pinned: nothing else may go
    assert evicted == 0 and state.match(NS.digest, [a, b]).matched == 2


def test_a_block_written_again_under_another_parent_leaves_its_old_parent(make_state):
    clock = Clock()
    state = make_state(clock)
    p1, p2 = block_keys(NS, [1] * 4, 4)[0], block_keys(NS, [2] * 4, 4)[0]
    child = block_keys(NS, [3] * 4, 4)[0]  # any key will do: the metaserver trusts the parent it is sent
    write(state, [p1])
    write(state, [p2])
    alloc = state.allocate(NS.digest, [child], LAYOUT_MSG, p1)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class="short")
    req.blocks.add(key=child, chunk_checksums=[7])
    state.commit(NS.digest, req)
    clock.now += 11  # the child expires (short), its parents live on
    alloc = state.allocate(NS.digest, [child], LAYOUT_MSG, p2)  # written again, under p2 this time
    assert not alloc.blocks[0].already_present
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    req.blocks.add(key=child, chunk_checksums=[7])
    assert state.commit(NS.digest, req)[0] == 1
    assert_consistent(state)  # one child entry, under p2; p1 a leaf again


def test_an_oversized_or_unplaceable_allocation_is_refused_before_anything_is_evicted(make_state):
    from kvfs.errors import InvalidArgument, ResourceExhausted

    clock = Clock()
    state = make_state(clock, max_layers=64, max_block_bytes=4 << 20)
    for i in range(10):  # 44 blocks: past the high watermark, so any write would evict
        clock.now = 1000 + i
        serve(state, conversation(i))
    before = dict(rows(state))
    evicted = state.evicted_blocks
    huge = [
        meta_pb2.BlockLayout(layers=65, block_tokens=1, kv_dim=1, dtype="bfloat16"),  # too many layers
        meta_pb2.BlockLayout(layers=1, block_tokens=4096, kv_dim=1024, dtype="bfloat16"),  # an 8 MiB block
    ]
    for layout in huge:
        with pytest.raises(InvalidArgument, match="max_layers, max_block_bytes"):
            state.allocate(NS.digest, block_keys(NS, range(8), 4)[:1], layout)
    # within the bounds, but 60 blocks of 64 KiB slots cannot fit a 48-block cache at all
    with pytest.raises(ResourceExhausted, match="below its high watermark"):
        state.allocate(NS.digest, block_keys(NS, range(500, 740), 4), LAYOUT_MSG)
    assert state.evicted_blocks == evicted and dict(rows(state)).keys() == before.keys()
    assert not state.allocations.open
    # a server comes back smaller: the cache (40 blocks) is over the new high mark (36 blocks), yet a
    # write that fits evicts what it brings (one block), no more; the background pass does the rest
    state.register(meta_pb2.RegisterRequest(server_id="cs-2", address="127.0.0.1:9002", failure_domain="host-2",
                                            capacity_bytes=1 << 20))
    assert state.capacity_bytes() == 40 * BLOCK and state.cache_bytes == 40 * BLOCK
    clock.now = 2000
    evicted = state.evicted_blocks
    write(state, block_keys(NS, range(900, 904), 4))
    assert state.evicted_blocks - evicted == 1
    assert_consistent(state)


def test_a_write_evicts_what_it_brings_even_while_other_writers_commit_between_its_slices(make_state):
    clock = Clock()
    state = make_state(clock, capacity=16 << 20)  # 3 x 16 MiB / 2 replicas: 384 blocks, high mark at 345.6
    keys = block_keys(NS, range(4 * 420), 4)
    for i in range(0, 340, 20):
        clock.now += 1
        write(state, keys[i : i + 20], first=0) if i == 0 else state.commit(NS.digest, commit_all(
            state.allocate(NS.digest, keys[i : i + 20], LAYOUT_MSG, keys[i - 1])))
    other = state.allocate(NS.digest, block_keys(NS, range(9000, 9000 + 4 * 20), 4), LAYOUT_MSG)  # 20 more
    evicted = state.evicted_blocks
    big = block_keys(NS, range(50_000, 50_000 + 4 * 100), 4)
    steps = state.allocations.allocate_steps(NS.digest, big, LAYOUT_MSG, b"", state.make_room_steps)
    slices = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            alloc = done.value
            break
        # after the first slice (EVICT_SLICE blocks, or fewer where its time bound ran out first)
        if state.evicted_blocks > evicted and slices == 0:
            slices += 1
            state.commit(NS.digest, commit_all(other))  # another writer's commit between two slices
    assert slices == 1 and len(alloc.blocks) == 100
    assert state.evicted_blocks - evicted == 100  # what it brings: 100 blocks of one slot each, no more
    assert_consistent(state)


def commit_all(alloc, ttl_class="chat"):
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class=ttl_class)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return req


def test_a_write_placed_between_another_writes_steps_counts_it_and_evicts_for_itself(make_state):
    """From a review: an allocation still placing its pieces was invisible to writers
    running between its steps, which then evicted too little."""
    clock = Clock()
    state = make_state(clock, capacity=16 << 20)  # 384 blocks, high mark at 345.6
    keys = block_keys(NS, range(4 * 345), 4)
    for i in range(0, 345, 23):
        state.commit(NS.digest, commit_all(state.allocate(NS.digest, keys[i : i + 23], LAYOUT_MSG,
                                                          keys[i - 1] if i else b"")))
    evicted = state.evicted_blocks
    a = block_keys(NS, range(10_000, 10_000 + 4 * 130), 4)
    steps = state.allocations.allocate_steps(NS.digest, a, LAYOUT_MSG, b"", state.make_room_steps)
    while state.evicted_blocks - evicted < 130:  # A evicted for itself and is placing its pieces
        next(steps)
    b = block_keys(NS, range(20_000, 20_000 + 4 * 100), 4)
    state.allocate(NS.digest, b, LAYOUT_MSG)  # B, all at once between two of A's steps
    for _ in steps:
        pass
    assert state.evicted_blocks - evicted == 230 and not state.over_high()
    assert len(state.allocations.open) == 2 and not state.allocations.placing


def test_servers_gone_silent_between_an_allocations_pieces_fail_it_cleanly(make_state):
    from kvfs.errors import Unavailable

    clock = Clock()
    state = make_state(clock, capacity=16 << 20, heartbeat_timeout=5)
    keys = block_keys(NS, range(4 * 200), 4)  # several pieces
    steps = state.allocations.allocate_steps(NS.digest, keys, LAYOUT_MSG, b"", state.make_room_steps)
    next(steps), next(steps)  # checked, room made, the first piece placed
    clock.now += 6  # every server silent past the timeout before the next piece
    with pytest.raises(Unavailable, match="no chains"):
        for _ in steps:
            pass
    assert all(s.pending_bytes == 0 for s in state.servers.values())  # the pieces placed were undone
    assert not state.allocations.open and not state.allocations.placing


def test_deletes_queued_for_a_server_that_is_down_never_stop_eviction(make_state, monkeypatch):
    """A dead server's deletes wait for it, but only up to the queue's bound (the rest are
    orphan GC's once it is back), and they do not count towards the bound that pauses
    background eviction: else one server down would stop eviction until it returned."""
    from kvfs.metaserver import state as state_module

    monkeypatch.setattr(state_module, "MAX_QUEUED_DELETES", 4)
    clock = Clock()
    state = make_state(clock, heartbeat_timeout=5)
    for i in range(9):  # 40 blocks of the 48 three servers hold
        clock.now = 1000 + i
        for sid in state.servers:
            state.heartbeat(meta_pb2.HeartbeatRequest(server_id=sid))
        serve(state, conversation(i))
    for _ in range(2):
        clock.now += 3
        for sid in ("cs-0", "cs-1"):  # cs-2 went silent: the cache is two servers' now, 32 blocks
            state.heartbeat(meta_pb2.HeartbeatRequest(server_id=sid))
    state.refresh_liveness()
    assert set(state.live_servers()) == {"cs-0", "cs-1"} and state.over_high()
    slices = 0
    while not state.deletes_backed_up() and state.evict_slice(limit=2):  # what the background pass does
        slices += 1
        for sid in ("cs-0", "cs-1"):  # and its delete pass, which skips servers that are down
            state.deleted(sid, list(state.undeleted.get(sid, {})))
    assert state.cache_bytes <= 0.8 * state.capacity_bytes(), f"eviction stopped after {slices} slices"
    assert not state.deletes_backed_up()
    assert len(state.undeleted["cs-2"]) == 4 and state.deletes_left_to_gc > 0  # held for its return, bounded
    assert_consistent(state)


def test_arc_splits_the_cache_between_a_recent_and_a_frequent_segment_and_learns_the_split(make_state):
    clock = Clock()
    state = make_state(clock, "arc")
    for i in range(4):  # the shared prompt, then conversations 0-3, each used twice: the frequent segment
        clock.now = 1000 + i
        serve(state, conversation(i))
        clock.now = 1004 + i
        serve(state, conversation(i))
    for i in range(4, 9):  # conversations 4-8, used once: the recent segment; 40 blocks in all
        clock.now = 1010 + i
        serve(state, conversation(i))
    state.flush_last_used()
    ranks = state.blocks.ranks
    assert (ranks.recent, state.blocks.peak_blocks, ranks.target) == (20, 40, 0.5)
    assert_consistent(state)
    c0, c1, c4 = conversation(0), conversation(1), conversation(4)
    clock.now = 1020
    serve(state, conversation(9))  # past the high watermark, with 20 recent blocks: not over half of 40
    # so the older of the two segments' oldest leaves goes first: conversation 0's (LFU-DA would take 4's)
    assert cached(state, c0) == [True] * 4 + [False] * 4 and all(cached(state, c4))
    assert (ranks.recent, ranks.recent_ghosts, state.blocks.ghosts) == (24, 0, 4)  # conversation 9 came in
    assert_consistent(state)
    clock.now = 1021
    assert serve(state, c0)[0] == 4  # wanted again after its eviction from the frequent segment
    # its write made room first: 24 recent blocks are over half, so they gave up conversation 4's,
    # though conversation 1's are older (LRU would take those)
    assert cached(state, c4) == [True] * 4 + [False] * 4 and all(cached(state, c1))
    assert ranks.recent_ghosts == 4
    # then its 4 blocks came back from the frequent ghosts, each lowering the recent share by ARC's
    # step: max(recent ghosts / (frequent ghosts left + 1), 1) over the 40 blocks the cache held at most
    assert ranks.target == pytest.approx(0.5 - (4 / 4 + 4 / 3 + 4 / 2 + 4 / 1) / 40)
    assert [state.blocks.row(NS.digest + k).rank for k in c0] == [FREQUENT] * 8
    assert_consistent(state)
    target, recent = ranks.target, ranks.recent
    state.close()
    state = make_state(clock, "arc", register=False)
    assert (state.blocks.ranks.target, state.blocks.ranks.recent) == (target, recent)  # persisted
    assert_consistent(state)
