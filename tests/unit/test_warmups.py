"""Reads made ahead off the event loop (BlockTable.warm): a commit's piece and
eviction's next victims are read first on the database's reader thread, so that
the loop's own reads of them, moments later, find them in RocksDB's block cache
instead of waiting for the disk while they hold the GIL.

A warm-up answers nothing and changes nothing: these tests check that each one
reads exactly what its step reads next, that it leaves the database as it was,
and that a background pass makes it on the reader thread."""

import threading

import pytest

from kvfs.keys import Namespace, block_keys
from kvfs.metaserver import blocks as blocks_module
from kvfs.metaserver.db import OffLoop
from kvfs.metaserver.records import VICTIM
from kvfs.metaserver.state import run_steps
from kvfs.proto import meta_pb2

from helpers import Clock, assert_metadata_consistent

NS = Namespace("t", "warm")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256-byte blocks
BLOCK = 64 * 1024  # the slot each block's one chunk takes


def commit_request(alloc) -> meta_pb2.CommitBlocksRequest:
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class="chat")
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return req


def write(state, keys, parent=b""):
    return run_steps(state.allocations.commit_steps(
        NS.digest, commit_request(state.allocate(NS.digest, keys, LAYOUT_MSG, parent))))


def everything(state) -> list[tuple[bytes, bytes]]:
    it = state.db.db.iter()
    it.seek_to_first()
    out = []
    while it.valid():
        out.append((it.key(), it.value()))
        it.next()
    return out


def test_a_commit_reads_each_piece_ahead_off_the_loop_then_decides_and_writes_it(make_state):
    state = make_state()
    prefix = block_keys(NS, range(4 * 20), 4)
    write(state, prefix)
    keys = block_keys(NS, range(4 * 20, 4 * 170), 4)  # 150 blocks after the prefix: pieces of 64
    steps = state.allocations.commit_steps(NS.digest, commit_request(
        state.allocate(NS.digest, keys, LAYOUT_MSG, prefix[-1])))
    warmed, answer = [], None
    while True:
        try:
            asked = steps.send(answer)
        except StopIteration as done:
            result = done.value
            break
        answer = None
        if isinstance(asked, OffLoop):
            assert asked.fn == state.blocks.warm
            fulls, parents = asked.args
            written = state.blocks.blocks
            answer = asked.fn(*asked.args)
            assert answer == 2 * len(fulls) + len(parents)  # rows, ghosts (lfuda remembers), parents' rows
            assert state.blocks.blocks == written  # it wrote nothing
            warmed.append((fulls, parents))
    assert result[:2] == (150, 0)
    # one warm-up before each piece, of that piece's blocks, in order, with the parent outside it
    assert [len(f) for f, _ in warmed] == [64, 64, 22]
    assert [f for fulls, _ in warmed for f in fulls] == [NS.digest + k for k in keys]
    assert warmed[0][1] == [NS.digest + prefix[-1]]  # the committed prefix's last block
    assert warmed[1][1] == [NS.digest + keys[63]]  # the piece before's last block
    assert state.match(NS.digest, prefix + keys).matched == 170
    assert_metadata_consistent(state)


@pytest.mark.parametrize("policy", ["lfuda", "lru"])
def test_a_warm_up_changes_nothing_and_asks_only_for_what_the_policy_reads(make_state, policy):
    state = make_state(Clock(), policy)
    keys = block_keys(NS, range(4 * 40), 4)
    write(state, keys)
    fulls = [NS.digest + k for k in keys]
    absent = [NS.digest + k for k in block_keys(NS, range(10_000, 10_000 + 4 * 8), 4)]
    before = everything(state)
    asked = state.blocks.warm(fulls[20:] + absent, fulls[:2])
    # rows of the blocks and the parents, and the ghosts where the policy remembers hit counts
    assert asked == (28 + 2 + 28 if policy == "lfuda" else 28 + 2)
    assert everything(state) == before


