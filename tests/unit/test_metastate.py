"""MetaState in-process with an injectable clock: RocksDB on disk, no sockets."""

import time

import pytest

from kvfs.metaserver.config import MetaserverConfig
from kvfs.errors import InvalidArgument, NotFound, Unavailable
from kvfs.keys import Namespace, block_keys
from kvfs.layout import BlockLayout
from kvfs.metaserver.state import MetaState
from kvfs.proto import meta_pb2
from kvfs.serving import LoopStats

from helpers import Clock, Turns, assert_metadata_consistent

NS = Namespace("t", "m")
LAYOUT = BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256-byte blocks
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")


def write(state, keys, ttl_class="chat", parent=b"", ns=NS):
    alloc = state.allocate(ns.digest, keys, LAYOUT_MSG, parent)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class=ttl_class)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return alloc, state.commit(ns.digest, req)


def slots(state, keys, ns=NS):
    return [state.blocks.row(ns.digest + k).slot for k in keys]


def test_a_prompts_blocks_take_consecutive_slots_and_a_branch_starts_a_run_of_its_own(make_state):
    state = make_state()
    keys = block_keys(NS, range(80), 4)
    write(state, keys[:8])
    write(state, keys[8:12], parent=keys[7])  # the prompt grows in a later commit: the slots after
    first = slots(state, keys[:12])
    assert first == list(range(first[0], first[0] + 12))
    branch = block_keys(NS, list(range(24)) + [999] * 8, 4)  # shares 6 blocks, then differs
    assert branch[:6] == keys[:6] and branch[6] != keys[6]
    write(state, branch[6:], parent=branch[5])  # slot 7 of the run is taken: a fresh run
    other = slots(state, branch[6:])
    assert other == list(range(other[0], other[0] + 2)) and other[0] not in first
    assert state.match(NS.digest, keys).matched == 12
    assert state.match(NS.digest, branch).matched == 8  # 6 from the first run, 2 from the branch's
    assert state.match(NS.digest, keys[:3] + branch[3:]).matched == 8
    assert_metadata_consistent(state)


def test_a_lookup_never_reads_another_namespaces_rows(make_state):
    # the same block keys under two namespaces (a client may send any 16 bytes): a lookup
    # that runs off the end of its namespace's rows must not continue into the next one's
    a, b = sorted([NS, Namespace("t", "other")], key=lambda ns: ns.digest)
    keys = block_keys(NS, range(40), 4)
    write(state := make_state(), keys[:4], ns=a)
    write(state, keys[4:], parent=b"", ns=b)  # b's rows start with keys[4], right after a's in key order
    assert state.match(a.digest, keys).matched == 4
    assert state.match(b.digest, keys[4:]).matched == 6
    assert_metadata_consistent(state)


def test_a_block_gone_from_the_middle_of_a_run_ends_the_match_there(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(40), 4)
    write(state, keys[:4], ttl_class="chat")
    write(state, keys[4:], parent=keys[3], ttl_class="short")
    clock.now += 11  # keys[4:] expire; written again under the same parent, keys[4] keeps its slot
    state.expire_blocks()
    assert state.match(NS.digest, keys).matched == 4
    write(state, keys[4:6], parent=keys[3])
    assert state.match(NS.digest, keys).matched == 6
    assert slots(state, keys[:6]) == list(range(slots(state, keys[:1])[0], slots(state, keys[:1])[0] + 6))
    assert_metadata_consistent(state)


def test_match_is_the_longest_present_run_from_block_zero(make_state):
    state = make_state()
    keys = block_keys(NS, range(40), 4)
    write(state, keys[:6])
    assert state.match(NS.digest, keys).matched == 6
    assert state.match(NS.digest, keys[:3]).matched == 3
    other = block_keys(NS, [99] + list(range(1, 40)), 4)  # first block differs: no match at all
    assert state.match(NS.digest, other).matched == 0
    assert state.match(Namespace("u", "m").digest, keys).matched == 0  # another namespace sees nothing


def test_match_reports_live_replicas_of_every_chunk(make_state):
    clock = Clock()
    state = make_state(clock, heartbeat_timeout=5)
    keys = block_keys(NS, range(32), 4)
    alloc, _ = write(state, keys)
    reply = state.match(NS.digest, keys)
    assert reply.matched == 8
    placed = {c.chunk_id: set(c.servers) for b in alloc.blocks for c in b.chunks}
    for block in reply.blocks:
        for c in block.chunks:
            assert {reply.servers[i].id for i in c.replicas} == placed[c.chunk_id]
            assert c.checksum == 7 and len(c.replicas) == 2
    # every server but one goes silent: chunks with no live replica end the match
    clock.now += 6
    state.heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-0"))
    # back from silence: not live until its chunks were reconciled (metaserver/repair.py)
    assert state.to_reconcile() == ["cs-0"] and state.match(NS.digest, keys).matched == 0
    state.reconciled("cs-0")
    assert state.to_reconcile() == [] and "cs-0" in state.live_servers()
    reply = state.match(NS.digest, keys)
    assert [s.id for s in reply.servers] in ([], ["cs-0"])
    readable = [all("cs-0" in placed[c.chunk_id] for c in b.chunks) for b in alloc.blocks]
    expect = readable.index(False) if False in readable else len(readable)
    assert reply.matched == expect < 8  # stops at the first block with a chunk nobody live holds


def test_first_writer_wins_and_the_losers_chunks_are_garbage(make_state):
    state = make_state()
    keys = block_keys(NS, range(12), 4)
    a1 = state.allocate(NS.digest, keys, LAYOUT_MSG)
    a2 = state.allocate(NS.digest, keys, LAYOUT_MSG)
    reqs = []
    for a in (a1, a2):
        req = meta_pb2.CommitBlocksRequest(allocation_id=a.allocation_id)
        for b in a.blocks:
            req.blocks.add(key=b.key, chunk_checksums=[1] * len(b.chunks))
        reqs.append(req)
    assert state.commit(NS.digest, reqs[0])[:2] == (3, 0)
    committed, already, garbage = state.commit(NS.digest, reqs[1])
    assert (committed, already) == (0, 3)
    assert {c.chunk_id for c in garbage} == {c.chunk_id for b in a2.blocks for c in b.chunks}
    again = state.allocate(NS.digest, keys, LAYOUT_MSG)
    assert all(b.already_present and not b.chunks for b in again.blocks)


