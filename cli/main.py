"""`kvfs`: the local cluster, admin commands and the demo."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

import grpc
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from kvfs import tls
from kvfs.config import render_toml
from kvfs.errors import InvalidArgument, KvfsError, from_rpc_error
from kvfs.cli.launcher import LocalCluster, meta_status

console = Console(width=None if sys.stdout.isatty() else 120)
DEFAULT_CLUSTER_DIR = "kvfs-data/cluster"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _stalls(status) -> str:
    """'; event loop: 3 stalls over 100 ms (1 with its thread on the CPU, 1 waiting for a core), the
    longest 180 ms' (nothing when none)."""
    over = [s for s in status.loop_stalls if s.over_s >= 0.1 and s.count]
    if not over:
        return ""
    return (f"; event loop: {over[0].count} stalls over {over[0].over_s * 1e3:.0f} ms ({over[0].busy_count} with "
            f"its thread on the CPU, {over[0].waiting_count} waiting for a core), the longest "
            f"{status.loop_longest_stall_s * 1e3:.0f} ms")


def _status_table(status) -> Table:
    table = Table(title=f"kvfs: {status.blocks} blocks, {_human(status.block_bytes)}, replicas {status.replicas}, "
                        f"{status.chains} chains, {status.open_allocations} open allocations",
                  caption=f"cache {_human(status.cache_bytes)} of {_human(status.cache_capacity_bytes)}; evicted "
                          f"{status.evicted_blocks}, expired {status.expired_blocks}, stranded {status.stranded_blocks}"
                          + _stalls(status))
    for col in ("server", "address", "domain", "live", "chunks", "used", "capacity", "heartbeat"):
        table.add_column(col)
    for s in status.servers:
        table.add_row(s.id, s.address, s.failure_domain, "yes" if s.live else "[red]NO[/]", str(s.chunk_count),
                      _human(s.used_bytes), _human(s.capacity_bytes), f"{s.heartbeat_age_s:.1f}s ago")
    return table


def _usage_table(reply, restored: dict[str, dict] | None) -> Table:
    table = Table(title="kvfs usage per tenant", caption="tokens hit: served from cache; written: committed new "
                  "(misses written back); stored: payload; of the cache: whole slots per replica (what quotas "
                  "count); GiB-hours: payload stored over time, since metering began; restored: bytes the "
                  "chunkservers sent its restores, and reads that waited for its pace, since each started"
                  + ("" if restored is not None else " (not shown: reading them takes an admin certificate)"))
    for col in ("tenant", "lookups", "blocks hit", "hit ratio", "tokens hit", "tokens written", "stored now",
                "of the cache", "GiB-hours", "restored", "paced", "since"):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for u in reply.tenants:
        ratio = f"{u.blocks_hit / u.blocks_requested:.1%}" if u.blocks_requested else "-"
        reads = (restored or {}).get(u.tenant)
        table.add_row(u.tenant, f"{u.lookups:,}", f"{u.blocks_hit:,}", ratio, f"{u.tokens_hit:,}",
                      f"{u.tokens_written:,}", _human(u.bytes_stored), _human(u.cache_bytes),
                      f"{u.byte_seconds / 3600 / (1 << 30):,.3f}", _human(reads["bytes"]) if reads else "-",
                      f"{reads['reads_paced']:,}" if reads else "-",
                      time.strftime("%Y-%m-%d %H:%M", time.gmtime(u.since)))
    return table


def _restored(status, credentials, tenants: list[str]) -> dict[str, dict] | None:
    """Per tenant: the reads, bytes and paced reads its restores made, summed over the
    live chunkservers (their Stat counts tenants by id, kvfs.grants.tenant_id, since
    each started); None when a chunkserver refuses Stat (it takes an admin)."""
    from kvfs.grants import tenant_id
    from kvfs.proto import chunk_pb2, chunk_pb2_grpc

    names = {tenant_id(t): t for t in tenants}
    out = {t: {"reads": 0, "bytes": 0, "reads_paced": 0} for t in tenants}
    for server in status.servers:
        if not server.live:
            continue
        with tls.channel(server.address, credentials) as channel:
            try:
                stat = chunk_pb2_grpc.ChunkServiceStub(channel).Stat(chunk_pb2.StatRequest(), timeout=10)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.PERMISSION_DENIED:
                    return None
                raise
        for t in stat.tenant_reads:
            if t.tenant_id in names:
                mine = out[names[t.tenant_id]]
                mine["reads"] += t.reads
                mine["bytes"] += t.bytes
                mine["reads_paced"] += t.reads_paced
    return out


