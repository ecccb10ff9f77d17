"""`kvfs-metaserver`: flags, then serve() until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, ProcessCollector

from kvfs import tls
from kvfs.serving import (STALL_BOUNDS, LoopStats, MetricsServer, StallSampler, add_introspection, bound_address,
                          cluster_key, credentials, freeze_startup_heap, grpc_server, run_server, until_signalled,
                          watch_event_loop, write_ready_file)

from .config import MetaserverConfig
from .lifecycle import Lifecycle
from .metrics import RpcMetrics, StatusCollector
from .readsfirst import CountsLookups
from . import sharded
from .repair import Repairer
from .service import SERVICE, MetaServicer, add_to_server
from .state import MetaState

log = logging.getLogger("kvfs.metaserver")


async def _rebuild_later(lifecycle: Lifecycle, delay: float) -> None:
    await asyncio.sleep(delay)  # let chunkservers register first
    await lifecycle.rebuild()


async def serve(cfg: MetaserverConfig) -> None:
    creds = credentials(cfg, "metaserver")
    state = MetaState(cfg, key=cluster_key(cfg, "metaserver"))
    lifecycle = Lifecycle(state)
    repairer = Repairer(state, lifecycle)
    server = grpc_server("metaserver", creds, cfg.max_request_bytes,
                         last=(CountsLookups(state.reads, f"/{SERVICE}/MatchPrefix"),))
    loop = LoopStats()
    state.members.watch(loop)
    registry = CollectorRegistry()
    servicer = MetaServicer(state, lifecycle, loop, RpcMetrics(registry), repairer)
    add_to_server(servicer, server)
    health_servicer = add_introspection(server, SERVICE)
    address = bound_address(cfg.listen, tls.add_port(server, cfg.listen, creds))
    metrics = None
    if cfg.metrics_listen:  # before serving: a port taken stops the server before any call reaches it
        registry.register(StatusCollector(state.blocks, servicer.status, asyncio.get_running_loop(), state.reads))
        ProcessCollector(registry=registry)
        metrics = MetricsServer(cfg.metrics_listen, registry)
        log.info("metrics on http://%s/metrics", metrics.address)
    # among several metaservers: it answers for the slots its lease on etcd holds, none before
    try:
        shards = servicer.shards = sharded.among_several(cfg, address)
    except ValueError as err:
        raise SystemExit(f"metaserver: etcd: {err}") from None
    state.owns, state.members.share, state.allocations.check_slot = shards.owns, shards.share, shards.check
    state.blocks.answers = shards.answers
    if not shards.alone:
        shards.lease.live_servers = lambda: len(state.live_servers())
    rebuilds: set[asyncio.Task] = set()  # and forgetting: slots that changed hands

    async def rebuild(slots: set[int]) -> None:
        try:
            await lifecycle.rebuild(slots)
        except Exception:  # their orphans stay uncollected (the safe side) until a restart
            log.exception("rebuilding %d hash slots taken over failed", len(slots))
        else:
            shards.rebuilt(slots)

    async def forget(slots: set[int]) -> None:
        try:
            await lifecycle.forget(slots)
        except Exception:  # their rows stay; lookups of them are refused, eviction deletes no chunk of theirs
            log.exception("forgetting the blocks of %d hash slots handed over failed", len(slots))

    def in_background(work) -> None:
        task = asyncio.create_task(work)
        rebuilds.add(task)
        task.add_done_callback(rebuilds.discard)

    shards.on_gain = lambda slots: in_background(rebuild(slots))  # from the chunkservers
    shards.on_lose = lambda slots: in_background(forget(slots))
    frozen = freeze_startup_heap()
    await server.start()
    await sharded.start(shards, cfg)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("metaserver serving on %s: data %s, replicas %d, chunk size %d, eviction %s from %.0f%% to %.0f%%; "
             "%d start-up objects frozen out of garbage collection", address, cfg.data_dir, cfg.replicas,
             cfg.chunk_size, cfg.eviction_policy, 100 * cfg.evict_high, 100 * cfg.evict_low, frozen)
    tasks = [asyncio.create_task(lifecycle.run_forever()), asyncio.create_task(lifecycle.flush_forever()),
             asyncio.create_task(lifecycle.sweep_orphans_forever()), asyncio.create_task(repairer.run_forever()),
             # stalls over 50 ms logged (issue 13's bar), with where the loop was held
             asyncio.create_task(watch_event_loop(log, loop, threshold=STALL_BOUNDS[1],
                                                  sampler=StallSampler(loop).start()))]
    write_ready_file(cfg.ready_file, address, metrics.address if metrics else "")
    if cfg.rebuild:
        tasks.append(asyncio.create_task(_rebuild_later(lifecycle, cfg.rebuild_after)))
    await until_signalled()
    log.info("metaserver stopping")
    for t in [*tasks, *rebuilds]:
        t.cancel()
    await health_servicer.enter_graceful_shutdown()
    if not shards.alone:
        await shards.lease.stop()  # a clean stop: the others take its slots at once
    await server.stop(grace=2)
    if metrics:
        metrics.close()
    await lifecycle.close()
    state.close()


def main(argv: list[str] | None = None) -> int:
    return run_server("kvfs-metaserver", "Run the kvfs metaserver.", MetaserverConfig, "metaserver", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