def test_commit_of_an_unknown_or_expired_allocation_is_refused(make_state):
    clock = Clock()
    state = make_state(clock, allocation_timeout=60)
    keys = block_keys(NS, range(4), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    clock.now += 61
    n, garbage = state.expire_allocations()
    assert n == 1 and {c.chunk_id for c in garbage} == {c.chunk_id for c in alloc.blocks[0].chunks}
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    req.blocks.add(key=keys[0], chunk_checksums=[1])
    with pytest.raises(NotFound, match="expired"):
        state.commit(NS.digest, req)


def test_ttl_hides_blocks_at_once_and_a_hit_refreshes_it(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    alloc, _ = write(state, keys[:1], "short")
    write(state, keys[1:], "chat")
    clock.now += 8
    assert state.match(NS.digest, keys).matched == 2  # refreshes both
    clock.now += 8
    assert state.match(NS.digest, keys).matched == 2  # 8 s since the refresh: still alive
    clock.now += 11
    assert state.match(NS.digest, keys).matched == 0  # block 0 expired: nothing matches past it
    garbage = state.expire_blocks()
    assert {c.chunk_id for c in garbage} == {c.chunk_id for c in alloc.blocks[0].chunks}
    assert state.expired_blocks == 1 and len(state.blocks) == 1


def test_state_survives_reopen_including_refreshed_use(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(8), 4)
    write(state, keys, "short")
    clock.now += 9
    state.match(NS.digest, keys)
    state.close()
    state = make_state(clock)
    clock.now += 9  # 18 s after commit, 9 s after the refreshed use
    assert state.match(NS.digest, keys).matched == 2


def test_bad_requests_are_invalid(make_state):
    state = make_state()
    with pytest.raises(InvalidArgument, match="16 bytes"):
        state.match(NS.digest, [b"short"])
    with pytest.raises(InvalidArgument, match="layout"):
        state.allocate(NS.digest, block_keys(NS, range(4), 4), meta_pb2.BlockLayout(layers=1, block_tokens=4,
                                                                                   kv_dim=8, dtype="complex64"))
    alloc = state.allocate(NS.digest, block_keys(NS, range(4), 4), LAYOUT_MSG)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class="forever")
    req.blocks.add(key=alloc.blocks[0].key, chunk_checksums=[1])
    with pytest.raises(InvalidArgument, match="TTL class"):
        state.commit(NS.digest, req)


def test_joined_keys_match_as_the_keys_do_and_malformed_ones_are_invalid(make_state):
    state = make_state()
    keys = block_keys(NS, range(320), 4)  # 80 blocks: two row groups, written in two allocations
    write(state, keys[:70])
    write(state, keys[70:], parent=keys[69])
    for n in (1, 64, 65, 80):
        asked = keys[:n] + block_keys(NS, range(500, 512), 4)  # a miss after the hit
        joined = state.match_bytes(NS.digest, (), joined=b"".join(asked))
        assert joined == state.match_bytes(NS.digest, asked)
        assert meta_pb2.MatchPrefixReply.FromString(joined).matched == n
    # zero bytes across two keys are no zero key: a real digest may end or start with them
    edge = [b"\x01" * 8 + bytes(8), bytes(8) + b"\x02" * 8]
    assert state.match(NS.digest, edge).matched == 0
    assert meta_pb2.MatchPrefixReply.FromString(
        state.match_bytes(NS.digest, (), joined=b"".join(edge))).matched == 0
    cases = {b"".join(keys[:2]) + b"x": "not a whole number of 16-byte keys",
             b"".join(keys[:2]) + bytes(16): "16 zero bytes is not a block key",
             b"\x01" * 16 * (state.cfg.max_keys + 1): f"at most {state.cfg.max_keys}"}
    for joined, message in cases.items():
        with pytest.raises(InvalidArgument, match=message):
            state.match_bytes(NS.digest, (), joined=joined)
    with pytest.raises(InvalidArgument, match="one of the two"):
        state.match_bytes(NS.digest, keys[:1], joined=keys[1])
    assert state.match(NS.digest, keys).matched == 80  # and nothing changed


def test_no_chains_without_enough_failure_domains(make_state, tmp_path):
    cfg = MetaserverConfig(data_dir=str(tmp_path / "solo"), replicas=2)
    state = MetaState(cfg, Clock())
    state.register(meta_pb2.RegisterRequest(server_id="a", address="x:1", failure_domain="d", capacity_bytes=1 << 30))
    state.register(meta_pb2.RegisterRequest(server_id="b", address="x:2", failure_domain="d", capacity_bytes=1 << 30))
    with pytest.raises(Unavailable, match="failure domains"):
        state.allocate(NS.digest, block_keys(NS, range(64), 64), LAYOUT_MSG)
    state.close()


def test_a_stall_of_the_metaserver_itself_is_not_the_servers_silence(make_state):
    clock = Clock()
    state = make_state(clock, heartbeat_timeout=5)
    loop = LoopStats()
    loop.tick, loop.last_tick = 0.01, time.monotonic()  # as watch_event_loop sets them
    state.members.watch(loop)
    everyone = {"cs-0", "cs-1", "cs-2"}
    # the process was stopped for 8 s: its clock moved on, its loop watcher has not woken yet
    clock.now += 8
    loop.last_tick -= 8
    state.refresh_liveness()
    assert set(state.live_servers()) == everyone, "servers declared dead for the metaserver's own stall"
    loop.woke(time.monotonic(), 8.0, 0.0)  # the watcher wakes and counts it
    state.refresh_liveness()
    assert set(state.live_servers()) == everyone
    # silence while awake counts: 6 s more, cs-0 alone heartbeats
    clock.now += 4
    state.heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-0"))
    clock.now += 2
    state.refresh_liveness()
    assert set(state.live_servers()) == {"cs-0"}


def test_silent_servers_leave_chunks_short_of_copies_and_blocks_without_any_are_lost(make_state):
    clock = Clock()
    state = make_state(clock, heartbeat_timeout=5)
    keys = block_keys(NS, range(32), 4)
    alloc, _ = write(state, keys)
    assert state.under_replicated() == ([], [])
    clock.now += 6  # cs-0 alone keeps heartbeating
    state.heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-0"))
    state.reconciled("cs-0")
    repairs, lost = state.under_replicated()
    chains = [set(c.servers) for b in alloc.blocks for c in b.chunks]
    # every chunk had two copies in distinct domains, so each kept at most cs-0's
    assert all(r.holders == ["cs-0"] for r in repairs)
    assert len(repairs) == sum("cs-0" in c for c in chains)
    assert {k for k in lost} == {NS.digest + b.key for b in alloc.blocks
                                 if any("cs-0" not in set(c.servers) for c in b.chunks)}
    # a new copy on a server that is back: the block lists live copies only
    state.heartbeat(meta_pb2.HeartbeatRequest(server_id="cs-1"))
    state.reconciled("cs-1")
    r = next(r for r in repairs if "cs-2" in r.chunk.servers)  # copies on cs-0 and the silent cs-2
    assert state.replica_target(r.holders, r.chunk.length) == "cs-1"
    assert state.update_replicas(r.full_key, r.chunk.chunk_id, added=["cs-1"], gone=["cs-2"])
    owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=r.full_key[len(NS.digest):])
    assert state.is_stale(r.chunk.chunk_id, owner, "cs-2")  # re-created on cs-1 while cs-2 was away
    assert not state.is_stale(r.chunk.chunk_id, owner, "cs-1")
    assert not state.is_stale(b"x" * 16, owner, "cs-2")  # not a chunk of that block: orphan GC's
    assert not state.is_stale(r.chunk.chunk_id, None, "cs-2")
    garbage = state.drop_lost_blocks(lost)
    assert state.blocks_lost == len(lost) and len(garbage) >= len(lost)
    assert state.under_replicated()[1] == []