def _cluster_state(args) -> dict | None:
    state = pathlib.Path(args.data_dir) / "cluster.json"
    return json.loads(state.read_text()) if state.exists() else None


def _meta_address(args) -> str:
    if args.meta:
        return args.meta
    state = _cluster_state(args)
    if state is None:
        raise SystemExit(f"no --meta given and no local cluster state in {args.data_dir}/cluster.json; start one "
                         f"with `kvfs cluster up`")
    return state["metaserver"]


def _admin_credentials(args) -> tls.Credentials | None:
    """--tls-* files, else the local cluster's admin certificate; None with --insecure."""
    if args.insecure:
        return None
    if args.tls_cert or args.tls_key or args.tls_ca:
        try:
            return tls.Credentials.from_files(args.tls_ca, args.tls_cert, args.tls_key)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
    state = _cluster_state(args) or {}
    if state.get("insecure"):
        return None
    folder = state.get("tls") or str(pathlib.Path(args.data_dir) / "tls")
    try:
        return tls.Credentials.from_files(f"{folder}/ca.pem", f"{folder}/admin.pem", f"{folder}/admin.key")
    except ValueError:
        raise InvalidArgument("no admin certificate: pass --tls-ca/--tls-cert/--tls-key (an admin certificate, "
                              "`kvfs tls issue admin NAME`), or --data-dir of a local cluster, or --insecure "
                              "for a cluster started with --insecure") from None


