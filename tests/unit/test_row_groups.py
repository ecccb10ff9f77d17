"""Rows stored 64 slots to a RocksDB value (metaserver/groups.py), the lookups that
read them a group at a time, and hits recorded per run (metaserver/hits.py)."""

import pytest

from kvfs.errors import InvalidArgument
from kvfs.keys import block_keys
from kvfs.metaserver import groups
from kvfs.metaserver.db import Batch
from kvfs.metaserver.hits import PendingHits
from kvfs.metaserver.records import Row
from kvfs.proto import meta_pb2

from helpers import Clock, assert_metadata_consistent
from test_metastate import LAYOUT_MSG, NS, slots, write


class CountingReads:
    """Stands in for a MetaDB's Rdict and counts the point reads made through it."""

    def __init__(self, db):
        self._db, self.gets = db, 0

    def get(self, key, *args, **kw):
        self.gets += 1
        return self._db.get(key, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._db, name)


def test_a_long_hit_reads_a_group_per_64_blocks_not_a_row_per_block(make_state):
    state = make_state()
    keys = block_keys(NS, range(4 * 640), 4)
    write(state, keys)
    first = slots(state, keys[:1])[0] % groups.GROUP_SLOTS
    counting = state.blocks.db.db = CountingReads(state.blocks.db.db)
    assert state.match(NS.digest, keys).matched == 640
    # the first key's slot, then the groups its run spans
    assert counting.gets == 1 + (first + 640 + groups.GROUP_SLOTS - 1) // groups.GROUP_SLOTS


def test_a_reply_names_the_layout_once_and_no_block_keys(make_state):
    state = make_state()
    keys = block_keys(NS, range(4 * 70), 4)
    alloc, _ = write(state, keys)
    reply = state.match(NS.digest, keys)
    assert reply.matched == 70 and reply.layout == LAYOUT_MSG
    assert all(not b.key and not b.HasField("layout") for b in reply.blocks)
    assert [[c.chunk_id for c in b.chunks] for b in reply.blocks] == \
        [[c.chunk_id for c in b.chunks] for b in alloc.blocks]
    assert not state.match(NS.digest, block_keys(NS, range(100, 140), 4)).HasField("layout")


def test_a_block_must_have_its_parents_layout(make_state):
    state = make_state()
    keys = block_keys(NS, range(16), 4)
    write(state, keys[:2])
    other = meta_pb2.BlockLayout(layers=8, block_tokens=4, kv_dim=8, dtype="bfloat16")
    with pytest.raises(InvalidArgument, match="layout"):
        state.allocate(NS.digest, keys[2:], other, keys[1])
    write(state, keys[2:], parent=keys[1])  # the parent's layout is fine
    assert state.match(NS.digest, keys).matched == 4


def test_rows_of_one_group_changed_by_two_open_batches_both_land(make_state):
    state = make_state()
    keys = block_keys(NS, range(8), 4)
    write(state, keys)
    a, b = (state.blocks.row(NS.digest + k) for k in keys)
    assert a.slot // groups.GROUP_SLOTS == b.slot // groups.GROUP_SLOTS
    first, second, dropped = Batch(), Batch(), Batch()
    a.hits, b.hits = 5, 9
    state.blocks.put_row(first, NS.digest + keys[0], a)
    state.blocks.put_row(second, NS.digest + keys[1], b)
    dropped.delete_row(NS.digest, a.slot)  # never written: changes nothing
    state.db.write(second)
    state.db.write(first)
    assert [state.blocks.row(NS.digest + k).hits for k in keys] == [5, 9]
    assert_metadata_consistent(state)


def test_a_key_of_zeros_which_marks_empty_slots_is_refused(make_state):
    state = make_state()
    keys = block_keys(NS, range(8), 4)
    write(state, keys)
    with pytest.raises(InvalidArgument, match="zero bytes"):
        state.match(NS.digest, [keys[0], bytes(16)])
    with pytest.raises(InvalidArgument, match="zero bytes"):
        state.allocate(NS.digest, [bytes(16)], LAYOUT_MSG)


