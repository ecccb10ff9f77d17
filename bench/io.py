"""`kvfs-bench io`: restores through the cluster beside what the machine can do.

For each cache mode (warm: chunkservers in buffered mode, data in the page cache;
cold: O_DIRECT, nothing cached) it starts a real local cluster, writes one long
MLA prefix, and measures for each transport (grpc, tcp, shm):
  restore   - lookup + read of the whole prefix into one buffer (GB/s);
  per block - single-block restores from `concurrency` workers (p50, p99 latency
              and the GB/s they add up to);
  write     - the prefix written through the cluster (allocate, replicas to
              chunkservers, commit) once per write path, one after the other:
              gRPC WriteChunk, the data port over TCP, and the default (the
              data port's local socket, on this host); GB/s of payload and of
              disk bytes, and the disk bytes over raw write;
beside baselines measured in the same run:
  raw       - the chunkservers' own reader (io_uring, or preadv where it
              cannot run), in this process, over the same slot files
              (O_DIRECT when cold, page cache when warm);
  raw write - the same disk bytes written to files beside the slot files, the
              way chunkservers write (O_DIRECT when cold, buffered when warm,
              then fdatasync), one writer thread per chunkserver;
  socket    - a plain loopback TCP copy into a reused buffer;
  redis     - GET of the same blocks from a local redis-server (when one is on
              the PATH and the `redis` package is installed), same concurrency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from kvfs.buffers import aligned_bytearray, byte_view
from kvfs.chunkserver.uring import open_reader  # the server's reader, used here without a server
from kvfs.client import BufferPool, Client
from kvfs.keys import Namespace
from kvfs.cli.launcher import LocalCluster, LaunchError
from kvfs.layout import BlockLayout

NS = Namespace("bench", "deepseek-v3")
CHUNK = 1 << 20


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def drop_cache(files: list[pathlib.Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def raw_disk(files: list[pathlib.Path], direct: bool, depth: int = 32) -> tuple[float, str]:
    """GB/s of 1 MiB reads over whole slot files through the chunkservers' reader (io_uring,
    or preadv where it cannot run: the log says so), and that reader's name."""
    reader = open_reader("auto", 256)
    fds = [os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in files]
    try:
        ops = [(fd, off) for fd, p in zip(fds, files) for off in range(0, p.stat().st_size, CHUNK)]
        free = [aligned_bytearray(CHUNK) for _ in range(depth)]
        moved = 0

        async def worker(mine):
            nonlocal moved
            for fd, off in mine:
                buf = free.pop()
                try:
                    got = (await asyncio.wrap_future(reader.read_batch([(fd, off, buf)])))[0]
                finally:
                    free.append(buf)
                if got < 0:
                    raise OSError(-got, os.strerror(-got))
                moved += got

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(ops[i::depth]) for i in range(depth)))
        return moved / (time.perf_counter() - t0) / 1e9, reader.name
    finally:
        for fd in fds:
            os.close(fd)
        reader.close()