def _cluster_up(args) -> int:
    root = pathlib.Path(args.data_dir)
    cluster = LocalCluster(root, chunkservers=args.chunkservers, replicas=args.replicas, capacity=args.capacity,
                           insecure=args.insecure, metaservers=args.metaservers)
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    state = root / "cluster.json"
    try:
        for m in cluster.metas:
            print(f"{m.name} {m.address} metrics http://{m.metrics_address}/metrics", flush=True)
        if cluster.etcd is not None:
            print(f"etcd {cluster.etcd.address} (the metaservers' shard map and leases); workers and chunkservers "
                  f"take every metaserver: {cluster.meta_addresses}", flush=True)
        for i, cs in enumerate(cluster.chunkservers):
            print(f"chunkserver cs-{i} {cs.address} host-{i} metrics http://{cs.metrics_address}/metrics", flush=True)
        tls_dir = str(cluster.ca.folder.resolve()) if cluster.ca else None
        if cluster.ca:
            cluster.worker  # issues worker.pem (any tenant) for this local cluster's workers
            print(f"mutual TLS: CA and certificates in {tls_dir}; a worker connects with KVFS_CLIENT_TLS_CA="
                  f"{tls_dir}/ca.pem KVFS_CLIENT_TLS_CERT={tls_dir}/worker.pem KVFS_CLIENT_TLS_KEY="
                  f"{tls_dir}/worker.key", flush=True)
        else:
            print("WARNING: --insecure: plaintext gRPC, no authentication, no access rules", flush=True)
        state.write_text(json.dumps({"pid": os.getpid(), "metaserver": cluster.meta_address,
                                     "metaservers": cluster.meta_addresses,
                                     "tls": tls_dir, "insecure": args.insecure,
                                     "servers": {p.name: {"address": p.address, "pid": p.pid,
                                                          "metrics": p.metrics_address}
                                                 for p in cluster.processes()}}))
        print(f"cluster up ({args.metaservers} metaserver{'s' if args.metaservers > 1 else ''}, "
              f"{args.chunkservers} chunkservers, {args.replicas} replicas, data in {root}); "
              f"Ctrl-C or `kvfs cluster down --data-dir {root}` stops it", flush=True)
        while not stop:
            dead = [p.name for p in cluster.processes() if not p.alive()]
            if dead:
                print(f"{', '.join(dead)} exited; stopping the cluster", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        cluster.stop()
        state.unlink(missing_ok=True)
        print("cluster stopped", flush=True)
    return 0


def _cluster_down(args) -> int:
    state = pathlib.Path(args.data_dir) / "cluster.json"
    if not state.exists():
        print(f"no cluster running from {args.data_dir}")
        return 0
    info = json.loads(state.read_text())
    try:
        os.kill(info["pid"], signal.SIGTERM)
    except ProcessLookupError:  # the launcher is gone: stop its servers directly
        for server in info["servers"].values():
            try:
                os.kill(server["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        state.unlink(missing_ok=True)
    deadline = time.monotonic() + 30
    while state.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("cluster stopped" if not state.exists() else "cluster did not stop within 30s")
    return 0 if not state.exists() else 1


def _demo(args) -> int:
    from kvfs.cli.demo import make_prompts, run_workload, summary
    from kvfs.cli.top import frame, take_sample

    root = pathlib.Path(args.data_dir or tempfile.mkdtemp(prefix="kvfs-demo-"))
    console.print(f"[bold]kvfs demo[/]: starting a local cluster in {root}")
    with LocalCluster(root, chunkservers=args.chunkservers, replicas=args.replicas, capacity="8GiB",
                      insecure=args.insecure) as cluster:
        console.print(f"metaserver {cluster.meta_address}")
        for i, cs in enumerate(cluster.chunkservers):
            console.print(f"chunkserver cs-{i} {cs.address} (failure domain host-{i})")
        prompts = make_prompts(args.prompts, args.seed, 64)
        console.print(f"serving {len(prompts)} prompts from 10 prefix families, {args.concurrency} at a time, "
                      f"MLA blocks of 64 tokens x 27 layers x 576 values x bf16")
        before = take_sample(cluster.meta_address, cluster.admin) if args.top_svg else None
        t0 = time.perf_counter()
        stats = asyncio.run(run_workload(cluster.meta_address, prompts, args.concurrency,
                                         credentials=cluster.worker))
        wall = time.perf_counter() - t0
        if before is not None:  # `kvfs top` as it looked over the workload, its rates over the whole of it
            shot = Console(record=True, width=120, file=io.StringIO())  # recorded, not shown twice
            shot.print(frame(before, take_sample(cluster.meta_address, cluster.admin)))
            shot.save_svg(args.top_svg, title="kvfs top (during kvfs demo)")
            console.print(f"kvfs top, as it looked over the workload: {args.top_svg}")
        for line in summary(stats, wall):
            console.print(line)
        same = True
        if args.engine_tokens:
            from kvfs.cli.demo import engine_miss_then_hit

            lines = asyncio.run(engine_miss_then_hit(cluster.meta_address, args.engine_tokens,
                                                     credentials=cluster.worker))
            same = lines[-1].startswith("  same answer: yes")
            for line in lines:
                console.print(line)
        console.print(_status_table(meta_status(cluster.meta_address, credentials=cluster.admin)))
    console.print("cluster stopped")
    return 0 if stats.mismatches == 0 and same else 1


def _admin(args) -> int:
    from kvfs.proto import meta_pb2, meta_pb2_grpc

    address = _meta_address(args)
    with tls.channel(address, _admin_credentials(args)) as channel:
        stub = meta_pb2_grpc.MetaServiceStub(channel)
        try:
            if args.cmd == "status":
                status = stub.Status(meta_pb2.StatusRequest(), timeout=10)
                if args.json:
                    print(json.dumps(json_format.MessageToDict(status, preserving_proto_field_name=True,
                                                               always_print_fields_with_no_presence=True),
                                     indent=2))
                else:
                    console.print(_status_table(status))
            elif args.cmd == "top":
                from kvfs.cli.top import run

                return run(console, address, _admin_credentials(args), args.interval, args.once)
            elif args.cmd == "usage":
                usage = stub.Usage(meta_pb2.UsageRequest(tenants=args.tenant), timeout=10)
                restored = _restored(stub.Status(meta_pb2.StatusRequest(), timeout=10), _admin_credentials(args),
                                     [u.tenant for u in usage.tenants])
                if args.json:
                    print(json.dumps({**json_format.MessageToDict(usage, preserving_proto_field_name=True,
                                                                  always_print_fields_with_no_presence=True),
                                      "restored": restored}, indent=2))
                else:
                    console.print(_usage_table(usage, restored))
            elif args.cmd == "rebuild":
                r = stub.Rebuild(meta_pb2.RebuildRequest(), timeout=600)
                console.print(f"rebuild: {r.chunks_seen} chunks seen, {r.blocks_restored} blocks restored, "
                              f"{r.blocks_incomplete} incomplete")
            elif args.cmd == "gc":
                r = stub.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=600)
                console.print(f"lifecycle: {r.expired_allocations} allocations expired, "
                              f"{r.deleted_chunks} chunks deleted ({r.expired_blocks} blocks expired so far)")
        except grpc.RpcError as err:
            raise from_rpc_error(err, address) from None
    return 0


async def _chunk_admin(args) -> int:
    from kvfs.client import ChunkClient

    creds = _admin_credentials(args)
    async with ChunkClient(args.address, credentials=creds, insecure=creds is None) as client:
        if args.chunk_cmd == "stat":
            s = await client.stat()
            c = s.counters
            console.print(f"{s.server_id} ({s.failure_domain}): {s.chunk_count} chunks, {_human(s.used_bytes)} used, "
                          f"{_human(s.allocated_bytes)} allocated of {_human(s.capacity_bytes)}; "
                          f"{s.io_engine} reads, {s.io_mode} mode; reads {c.reads}, writes {c.writes}, "
                          f"deletes {c.deletes}, checksum errors {c.checksum_errors}, "
                          f"rejected requests {c.rejected_requests}")
        else:
            n = 0
            async for info in client.list():
                n += 1
                if n <= args.limit:
                    console.print(f"{info.chunk_id.hex()} {info.length:>10} {info.checksum:016x} "
                                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.created))}")
            console.print(f"{n} chunks" + (f" (first {args.limit} shown)" if n > args.limit else ""))
    return 0