def test_a_group_value_holds_its_rows_and_their_lookup_fields():
    rows = [None] * groups.GROUP_SLOTS
    for slot in (0, 5, 63):
        row = Row(ttl=100, depth=0, hits=1, created=1.0, last_used=2.0 + slot, rank=0.0, footprint=1, nbytes=1,
                  parent=b"", servers=(3, 7 + slot), ttl_class="chat", location=b"\x12\x02\x1a\x00",
                  layout=LAYOUT_MSG.SerializeToString(), key=bytes([slot + 1]) * 16, slot=slot)
        rows[slot] = row.encode()
    value = groups.pack(rows)
    assert groups.unpack(value) == rows and groups.occupied(value) == [0, 5, 63]
    assert groups.expiry_times(value, 5, 1) == (107.0,)
    assert groups.locations(value, 0, 6) == b"\x12\x02\x1a\x00" * 2
    assert groups.pack([None] * groups.GROUP_SLOTS) is None
    assert groups.run_length(value, 0, bytes([1]) * 16 + bytes([6]) * 16, 0, 2) == 1  # slot 1 holds no row
    assert groups.run_length(value, 5, bytes([6]) * 16, 0, 1) == 1


def _random_row(rng, slot: int) -> bytes:
    return Row(ttl=100, depth=slot, hits=1, created=1.0, last_used=float(slot), rank=0.0, footprint=1, nbytes=1,
               parent=b"", servers=tuple(rng.sample(range(12), rng.randint(1, 3))), ttl_class="chat",
               location=b"\x12\x03\x1a\x01" + bytes([slot]) * rng.randint(1, 9),
               layout=LAYOUT_MSG.SerializeToString(), key=bytes([slot + 1]) * 16, slot=slot).encode()


@pytest.mark.parametrize("seed", range(20))
def test_rows_appended_after_a_groups_last_row_read_as_packing_the_group_whole_would(seed):
    import random
    rng = random.Random(seed)
    rows = [None] * groups.GROUP_SLOTS
    last = rng.randrange(groups.GROUP_SLOTS - 1)
    for slot in sorted(rng.sample(range(last + 1), rng.randint(1, last + 1))):
        rows[slot] = _random_row(rng, slot)
    value = groups.pack(rows)
    if rng.random() < 0.5:  # rows cut out first: the servers a superset, the fewest copies a bound
        gone = set(rng.sample(groups.occupied(value), rng.randint(0, len(groups.occupied(value)) - 1)))
        value = groups.without(value, gone)
        rows = [None if k in gone else raw for k, raw in enumerate(rows)]
    last_row = max(groups.occupied(value))
    new = [(k, _random_row(rng, k)) for k in sorted(rng.sample(range(last_row + 1, groups.GROUP_SLOTS),
                                                              rng.randint(1, groups.GROUP_SLOTS - 1 - last_row)))]
    added = groups.appended(value, new)
    for k, raw in new:
        rows[k] = raw
    exact = groups.pack(rows)
    assert groups.unpack(added) == rows and groups.occupied(added) == groups.occupied(exact)
    assert groups.expiry_times(added, 0, groups.GROUP_SLOTS) == groups.expiry_times(exact, 0, groups.GROUP_SLOTS)
    for k in range(groups.GROUP_SLOTS):
        assert groups.locations(added, k, groups.GROUP_SLOTS - k) == groups.locations(exact, k, groups.GROUP_SLOTS - k)
    assert set(groups.server_numbers(added)) >= set(groups.server_numbers(exact))
    assert groups.fewest_copies(added) <= groups.fewest_copies(exact)
    assert groups.appended(added, [(last_row, _random_row(rng, last_row))]) is None  # not after the last row


def test_rows_cut_out_of_a_group_leave_the_others_as_packing_them_would():
    import random
    rng = random.Random(5)
    rows = [None] * groups.GROUP_SLOTS
    for slot in rng.sample(range(groups.GROUP_SLOTS), 40):
        row = Row(ttl=100, depth=slot, hits=1, created=1.0, last_used=float(slot), rank=0.0, footprint=1, nbytes=1,
                  parent=b"", servers=(slot % 5, 9), ttl_class="chat", location=b"\x12\x03\x1a\x01" + bytes([slot]),
                  layout=LAYOUT_MSG.SerializeToString(), key=bytes([slot + 1]) * 16, slot=slot)
        rows[slot] = row.encode()
    value = groups.pack(rows)
    gone = set(rng.sample(groups.occupied(value), 25))
    cut = groups.without(value, gone)
    kept = [None if k in gone else raw for k, raw in enumerate(rows)]
    exact = groups.pack(kept)
    assert groups.unpack(cut) == kept and groups.occupied(cut) == groups.occupied(exact)
    assert groups.expiry_times(cut, 0, groups.GROUP_SLOTS) == groups.expiry_times(exact, 0, groups.GROUP_SLOTS)
    assert groups.locations(cut, 0, groups.GROUP_SLOTS) == groups.locations(exact, 0, groups.GROUP_SLOTS)
    # the servers and fewest copies stay: a superset and a lower bound
    assert set(groups.server_numbers(cut)) >= set(groups.server_numbers(exact))
    assert groups.fewest_copies(cut) <= groups.fewest_copies(exact)
    assert groups.without(value, set(groups.occupied(value))) is None


