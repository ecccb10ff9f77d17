"""MetaState.chunks_lost: a chunkserver reports chunks it removed as corrupt."""


from kvfs.keys import Namespace, block_keys
from kvfs.proto import meta_pb2

NS = Namespace("t", "lost")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8192, dtype="bfloat16")  # 256 KiB blocks


def committed(state, n):
    keys = block_keys(NS, range(4 * n), 4)
    alloc = state.allocate(NS.digest, keys, LAYOUT_MSG)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    for b in alloc.blocks:
        req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    state.commit(NS.digest, req)
    return keys, alloc


def owner(key, index=0):
    return meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=key, chunk_index=index)


def holders(state, keys, block, chunk_id):
    reply = state.match(NS.digest, keys)
    (loc,) = [c for c in reply.blocks[block].chunks if c.chunk_id == chunk_id]
    return {reply.servers[i].id for i in loc.replicas}


def test_a_lost_copy_leaves_the_chunks_replicas_and_a_repeat_report_changes_nothing(make_state):
    state = make_state()
    keys, alloc = committed(state, 4)
    chunk = alloc.blocks[2].chunks[1]
    bad, good = chunk.servers
    assert state.chunks_lost(bad, [(chunk.chunk_id, owner(keys[2], 1))]) == []
    assert holders(state, keys, 2, chunk.chunk_id) == {good}
    assert state.match(NS.digest, keys).matched == 4
    state.chunks_lost(bad, [(chunk.chunk_id, owner(keys[2], 1))])  # the reply was lost; sent again
    assert (state.replicas_lost, state.blocks_lost) == (1, 0)
    # a server that never held it, a block nobody committed, no owner record: ignored
    state.chunks_lost("cs-9", [(chunk.chunk_id, owner(keys[2], 1))])
    state.chunks_lost(bad, [(b"x" * 16, owner(b"k" * 16)), (b"y" * 16, None)])
    assert state.chunks_lost(bad, [(b"y" * 16, None)]) == []
    assert (state.replicas_lost, state.blocks_lost) == (1, 0)


def test_losing_every_copy_drops_the_block_durably_and_returns_its_other_chunks(make_state):
    state = make_state()
    keys, alloc = committed(state, 4)
    chunk = alloc.blocks[2].chunks[0]
    first, second = chunk.servers
    state.chunks_lost(first, [(chunk.chunk_id, owner(keys[2]))])
    garbage = state.chunks_lost(second, [(chunk.chunk_id, owner(keys[2]))])
    assert state.match(NS.digest, keys).matched == 2  # the blocks before it
    assert (state.replicas_lost, state.blocks_lost) == (2, 1)
    others = {c.chunk_id: list(c.servers) for c in alloc.blocks[2].chunks[1:]}
    assert {c.chunk_id: list(c.servers) for c in garbage if c.servers} == others
    state.close()
    assert make_state().match(NS.digest, keys).matched == 2