CONFIG_HEADER = """kvfs configuration: one table per server, every setting at its default.
Written by `kvfs config`; edit a copy. Flags override these, and
KVFS_<PART>_<KEY> environment variables (KVFS_CHUNKSERVER_CAPACITY=2TiB) too."""


def default_config() -> str:
    from kvfs.chunkserver.config import ChunkserverConfig
    from kvfs.client.config import ClientConfig
    from kvfs.metaserver.config import MetaserverConfig

    return render_toml({"chunkserver": ChunkserverConfig, "metaserver": MetaserverConfig, "client": ClientConfig},
                       CONFIG_HEADER)


def _tls(args) -> int:
    """`kvfs tls ca` / `kvfs tls issue`: certificate files for a real cluster."""
    folder = pathlib.Path(args.dir)
    if args.tls_cmd == "ca":
        if (folder / "ca.key").exists():
            raise InvalidArgument(f"{folder}/ca.key exists: a CA is made once (remove it to start over)")
        tls.Authority.create(args.name).save(folder)
        tls.make_cluster_key(folder / tls.CLUSTER_KEY)
        print(f"CA certificate {folder}/ca.pem, key {folder}/ca.key (keep the key off the cluster's machines); "
              f"cluster key {folder}/{tls.CLUSTER_KEY} (every server's --cluster-key; no worker's)")
        return 0
    try:
        authority = tls.Authority.load(folder)
    except OSError:
        raise InvalidArgument(f"no CA in {folder}: make one with `kvfs tls ca --dir {folder}`") from None
    try:
        creds = authority.issue(args.name, [args.role], tenants=args.tenant, hosts=args.host, days=args.days)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None
    ca, cert, key = creds.write(args.out or folder, args.name)
    print(f"{args.role} certificate for {creds.identity}: {cert}, key {key}, CA {ca}")
    return 0