def test_rebuild_restores_complete_blocks_a_slice_at_a_time_from_staged_inventories(make_state):
    from kvfs.metaserver import records
    from kvfs.proto import chunk_pb2

    from helpers import assert_metadata_consistent, keys_under

    state = make_state()
    keys = block_keys(NS, range(16), 4)  # 4 blocks of one 256-byte chunk each
    lengths = {0: LAYOUT.payload_bytes}

    def info(key, index=0, chunk_id=None, length=None):
        owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=key, chunk_index=index, chunk_count=1,
                                    layout=LAYOUT_MSG, ttl_class="chat", chunk_size=64 * 1024)
        return chunk_pb2.ChunkInfo(chunk_id=chunk_id or key, length=lengths[0] if length is None else length,
                                   checksum=5, created=900.0, owner=owner.SerializeToString())

    state.rebuild_begin()
    # block 0 on two servers, 1 on one, 2 with a chunk of the wrong length, 3 found nowhere, plus junk
    assert state.rebuild_stage("cs-0", [info(keys[0]), info(keys[1]), chunk_pb2.ChunkInfo(chunk_id=b"j" * 16)]) == 2
    assert state.rebuild_stage("cs-1", [info(keys[0]), info(keys[2], length=100)]) == 2
    other = info(keys[0])
    other.checksum = 6  # the same chunk id with other bytes: not a third copy of block 0's chunk
    assert state.rebuild_stage("cs-2", [other]) == 1
    slices, floors = [], []
    while (done := state.rebuild_slice(limit=1)) != (0, 0):
        slices.append(done)
        floors.append(state._staged_floor)
        # the next slice starts at the first block still staged, not at deleted entries before it
        assert keys_under(state, records.STAGED) <= {k for k in keys_under(state, records.STAGED) if k >= floors[-1]}
        assert not keys_under(state, records.STAGED) or min(keys_under(state, records.STAGED)) == floors[-1]
    assert sorted(slices) == [(0, 1), (1, 0), (1, 0)]  # one block per slice; block 2 incomplete
    assert not keys_under(state, records.STAGED)  # the staging table is emptied as it goes
    assert keys_under(state, records.SHORT) == {records.SHORT + NS.digest + keys[1]}  # one copy: repair's queue
    assert state.match(NS.digest, keys).matched == 2
    reply = state.match(NS.digest, keys[:1])
    assert {reply.servers[i].id for i in reply.blocks[0].chunks[0].replicas} == {"cs-0", "cs-1"}
    assert_metadata_consistent(state)


def test_rebuilt_blocks_share_row_groups(make_state):
    # owner records name no parent, so every rebuilt block is a root; placed each at the start
    # of a run of its own, each took a row group of its own (~2 KiB apiece)
    from kvfs.metaserver import records
    from kvfs.metaserver.groups import GROUP_SLOTS
    from kvfs.proto import chunk_pb2

    from helpers import keys_under

    state = make_state()
    keys = block_keys(NS, range(4 * 300), 4)
    infos = [chunk_pb2.ChunkInfo(chunk_id=k, length=LAYOUT.payload_bytes, checksum=5, created=900.0,
                                 owner=meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=k, chunk_index=0,
                                                           chunk_count=1, layout=LAYOUT_MSG,
                                                           chunk_size=64 * 1024).SerializeToString())
             for k in keys]
    state.rebuild_begin()
    assert state.rebuild_stage("cs-0", infos) == 300
    restored = 0
    while (done := state.rebuild_slice(limit=7)) != (0, 0):
        restored += done[0]
    assert restored == 300 and len(state.blocks) == 300
    assert len(keys_under(state, records.ROW)) <= 300 // GROUP_SLOTS + 1
    # a write continuing a rebuilt block (its parent) still works: its slot was taken, so a fresh run
    longer = block_keys(NS, [*range(4), 7, 7, 7, 7], 4)
    assert longer[0] == keys[0] and longer[1] not in keys
    write(state, longer[1:], parent=keys[0])
    assert state.match(NS.digest, longer).matched == 2
    assert_metadata_consistent(state)


def test_a_rebuild_takes_only_owner_records_the_metaserver_sealed(make_state):
    import os

    from kvfs.grants import owner_sealed
    from kvfs.proto import chunk_pb2
    from kvfs.shards import hash_slot

    state = make_state()
    state.key = state.allocations.key = os.urandom(32)  # as --cluster-key gives it
    keys = block_keys(NS, range(12), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    placed = [(b.key, c) for b in alloc.blocks for c in b.chunks]
    assert all(len(c.owner_seal) == 16 for _, c in placed)  # every allocated chunk's owner record is sealed

    def info(key, chunk_id, seal, **change):
        owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=key, chunk_index=0, chunk_count=1,
                                    layout=LAYOUT_MSG, ttl_class="chat", chunk_size=64 * 1024, seal=seal,
                                    hash_slot=alloc.hash_slot)
        for field, value in change.items():
            setattr(owner, field, value)
        return chunk_pb2.ChunkInfo(chunk_id=chunk_id, length=LAYOUT.payload_bytes, checksum=5, created=900.0,
                                   owner=owner.SerializeToString())

    (k0, c0), (k1, c1), (k2, c2) = placed
    state.rebuild_begin()
    staged = state.rebuild_stage("cs-0", [
        info(k0, c0.chunk_id, c0.owner_seal),  # as the writer stored it: taken
        info(k1, c1.chunk_id, b""),  # no seal
        info(k2, c2.chunk_id, os.urandom(16)),  # a made-up seal
        info(k1, c0.chunk_id, c0.owner_seal),  # a real seal moved onto another block's record
        info(k2, c2.chunk_id, c2.owner_seal, block_key=b"x" * 16),  # a sealed record, edited
        info(k2, c2.chunk_id, c2.owner_seal, hash_slot=alloc.hash_slot ^ 1),  # ... filed under another hash slot
    ])
    assert alloc.hash_slot == hash_slot(keys[0])
    assert staged == 1 and state.forged_owners == 5
    assert owner_sealed(state.key, meta_pb2.ChunkOwner.FromString(
        info(k0, c0.chunk_id, c0.owner_seal).owner), c0.chunk_id)