def test_a_warm_up_that_fails_is_logged_and_raises_nothing(make_state, caplog):
    state = make_state()
    keys = block_keys(NS, range(4 * 4), 4)
    write(state, keys)
    state.close()  # every read now fails
    assert state.blocks.warm([NS.digest + k for k in keys]) == 0
    assert "a read ahead of 4 rows failed" in caplog.text


@pytest.fixture
def evicting_state(make_state, monkeypatch):
    """A state past its high watermark, ten prompts of four blocks each, and warm-ups
    of four victims at a time."""
    monkeypatch.setattr(blocks_module, "WARM_VICTIMS", 4)
    clock = Clock()
    state = make_state(clock, capacity=2 << 20)  # 3 x 2 MiB, 2 replicas: 48 blocks; high mark 43.2
    prompts = [block_keys(NS, range(1000 * i, 1000 * i + 16), 4) for i in range(11)]
    for i, prompt in enumerate(prompts[:10]):
        clock.now = 1000 + i
        write(state, prompt)
    assert state.cache_bytes == 40 * BLOCK and not state.over_high()
    return state, prompts


def index_order(state) -> list[bytes]:
    return [k[-blocks_module.FULL:] for k, _ in state.db.scan(VICTIM)]


def test_a_write_past_the_high_watermark_reads_its_victims_ahead_before_evicting(evicting_state):
    state, prompts = evicting_state
    leaves = index_order(state)
    assert len(leaves) == 10  # each prompt's last block
    steps = state.allocations.allocate_steps(NS.digest, prompts[10], LAYOUT_MSG, b"", state.make_room_steps)
    asked, answer = [], None
    while True:
        try:
            ask = steps.send(answer)
        except StopIteration:
            break
        answer = ask.fn(*ask.args) if isinstance(ask, OffLoop) else None
        if isinstance(ask, OffLoop) and ask.fn == state.blocks.warm:
            asked.append((ask.args[0], state.evicted_blocks))
    # one warm-up, of the index's first four entries, before anything was evicted; the
    # write then evicted what it brings (4 blocks: the least recently used leaf, then its
    # parents as they became leaves, which the warm-up's row groups hold too)
    assert asked == [(leaves[:4], 0)]
    assert state.evicted_blocks == 4
    assert_metadata_consistent(state)


def test_the_next_warm_up_waits_until_eviction_passed_half_of_the_last_and_reads_on_after_it(evicting_state):
    state, _ = evicting_state
    table = state.blocks
    first = table.victims_to_warm()
    assert first == index_order(state)[:4]
    assert table.victims_to_warm() == []  # eviction has not reached the middle of those yet
    after, again = table.warm_from, table.warm_again  # just past the last entry read ahead; its middle
    evictions = 0
    while True:
        floor = table.victim_floor
        if nxt := table.victims_to_warm():
            break
        assert state._evict(BLOCK, frozenset(), 1) == 1  # one block at a time, whatever the watermarks
        evictions += 1
    # not before eviction's floor passed the middle entry (the first victims' parents, leaves in
    # turn, went first)
    assert evictions >= 2 and floor >= again
    # the next entries from where the last warm-up ended, none of them read ahead before
    assert nxt == [k[-blocks_module.FULL:] for k, _ in state.db.scan(VICTIM, start=after, limit=4)]
    assert set(nxt).isdisjoint(first)
    assert_metadata_consistent(state)


async def test_background_eviction_reads_ahead_on_the_reader_thread(evicting_state):
    from kvfs.metaserver.lifecycle import Lifecycle

    state, _ = evicting_state
    threads = []

    def warm(fulls):
        threads.append(threading.current_thread().name)
        return state.blocks.warm(fulls)

    lifecycle = Lifecycle(state)
    asks = iter([OffLoop(warm, (index_order(state)[:2],)), None, None])
    work = iter([1, 1, 0])  # two turns with work, then none
    try:
        assert await lifecycle.drain("evict", lambda: next(work), warm=lambda: next(asks)) == 2
    finally:
        await lifecycle.close()
    assert len(threads) == 1 and threads[0].startswith("meta-read")
