"""`kvfs-bench rebuild`: how long a metaserver takes to rebuild its metadata from
the chunkservers' inventories, per million blocks, end to end: a real metaserver
process, its Rebuild RPC, every inventory page over gRPC from fake chunkservers
(bench/fakes.py, Inventory: synthetic MLA blocks of 2 chunks with owner records,
stored nowhere) in a child process. What a metaserver taking over hash slots
(issue 19's failover and rebalancing) or a lost database pays, minus the seal
checks: fakes speak plaintext, so the metaserver runs --insecure and checks no
seal (the figure for one HMAC per chunk is reported beside, measured here).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import time

import grpc

from kvfs import tls
from kvfs.cli.launcher import start_metaserver
from kvfs.grants import owner_seal
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS

from .fakes import FakeChunkservers, Inventory, StallProbe
from .meta import NO_EVICT_CAPACITY, _main_thread_times, _summary


def seal_seconds(n: int = 20_000) -> float:
    """Seconds one owner-record seal check costs (an HMAC), as a rebuild makes per chunk."""
    inv = Inventory(1, 1, 1)
    key = os.urandom(32)
    full = inv.namespace + inv.block_key(0)
    t0 = time.perf_counter()
    for i in range(n):
        owner_seal(key, full, 0, 2, inv.layout, 1 << 20, i.to_bytes(16, "big"), 5)
    return (time.perf_counter() - t0) / n


async def run_rebuild(root: pathlib.Path, blocks: int, servers: int, replicas: int, chain: int = 64,
                      log=print) -> dict:
    meta = await asyncio.to_thread(start_metaserver, root / "meta", extra=["--insecure"], run_dir=root)
    fakes = probe = None
    try:
        fakes = await asyncio.to_thread(FakeChunkservers(meta.address, servers, NO_EVICT_CAPACITY, inventory=blocks,
                                                         replicas=replicas, chain=chain).start)
        async with grpc.aio.insecure_channel(meta.address, options=CHANNEL_OPTIONS) as channel:
            stub = meta_pb2_grpc.MetaServiceStub(channel)
            deadline = time.monotonic() + 60
            while sum(s.live for s in (await stub.Status(meta_pb2.StatusRequest(), timeout=10)).servers) < servers:
                if time.monotonic() > deadline:
                    raise TimeoutError("the fake chunkservers did not register in 60 s")
                await asyncio.sleep(0.2)
            probe = await asyncio.to_thread(StallProbe(meta.address).start)
            cpu0 = _main_thread_times(meta.pid)
            log(f"rebuilding {blocks:,} blocks ({2 * blocks * replicas:,} chunk copies on {servers} fake servers)")
            t0 = time.monotonic()
            reply = await stub.Rebuild(meta_pb2.RebuildRequest(), timeout=24 * 3600)
            took = time.monotonic() - t0
            cpu1 = _main_thread_times(meta.pid)
            samples = await asyncio.to_thread(probe.stop)
            probe = None
            st = await stub.Status(meta_pb2.StatusRequest(), timeout=30)
        during = [s for t, s, ok in samples if t0 <= t <= t0 + took]
        on_cpu = cpu1[0] - cpu0[0] if cpu0 and cpu1 else None
        per_million = took / blocks * 1e6
        seal = seal_seconds()
        return {"blocks": blocks, "servers": servers, "replicas": replicas, "chain": chain, "seconds": took,
                "restored": reply.blocks_restored, "incomplete": reply.blocks_incomplete,
                "chunks_seen": reply.chunks_seen, "blocks_after": st.blocks, "blocks_per_s": blocks / took,
                "seconds_per_million": per_million,
                "loop_cpu_seconds": on_cpu, "loop_cpu_seconds_per_million": on_cpu / blocks * 1e6 if on_cpu else None,
                "seal_check_us": seal * 1e6,
                "seconds_per_million_with_seals": per_million + seal * 2 * replicas * 1e6,
                "health_probe_during": _summary(during)}
    finally:
        if probe is not None:
            probe.kill()
        if fakes is not None:
            fakes.stop()
        meta.stop()
