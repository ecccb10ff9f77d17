"""Per-tenant usage (metaserver/usage.py) in-process: lookups, writes and storage
over time are metered per tenant, follow the blocks out of the cache, survive a
restart, and stay bounded in the number of tenants."""

from kvfs.keys import Namespace, block_keys
from kvfs.metaserver.usage import OTHER, UNKNOWN
from kvfs.proto import meta_pb2

from helpers import Clock

A, B = Namespace("tenant-a", "m"), Namespace("tenant-b", "m")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256-byte blocks
BLOCK_BYTES = 256


def write(state, ns, keys, ttl_class="chat"):
    state.blocks.usage.note(ns.digest, ns.tenant)  # as AllocateBlocks does
    alloc = state.allocate(ns.digest, keys, LAYOUT_MSG)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class=ttl_class)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return state.commit(ns.digest, req)


def usage(state, *names) -> dict[str, meta_pb2.TenantUsage]:
    return {u.tenant: u for u in state.blocks.usage.report(lambda tenant: True, names)}


def test_each_tenant_is_metered_for_its_lookups_writes_and_storage_over_time(make_state):
    clock = Clock()
    state = make_state(clock)
    keys_a, keys_b = block_keys(A, range(32), 4), block_keys(B, range(16), 4)  # 8 and 4 blocks of 4 tokens
    assert write(state, A, keys_a)[0] == 8
    assert write(state, B, keys_b)[0] == 4
    assert all(b.already_present for b in state.allocate(A.digest, keys_a, LAYOUT_MSG).blocks)  # nothing to write
    state.match_bytes(A.digest, keys_a + block_keys(A, range(100, 108), 4), A.tenant)  # 8 of 10 cached
    state.match_bytes(A.digest, block_keys(A, range(200, 204), 4), A.tenant)  # a miss
    clock.now += 100

    got = usage(state)
    assert set(got) == {A.tenant, B.tenant}
    a, b = got[A.tenant], got[B.tenant]
    assert (a.blocks_written, a.tokens_written, a.bytes_written) == (8, 32, 8 * BLOCK_BYTES)
    assert (a.lookups, a.blocks_requested, a.blocks_hit, a.tokens_hit, a.bytes_hit) == (2, 11, 8, 32, 8 * BLOCK_BYTES)
    assert (a.blocks_stored, a.bytes_stored, a.cache_bytes) == (8, 8 * BLOCK_BYTES, 8 * (64 << 10))
    assert a.byte_seconds == 8 * BLOCK_BYTES * 100 and a.as_of == clock.now
    assert (b.blocks_written, b.blocks_stored, b.lookups, b.byte_seconds) == (4, 4, 0, 4 * BLOCK_BYTES * 100)
    assert set(usage(state, B.tenant)) == {B.tenant}
    assert usage(state)[A.tenant].byte_seconds == a.byte_seconds  # reading does not count twice


def test_storage_leaves_the_bill_with_the_blocks_and_the_records_survive_a_restart(make_state):
    clock = Clock()
    state = make_state(clock)
    write(state, A, block_keys(A, range(16), 4), ttl_class="short")  # 4 blocks, a 10 s TTL
    write(state, B, block_keys(B, range(16), 4))
    state.match_bytes(B.digest, block_keys(B, range(16), 4), B.tenant)
    clock.now += 11
    state.expire_blocks()  # A's first block; its descendants after it
    state.drain_stranded()
    a = usage(state)[A.tenant]
    assert (a.blocks_stored, a.bytes_stored, a.cache_bytes, a.blocks_written) == (0, 0, 0, 4)
    assert a.byte_seconds == 4 * BLOCK_BYTES * 11  # stored for 11 s, then nothing
    state.close()  # writes what lookups changed since the last block write

    state = make_state(clock)
    clock.now += 5
    a, b = usage(state)[A.tenant], usage(state)[B.tenant]
    assert (a.blocks_stored, a.byte_seconds) == (0, 4 * BLOCK_BYTES * 11)
    assert (b.blocks_stored, b.lookups, b.blocks_hit) == (4, 1, 4)
    assert b.byte_seconds == 4 * BLOCK_BYTES * 16


def test_tenants_past_the_bound_share_one_record_and_unknown_namespaces_are_named_so(make_state):
    state = make_state(usage_max_tenants=2)
    for i in range(5):
        state.match_bytes(Namespace(f"t{i}", "m").digest, block_keys(A, range(4), 4), f"t{i}")
    got = usage(state)
    assert set(got) == {"t0", "t1", OTHER} and got[OTHER].lookups == 3
    # blocks of a namespace no worker allocated in here (as after a rebuild): "(unknown)"
    stray = Namespace("t9", "m")
    alloc = state.allocate(stray.digest, block_keys(stray, range(4), 4), LAYOUT_MSG)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    req.blocks.add(key=alloc.blocks[0].key, chunk_checksums=[7] * len(alloc.blocks[0].chunks))
    state.commit(stray.digest, req)
    assert usage(state)[UNKNOWN].blocks_stored == 1
