"""Every block is filed under its prompt's hash slot (kvfs/shards.py): the slot of the
prompt's first key, given at allocation, kept in the block's row, sealed into its
chunks' owner records, and taken back from them by a rebuild. With several
metaservers a prompt lives where a lookup of it goes, and a metaserver rebuilds and
collects only its own slots. MetaState in-process: RocksDB on disk, no sockets."""

from __future__ import annotations

import pytest

from kvfs.errors import InvalidArgument
from kvfs.keys import Namespace, block_keys
from kvfs.metaserver.records import ROW, row_hash_slot
from kvfs.proto import chunk_pb2, meta_pb2
from kvfs.shards import hash_slot

from helpers import assert_metadata_consistent

NS = Namespace("t", "slots")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256-byte blocks


def commit(state, alloc):
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return state.commit(NS.digest, req)


def stored_slots(state, keys) -> list[int]:
    return [row_hash_slot(raw) for raw in state.blocks.rows([NS.digest + k for k in keys])]


def other_slot_key(key: bytes) -> bytes:
    """A 16-byte key whose hash slot differs from `key`'s."""
    flipped = bytes([key[0] ^ 0x01]) + key[1:]
    assert hash_slot(flipped) != hash_slot(key)
    return flipped


def test_a_prompt_written_in_pieces_keeps_its_first_keys_slot(make_state):
    state = make_state()
    keys = block_keys(NS, range(48), 4)
    first = state.allocate(NS.digest, keys[:4], LAYOUT_MSG)
    assert first.hash_slot == hash_slot(keys[0])
    commit(state, first)
    # the parent is cached: its prompt's slot, whether or not the writer names the first key
    second = state.allocate(NS.digest, keys[4:8], LAYOUT_MSG, keys[3])
    third = state.allocate(NS.digest, keys[8:12], LAYOUT_MSG, keys[3], keys[0])
    assert second.hash_slot == third.hash_slot == hash_slot(keys[0]) != hash_slot(keys[4])
    commit(state, second)
    assert stored_slots(state, keys[:8]) == [hash_slot(keys[0])] * 8
    assert state.match(NS.digest, keys).matched == 8


def test_a_first_key_that_disagrees_is_refused(make_state):
    state = make_state()
    keys = block_keys(NS, range(64), 4)
    commit(state, state.allocate(NS.digest, keys[:4], LAYOUT_MSG))
    with pytest.raises(InvalidArgument, match="differs from keys\\[0\\]"):  # a prompt's first block is keys[0]
        state.allocate(NS.digest, keys[:4], LAYOUT_MSG, b"", keys[5])
    with pytest.raises(InvalidArgument, match="not in the hash slot of parent block"):
        state.allocate(NS.digest, keys[4:8], LAYOUT_MSG, keys[3], other_slot_key(keys[0]))
    with pytest.raises(InvalidArgument, match="first_key must be a 16-byte block key"):
        state.allocate(NS.digest, keys[4:8], LAYOUT_MSG, keys[3], b"short")
    # a parent not cached: the writer must say which prompt the blocks belong to
    with pytest.raises(InvalidArgument, match="not cached and first_key is empty"):
        state.allocate(NS.digest, keys[12:16], LAYOUT_MSG, keys[11])
    alloc = state.allocate(NS.digest, keys[12:16], LAYOUT_MSG, keys[11], keys[0])
    assert alloc.hash_slot == hash_slot(keys[0])
    assert state.match(NS.digest, keys).matched == 4  # nothing refused was placed or committed


def test_a_child_named_under_another_slot_than_its_parent_got_is_garbage_at_commit(make_state):
    state = make_state()
    keys = block_keys(NS, range(16), 4)
    liar = other_slot_key(keys[0])
    # the child is allocated while its parent is not cached yet, naming a first key of another slot ...
    child = state.allocate(NS.digest, keys[2:4], LAYOUT_MSG, keys[1], liar)
    assert child.hash_slot == hash_slot(liar)
    commit(state, state.allocate(NS.digest, keys[:2], LAYOUT_MSG))  # ... then the parent comes, in its own slot
    committed, already, garbage = commit(state, child)
    assert committed == 0 and len(garbage) == 2  # never filed under a slot its prompt is not in
    assert state.match(NS.digest, keys).matched == 2
    honest = state.allocate(NS.digest, keys[2:4], LAYOUT_MSG, keys[1], keys[0])
    assert commit(state, honest)[0] == 2 and stored_slots(state, keys[:4]) == [hash_slot(keys[0])] * 4


