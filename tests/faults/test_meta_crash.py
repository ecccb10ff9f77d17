"""SIGKILL the metaserver during a storm of commits, then restart it on the same
data: no acknowledged commit is lost and no committed block points at a chunk
its listed replicas do not hold, before and after garbage collection."""

import asyncio
import random
import time
from collections import defaultdict

import pytest

from kvfs import tls
from kvfs.checksum import chunk_checksum
from kvfs.client import ChunkClient, Client
from kvfs.errors import DeadlineExceeded, KvfsError, Unavailable
from kvfs.keys import Namespace
from kvfs.cli.launcher import meta_status
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, layer_major, restore_all, tokens_for, until

NS = Namespace("acme", "meta-crash")
# 128 KiB blocks cut into two 64 KiB chunks: a commit covers several chunks per block
LAYOUT = BlockLayout(layers=8, block_tokens=64, kv_dim=128, dtype="bfloat16")
META = ["--chunk-size", "64KiB", "--allocation-timeout", "2s", "--gc-grace", "1s"]
WRITERS = 12
KILL_AFTER_ACKS = 120
WRITE_DEADLINE = 20  # seconds one write may take before it counts as hung
FAMILIES = [tokens_for(4, seed=700 + f) for f in range(4)]  # shared prefixes: commits race on them

_payloads: dict[bytes, bytes] = {}


def payload_of(key: bytes) -> bytes:
    """A block's bytes, fixed by its key: every writer of a block writes the same bytes."""
    if key not in _payloads:
        _payloads[key] = random.Random(key).randbytes(LAYOUT.payload_bytes)
    return _payloads[key]


def prompt_for(w: int, i: int) -> list[int]:
    """A family prefix of 1-4 blocks, then 0-3 blocks only this write has."""
    rng = random.Random(w * 10_000 + i)
    shared = rng.randint(1, 4)
    own = rng.choice([0, 1, 2, 3])
    return FAMILIES[rng.randrange(len(FAMILIES))][: shared * 64] + tokens_for(own, seed=w * 10_000 + i + 1)


def buffer_for(keys: list[bytes]) -> bytearray:
    return layer_major(LAYOUT, [payload_of(k) for k in keys])


def run_lifecycle(address: str) -> meta_pb2.RunLifecycleReply:
    with tls.channel(address, credentials()) as ch:
        return meta_pb2_grpc.MetaServiceStub(ch).RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=30)


async def inventories(cluster) -> dict[str, dict[bytes, object]]:
    """Server id -> chunk id -> ChunkInfo, from every chunkserver's ListChunks."""
    out = {}
    for i, cs in enumerate(cluster.chunkservers):
        async with ChunkClient(cs.address) as c:
            out[f"cs-{i}"] = {info.chunk_id: info async for info in c.list()}
    return out


async def committed_blocks(client: Client, prompts) -> dict[bytes, object]:
    """Every block a lookup of any of `prompts` matches: key -> (BlockLocation, servers)."""
    blocks = {}
    for tokens in prompts:
        match = await client.lookup(NS, tokens)
        for key, loc in zip(match.keys, match.blocks):
            blocks[key] = (loc, match.servers)
    return blocks


def shape(blocks) -> dict[bytes, list]:
    """What a block record says, independent of how a lookup numbered its servers."""
    return {key: [(c.chunk_id, c.checksum, sorted(servers[r].id for r in c.replicas)) for c in loc.chunks]
            for key, (loc, servers) in blocks.items()}


async def check_replicas(cluster, blocks) -> int:
    """Every listed replica of every chunk of `blocks` holds it with the record's checksum
    and serves exactly the block's bytes. Returns how many copies were checked."""
    inventory = await inventories(cluster)
    wanted: dict[str, list] = defaultdict(list)  # address -> (key, chunk)
    problems = []
    for key, (loc, servers) in blocks.items():
        for c in loc.chunks:
            assert c.replicas, f"block {key.hex()[:12]} chunk {c.chunk_id.hex()[:12]} lists no replica"
            for r in c.replicas:
                server = servers[r]
                info = inventory[server.id].get(c.chunk_id)
                if info is None:
                    problems.append(f"block {key.hex()[:12]} chunk {c.chunk_id.hex()[:12]}: missing on {server.id}")
                elif (info.checksum, info.length) != (c.checksum, c.length):
                    problems.append(f"block {key.hex()[:12]} chunk {c.chunk_id.hex()[:12]} on {server.id}: "
                                    f"checksum/length {info.checksum:x}/{info.length}, "
                                    f"record says {c.checksum:x}/{c.length}")
                wanted[server.address].append((key, c))
    assert not problems, f"{len(problems)} committed chunk copies are wrong:\n" + "\n".join(problems[:20])
    copies = 0
    for address, items in wanted.items():
        async with ChunkClient(address) as cc:
            for i in range(0, len(items), 16):
                part = items[i : i + 16]
                results = await cc.read([(c.chunk_id, 0, 0) for _, c in part])
                for (key, c), res in zip(part, results):
                    assert res.code == 0, f"chunk {c.chunk_id.hex()[:12]} on {address}: {res.message}"
                    assert chunk_checksum(res.data) == c.checksum
                    assert res.data == payload_of(key)[c.offset : c.offset + c.length], \
                        f"chunk {c.chunk_id.hex()[:12]} on {address} holds other bytes"
                    copies += 1
    return copies