def test_interleaved_commits_of_the_same_keys_still_let_the_first_writer_win(make_state):
    from helpers import assert_metadata_consistent

    state = make_state()
    keys = block_keys(NS, range(4 * 200), 4)  # 200 blocks: a commit of several pieces
    reqs = []
    for _ in range(2):
        alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
        req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
        for b in alloc.blocks:
            req.blocks.add(key=b.key, chunk_checksums=[1] * len(b.chunks))
        reqs.append((alloc, req))
    first = state.allocations.commit_steps(NS.digest, reqs[0][1])
    second = state.allocations.commit_steps(NS.digest, reqs[1][1])
    results = {}
    pending = {"first": first, "second": second}
    while pending:  # alternate one piece of each, as two RPCs would on the event loop
        for name, steps in list(pending.items()):
            try:
                next(steps)
            except StopIteration as done:
                results[name] = done.value
                del pending[name]
    (c1, a1, g1), (c2, a2, g2) = results["first"], results["second"]
    assert sorted([(c1, a1), (c2, a2)]) == [(0, 200), (200, 0)]  # one commit wins every block
    loser = reqs[0][0] if c1 == 0 else reqs[1][0]
    assert {c.chunk_id for c in (g1 or g2)} == {c.chunk_id for b in loser.blocks for c in b.chunks}
    winner = reqs[1][0] if c1 == 0 else reqs[0][0]
    reply = state.match(NS.digest, keys)
    assert reply.matched == 200
    assert [c.chunk_id for b in reply.blocks for c in b.chunks] == [c.chunk_id for b in winner.blocks for c in b.chunks]
    assert_metadata_consistent(state)



def commit_request(alloc, blocks=None) -> meta_pb2.CommitBlocksRequest:
    """A CommitBlocks of `blocks` (default: every block) of an allocation."""
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    for b in alloc.blocks if blocks is None else blocks:
        req.blocks.add(key=b.key, chunk_checksums=[1] * len(b.chunks))
    return req


def until_a_piece_is_written(state, steps) -> int:
    """Steps a commit until its first piece is written; the blocks it committed."""
    before = state.blocks.blocks
    while state.blocks.blocks == before:
        next(steps)
    return state.blocks.blocks - before


def test_a_large_commit_is_written_in_pieces_and_an_allocation_expiring_between_them_frees_only_the_rest(make_state):
    """Each piece of a commit is written with the allocation's count of settled
    keys: blocks committed so far stay whole and readable, and expiry deletes the
    unsettled chunks only, never a committed block's."""
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(4 * 200), 4)  # 200 blocks: pieces of 64
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    req = commit_request(alloc)
    steps = state.allocations.commit_steps(NS.digest, req)
    first = until_a_piece_is_written(state, steps)
    assert 0 < first < 200 and state.match(NS.digest, keys).matched == first
    clock.now += 61  # past allocation_timeout, between two pieces
    expired, garbage = state.expire_allocations()
    assert expired == 1
    chunk_ids = [[c.chunk_id for c in b.chunks] for b in alloc.blocks]
    assert {c.chunk_id for c in garbage} == {c for ids in chunk_ids[first:] for c in ids}
    with pytest.raises(NotFound):
        next(steps)
    reply = state.match(NS.digest, keys)
    assert reply.matched == first
    assert [c.chunk_id for b in reply.blocks for c in b.chunks] == [c for ids in chunk_ids[:first] for c in ids]
    assert_metadata_consistent(state)


def test_a_restart_between_two_pieces_of_a_commit_keeps_what_the_pieces_settled(make_state):
    """A piece writes the allocation's settled count beside its record, not the record
    again: reopened, the allocation knows the pieces' blocks are settled, so its
    expiry frees only the rest, and its retry commits the rest."""
    from kvfs.metaserver.records import ALLOC_SETTLED

    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    req = commit_request(alloc)
    steps = state.allocations.commit_steps(NS.digest, req)
    first = until_a_piece_is_written(state, steps)
    second = until_a_piece_is_written(state, steps)
    steps.close()
    state.close()  # the process stops between two pieces
    state = make_state(clock, register=False)
    reopened = state.allocations.open[alloc.allocation_id]
    assert reopened.record.settled == first + second < 200
    chunk_ids = [[c.chunk_id for c in b.chunks] for b in alloc.blocks]
    assert {c.chunk_id for c in reopened.unsettled_chunks()} == {c for ids in chunk_ids[first + second:] for c in ids}
    assert state.commit(NS.digest, req)[:2] == (200 - first - second, first + second)  # its retry
    assert state.match(NS.digest, keys).matched == 200
    assert not state.allocations.open
    state.close()
    state = make_state(clock, register=False)  # nothing of the allocation is left behind
    assert not state.allocations.open and not list(state.blocks.db.scan(ALLOC_SETTLED))
    assert_metadata_consistent(state)


def test_while_lookups_keep_coming_a_commit_decides_and_writes_pieces_that_fit_a_step(make_state):
    """Beside lookups a piece is as many blocks as the pieces so far say fit in a step
    (SLICE_SECONDS_BESIDE_LOOKUPS), between MIN_COMMIT_PIECE and COMMIT_PIECE_BESIDE_LOOKUPS;
    each piece's time moves that running mean."""
    from kvfs.metaserver.allocations import (COMMIT_PIECE, COMMIT_PIECE_BESIDE_LOOKUPS, MIN_COMMIT_PIECE,
                                             SLICE_SECONDS_BESIDE_LOOKUPS)

    state = make_state()
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    assert until_a_piece_is_written(state, steps) == COMMIT_PIECE  # no lookups: whole pieces
    state.reads.ended(state.reads.began())  # a lookup, just now
    state.allocations.settle_s = SLICE_SECONDS_BESIDE_LOOKUPS / 10  # as if pieces took that long a block
    assert until_a_piece_is_written(state, steps) == 10 < COMMIT_PIECE
    assert state.allocations.settle_s != SLICE_SECONDS_BESIDE_LOOKUPS / 10  # that piece was timed
    state.allocations.settle_s = 1.0  # pieces far slower than a step: the least piece still
    assert state.allocations.piece_within(SLICE_SECONDS_BESIDE_LOOKUPS) == MIN_COMMIT_PIECE
    state.allocations.settle_s = 1e-9  # far faster: no more than the most
    assert state.allocations.piece_within(SLICE_SECONDS_BESIDE_LOOKUPS) == COMMIT_PIECE_BESIDE_LOOKUPS
    state.reads.last_began -= 3600  # none since
    assert until_a_piece_is_written(state, steps) == COMMIT_PIECE
    assert until_a_piece_is_written(state, steps) == 200 - 2 * COMMIT_PIECE - 10  # the last piece: the rest
    with pytest.raises(StopIteration) as done:  # the step closing the allocation
        next(steps)
    assert done.value.value == (200, 0, [])
    assert state.match(NS.digest, keys).matched == 200
    assert not state.allocations.open
    assert_metadata_consistent(state)