def test_a_rebuild_files_blocks_under_the_slot_their_owner_records_name(make_state):
    state = make_state()
    keys = block_keys(NS, range(8), 4)  # 2 blocks of one 256-byte chunk each

    def info(key, slot):
        owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=key, chunk_index=0, chunk_count=1,
                                    layout=LAYOUT_MSG, chunk_size=64 * 1024, hash_slot=slot)
        return chunk_pb2.ChunkInfo(chunk_id=key, length=256, checksum=5, created=900.0,
                                   owner=owner.SerializeToString())

    state.rebuild_begin()
    # as found: a rebuilt block is a root (owner records name no parent), so its record is all there is
    assert state.rebuild_stage("cs-0", [info(keys[0], hash_slot(keys[0])), info(keys[1], 77)]) == 2
    assert state.rebuild_slice() == (2, 0)
    assert stored_slots(state, keys[:2]) == [hash_slot(keys[0]), 77]


def test_chunks_filed_under_slots_another_metaserver_answers_for_are_left_alone(make_state):
    state = make_state()
    keys = block_keys(NS, range(16), 4)
    mine, theirs = hash_slot(keys[0]), hash_slot(keys[1])
    assert mine != theirs
    state.owns = lambda slot: slot != theirs  # as a lease over all slots but one gives it

    def owner(key, slot):
        return meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=key, chunk_index=0, chunk_count=1,
                                   layout=LAYOUT_MSG, chunk_size=64 * 1024, hash_slot=slot)

    # orphan GC: a chunk no block here lists is garbage only in a slot of this metaserver's
    assert not state.is_referenced(b"c" * 16, owner(keys[0], mine), set(), "cs-0")
    assert state.is_referenced(b"c" * 16, owner(keys[1], theirs), set(), "cs-0")
    # reconciliation: a copy no block here lists on this server is stale only in its own slots
    alloc = state.allocate(NS.digest, keys[:1], LAYOUT_MSG)
    commit(state, alloc)
    chunk = alloc.blocks[0].chunks[0]
    away = ({"cs-0", "cs-1", "cs-2"} - set(chunk.servers)).pop()
    assert state.is_stale(chunk.chunk_id, owner(keys[0], mine), away)
    assert not state.is_stale(chunk.chunk_id, owner(keys[0], theirs), away)
    # a rebuild takes in its own slots only
    infos = [chunk_pb2.ChunkInfo(chunk_id=k, length=256, checksum=5, created=900.0,
                                 owner=owner(k, hash_slot(k)).SerializeToString()) for k in keys[1:3]]
    state.rebuild_begin()
    assert state.rebuild_stage("cs-0", infos) == 1 and state.forged_owners == 0
    assert state.rebuild_slice() == (1, 0)
    assert state.match(NS.digest, keys[2:3]).matched == 1 and state.match(NS.digest, keys[1:2]).matched == 0


def test_slots_handed_over_are_forgotten_with_their_chunks_kept_and_never_deleted_here(make_state):
    state = make_state()
    prompts = [block_keys(NS, range(1000 * p, 1000 * p + 40), 4) for p in range(12)]  # 10 blocks each
    for keys in prompts:
        commit(state, state.allocate(NS.digest, keys, LAYOUT_MSG))
    slots = [hash_slot(k[0]) for k in prompts]
    gone = set(slots[:5])  # handed to another metaserver
    kept = [k for k, s in zip(prompts, slots) if s not in gone]
    assert len(kept) == 7
    state.blocks.answers = lambda slot: slot not in gone
    # removing a block of a slot handed over (eviction, expiry, loss) deletes no chunk: they are the
    # new holder's now; a block of a slot still here takes its chunks with it
    assert state.blocks.drop([NS.digest + prompts[0][-1]]) == []
    assert len(state.blocks.drop([NS.digest + kept[0][-1]])) == 1
    before, left = len(state.blocks), sum(s in gone for s in slots) * 10 - 1
    after, forgotten = ROW, 0
    while after is not None:  # a slice of 2 row groups at a time, as the server's turns take them
        n, after = state.forget_slice(gone, after, 2)
        forgotten += n
    assert forgotten == left and state.blocks.forgotten == left and len(state.blocks) == before - left
    assert not any(raw for keys in prompts[:5] for raw in state.blocks.rows([NS.digest + k for k in keys]))
    assert state.match(NS.digest, kept[1]).matched == 10  # the rest is untouched
    assert_metadata_consistent(state)
