"""`kvfs-chunkserver`: flags, then serve() until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfs.config import ChunkserverConfig, add_flags, load
from kvfs.proto import chunk_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS
from kvfs.serving import bound_address, write_ready_file

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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("chunkserver %s stopping", cfg.id)
    if beats:
        beats.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2)
    store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs-chunkserver", description="Run a kvfs chunkserver.")
    add_flags(parser, ChunkserverConfig)
    args = parser.parse_args(argv)
    try:
        cfg = load(ChunkserverConfig, "chunkserver", vars(args))
    except (ValueError, OSError) as err:
        parser.error(str(err))
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