async def explain_lost(client: Client, blocks, lost: set, acked_keys: set, prompts) -> str:
    """The assertion message when committed chunk copies vanished: which blocks, and
    what a reader of them gets now."""
    lost_ids = {cid for cid, _ in lost}
    hit = {k for k, (loc, _) in blocks.items() if any(c.chunk_id in lost_ids for c in loc.chunks)}
    unreadable = {k for k, (loc, servers) in blocks.items()
                  if any({(c.chunk_id, servers[r].id) for r in c.replicas} <= lost for c in loc.chunks)}
    msg = (f"garbage collection deleted {len(lost)} chunk copies of {len(hit)} committed blocks "
           f"({len(hit & acked_keys)} of them acknowledged); {len(unreadable)} blocks lost every copy of a chunk")
    for tokens in prompts:
        keys = await client.keys(NS, tokens)
        if unreadable & set(keys):
            match = await client.lookup(NS, tokens)
            try:
                await restore_all(client, match, LAYOUT)
                seen = "restores"
            except KvfsError as err:
                seen = f"restore fails: {type(err).__name__}: {err.message[:160]}"
            msg += (f"; a lookup of a prompt holding one still matches {match.matched} of {len(keys)} "
                    f"blocks and its {seen}")
            break
    return msg


async def check_acknowledged(client: Client, acked: list[list[int]]) -> None:
    for tokens in acked:
        match = await client.lookup(NS, tokens)
        assert match.matched == len(match.keys), \
            f"acknowledged write lost: {match.matched} of {len(match.keys)} blocks match"
        out, _, _ = await restore_all(client, match, LAYOUT)
        assert out == buffer_for(match.keys), "acknowledged write restores other bytes"