def test_an_allocation_keeps_its_placements_pins_and_its_commit_unpins_them_in_a_step_of_its_own(make_state):
    """An allocation's last step writes its record and keeps the pins its placement took
    (its parent, its keys) instead of counting them out and its blocks' parents back in;
    its commit unpins them in a step after its last piece, not in it. At 500 blocks each
    of those took 0.4-0.5 ms of a step otherwise about as long. Until then the
    allocation stays open, and pins its blocks found present too."""
    from kvfs.metaserver.db import OffLoop
    from kvfs.metaserver.state import _answer

    state = make_state()
    allocs = state.allocations
    write(state, block_keys(NS, range(4 * 20), 4))  # the first 20 blocks of the prompt below
    keys = block_keys(NS, range(4 * 220), 4)
    pin, touched = allocs._pin, []  # keys pinned or unpinned, per step

    def counting(pins, delta):
        pins = list(pins)
        touched[-1] += len(pins)
        pin(pins, delta)

    allocs._pin = counting
    steps, answer = allocs.allocate_steps(NS.digest, keys, LAYOUT_MSG, b"", state.make_room_steps), None
    while True:
        touched.append(0)
        try:
            asked = steps.send(answer)
        except StopIteration as done:
            alloc = done.value
            break
        answer = _answer(asked.fn, asked.args)[0] if isinstance(asked, OffLoop) else None
    assert touched[0] == 220 and sum(touched) == 220  # pinned as its placement began, once
    assert set(allocs.pinned()) == {NS.digest + k for k in keys}
    steps = allocs.commit_steps(NS.digest, commit_request(alloc, [b for b in alloc.blocks if not b.already_present]))
    touched.clear()
    while state.match(NS.digest, keys).matched < 220:
        touched.append(0)
        next(steps)
    assert len(touched) > 2 and sum(touched) == 0  # its pieces, the last one too, unpin nothing
    assert set(allocs.pinned()) == {NS.digest + k for k in keys}  # still open
    assert_metadata_consistent(state)
    touched.append(0)
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value == (200, 0, [])
    assert touched[-1] == 220 and not allocs.open and not allocs.pinned()
    assert_metadata_consistent(state)


def test_an_allocation_expiring_or_restarted_between_its_last_piece_and_its_close_frees_nothing(make_state):
    """Its last piece settled every key: expiry before the closing step frees none of its
    chunks, and that step then finds it gone; reopened after a stop there, it has nothing
    unsettled, and the commit's retry finds every block present."""
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(4 * 100), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    while state.match(NS.digest, keys).matched < 100:
        next(steps)
    clock.now += 61  # past allocation_timeout
    assert state.expire_allocations() == (1, [])
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value == (100, 0, []) and not state.allocations.open
    assert_metadata_consistent(state)

    more = block_keys(NS, range(1000, 1000 + 4 * 100), 4)
    alloc = state.allocate(NS.digest, more, LAYOUT_MSG)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    while state.match(NS.digest, more).matched < 100:
        next(steps)
    steps.close()
    state.close()  # the process stops before the closing step
    state = make_state(clock, register=False)
    reopened = state.allocations.open[alloc.allocation_id]
    assert reopened.record.settled == 100 and not reopened.unsettled_chunks() and reopened.footprint == 0
    assert state.commit(NS.digest, commit_request(alloc)) == (0, 100, [])  # its retry
    assert not state.allocations.open and state.match(NS.digest, more).matched == 100
    assert_metadata_consistent(state)


def test_a_commit_cut_short_between_pieces_is_finished_by_its_retry_and_none_runs_twice_at_once(make_state):
    from kvfs.errors import Aborted

    state = make_state()
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    req = commit_request(alloc, alloc.blocks[:150])  # the last 50 blocks are abandoned
    steps = state.allocations.commit_steps(NS.digest, req)
    first = until_a_piece_is_written(state, steps)
    with pytest.raises(Aborted):  # a retry while the first call still runs
        next(state.allocations.commit_steps(NS.digest, req))
    steps.close()  # the call is cancelled between two pieces
    committed, already, garbage = state.commit(NS.digest, req)  # its retry
    assert (committed, already) == (150 - first, first)
    chunk_ids = [[c.chunk_id for c in b.chunks] for b in alloc.blocks]
    assert {c.chunk_id for c in garbage} == {c for ids in chunk_ids[150:] for c in ids}
    reply = state.match(NS.digest, keys)
    assert reply.matched == 150
    assert [c.chunk_id for b in reply.blocks for c in b.chunks] == [c for ids in chunk_ids[:150] for c in ids]
    assert not state.allocations.open
    assert_metadata_consistent(state)



def victim_of(state, full: bytes) -> bytes:
    from kvfs.metaserver import records

    row = state.blocks.row(full)
    return records.victim_key(row.rank, row.last_used, row.depth, full)


def test_a_commits_pieces_seek_child_entries_twice_a_commit_not_twice_a_piece(make_state):
    """The last block of a piece followed by its child's piece enters no eviction index
    (pinned meanwhile, then a parent), so neither piece seeks its child entries (a read
    in every level of the database that no filter rules out): only the commit's first
    parent and its last block are looked up. The result is the same metadata."""
    state = make_state()
    keys = block_keys(NS, range(4 * 300), 4)
    write(state, keys[:100])
    alloc = state.allocate(NS.digest, keys[100:], LAYOUT_MSG, parent=keys[99])
    seeks = []
    has_prefix = state.db.has_prefix
    state.db.has_prefix = lambda prefix, *a: seeks.append(prefix) or has_prefix(prefix, *a)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    pieces = []
    with pytest.raises(StopIteration):
        while True:
            before = state.blocks.blocks
            next(steps)
            pieces += [state.blocks.blocks - before] if state.blocks.blocks != before else []
    from kvfs.metaserver.records import CHILD

    assert pieces == [64, 64, 64, 8]
    assert seeks == [CHILD + NS.digest + keys[99], CHILD + NS.digest + keys[299]]
    assert state.match(NS.digest, keys).matched == 300
    assert_metadata_consistent(state)  # the last block is the one leaf


