"""`kvfs-chunkserver`: flags, then serve() until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry, ProcessCollector

from kvfs import tls
from kvfs.proto import chunk_pb2, chunk_pb2_grpc
from kvfs.serving import (MetricsServer, add_introspection, bound_address, cluster_key, credentials, freeze_startup_heap,
                          grpc_server, run_server, until_signalled, watch_event_loop, write_ready_file)

from .config import ChunkserverConfig
from .dataport import start_data_server
from .health import Readiness
from .membership import Metaservers, heartbeat_forever, metaserver_addresses
from .metrics import ChunkMetrics, StoreCollector
from .scrub import Scrubber
from .service import ChunkServicer
from .store import ChunkStore

log = logging.getLogger("kvfs.chunkserver")


async def serve(cfg: ChunkserverConfig) -> None:
    creds = credentials(cfg, f"chunkserver {cfg.id}")
    if creds is not None and creds.identity.name != cfg.id:
        raise SystemExit(f"chunkserver {cfg.id}: its certificate names server {creds.identity.name!r}; the "
                         f"metaserver accepts it only as that id (issue one for {cfg.id!r} or pass --id)")
    key = cluster_key(cfg, f"chunkserver {cfg.id}")
    store = ChunkStore(cfg)
    registry = CollectorRegistry()
    metrics = ChunkMetrics(registry)
    host = cfg.listen.rsplit(":", 1)[0]
    data = (start_data_server(cfg.data_listen or f"{host}:0", store, metrics, cfg.data_request_timeout,
                              cfg.data_peer_connections, key, creds) if cfg.data_listen != "off" else None)
    server = grpc_server(f"chunkserver {cfg.id}", creds)
    address = bound_address(cfg.listen, tls.add_port(server, cfg.listen, creds))
    advertised = cfg.advertise or address
    # the data port is advertised on the same host as gRPC
    data_address = f"{advertised.rsplit(':', 1)[0]}:{data.address.rsplit(':', 1)[1]}" if data else ""
    if data:
        data.listen_local(data_address)  # same-host clients: shared memory, passed by descriptor
    servicer = ChunkServicer(store, metrics, data_address, creds, key)
    chunk_pb2_grpc.add_ChunkServiceServicer_to_server(servicer, server)
    health_servicer = add_introspection(server, chunk_pb2.DESCRIPTOR.services_by_name["ChunkService"].full_name)
    readiness = Readiness(health_servicer, registered=not cfg.meta)
    loop = asyncio.get_running_loop()
    store.on_full = lambda full: loop.call_soon_threadsafe(readiness.set_full, full)  # writes' threads find it
    # without a metaserver nobody could copy a corrupt chunk back: the scrubber only reports
    scrubber = Scrubber(store, cfg.scrub_rate, cfg.scrub_interval, remove=bool(cfg.meta))
    metrics_server = None
    if cfg.metrics_listen:  # before serving: a port taken stops the server before any call reaches it
        registry.register(StoreCollector(store, scrubber, data))
        ProcessCollector(registry=registry)
        metrics_server = MetricsServer(cfg.metrics_listen, registry)
        log.info("metrics on http://%s/metrics", metrics_server.address)
    await readiness.publish()
    frozen = freeze_startup_heap()
    await server.start()
    log.info("chunkserver %s (%s) serving on %s (data port %s): data %s, capacity %d bytes, %s reads, %s mode; "
             "%d start-up objects frozen out of garbage collection", cfg.id, cfg.failure_domain, address,
             data_address or "off", cfg.data_dir, cfg.capacity, store.reader.name, store.io_mode, frozen)
    write_ready_file(cfg.ready_file, address, metrics_server.address if metrics_server else "")
    metaservers = Metaservers(metaserver_addresses(cfg.meta), store, readiness.set_registered)
    beats: list[asyncio.Task] = []

    def beat_to(meta: str) -> None:
        beats.append(asyncio.create_task(heartbeat_forever(cfg, meta, metaservers, advertised, data_address, creds)))

    metaservers.on_new = beat_to  # a metaserver added to the cluster, named by another's heartbeat replies
    for meta in list(metaservers.addresses):
        beat_to(meta)
    publishing = asyncio.create_task(readiness.publish_forever())
    scrubbing = asyncio.create_task(scrubber.run_forever())
    # the data path is the data port's threads: a coarse tick here is enough, and costs
    # a fifth of the default's wake-ups (at 10 ms, ~2% of a core per idle server here)
    watching = asyncio.create_task(watch_event_loop(log, tick=0.05))
    await until_signalled()
    watching.cancel()
    publishing.cancel()  # before the shutdown's NOT_SERVING, which nothing may undo
    log.info("chunkserver %s stopping", cfg.id)
    for beat in beats:
        beat.cancel()
    scrubber.stop()
    await scrubbing
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2)
    if metrics_server:
        metrics_server.close()
    await servicer.close()  # channels CopyChunk opened to other chunkservers
    if data:
        data.shutdown()
        data.server_close()
    store.close()


def main(argv: list[str] | None = None) -> int:
    return run_server("kvfs-chunkserver", "Run a kvfs chunkserver.", ChunkserverConfig, "chunkserver", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