def raw_write(folder: pathlib.Path, total: int, writers: int, direct: bool) -> float:
    """GB/s of `total` bytes written by `writers` threads, each to its own file, then fdatasync."""
    folder.mkdir(parents=True, exist_ok=True)
    share = -(-total // writers // CHUNK) * CHUNK

    def write(i):
        buf = aligned_bytearray(CHUNK)
        buf[:] = os.urandom(CHUNK)
        fd = os.open(folder / f"raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
        try:
            for _ in range(share // CHUNK):
                os.write(fd, buf)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = share * writers / (time.perf_counter() - t0) / 1e9
    shutil.rmtree(folder)
    return rate


def socket_copy(total: int, piece: int = CHUNK) -> float:
    """GB/s of a plain loopback TCP copy into a reused buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = os.urandom(piece)

    def send():
        conn, _ = listener.accept()
        with conn:
            for _ in range(total // piece):
                conn.sendall(payload)

    sender = threading.Thread(target=send)
    sender.start()
    buf = bytearray(piece)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        t0 = time.perf_counter()
        got = 0
        while got < total // piece * piece:
            n = sock.recv_into(view)
            if not n:
                break
            got += n
        rate = got / (time.perf_counter() - t0) / 1e9
    sender.join()
    listener.close()
    return rate


async def redis_get(blocks: list[bytes], concurrency: int, rounds: int, root: pathlib.Path) -> dict | None:
    """GB/s and per-block latency of GET from a local redis-server, or None."""
    exe = shutil.which("redis-server")
    try:
        import redis.asyncio as aioredis
    except ImportError:
        return None
    if not exe:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = aioredis.Redis(host="127.0.0.1", port=port, max_connections=concurrency * 2)
        deadline = time.monotonic() + 10
        while True:
            try:
                await client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise LaunchError("redis-server did not start") from None
                await asyncio.sleep(0.05)
        for i, b in enumerate(blocks):
            await client.set(f"b{i}", b)
        rates, lat = [], []
        for _ in range(rounds):
            order = list(range(len(blocks)))
            random.shuffle(order)
            t0 = time.perf_counter()

            async def worker(mine):
                for i in mine:
                    s = time.perf_counter()
                    v = await client.get(f"b{i}")
                    lat.append(time.perf_counter() - s)
                    assert len(v) == len(blocks[i])

            await asyncio.gather(*(worker(order[k::concurrency]) for k in range(concurrency)))
            rates.append(sum(map(len, blocks)) / (time.perf_counter() - t0) / 1e9)
        await client.aclose()
        return {"gbps": statistics.median(rates), "block_p50_ms": percentile(lat, 0.5) * 1e3,
                "block_p99_ms": percentile(lat, 0.99) * 1e3}
    finally:
        proc.terminate()
        proc.wait()


async def transport_pass(meta: str, transport: str, prompt: list[int], payload: bytearray, layout: BlockLayout,
                         rounds: int, concurrency: int, cold_files: list[pathlib.Path] | None) -> dict:
    # restores land in BufferPool memory, as an engine's would (with shm, the
    # chunkservers read straight into it)
    pool = BufferPool(arena_bytes=len(payload) + (concurrency + 1) * layout.payload_bytes)
    async with Client(meta, transport=transport) as client:
        out = pool.get(len(payload))
        rates = []
        for r in range(rounds + 1):  # the first round opens connections: not counted
            if cold_files:
                drop_cache(cold_files)
            t0 = time.perf_counter()
            match = await client.lookup(NS, prompt)
            stats = await client.read(match, out).wait()
            if r:
                rates.append(stats.bytes / (time.perf_counter() - t0) / 1e9)
        if bytes(byte_view(out)) != bytes(payload):
            raise RuntimeError(f"{transport}: restored bytes differ from what was written")
        singles = [dataclasses.replace(match, matched=1, blocks=[b]) for b in match.blocks]
        lat: list[float] = []
        order = list(range(len(singles))) * 2
        random.shuffle(order)
        bufs = [pool.get(layout.payload_bytes) for _ in range(concurrency)]

        async def worker(k, mine):
            for i in mine:
                s = time.perf_counter()
                await client.read(singles[i], bufs[k]).wait()
                lat.append(time.perf_counter() - s)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k, order[k::concurrency]) for k in range(concurrency)))
        concurrent_gbps = len(order) * layout.payload_bytes / (time.perf_counter() - t0) / 1e9
        return {"transport": transport, "restore_gbps": rates, "restore_gbps_median": statistics.median(rates),
                "concurrent_gbps": concurrent_gbps, "block_p50_ms": percentile(lat, 0.5) * 1e3,
                "block_p99_ms": percentile(lat, 0.99) * 1e3}


async def tls_cost(secure: LocalCluster, plain: LocalCluster, transport: str, prompt: list[int], payload: bytearray,
                   layout: BlockLayout, rounds: int, cold: bool) -> dict:
    """Whole-prefix restores alternating between a mutual-TLS cluster and an
    --insecure one holding the same prefix, so both see the same load; medians."""
    pool = BufferPool(arena_bytes=len(payload) + layout.payload_bytes)
    out = pool.get(len(payload))
    sides = {"tls": (secure, Client(secure.meta_address, transport=transport, credentials=secure.worker)),
             "insecure": (plain, Client(plain.meta_address, transport=transport, insecure=True))}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for r in range(rounds + 1):  # the first round opens connections: not counted
            for name, (cluster, client) in sides.items():
                if cold:
                    drop_cache(sorted(cluster.root.glob("cs-*/slots/*/*.slots")))
                t0 = time.perf_counter()
                stats = await client.read(await client.lookup(NS, prompt), out).wait()
                if r:
                    rates[name].append(stats.bytes / (time.perf_counter() - t0) / 1e9)
                if bytes(byte_view(out)) != bytes(payload):
                    raise RuntimeError(f"{transport} ({name}): restored bytes differ from what was written")
    finally:
        for _, client in sides.values():
            await client.close()
    tls, insecure = statistics.median(rates["tls"]), statistics.median(rates["insecure"])
    return {"transport": transport, "tls_gbps": tls, "insecure_gbps": insecure, "tls_over_insecure": tls / insecure}


async def _tls_costs(root: pathlib.Path, mode: str, chunkservers: int, transports: list[str], prompt, payload,
                     layout: BlockLayout, rounds: int, cold: bool) -> list[dict]:
    """tls_cost for each transport, on two fresh clusters (TLS and --insecure) holding the prefix."""
    clusters = [LocalCluster(root / name, chunkservers=chunkservers, replicas=2, capacity="16GiB",
                             chunk_extra=["--io-mode", mode], insecure=name == "insecure")
                for name in ("tls", "insecure")]
    try:
        for cluster in clusters:
            cluster.start()
            async with Client(cluster.meta_address, credentials=cluster.worker, insecure=cluster.ca is None) as c:
                await c.write(NS, prompt, payload, layout, "chat")
        return [await tls_cost(*clusters, t, prompt, payload, layout, rounds, cold) for t in transports]
    finally:
        for cluster in clusters:
            cluster.stop()


# (what the report calls it, Client(transport=)); the last one's blocks are the ones restored
WRITE_PATHS = (("grpc", "grpc"), ("tcp data port", "tcp"), ("local data port", "auto"))


async def write_pass(cluster: LocalCluster, path: str, transport: str, prompt, payload, layout: BlockLayout,
                     insecure: bool, raw_write_gbps: float) -> dict:
    """The prefix written once by a fresh client over one write path (salted with
    the path's name, but for the last path: restores read that one)."""
    salt = None if (path, transport) == WRITE_PATHS[-1] else path
    async with Client(cluster.meta_address, credentials=cluster.worker, insecure=insecure,
                      transport=transport) as client:
        await client.write(NS, prompt[: 2 * layout.block_tokens], payload, layout, "chat", salt=f"warm {path}",
                           buffer_tokens=len(prompt))  # connections open, slot files touched
        t0 = time.perf_counter()
        written = await client.write(NS, prompt, payload, layout, "chat", salt=salt)
        seconds = time.perf_counter() - t0
    if written.bytes_written != len(payload):
        raise RuntimeError(f"{path}: wrote {written.bytes_written} of {len(payload)} bytes")
    disk = 2 * len(payload) / seconds / 1e9
    return {"path": path, "write_gbps": len(payload) / seconds / 1e9, "write_disk_gbps": disk,
            "write_over_raw": disk / raw_write_gbps}


async def run_io(tokens: int, layers: int, transports: list[str], caches: list[str], rounds: int,
                 concurrency: int, chunkservers: int, log=print, insecure: bool = False,
                 vs_insecure: bool = False) -> dict:
    layout = BlockLayout.mla(layers=layers)
    rng = random.Random(0)
    prompt = [rng.randrange(100_000) for _ in range(tokens - tokens % layout.block_tokens)]
    payload = bytearray(os.urandom(layout.buffer_bytes(len(prompt))))
    report: dict = {"security": "insecure" if insecure else "mutual TLS", "block_bytes": layout.payload_bytes,
                    "blocks": len(prompt) // layout.block_tokens,
                    "prefix_bytes": len(payload), "modes": {}}
    report["socket_gbps"] = socket_copy(len(payload))
    log(f"baseline: loopback socket copy {report['socket_gbps']:.2f} GB/s")
    whole = layout.span_of(0, layout.payload_bytes)
    blocks = []
    for b in range(report["blocks"]):
        block = bytearray(layout.payload_bytes)
        for src, dst, n in layout.scatter(whole, b, len(prompt)):
            block[src : src + n] = payload[dst : dst + n]
        blocks.append(bytes(block))
    root = pathlib.Path(tempfile.mkdtemp(prefix="kvfs-bench-"))
    try:
        report["redis"] = await redis_get(blocks, concurrency, rounds, root)
        del blocks
        if report["redis"]:
            log(f"baseline: redis GET {report['redis']['gbps']:.2f} GB/s, block p50 "
                f"{report['redis']['block_p50_ms']:.2f} ms, p99 {report['redis']['block_p99_ms']:.2f} ms")
        else:
            log("baseline: redis skipped (needs redis-server on the PATH and the redis package)")
        for cache in caches:
            mode = "buffered" if cache == "warm" else "direct"
            cluster = LocalCluster(root / cache, chunkservers=chunkservers, replicas=2, capacity="16GiB",
                                   chunk_extra=["--io-mode", mode], insecure=insecure)
            cluster.start()
            try:
                raw_w = raw_write(root / cache / "raw-write", len(payload) * 2, chunkservers, cache == "cold")
                entry = {"transports": [], "raw_write_gbps": raw_w, "writes": []}
                for path, transport in WRITE_PATHS:
                    entry["writes"].append(res := await write_pass(cluster, path, transport, prompt, payload, layout,
                                                                   insecure, raw_w))
                    log(f"{cache}: write over {path}: {res['write_gbps']:.2f} GB/s of payload "
                        f"({res['write_disk_gbps']:.2f} GB/s to disks, 2 replicas): {res['write_over_raw']:.2f} of "
                        f"raw write ({raw_w:.2f} GB/s)")
                entry.update({k: entry["writes"][-1][k] for k in ("write_gbps", "write_disk_gbps", "write_over_raw")})
                files = sorted((root / cache).glob("cs-*/slots/*/*.slots"))
                if cache == "cold":
                    drop_cache(files)
                raw, entry["raw_reader"] = await raw_disk(files, direct=cache == "cold")
                entry["raw_gbps"] = raw
                log(f"{cache}: raw {entry['raw_reader']} read over the slot files {raw:.2f} GB/s")
                for t in transports:
                    with cluster.worker_env():
                        res = await transport_pass(cluster.meta_address, t, prompt, payload, layout, rounds,
                                                   concurrency, files if cache == "cold" else None)
                    entry["transports"].append(res)
                    log(f"{cache} {t}: restore {res['restore_gbps_median']:.2f} GB/s; {concurrency} concurrent "
                        f"single-block restores {res['concurrent_gbps']:.2f} GB/s, p50 {res['block_p50_ms']:.1f} ms, "
                        f"p99 {res['block_p99_ms']:.1f} ms")
                report["modes"][cache] = entry
            finally:
                cluster.stop()
            if vs_insecure and not insecure:
                entry["tls_cost"] = await _tls_costs(root / cache, mode, chunkservers, transports, prompt, payload,
                                                     layout, rounds, cache == "cold")
                for c in entry["tls_cost"]:
                    log(f"{cache} {c['transport']}: alternating restores, mutual TLS {c['tls_gbps']:.2f} GB/s, "
                        f"--insecure {c['insecure_gbps']:.2f} GB/s: {c['tls_over_insecure']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for entry in report["modes"].values():
        for res in entry["transports"]:
            res["over_raw"] = res["restore_gbps_median"] / entry["raw_gbps"]
            res["over_socket"] = res["restore_gbps_median"] / report["socket_gbps"]
            if report["redis"]:
                res["over_redis"] = res["restore_gbps_median"] / report["redis"]["gbps"]
    return report