def test_a_commit_cut_short_between_pieces_leaves_its_last_committed_block_evictable(make_state):
    from helpers import keys_under
    from kvfs.metaserver.records import VICTIM

    state = make_state()
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    first = until_a_piece_is_written(state, steps)
    assert victim_of(state, NS.digest + keys[first - 1]) not in keys_under(state, VICTIM)  # its child comes next
    steps.close()  # the call is cancelled before that
    assert keys_under(state, VICTIM) == {victim_of(state, NS.digest + keys[first - 1])}
    assert_metadata_consistent(state)


def test_a_crash_between_pieces_leaves_the_last_committed_block_evictable_once_the_allocation_expires(
        make_state, tmp_path):
    import shutil

    from helpers import keys_under
    from kvfs.metaserver.records import VICTIM

    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc))
    first = until_a_piece_is_written(state, steps)
    state.db.sync()
    shutil.copytree(tmp_path / "meta", tmp_path / "crashed")  # the database as a crash now leaves it
    steps.close()
    state.close()
    shutil.rmtree(tmp_path / "meta")
    (tmp_path / "crashed").rename(tmp_path / "meta")
    state = make_state(clock, register=False)
    assert state.allocations.open[alloc.allocation_id].record.settled == first
    assert not keys_under(state, VICTIM)  # the piece's last block waited for its child's piece
    clock.now += 61  # past allocation_timeout
    assert state.expire_allocations()[0] == 1
    assert keys_under(state, VICTIM) == {victim_of(state, NS.digest + keys[first - 1])}
    assert state.match(NS.digest, keys).matched == first
    assert_metadata_consistent(state)


