"""`kvfs-chunkserver`: flags, then serve() until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfs.config import ChunkserverConfig
from kvfs.proto import chunk_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS
from kvfs.serving import bound_address, run_server, until_signalled, write_ready_file

from .membership import heartbeat_forever
from .service import ChunkServicer
from .store import ChunkStore

log = logging.getLogger("kvfs.chunkserver")


async def serve(cfg: ChunkserverConfig) -> None:
    store = ChunkStore(cfg)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    chunk_pb2_grpc.add_ChunkServiceServicer_to_server(ChunkServicer(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = bound_address(cfg.listen, server.add_insecure_port(cfg.listen))
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("kvfs.chunk.ChunkService", health_pb2.HealthCheckResponse.SERVING)
    log.info("chunkserver %s (%s) serving on %s: data %s, capacity %d bytes, %s reads, %s mode",
             cfg.id, cfg.failure_domain, address, cfg.data_dir, cfg.capacity,
             store.reader.name, store.io_mode)
    write_ready_file(cfg.ready_file, address)
    beats = asyncio.create_task(heartbeat_forever(cfg, store, cfg.advertise or address)) if cfg.meta else None
    await until_signalled()
    log.info("chunkserver %s stopping", cfg.id)
    if beats:
        beats.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2)
    store.close()


def main(argv: list[str] | None = None) -> int:
    return run_server("kvfs-chunkserver", "Run a kvfs chunkserver.", ChunkserverConfig, "chunkserver", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
