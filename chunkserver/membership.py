"""Registration with the metaserver, then heartbeats carrying usage and the
chunks removed as corrupt since the last heartbeat that got through."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvfs import tls
from kvfs.proto import meta_pb2, meta_pb2_grpc

from .config import ChunkserverConfig
from .store import ChunkStore

log = logging.getLogger(__name__)

MAX_LOST_PER_BEAT = 1000  # a failing disk can lose many; the rest go with the next beats


async def heartbeat_forever(cfg: ChunkserverConfig, store: ChunkStore, address: str, data_address: str,
                            creds: tls.Credentials | None,
                            on_registered: Callable[[bool], None] = lambda registered: None) -> None:
    """Registers (retrying until the metaserver answers) and heartbeats for ever,
    as the server its certificate names; `on_registered` hears when it registered
    and when the metaserver asks it to register again."""
    async with tls.aio_channel(cfg.meta, creds) as channel:
        stub = meta_pb2_grpc.MetaServiceStub(channel)
        interval, registered, failures = 1.0, False, 0
        while True:
            try:
                if not registered:
                    reply = await stub.Register(meta_pb2.RegisterRequest(
                        server_id=cfg.id, address=address, failure_domain=cfg.failure_domain,
                        capacity_bytes=cfg.capacity, data_address=data_address), timeout=10)
                    interval, registered = reply.heartbeat_interval_s or interval, True
                    on_registered(True)
                    log.info("registered with metaserver %s as %s (%s)", cfg.meta, cfg.id, address)
                stat = store.stat()
                lost = store.lost_chunks(MAX_LOST_PER_BEAT)
                reply = await stub.Heartbeat(meta_pb2.HeartbeatRequest(
                    server_id=cfg.id, used_bytes=stat["used_bytes"], allocated_bytes=stat["allocated_bytes"],
                    chunk_count=stat["chunk_count"], capacity_bytes=stat["capacity_bytes"],
                    lost_chunks=[meta_pb2.LostChunk(chunk_id=c, owner=o) for c, o in lost]), timeout=10)
                if reply.register_again:
                    registered = False
                    on_registered(False)
                    continue
                if lost:  # kept until now: a heartbeat that failed is sent again with them
                    await store.forget_lost([c for c, _ in lost])
                    log.info("reported %d lost chunks to metaserver %s", len(lost), cfg.meta)
                if failures:
                    log.info("metaserver %s reachable again", cfg.meta)
                failures = 0
            except grpc.aio.AioRpcError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("metaserver %s: %s (%s); retrying", cfg.meta, err.code().name, err.details())
            await asyncio.sleep(interval)