def test_the_garbage_of_each_piece_is_queued_for_deletion_even_if_the_commit_is_cut_short(make_state):
    state = make_state()
    keys = block_keys(NS, range(4 * 200), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    write(state, keys[:64])  # another writer's commit of the first 64 blocks lands first
    steps = state.allocations.commit_steps(NS.digest, commit_request(alloc), state.queue_deletes)
    while state.allocations.open[alloc.allocation_id].record.settled == 0:
        next(steps)
    steps.close()  # cut short after its first piece: 64 blocks that lost the race
    queued = {cid for per_server in state.undeleted.values() for cid in per_server}
    assert {c.chunk_id for b in alloc.blocks[:64] for c in b.chunks} <= queued
    assert not {c.chunk_id for b in alloc.blocks[64:] for c in b.chunks} & queued  # still the allocation's
    assert_metadata_consistent(state)

def test_a_block_whose_parent_goes_between_two_pieces_of_its_commit_is_garbage(make_state):
    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(4 * 130), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    req = commit_request(alloc)
    steps = state.allocations.commit_steps(NS.digest, req)
    first = until_a_piece_is_written(state, steps)
    state.drop_lost_blocks([NS.digest + keys[first - 1]])  # the next piece's first parent, lost meanwhile
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
    committed, already, garbage = done.value.value
    assert (committed, already) == (first, 0)
    assert {c.chunk_id for c in garbage} >= {c.chunk_id for b in alloc.blocks[first:] for c in b.chunks}
    state.drain_stranded()
    assert state.match(NS.digest, keys).matched == first - 1
    assert_metadata_consistent(state)

def test_rewritten_rows_are_updated_in_place_not_stacked_in_the_memtable(tmp_path):
    """A hot prompt's rows are rewritten on every flush of its hits; stacked versions
    would make every lookup's range read step over all of them (db.py)."""
    from kvfs.metaserver.db import MetaDB
    db = MetaDB(str(tmp_path / "meta"), 1 << 20)
    try:
        entries = lambda: db.db.property_int_value("rocksdb.num-entries-active-mem-table")  # noqa: E731
        db.put(b"l-row", b"x" * 200)
        before = entries()
        for i in range(100):
            db.put(b"l-row", bytes([i]) * 200)
        assert entries() == before
        assert db.get(b"l-row") == bytes([99]) * 200
        db.put(b"l-row", b"y" * 300)  # a longer value cannot go in place: a new version, still read right
        assert entries() == before + 1 and db.get(b"l-row") == b"y" * 300
    finally:
        db.close()


@pytest.mark.asyncio
async def test_writers_steps_take_turns_at_most_one_per_turn_of_the_event_loop():
    """Eight writers with a step ready must not run eight steps between two polls of
    the sockets (every lookup and heartbeat would wait that long)."""
    import asyncio

    from kvfs.metaserver.readsfirst import ReadsFirst
    from kvfs.metaserver.state import run_steps_async

    turns = Turns()
    seen = []

    def steps(name):
        for _ in range(5):
            seen.append(turns.n)
            yield
        return name

    gate = asyncio.Lock()
    try:
        results = await asyncio.gather(*(run_steps_async(steps(n), gate, ReadsFirst(), "commit") for n in "abcdefgh"))
    finally:
        turns.stop()
    assert results == list("abcdefgh") and len(seen) == 40
    assert len(set(seen)) == len(seen)  # no two steps in one turn
    assert not gate.locked()


@pytest.mark.asyncio
async def test_a_read_a_step_asks_for_is_made_off_the_loop_while_other_writers_go_on():
    """A step's OffLoop read runs on the reader thread, its answer sent back into the
    steps; the gate is not held meanwhile, so another writer's steps all run while
    the read waits (a page read from the disk must not hold every write up)."""
    import asyncio
    import concurrent.futures
    import threading

    from kvfs.metaserver.db import OffLoop
    from kvfs.metaserver.readsfirst import ReadsFirst
    from kvfs.metaserver.state import run_steps, run_steps_async

    release, loop_thread = threading.Event(), threading.get_ident()
    other_done: list[bool] = []

    def slow_read(x):  # stands in for a multi-get waiting on the disk
        assert release.wait(10), "the other writer never finished while the read waited"
        return x * 2, threading.get_ident()

    def reading():
        answer, thread = yield OffLoop(slow_read, (21,))
        return answer, thread, list(other_done)

    def other():
        for _ in range(5):
            yield
        other_done.append(True)
        release.set()
        return "other"

    gate = asyncio.Lock()
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        (answer, thread, seen), name = await asyncio.gather(
            run_steps_async(reading(), gate, ReadsFirst(), "allocate", reader),
            run_steps_async(other(), gate, ReadsFirst(), "allocate", reader))
    assert (answer, name) == (42, "other") and seen == [True] and thread != loop_thread
    release.clear()
    release.set()
    assert run_steps(reading())[0] == 42  # run at once, the read made in place

    cleaned: list[str] = []

    def failing_read():
        raise OSError("the disk said no")

    def failing():  # a read that fails raises in the steps, whose cleanup runs
        try:
            yield OffLoop(failing_read, ())
        except OSError as err:
            cleaned.append(str(err))
            raise

    with pytest.raises(OSError, match="said no"):
        await run_steps_async(failing(), asyncio.Lock(), ReadsFirst(), "commit")
    with pytest.raises(OSError, match="said no"):
        run_steps(failing())
    assert cleaned == ["the disk said no"] * 2


def test_a_removed_block_leaves_no_tombstone_on_repairs_queue_unless_it_was_on_it(make_state, tmp_path):
    """Removing a block deletes its repair-queue entry only if it has one: blind deletes
    of every evicted block's entry piled tombstones at the queue's front, which each
    repair round's scan stepped over on the event loop (~100 ms at 10M blocks)."""
    import shutil

    from kvfs.metaserver.records import SHORT

    def deletes_expiring(queued: bool) -> int:
        shutil.rmtree(tmp_path / "meta", ignore_errors=True)  # the same state from scratch each time
        clock = Clock()
        state = make_state(clock)
        keys = block_keys(NS, range(32), 4)  # 8 blocks
        write(state, keys, "short")
        if queued:  # found short of copies, as repair's scan queues them
            for key in keys:
                state.db.put(SHORT + NS.digest + key, b"")
        count = lambda: state.db.db.property_int_value("rocksdb.num-deletes-active-mem-table")  # noqa: E731
        before = count()
        clock.now += 30
        assert state.expire_blocks()
        assert len(state.blocks) == 0 and state.blocks.short_blocks() == []
        took = count() - before
        state.close()
        return took

    assert deletes_expiring(queued=True) - deletes_expiring(queued=False) == 8  # one per queued block


def test_the_metaservers_tables_carry_a_bloom_filter_of_every_key(make_state):
    """Reads of keys that are not there (every new block of an allocation is looked
    up first) are answered by the filters, not by a data block of every file."""
    state = make_state()
    write(state, block_keys(NS, range(4 * 200), 4))
    db = state.blocks.db.db
    db.flush(True)
    props = dict(part.strip().split("=", 1) for part in db.property_value("rocksdb.aggregated-table-properties")
                 .split(";") if "=" in part)
    assert int(props["# entries"]) > 200  # the rows, their indexes and the rest
    assert int(props["# entries for filter"]) == int(props["# entries"]), props  # deletions included
    assert int(props["filter block size"]) > 0


def test_a_slot_read_before_its_block_left_it_is_no_row_of_another_block(make_state):
    """rows() runs off the event loop: between its read of a block's slot and of the
    slot's group, the block may be removed and the slot given to another block. The
    row found then holds that block's key, and is no row of the block asked for."""
    from kvfs.metaserver.records import BLOCK, u64

    state = make_state()
    keys = block_keys(NS, range(8), 4)
    write(state, keys)
    (slot,) = slots(state, keys[:1])
    stray = block_keys(NS, range(100, 104), 4)[0]  # never written; made to point at keys[0]'s slot
    state.blocks.db.db.put(BLOCK + NS.digest + stray, u64(slot))
    found, missing = state.blocks.rows([NS.digest + keys[0], NS.digest + stray])
    assert found is not None and found[:16] == keys[0] and missing is None


@pytest.mark.asyncio
async def test_a_background_slice_and_a_writers_step_never_share_a_turn_of_the_event_loop(make_state):
    """Writers' steps and background passes' slices take one step slot: a lookup's
    first turns on the loop, before its handler counts it in, wait behind one step,
    not behind a write's step and a pass's slice in the same turn."""
    import asyncio

    from kvfs.metaserver.lifecycle import Lifecycle
    from kvfs.metaserver.state import run_steps_async

    state = make_state()
    lifecycle = Lifecycle(state)
    turns = Turns()
    seen: list[tuple[str, int]] = []

    def steps(name):
        for _ in range(6):
            seen.append((name, turns.n))
            yield
        return name

    async def background():
        for _ in range(6):
            async with lifecycle.turn("evict"):
                seen.append(("pass", turns.n))

    try:
        await asyncio.gather(background(),
                             *(run_steps_async(steps(n), state._step_gate, state.reads, "commit") for n in "ab"))
    finally:
        turns.stop()
    assert len(seen) == 18 and {name for name, _ in seen} == {"pass", "a", "b"}
    turns = [t for _, t in seen]
    assert len(set(turns)) == len(turns)  # no two steps, of either kind, in one turn
    assert not state._step_gate.locked()


def test_beside_lookups_a_commit_builds_its_rows_in_shorter_steps(make_state, monkeypatch):
    """While lookups keep coming a step of work holds the loop at most
    SLICE_SECONDS_BESIDE_LOOKUPS, else SLICE_SECONDS. Made a step per block beside
    lookups and no time limit without (commit pieces the same size either way), a
    40-block commit's steps tell them apart: 40 steps building rows, one writing
    them and one closing the allocation, against those two alone."""
    from kvfs.metaserver import allocations

    monkeypatch.setattr(allocations, "SLICE_SECONDS", 3600.0)
    monkeypatch.setattr(allocations, "SLICE_SECONDS_BESIDE_LOOKUPS", 0.0)
    monkeypatch.setattr(allocations, "MIN_COMMIT_PIECE", allocations.COMMIT_PIECE)
    monkeypatch.setattr(allocations, "COMMIT_PIECE_BESIDE_LOOKUPS", allocations.COMMIT_PIECE)
    state = make_state()
    keys = block_keys(NS, range(320), 4)  # 80 blocks of 4 tokens

    def commit_steps(blocks) -> int:
        alloc = state.allocate(NS.digest, blocks, LAYOUT_MSG, b"" if blocks[0] == keys[0] else keys[39])
        req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
        for b in alloc.blocks:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
        steps, n = state.allocations.commit_steps(NS.digest, req), 0
        with pytest.raises(StopIteration) as done:
            while True:
                next(steps)
                n += 1
        assert done.value.value[0] == len(blocks)
        return n

    assert state.slice_seconds() == 3600.0
    assert commit_steps(keys[:40]) == 2
    state.reads.clock = lambda: 100.0  # a lookup reached its handler "just now", and stays recent
    state.reads.began()
    assert state.slice_seconds() == 0.0
    assert commit_steps(keys[40:]) == 42
    assert state.match(NS.digest, keys).matched == 80


def test_a_rebuild_puts_blocks_back_under_their_parents_in_their_prompts_runs(make_state):
    # owner records name each block's parent and depth: however the inventories list them, a
    # rebuilt prompt is a tree again (eviction takes leaves first), its blocks in consecutive
    # slots after the first; a block whose prefix is gone is left out (no lookup could reach it)
    import random

    from kvfs.metaserver import records
    from kvfs.proto import chunk_pb2

    state = make_state()
    prompt = block_keys(NS, range(6 * 4), 4)  # 6 blocks
    orphan = block_keys(NS, [9] * 12, 4)  # 3 blocks, the first one lost

    def info(keys, i, server_copy=0):
        owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=keys[i], chunk_index=0, chunk_count=1,
                                    layout=LAYOUT_MSG, chunk_size=64 * 1024, parent=keys[i - 1] if i else b"",
                                    depth=i)
        return chunk_pb2.ChunkInfo(chunk_id=bytes([i, server_copy]) + keys[i][2:], length=LAYOUT.payload_bytes,
                                   checksum=5, created=900.0, owner=owner.SerializeToString())

    listed = [info(prompt, i) for i in range(6)] + [info(orphan, i) for i in (1, 2)]
    random.Random(7).shuffle(listed)
    state.rebuild_begin()
    assert state.rebuild_stage("cs-0", listed[:4]) + state.rebuild_stage("cs-1", listed[4:]) == 8
    restored = incomplete = 0
    while (done := state.rebuild_slice(limit=2)) != (0, 0):
        restored, incomplete = restored + done[0], incomplete + done[1]
    assert (restored, incomplete) == (6, 2)
    rows = [state.blocks.row(NS.digest + k) for k in prompt]
    assert [r.parent for r in rows] == [b"", *prompt[:5]] and [r.depth for r in rows] == list(range(6))
    assert [r.slot - rows[1].slot for r in rows[1:]] == [0, 1, 2, 3, 4]  # one run after the first block
    assert state.blocks.row(NS.digest + orphan[1]) is None and state.blocks.row(NS.digest + orphan[2]) is None
    assert state.match(NS.digest, prompt).matched == 6
    from helpers import keys_under

    assert keys_under(state, records.VICTIM) == {records.victim_key(rows[5].rank, rows[5].last_used, 5,
                                                                    NS.digest + prompt[5])}  # the leaf only
    assert_metadata_consistent(state)


