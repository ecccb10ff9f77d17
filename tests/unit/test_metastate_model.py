"""MetaState under random sequences of writes, lookups, hit flushes, expiry,
eviction, lost copies and reopening, checked against a plain model after every
step: lookups answer exactly what the model says is cached and reachable, and
the rows, every index and the counters agree with each other."""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import given, settings

from kvfs.keys import Namespace, block_keys
from kvfs.metaserver import records
from kvfs.metaserver.config import MetaserverConfig
from kvfs.metaserver.state import MetaState
from kvfs.proto import meta_pb2

from helpers import Clock, assert_metadata_consistent

NS = Namespace("t", "model")
LAYOUT_MSG = meta_pb2.BlockLayout(layers=4, block_tokens=4, kv_dim=8, dtype="bfloat16")  # one 64 KiB slot each
PROMPTS = [block_keys(NS, [p % 3] * 8 + [p] * 16, 4) for p in range(6)]  # 6 blocks; 3 shared 2-block roots

write = st.tuples(st.just("write"), st.integers(0, 5), st.sampled_from(["short", "chat"]))
step = st.one_of(
    write, write, write,
    st.tuples(st.just("match"), st.integers(0, 5)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("tick"), st.integers(1, 12)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("evict")),
    st.tuples(st.just("lose"), st.integers(0, 5), st.integers(0, 5)),
    st.tuples(st.just("reopen")),
)


def open_state(folder: str, clock: Clock, policy: str, register: bool) -> MetaState:
    cfg = MetaserverConfig(data_dir=folder, chunk_size=64 * 1024, heartbeat_timeout=1e9,
                           ttl_classes="short=10s,chat=7d", eviction_policy=policy)
    state = MetaState(cfg, clock)
    for i in range(3 if register else 0):
        # 3 servers x 512 KiB, 2 replicas: room for 12 one-slot blocks, eviction past 10.8
        state.register(meta_pb2.RegisterRequest(server_id=f"cs-{i}", address=f"127.0.0.1:{9000 + i}",
                                                failure_domain=f"host-{i}", capacity_bytes=512 << 10))
    return state


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=40), policy=st.sampled_from(["lru", "lfuda"]))
def test_random_operations_keep_lookups_and_indexes_right(steps, policy):
    folder = tempfile.mkdtemp(prefix="kvfs-model-")
    clock = Clock()
    state = open_state(folder, clock, policy, register=True)
    try:
        run(state, steps, clock, lambda: open_state(folder, clock, policy, register=False))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(state, steps, clock, reopen):
    for op, *args in steps:
        if op == "write":
            keys = PROMPTS[args[0]]
            first = state.match(NS.digest, keys).matched
            if first < len(keys):
                alloc = state.allocate(NS.digest, keys[first:], LAYOUT_MSG, keys[first - 1] if first else b"")
                req = meta_pb2.CommitBlocksRequest(allocation_id=alloc.allocation_id, ttl_class=args[1])
                for b in alloc.blocks:
                    if not b.already_present:
                        req.blocks.add(key=b.key, chunk_checksums=[7] * len(b.chunks))
                if req.blocks:
                    state.commit(NS.digest, req)
                assert state.match(NS.digest, keys).matched == len(keys)  # a write makes the whole prompt cached
        elif op == "match":
            expect = cached_run(state, clock, PROMPTS[args[0]])
            assert state.match(NS.digest, PROMPTS[args[0]]).matched == expect
        elif op == "flush":
            state.flush_last_used()
        elif op == "tick":
            clock.now += args[0]
        elif op == "expire":
            state.expire_blocks()
        elif op == "evict":  # as the background pass does: hits written back, then eviction in slices
            state.flush_last_used()
            evicted = state.evicted_blocks
            while state.evict_slice(limit=3):
                pass
            assert not state.over_high()
            assert state.evicted_blocks == evicted or state.cache_bytes <= 0.8 * state.capacity_bytes()
        elif op == "lose":
            keys = PROMPTS[args[0]]
            row = state.blocks.row(NS.digest + keys[args[1]])
            if row is not None:
                chunk = row.block_location().chunks[0]
                for n in list(chunk.replicas):  # every copy: the block is lost, its descendants stranded
                    server = state.members.by_number[n].record.id
                    owner = meta_pb2.ChunkOwner(namespace_digest=NS.digest, block_key=keys[args[1]])
                    state.chunks_lost(server, [(chunk.chunk_id, owner)])
                assert state.blocks.row(NS.digest + keys[args[1]]) is None
                state.drain_stranded()  # what the background pass does within a second
        elif op == "reopen":
            state.close()
            state = reopen()
        assert_metadata_consistent(state)
    state.close()


def cached_run(state, clock, keys) -> int:
    """The model: the longest run from block 0 of stored blocks within their TTL,
    counting hits not yet flushed as uses."""
    n = 0
    for k in keys:
        full = NS.digest + k
        (raw,) = state.blocks.rows([full])
        if raw is None or clock.now > state.blocks.last_use(NS.digest, raw) + records.Row.decode(raw).ttl:
            break
        n += 1
    return n
