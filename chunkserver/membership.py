"""Registration with the metaserver, then heartbeats carrying usage and the
chunks removed as corrupt since the last heartbeat that got through."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvfs import tls
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.shards import valid_address

from .config import ChunkserverConfig
from .store import ChunkStore

log = logging.getLogger(__name__)

MAX_LOST_PER_BEAT = 1000  # a failing disk can lose many; the rest go with the next beats
MAX_METASERVERS = 64  # registered with, configured and learned from shard maps together


class Metaservers:
    """The metaservers this server registers with (one; or, where several share the
    hash slots, every one of them), and what they have heard: it counts as registered
    while one knows it (a dead metaserver must not take its servers out of rotation:
    another takes its slots over), and a lost chunk is forgotten once every one heard
    of it (the chunk's slot is one metaserver's; which one, this server does not know)."""

    def __init__(self, addresses: list[str], store: ChunkStore,
                 on_registered: Callable[[bool], None] = lambda registered: None):
        self.addresses, self.store, self.on_registered = addresses, store, on_registered
        self._registered: set[str] = set()
        self._heard: dict[bytes, set[str]] = {}  # lost chunk -> the metaservers that heard of it
        self.on_new: Callable[[str], None] = lambda address: None  # starts heartbeats to one learned

    def learn(self, addresses, told_by: str) -> None:
        """The metaservers a shard map lists (a heartbeat's reply): the ones not known
        yet are registered with from now on (a metaserver added to the cluster). At
        most MAX_METASERVERS, each a host:port, or they are ignored with a log line."""
        for address in addresses:
            if address in self.addresses:
                continue
            if len(self.addresses) >= MAX_METASERVERS or not valid_address(address):
                log.warning("metaserver %s named metaserver %r; ignored (%d known, at most %d)", told_by,
                            address[:300], len(self.addresses), MAX_METASERVERS)
                continue
            log.info("metaserver %s named metaserver %s, new here: registering with it too", told_by, address)
            self.addresses.append(address)
            self.on_new(address)

    def registered(self, address: str, yes: bool) -> None:
        (self._registered.add if yes else self._registered.discard)(address)
        self.on_registered(bool(self._registered))

    async def heard_lost(self, address: str, chunk_ids: list[bytes]) -> int:
        """`address` acknowledged these lost chunks; forgets those all have. How many."""
        done = []
        for c in chunk_ids:
            heard = self._heard.setdefault(c, set())
            heard.add(address)
            if len(heard) == len(self.addresses):
                done.append(c)
                del self._heard[c]
        if done:
            await self.store.forget_lost(done)
        return len(done)


def metaserver_addresses(meta: str) -> list[str]:
    """The `meta` setting: host:port, or several comma-separated."""
    return [a.strip() for a in meta.split(",") if a.strip()]


async def heartbeat_forever(cfg: ChunkserverConfig, meta: str, metaservers: Metaservers, address: str,
                            data_address: str, creds: tls.Credentials | None) -> None:
    """Registers with metaserver `meta` (retrying until it answers) and heartbeats
    for ever, as the server its certificate names; `metaservers` hears when it
    registered, when `meta` asks it to register again, and which lost chunks it heard of."""
    store = metaservers.store
    async with tls.aio_channel(meta, creds) as channel:
        stub = meta_pb2_grpc.MetaServiceStub(channel)
        interval, registered, failures = 1.0, False, 0
        while True:
            try:
                if not registered:
                    reply = await stub.Register(meta_pb2.RegisterRequest(
                        server_id=cfg.id, address=address, failure_domain=cfg.failure_domain,
                        capacity_bytes=cfg.capacity, data_address=data_address), timeout=10)
                    interval, registered = reply.heartbeat_interval_s or interval, True
                    metaservers.registered(meta, True)
                    log.info("registered with metaserver %s as %s (%s)", meta, cfg.id, address)
                stat = store.stat()
                lost = store.lost_chunks(MAX_LOST_PER_BEAT)
                reply = await stub.Heartbeat(meta_pb2.HeartbeatRequest(
                    server_id=cfg.id, used_bytes=stat["used_bytes"], allocated_bytes=stat["allocated_bytes"],
                    chunk_count=stat["chunk_count"], capacity_bytes=stat["capacity_bytes"],
                    lost_chunks=[meta_pb2.LostChunk(chunk_id=c, owner=o) for c, o in lost]), timeout=10)
                if reply.register_again:
                    registered = False
                    metaservers.registered(meta, False)
                    continue
                metaservers.learn(reply.metaservers, meta)
                if lost:  # kept until now: a heartbeat that failed is sent again with them
                    await metaservers.heard_lost(meta, [c for c, _ in lost])
                    log.info("reported %d lost chunks to metaserver %s", len(lost), meta)
                if failures:
                    log.info("metaserver %s reachable again", meta)
                failures = 0
            except grpc.aio.AioRpcError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("metaserver %s: %s (%s); retrying", meta, err.code().name, err.details())
            await asyncio.sleep(interval)
