"""A metaserver whose background passes are slow keeps live servers live and
answers lookups right: passes run in slices with the event loop served between
them, so no pass, however long in all, holds up heartbeats past their timeout.

The test hook KVFS_METASERVER_TEST_SLICE_STALL makes every background slice block
the event loop (0.4 s here, against a 3 s heartbeat timeout), and
KVFS_METASERVER_TEST_SLICE shrinks slices to 8 blocks so each pass takes many:
a repair pass then lasts far longer than the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import time


from kvfs import tls
from kvfs.cli.launcher import meta_status
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2, meta_pb2_grpc

from helpers import credentials, tokens_for, until

LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 16 KiB blocks: one chunk each
NS = Namespace("slow", "m")
STALL = 0.4


async def test_slow_background_passes_never_make_live_servers_look_dead(local_cluster):
    cluster = local_cluster(chunkservers=3, replicas=2, env={"KVFS_METASERVER_TEST_SLICE_STALL": str(STALL),
                                                             "KVFS_METASERVER_TEST_SLICE": "8"},
                            meta_extra=["--repair-interval", "500ms"])
    async with Client(cluster.meta.address) as client:
        prompts = [tokens_for(12, seed=i, block_tokens=LAYOUT.block_tokens) for i in range(16)]
        for tokens in prompts:
            await client.write(NS, tokens, bytes(LAYOUT.buffer_bytes(len(tokens))), LAYOUT, "chat")
        cluster.chunkservers[2].kill()  # its copies need repair: a pass of many slow slices
        survivors = {"cs-0", "cs-1"}
        await until(lambda: {s.id for s in meta_status(cluster.meta.address, credentials=cluster.admin).servers
                             if s.live} == survivors,
                    timeout=15, what="cs-2 seen dead")
        async with tls.aio_channel(cluster.meta.address, credentials()) as channel:
            meta = meta_pb2_grpc.MetaServiceStub(channel)
            lifecycle = asyncio.ensure_future(meta.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=120))
            deadline = time.monotonic() + 4 * 3.0  # four heartbeat timeouts
            lookups = slow_slices_seen = 0
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                status = await meta.Status(meta_pb2.StatusRequest(), timeout=10)
                slow_slices_seen += time.monotonic() - t0 > STALL / 2  # answered after a slice held the loop
                live = {s.id for s in status.servers if s.live}
                assert live == survivors, f"live servers became {sorted(live)} during slow passes"
                for tokens in prompts[lookups % len(prompts) :][:2]:
                    match = await client.lookup(NS, tokens)
                    assert match.matched == 12, "a lookup answered wrong during slow passes"
                    lookups += 1
                await asyncio.sleep(0.05)
            await lifecycle
    assert lookups > 20
    assert slow_slices_seen > 0, "no slow slice ran: the hook did not take effect"
    status = meta_status(cluster.meta.address, credentials=cluster.admin)
    assert {s.id for s in status.servers if s.live} == survivors
