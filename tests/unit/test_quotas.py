"""Tenant quotas (tenant_quotas) in-process: a tenant past its share evicts its own
blocks, lowest rank first, never another tenant's; a write larger than the quota
is refused before anything is evicted."""

import pytest

from kvfs.errors import ResourceExhausted
from kvfs.keys import Namespace, block_keys
from kvfs.metaserver.config import MetaserverConfig
from kvfs.proto import meta_pb2

from helpers import Clock, assert_metadata_consistent

A, B = Namespace("tenant-a", "m"), Namespace("tenant-b", "m")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # 256 bytes: a 64 KiB slot
SLOT = 64 << 10


def write(state, ns, keys):
    state.blocks.usage.note(ns.digest, ns.tenant)  # as AllocateBlocks does
    alloc = state.allocate(ns.digest, keys, LAYOUT_MSG)
    req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id)
    for b in alloc.blocks:
        if not b.already_present:
            req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
    return state.commit(ns.digest, req)[0]


def cached(state, ns, keys) -> int:
    return state.match(ns.digest, keys).matched


def held(state, ns) -> int:
    """What the tenant's blocks take of the cache (quotas count whole slots)."""
    return state.blocks.usage.record_of(ns.tenant).cache_bytes


def test_a_tenant_past_its_quota_evicts_its_own_blocks_and_never_anothers(make_state):
    clock = Clock()
    state = make_state(clock, tenant_quotas="tenant-b=1MiB")  # 16 blocks; tenant-a has no quota
    a = block_keys(A, range(4 * 32), 4)
    assert write(state, A, a) == 32
    prompts = [block_keys(B, range(1000 * i, 1000 * i + 16), 4) for i in range(6)]  # B: prompts of 4 blocks
    for p in prompts[:4]:
        assert write(state, B, p) == 4
    assert held(state, B) == 16 * SLOT  # at its quota
    clock.now += 1
    cached(state, B, prompts[0])  # B's first prompt is hot: it outranks B's others
    state.flush_last_used()
    assert write(state, B, prompts[4]) == 4  # past the quota: down to evict_low (80%) of it, then this write
    assert held(state, B) <= 16 * SLOT and state.evicted_blocks >= 4
    assert cached(state, A, a) == 32  # A's blocks all stay
    assert cached(state, B, prompts[0]) == 4 and cached(state, B, prompts[4]) == 4  # the hot one and the new one
    assert sum(cached(state, B, p) for p in prompts[1:4]) <= 12 - 4  # B's cold prompts went, leaves first
    assert_metadata_consistent(state)


def test_a_write_larger_than_the_quota_is_refused_before_anything_is_evicted(make_state):
    state = make_state(tenant_quotas="*=256KiB")  # every tenant: 4 blocks
    keys = block_keys(A, range(4 * 4), 4)
    assert write(state, A, keys) == 4
    with pytest.raises(ResourceExhausted, match="tenant 'tenant-a' may hold 262144"):
        write(state, A, block_keys(A, range(100, 100 + 4 * 5), 4))
    assert cached(state, A, keys) == 4 and state.evicted_blocks == 0


def test_allocations_never_committed_count_against_their_tenants_quota(make_state):
    state = make_state(tenant_quotas="tenant-b=1MiB")  # 16 blocks
    a = block_keys(A, range(4 * 32), 4)
    assert write(state, A, a) == 32
    state.blocks.usage.note(B.digest, B.tenant)
    for i in range(4):  # B allocates its whole quota, four blocks at a time, and never writes a byte
        state.allocate(B.digest, block_keys(B, range(100 * i, 100 * i + 16), 4), LAYOUT_MSG)
    with pytest.raises(ResourceExhausted, match="allocations not committed yet"):
        state.allocate(B.digest, block_keys(B, range(900, 916), 4), LAYOUT_MSG)
    assert state.evicted_blocks == 0 and cached(state, A, a) == 32  # nobody's blocks went for B's allocations
    assert_metadata_consistent(state)


def test_quotas_read_as_sizes_or_shares_of_the_cache():
    cfg = MetaserverConfig(tenant_quotas="acme=2GiB, *=25%")
    assert cfg.quota_bytes("acme", 1000) == 2 << 30 and cfg.quota_bytes("other", 1000) == 250
    assert MetaserverConfig().quota_bytes("acme", 1000) is None
    for bad in ("acme", "acme=0%", "acme=150%", "acme=0", "acme=5 parsecs", "=5GiB"):
        with pytest.raises(ValueError, match="tenant_quotas"):
            MetaserverConfig(tenant_quotas=bad)


def test_a_tenant_writing_past_its_write_rate_is_refused_with_when_to_retry_and_others_write_on(make_state):
    clock = Clock()
    state = make_state(clock, tenant_write_rate=1024)  # 4 blocks' payload (256 bytes each) per second
    prompts = [block_keys(A, range(100 * i, 100 * i + 32), 4) for i in range(4)]  # 8 blocks each
    assert write(state, A, prompts[0]) == 8  # caught up: a write larger than a burst goes through, booked 2 s
    with pytest.raises(ResourceExhausted, match=r"tenant 'tenant-a' is writing faster than 1024 bytes/s "
                                                r"\(tenant_write_rate\).*retry in 1.00 s"):
        write(state, A, prompts[1])
    assert cached(state, A, prompts[1]) == 0 and not state.allocations.placing  # nothing placed for it
    assert write(state, B, block_keys(B, range(32), 4)) == 8  # another tenant: its own pace
    clock.now += 0.5
    with pytest.raises(ResourceExhausted, match=r"retry in 0.50 s"):  # a refusal books nothing
        write(state, A, prompts[1])
    clock.now += 0.5
    assert write(state, A, prompts[1]) == 8  # one burst behind its pace: admitted again
    again = state.allocate(A.digest, prompts[0], LAYOUT_MSG)  # present blocks cost nothing: only new ones are paced
    assert all(b.already_present for b in again.blocks)
    assert_metadata_consistent(state)
