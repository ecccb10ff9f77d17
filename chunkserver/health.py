"""What the chunkserver's gRPC health service answers, for launchers, probes and
operators: SERVING once it has registered with its metaserver (at once when it runs
standalone) and while it has room for writes; NOT_SERVING before it registered, when
the metaserver asked it to register again (it had forgotten or declared it dead),
and while its store is full (chunkserver/store.py, ChunkStore.full). Reads go on
being served meanwhile: NOT_SERVING says "do not count on this server for writes
or placement", not "dead"."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

SERVICES = ("", "kvfs.chunk.ChunkService")  # the server as a whole, and its one service


class Readiness:
    """Publishes SERVING or NOT_SERVING to a health servicer whenever registration
    or fullness changes (publish_forever, a task on the server's loop)."""

    def __init__(self, servicer: health.aio.HealthServicer, registered: bool):
        self._servicer = servicer
        self.registered = registered
        self.full = False
        self._changed = asyncio.Event()
        self._published: int | None = None

    def set_registered(self, registered: bool) -> None:
        if registered != self.registered:
            self.registered = registered
            self._changed.set()

    def set_full(self, full: bool) -> None:
        if full != self.full:
            self.full = full
            self._changed.set()

    def why_not(self) -> str:
        """Why it is NOT_SERVING ("" when SERVING)."""
        reasons = (["not registered with the metaserver"] if not self.registered else []) + \
                  (["full: its last write found no room"] if self.full else [])
        return " and ".join(reasons)

    async def publish(self) -> None:
        """Sets every service's status to what registration and fullness say now,
        with a line when it changed (none for the first SERVING: start-up has its own)."""
        why = self.why_not()
        status = health_pb2.HealthCheckResponse.NOT_SERVING if why else health_pb2.HealthCheckResponse.SERVING
        for service in SERVICES:
            await self._servicer.set(service, status)
        if status != self._published and (self._published is not None or why):
            log.log(logging.WARNING if self.full else logging.INFO, "health %s%s",
                    health_pb2.HealthCheckResponse.ServingStatus.Name(status), f": {why}" if why else "")
        self._published = status

    async def publish_forever(self) -> None:
        """publish() after every change, until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self.publish()