def test_an_owner_records_parent_is_sealed():
    from kvfs.grants import owner_seal, owner_sealed
    from kvfs import tls

    key, keys = b"k" * 32, block_keys(NS, range(8), 4)
    sealed = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=keys[1], chunk_index=0, chunk_count=1,
                                 layout=LAYOUT_MSG, chunk_size=64 * 1024, hash_slot=3, parent=keys[0], depth=1)
    sealed.seal = owner_seal(key, NS.digest + keys[1], 0, 1, LAYOUT_MSG, 64 * 1024, b"c" * 16, 3, keys[0])
    assert owner_sealed(key, sealed, b"c" * 16)
    moved = meta_pb2.ChunkOwner()
    moved.CopyFrom(sealed)
    moved.parent = NS.digest[:16]  # grafted under another block
    assert not owner_sealed(key, moved, b"c" * 16)
    moved.CopyFrom(sealed)
    moved.depth = 9  # the depth only orders a rebuild: not sealed
    assert owner_sealed(key, moved, b"c" * 16)
    # a prompt's first block is sealed as before records named parents
    root = owner_seal(key, NS.digest + keys[0], 0, 1, LAYOUT_MSG, 64 * 1024, b"c" * 16, 3)
    assert root == tls.seal(key, tls.OWNER, NS.digest, keys[0], 0, 1, LAYOUT_MSG.layers, LAYOUT_MSG.block_tokens,
                            LAYOUT_MSG.kv_dim, LAYOUT_MSG.dtype, 64 * 1024, b"c" * 16, 3)


def test_the_replica_index_names_row_groups_and_repair_trims_what_removals_left(make_state):
    from kvfs.metaserver import records

    from helpers import keys_under

    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(320), 4)  # 80 blocks of one prompt: its first 64 fill one row group
    write(state, keys[:64], ttl_class="chat")
    write(state, keys[64:], parent=keys[63], ttl_class="short")
    rows = {NS.digest + k: state.blocks.row(NS.digest + k) for k in keys}
    assert len({r.slot // 64 for r in rows.values()}) == 2
    wanted = {records.replica_key(n, NS.digest, r.slot // 64) for r in rows.values() for n in r.servers}
    assert keys_under(state, records.REPLICA) == wanted  # an entry per server and group, not per block
    assert len(wanted) <= 6

    def listed(n):  # every block blocks_on names for server n, page by page
        out, after = [], b""
        while True:
            fulls, after = state.blocks.blocks_on(n, after, limit=8)
            if after is None:
                return out
            out += fulls

    numbers = {n for r in rows.values() for n in r.servers}
    for n in numbers:
        assert sorted(listed(n)) == sorted(f for f, r in rows.items() if n in r.servers)
    clock.now += 11  # the second group's blocks expire; their entries stay behind
    state.expire_blocks()
    assert keys_under(state, records.REPLICA) == wanted
    for n in numbers:  # repair's listing finds the first group's blocks only, and trims the rest
        assert sorted(listed(n)) == sorted(NS.digest + k for k in keys[:64] if n in rows[NS.digest + k].servers)
    assert keys_under(state, records.REPLICA) == {
        records.replica_key(n, NS.digest, rows[NS.digest + k].slot // 64) for k in keys[:64]
        for n in rows[NS.digest + k].servers}
    assert_metadata_consistent(state)


def test_the_expiry_index_names_row_groups_and_a_visit_moves_it_to_the_soonest_row_left(make_state):
    from kvfs.metaserver import records

    from helpers import keys_under

    clock = Clock()
    state = make_state(clock)
    keys = block_keys(NS, range(64), 4)  # 16 blocks in one row group
    write(state, keys[:8], ttl_class="chat")
    write(state, keys[8:], parent=keys[7], ttl_class="short")
    rows = {k: state.blocks.row(NS.digest + k) for k in keys}
    ns, group = NS.digest, rows[keys[0]].slot // 64
    assert {rows[k].slot // 64 for k in keys} == {group}

    def visits():
        return sorted(records.expiry_of(k) for k in keys_under(state, records.EXPIRY)
                      if records.expiry_group(k) == (ns, group))

    chat, short = int(rows[keys[0]].last_used + rows[keys[0]].ttl), int(rows[keys[8]].last_used + 10)
    assert visits() == [short, chat]  # an entry per group and second, not per block
    assert len(keys_under(state, records.EXPIRY)) == 2
    clock.now += 11
    state.expire_blocks()  # the short blocks go; the visit leaves the chat blocks' entry
    assert state.match(NS.digest, keys).matched == 8 and visits() == [chat]
    clock.now += 100
    state.match(NS.digest, keys)  # a hit pushes the chat blocks' expiry out...
    state.flush_last_used()
    assert visits() == [chat]  # ...and leaves their group's entry where it was
    clock.now = chat + 50  # past the entry, not past the rows: the visit removes nothing and moves it
    state.expire_blocks()
    assert state.match(NS.digest, keys).matched == 8
    assert visits() == [int(state.blocks.row(NS.digest + keys[0]).last_used + rows[keys[0]].ttl)]
    assert_metadata_consistent(state)