def _add_credential_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", help="CA certificate (default: the local cluster's)")
    p.add_argument("--tls-cert", help="an admin certificate (default: the local cluster's admin.pem)")
    p.add_argument("--tls-key", help="its key")
    p.add_argument("--insecure", action="store_true", help="plaintext, to a cluster started with --insecure")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs", description="kvfs: local cluster, admin and demo.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    cluster = sub.add_parser("cluster", help="a local cluster: metaserver and chunkservers as processes")
    csub = cluster.add_subparsers(dest="cluster_cmd", required=True)
    up = csub.add_parser("up", help="start it and stay in the foreground until Ctrl-C")
    up.add_argument("--chunkservers", type=int, default=3)
    up.add_argument("--replicas", type=int, default=2)
    up.add_argument("--metaservers", type=int, default=1,
                    help="over 1: that many metaservers splitting the hash slots, with a local etcd member (Debian's "
                         "etcd-server) holding their shard map and leases")
    up.add_argument("--capacity", default="10GiB", help="per chunkserver")
    up.add_argument("--insecure", action="store_true",
                    help="plaintext gRPC, no authentication or access rules (a trusted lab only)")
    down = csub.add_parser("down", help="stop a cluster started with `kvfs cluster up`")
    for p in (up, down):
        p.add_argument("--data-dir", default=DEFAULT_CLUSTER_DIR)

    for name, text in (("status", "servers, liveness, capacity, blocks, bytes"),
                       ("top", "a live view: hit ratio, lookups/s, restore bytes/s, servers' use, losses"),
                       ("usage", "per-tenant usage: lookups, tokens served from cache and written, storage over "
                                 "time (what to bill from)"),
                       ("rebuild", "rebuild block metadata from chunkserver inventories"),
                       ("gc", "run expiry and garbage collection now")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--meta", help="metaserver host:port (default: the local cluster's)")
        p.add_argument("--data-dir", default=DEFAULT_CLUSTER_DIR, help="local cluster folder")
        _add_credential_flags(p)
        if name in ("status", "usage"):
            p.add_argument("--json", action="store_true",
                           help=f"print the metaserver's {name.title()} reply as JSON (protobuf's JSON mapping: "
                                "64-bit counts are strings)")
        if name == "usage":
            p.add_argument("--tenant", action="append", default=[], help="only this tenant (repeatable)")
        if name == "top":
            p.add_argument("--interval", type=float, default=2.0, help="seconds between two samples")
            p.add_argument("--once", action="store_true", help="print one frame (rates over one interval) and exit")

    demo = sub.add_parser("demo", help="a local cluster and a workload of prompts sharing prefixes")
    demo.add_argument("--prompts", type=int, default=200)
    demo.add_argument("--concurrency", type=int, default=1, help="prompts served at once")
    demo.add_argument("--chunkservers", type=int, default=3)
    demo.add_argument("--replicas", type=int, default=2)
    demo.add_argument("--seed", type=int, default=1)
    demo.add_argument("--engine-tokens", type=int, default=4096,
                      help="then serve a prompt this long through the MLA engine twice (0: skip)")
    demo.add_argument("--data-dir", help="keep cluster data here (default: a new temporary folder)")
    demo.add_argument("--insecure", action="store_true", help="run the cluster without TLS (a trusted lab only)")
    demo.add_argument("--top-svg", help="save a `kvfs top` frame of the workload here, as SVG")

    chunk = sub.add_parser("chunk", help="inspect one chunkserver")
    chunk_sub = chunk.add_subparsers(dest="chunk_cmd", required=True)
    for name, text in (("stat", "capacity, usage and I/O counters"), ("ls", "list stored chunks")):
        p = chunk_sub.add_parser(name, help=text)
        p.add_argument("address", help="host:port of the chunkserver")
        p.add_argument("--limit", type=int, default=50, help="rows to show (ls)")
        p.add_argument("--data-dir", default=DEFAULT_CLUSTER_DIR, help="local cluster folder (its admin certificate)")
        _add_credential_flags(p)

    tls_parser = sub.add_parser("tls", help="a CA and certificates (mutual TLS) for a real cluster")
    tls_sub = tls_parser.add_subparsers(dest="tls_cmd", required=True)
    ca = tls_sub.add_parser("ca", help="make a CA: ca.pem and ca.key in --dir")
    ca.add_argument("--name", default="kvfs CA")
    issue = tls_sub.add_parser("issue", help="issue a certificate signed by the CA in --dir")
    issue.add_argument("role", choices=tls.ROLES)
    issue.add_argument("name", help="a chunkserver's id (it registers only as this), or a label")
    issue.add_argument("--tenant", action="append", default=[],
                       help="worker: a tenant it may act for (repeat; '*' for any)")
    issue.add_argument("--host", action="append", default=[],
                       help="server: a DNS name or IP clients reach it by (repeat)")
    issue.add_argument("--days", type=int, default=365)
    issue.add_argument("--out", help="where to write NAME.pem, NAME.key and ca.pem (default: --dir)")
    for p in (ca, issue):
        p.add_argument("--dir", default="kvfs-tls", help="the CA's folder")

    sub.add_parser("config", help="print a configuration file with every setting at its default "
                   "(deploy/kvfs.toml is this output)")

    args = parser.parse_args(argv)
    if args.cmd == "config":
        print(default_config(), end="")
        return 0
    try:
        if args.cmd == "cluster":
            return _cluster_up(args) if args.cluster_cmd == "up" else _cluster_down(args)
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "chunk":
            return asyncio.run(_chunk_admin(args))
        if args.cmd == "tls":
            return _tls(args)
        return _admin(args)
    except KvfsError as err:  # one clear line for operators
        console.print(f"[red]error[/]: {err.message}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