@pytest.mark.parametrize("seed", range(10))
def test_uses_written_in_place_read_as_the_rows_written_again_would(seed):
    # a flush of hits rewrites last use, hits and rank (and the expiry time) over the old
    # bytes: the value must be the one packing the changed rows whole gives
    import random
    rng = random.Random(seed)
    rows = [None] * groups.GROUP_SLOTS
    for slot in rng.sample(range(groups.GROUP_SLOTS), rng.randint(1, groups.GROUP_SLOTS)):
        rows[slot] = _random_row(rng, slot)
    value = groups.pack(rows)
    at = groups.uses_at(value)
    changes = []
    for k in rng.sample(groups.occupied(value), rng.randint(1, len(groups.occupied(value)))):
        row = Row.decode(rows[k])
        assert groups.uses(value, at, k) == (row.ttl, row.last_used, row.depth, row.hits, row.created, row.rank)
        row.last_used, row.hits, row.rank = row.last_used + rng.uniform(1, 1e6), row.hits + 7, rng.uniform(0, 40)
        changes.append((k, (row.ttl, row.last_used, row.depth, row.hits, row.created, row.rank)))
        rows[k] = row.encode()
    assert groups.with_uses(value, at, changes) == groups.pack(rows)


def test_hits_wait_their_delay_then_move_the_rows_last_use(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    t0 = clock.now
    write(state, keys, ttl_class="short")  # 10 s
    clock.now += 9
    assert state.match(NS.digest, keys).matched == 2
    clock.now += 6  # 15 s after the commit: past the stored last use's TTL, not the hit's
    assert state.flush_slice(64, age=10) == 0  # the hit waited 6 s
    assert state.blocks.row(NS.digest + keys[0]).last_used == t0
    assert state.expire_slice(64) == 0  # the hit not yet written keeps them
    assert state.match(NS.digest, keys).matched == 2
    clock.now += 4
    assert state.flush_slice(64, age=10) == 2
    assert [state.blocks.row(NS.digest + k).last_used for k in keys] == [t0 + 15, t0 + 15]  # the later hit
    assert_metadata_consistent(state)


def test_a_hit_recorded_on_a_slot_is_not_credited_to_a_block_given_that_slot_later(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    other = block_keys(NS, list(range(4)) + [99] * 4, 4)  # the same first block, another second
    t0 = clock.now
    write(state, keys)
    clock.now += 5
    assert state.match(NS.digest, keys).matched == 2
    state.blocks.drop([NS.digest + keys[1]])
    clock.now += 1
    write(state, other[1:], parent=other[0])
    state.flush_last_used()
    row = state.blocks.row(NS.digest + other[1])
    assert row.slot == state.blocks.row(NS.digest + keys[0]).slot + 1  # keys[1]'s slot, given again
    assert (row.hits, row.last_used) == (1, t0 + 6)  # its own commit; keys[1]'s hit is not its
    assert state.blocks.row(NS.digest + keys[0]).last_used == t0 + 5
    assert_metadata_consistent(state)


def test_a_server_down_leaves_its_replicas_in_the_reply_with_an_empty_server_entry(make_state):
    clock = Clock()
    state = make_state(clock, heartbeat_timeout=5)
    keys = block_keys(NS, range(4 * 70), 4)
    alloc, _ = write(state, keys)
    clock.now += 6  # cs-2 goes silent
    for sid in ("cs-0", "cs-1"):
        state.heartbeat(meta_pb2.HeartbeatRequest(server_id=sid))
        state.reconciled(sid)  # back from silence: live once reconciled (metaserver/repair.py)
    down = state.servers["cs-2"].number
    reply = state.match(NS.digest, keys)
    assert reply.matched == 70  # every chunk has two copies: one is live
    assert reply.servers[down].address == "" and all(s.address for i, s in enumerate(reply.servers) if i != down)
    placed = {c.chunk_id: set(c.servers) for b in alloc.blocks for c in b.chunks}
    for block in reply.blocks:
        for c in block.chunks:
            assert {reply.servers[i].id for i in c.replicas} - {""} == placed[c.chunk_id] - {"cs-2"}
    # the locations went out as stored, not rebuilt block by block without cs-2's copies
    assert any(down in c.replicas for b in reply.blocks for c in b.chunks)
    # a chunk left with its copy on cs-2 alone is unreadable now: the match ends at its block
    victim = next(i for i, b in enumerate(alloc.blocks) if i > 3 and "cs-2" in b.chunks[0].servers)
    chunk = alloc.blocks[victim].chunks[0]
    (other,) = set(chunk.servers) - {"cs-2"}
    owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=keys[victim], chunk_index=0)
    state.chunks_lost(other, [(chunk.chunk_id, owner)])
    assert state.match(NS.digest, keys).matched == victim


def test_pending_hits_are_bounded_and_written_without_waiting_once_half_full(caplog):
    hits = PendingHits(max_runs=4, max_blocks=1000)
    ns, run = b"n" * 16, bytes([7]) * 16 * 3  # a run of three blocks
    hits.record(ns, [(0, 0, run), (1, 0, run)], now=1.0)
    hits.record(ns, [(0, 0, run)], now=2.0)  # the same run again: counted, no new entry
    assert (hits.runs, len(hits), hits.filling) == (2, 6, False)
    assert hits.of(ns, 1, bytes([7]) * 16) == (2, 2.0) and hits.of(ns, 3, bytes([7]) * 16) is None
    hits.record(ns, [(2, 0, run)], now=3.0)
    assert hits.filling  # past half the runs: flush_hits no longer waits for hit_flush_delay
    hits.record(ns, [(3, 0, run), (4, 0, run)], now=4.0)  # past the bound: not recorded, logged
    assert hits.runs == 3 and hits.dropped == 1 and "not recorded" in caplog.text
    assert [g for _, g, _ in hits.take(1, before=1.5)] == [0]  # the longest waiting first, by `before`
    assert hits.take(100, before=2.0) == [(ns, 1, {(k, bytes([7]) * 16): [1, 1.0] for k in range(3)})]
    assert [g for _, g, _ in hits.take(100)] == [2] and not hits and len(hits) == 0


def test_an_expired_block_written_again_with_another_layout_never_serves_its_childrens_bytes(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    write(state, keys[:1], ttl_class="short")  # P: 10 s
    write(state, keys[1:], ttl_class="chat", parent=keys[0])  # C under it, kept while P is replaced
    clock.now += 11  # P expired, not removed yet
    other = meta_pb2.BlockLayout(layers=2, block_tokens=4, kv_dim=16, dtype="bfloat16")  # as many bytes
    alloc = state.allocate(NS.digest, keys[:1], other)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    req.blocks.add(key=keys[0], chunk_checksums=[7] * len(alloc.blocks[0].chunks))
    committed, _, garbage = state.commit(NS.digest, req)
    assert committed == 0 and {c.chunk_id for c in garbage} == {c.chunk_id for c in alloc.blocks[0].chunks}
    assert state.match(NS.digest, keys).matched == 0  # P stays expired: no block is served under `other`
    write(state, keys[:1], ttl_class="chat")  # with its children's layout it is written again
    reply = state.match(NS.digest, keys)
    assert reply.matched == 2 and reply.layout == LAYOUT_MSG
    assert_metadata_consistent(state)


def two_prompts(state, blocks: int) -> tuple[list[bytes], list[bytes]]:
    """The keys of two prompts written, each its own run of slots."""
    a, b = block_keys(NS, range(4 * blocks), 4), block_keys(NS, range(100, 100 + 4 * blocks), 4)
    write(state, a)
    write(state, b)
    return a, b


def test_a_lookup_goes_on_at_a_branch_only_to_a_child_of_the_block_before_it(make_state):
    state = make_state()
    a, b = two_prompts(state, 2)
    assert state.match(NS.digest, a + b).matched == 4  # b[0] is a prompt's first block: a root goes on
    assert state.match(NS.digest, a + b[1:]).matched == 2  # b[1] is b[0]'s child, not a[1]'s
    assert_metadata_consistent(state)


def test_a_lookup_that_keeps_coming_back_to_a_group_reads_it_once(make_state):
    state = make_state()
    a, b = two_prompts(state, 1)
    counting = state.blocks.db.db = CountingReads(state.blocks.db.db)
    assert state.match(NS.digest, (a + b) * 50).matched == 100  # two roots, back and forth
    assert counting.gets == 100 + 2  # a slot read per key, each group once


def test_hits_waiting_since_before_the_clock_stepped_back_are_written_all_the_same(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    write(state, keys)
    clock.now += 5
    assert state.match(NS.digest, keys).matched == 2
    hit_at = clock.now
    clock.now -= 3600  # the wall clock steps back an hour
    assert state.match(NS.digest, keys).matched == 2
    clock.now += 60
    assert state.flush_slice(64, age=10) == 2  # not held back until the clock passes the first hit again
    assert state.blocks.row(NS.digest + keys[0]).last_used == hit_at