@pytest.mark.parametrize("rebuild", [False, True], ids=["restart", "rebuild"])
async def test_metaserver_sigkill_during_commit_storm_loses_no_acknowledged_write(local_cluster, rebuild):
    t0 = time.monotonic()
    cluster = local_cluster(chunkservers=3, replicas=2, meta_extra=META)
    attempted: list[list[int]] = []
    acked: list[list[int]] = []
    in_write: dict[int, list[int]] = {}  # writer -> prompt it is writing now
    errors: dict[int, BaseException] = {}
    killed = asyncio.Event()
    early: list[str] = []

    async def writer(w: int) -> None:
        async with Client(cluster.meta_address, timeout=10) as client:
            for i in range(10_000):
                tokens = prompt_for(w, i)
                keys = await client.keys(NS, tokens)
                attempted.append(tokens)
                in_write[w] = tokens
                try:
                    await asyncio.wait_for(client.write(NS, tokens, buffer_for(keys), LAYOUT, "chat"),
                                           WRITE_DEADLINE)
                except (KvfsError, TimeoutError) as err:
                    errors[w] = err
                    if not killed.is_set():
                        early.append(f"writer {w} failed before the kill: {err!r}")
                    return
                finally:
                    in_write.pop(w, None)
                acked.append(tokens)

    tasks = [asyncio.create_task(writer(w)) for w in range(WRITERS)]
    await until(lambda: len(acked) >= KILL_AFTER_ACKS or early or all(t.done() for t in tasks), 60,
                f"{KILL_AFTER_ACKS} acknowledged writes", interval=0.005)
    assert not early, early
    cluster.meta.kill()  # SIGKILL: no clean shutdown, RocksDB is not closed
    killed.set()
    acked_at_kill, in_flight_at_kill = len(acked), len(in_write)
    t_kill = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=WRITE_DEADLINE + 10)
    assert not pending, f"{len(pending)} writers still running {WRITE_DEADLINE + 10}s after the kill"
    for t in done:
        t.result()
    drained = time.monotonic() - t_kill
    kinds = sorted({type(e).__name__ for e in errors.values()})
    print(f"\ninjected: SIGKILL metaserver after {acked_at_kill} acknowledged writes, {in_flight_at_kill} "
          f"in flight; {len(attempted)} writes attempted, {len(acked)} acknowledged in all; every writer "
          f"failed within {drained:.1f}s with {kinds}")
    assert len(errors) == WRITERS
    hung = {w: e for w, e in errors.items() if isinstance(e, TimeoutError)}
    assert not hung, f"writers {sorted(hung)} hung past {WRITE_DEADLINE}s instead of failing"
    odd = {w: repr(e) for w, e in errors.items() if not isinstance(e, Unavailable | DeadlineExceeded)}
    assert not odd, f"writers failed with unexpected errors: {odd}"
    assert all("metaserver" in e.message for e in errors.values()), "errors do not name the metaserver"

    await asyncio.to_thread(cluster.start_metaserver)
    # chunk_count comes only from heartbeats: > 0 means each server checked in with the new process
    status = await asyncio.to_thread(cluster.wait_until, lambda st: len(st.servers) == 3 and all(
        s.live and s.chunk_count > 0 for s in st.servers) and st.chains > 0, 30, "3 chunkservers heartbeating")
    print(f"restarted metaserver: {status.blocks} blocks, {status.open_allocations} open allocations "
          f"(writes cut short by the kill)")

    if rebuild:  # `kvfs rebuild`: blocks whose every chunk is on some server come back
        with tls.channel(cluster.meta_address, credentials()) as ch:
            r = meta_pb2_grpc.MetaServiceStub(ch).Rebuild(meta_pb2.RebuildRequest(), timeout=30)
        status = await asyncio.to_thread(meta_status, cluster.meta_address, credentials=cluster.admin)
        print(f"rebuild: {r.chunks_seen} chunks seen, {r.blocks_restored} blocks restored, "
              f"{r.blocks_incomplete} incomplete; {status.blocks} blocks now")
    distinct = {tuple(t) for t in attempted}
    async with Client(cluster.meta_address) as client:
        await check_acknowledged(client, acked)
        blocks = await committed_blocks(client, distinct)
        assert status.blocks == len(blocks), \
            f"metaserver holds {status.blocks} blocks, lookups of every attempted prompt find {len(blocks)}"
        copies = await check_replicas(cluster, blocks)
        acked_keys = {k for t in acked for k in await client.keys(NS, t)}
        print(f"saw: all {len(acked)} acknowledged writes match and restore exactly; {len(blocks)} committed "
              f"blocks ({len(blocks) - len(acked_keys)} from unacknowledged writes), {copies} chunk copies "
              f"all present with their checksums")

        # abandoned allocations expire and orphans are collected: committed chunks must survive it
        def collected():
            run_lifecycle(cluster.meta_address)
            return meta_status(cluster.meta_address, credentials=cluster.admin).open_allocations == 0

        await until(lambda: asyncio.to_thread(collected), 20, "abandoned allocations to expire", interval=0.2)
        referenced = {(c.chunk_id, servers[r].id) for loc, servers in blocks.values()
                      for c in loc.chunks for r in c.replicas}

        async def only_referenced_left():
            await asyncio.to_thread(run_lifecycle, cluster.meta_address)
            on_disk = {(cid, sid) for sid, inv in (await inventories(cluster)).items() for cid in inv}
            if not referenced <= on_disk:
                raise AssertionError(await explain_lost(client, blocks, referenced - on_disk, acked_keys, distinct))
            return on_disk == referenced

        await until(only_referenced_left, 20, "orphan chunks to be collected", interval=0.2)
        assert shape(await committed_blocks(client, distinct)) == shape(blocks)
        copies = await check_replicas(cluster, blocks)
        await check_acknowledged(client, acked)
        print(f"saw: after allocation expiry and orphan GC, {copies} chunk copies left, exactly the "
              f"committed ones; acknowledged writes still restore")

        fresh = tokens_for(3, seed=9_999)
        res = await client.write(NS, fresh, buffer_for(await client.keys(NS, fresh)), LAYOUT)
        assert res.committed == 3
        await check_acknowledged(client, [fresh])
    print(f"saw: a new write round-trips after the restart; test took {time.monotonic() - t0:.1f}s")
