"""`kvfs-bench mixed`: restores while write-backs stream into the same chunkservers.

One real local cluster (chunkservers in direct mode by default: O_DIRECT, the
disk is what reads and writes share). A prefix of `--restore-tokens` is written
first; then restores of it, one after another from `--restorers` loops in this
process, are timed twice: alone, and while a writer process of its own (as
another inference worker's write-backs would be) writes fresh prompts of
`--write-tokens` from `--writers` concurrent loops as fast as the cluster takes
them. Raw O_DIRECT write speed over the same filesystem is measured in the same
run, one writer thread per chunkserver, as `kvfs-bench io` measures it.

The whole measurement runs once per pair of settings, one after the other on
fresh clusters: `--write-yield`, the chunkservers' (reads first on the disk: how
long a write waits for the reads in flight; 0: never), and `--write-nice`, the
chunkservers' and the writer's SDK's (reads first on the CPU: how much nicer the
threads doing write work run, kvfs.priority; 0: the same priority). Reported per
pair: restore p50/p99 alone and under the writes, their ratio, the write-back
rate (payload, and to disks with the replicas) beside raw write, the writes
the chunkservers deferred, and the CPUs in use in each phase: the host's, and
this process's (the restores), the writer's, the chunkservers' and the
metaserver's (bench/cpu.py).

Then (unless --no-disk-probe) the restores are timed twice more with no kvfs
writes, beside the disk's own work from threads of this process: raw overwrites
at the rate the write-backs put on the disks (never flushed, over a file written
in full first, so no filesystem metadata changes), and 4 KiB overwrites each
fdatasync'd, back to back. Their ratios say what the disk itself lets through:
the floor under what any write scheduling in kvfs can reach on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import statistics
import tempfile
import threading
import time

from rich.console import Console
from rich.table import Table

from kvfs.buffers import aligned_bytearray
from kvfs.cli.launcher import LocalCluster
from kvfs.client import BufferPool, ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from .cpu import CpuWindow
from .io import raw_write
from .tenants import SPAWN, in_own_process, percentile, tokens

console = Console()
NS = Namespace("bench", "mixed")
LAYOUT = BlockLayout.mla()
REPLICAS = 2


def _write_backs(meta: str, n_tokens: int, loops: int, transport: str, write_nice: int, stop, written,
                 failed) -> None:
    """The writer process: `loops` write-backs of fresh prompts at a time until `stop`."""

    async def run() -> None:
        payload = os.urandom(LAYOUT.buffer_bytes(n_tokens))
        async with Client(meta, transport=transport, write_nice=write_nice) as client:

            async def loop(i: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    try:
                        result = await client.write(NS, tokens(n_tokens, 1000 * i + n), payload, LAYOUT)
                    except Exception:  # counted; the stream goes on, as an engine's write-back queue would
                        with failed.get_lock():
                            failed.value += 1
                        continue
                    with written.get_lock():
                        written.value += result.bytes_written

            await asyncio.gather(*(loop(i + 1) for i in range(loops)))

    asyncio.run(run())


async def _restores(meta: str, prompt: list[int], seconds: float, loops: int, transport: str,
                    pool: BufferPool) -> list[float]:
    """Restores of the prefix (lookup + read) from `loops` loops for `seconds`: their times."""
    async with Client(meta, transport=transport) as client:
        out = [pool.get(LAYOUT.buffer_bytes(len(prompt))) for _ in range(loops)]
        await client.read(await client.lookup(NS, prompt), out[0]).wait()  # connections open: not counted
        took: list[float] = []
        deadline = time.monotonic() + seconds

        async def loop(buf) -> None:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                stats = await client.read(await client.lookup(NS, prompt), buf).wait()
                if stats.bytes != LAYOUT.buffer_bytes(len(prompt)):
                    raise RuntimeError(f"a restore read {stats.bytes} of {LAYOUT.buffer_bytes(len(prompt))} bytes")
                took.append(time.perf_counter() - t0)

        await asyncio.gather(*(loop(buf) for buf in out))
        return took


PROBE_RING = 64 << 20  # each raw writer's file, overwritten round and round
PROBE_PIECE = 1 << 20
PROBE_WRITERS = 8  # raw writer threads (one alone wrote 0.1 GB/s beside restores: each write waits its turn)


def _ring_file(path: pathlib.Path, direct: bool) -> None:
    """A PROBE_RING file written in full and synced: overwriting it later allocates
    and converts no extent (no filesystem metadata, no journal commits)."""
    buf = aligned_bytearray(PROBE_PIECE)
    buf[:] = os.urandom(PROBE_PIECE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    try:
        for off in range(0, PROBE_RING, PROBE_PIECE):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_overwrites(path: pathlib.Path, gbps: float, direct: bool, stop: threading.Event, done: list[int]) -> None:
    """Overwrites the ring file `path` PROBE_PIECE at a time at `gbps`, never
    flushing: disk bandwidth taken as kvfs's write-backs took it, and nothing else.
    `done` counts the bytes."""
    buf = aligned_bytearray(PROBE_PIECE)
    buf[:] = os.urandom(PROBE_PIECE)
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    try:
        t0, n = time.perf_counter(), 0
        while not stop.is_set():
            os.pwrite(fd, buf, n * PROBE_PIECE % PROBE_RING)
            n += 1
            done[0] += PROBE_PIECE
            ahead = n * PROBE_PIECE / (gbps * 1e9) - (time.perf_counter() - t0)
            if ahead > 0:
                stop.wait(ahead)
    finally:
        os.close(fd)


def _flushes(path: pathlib.Path, stop: threading.Event, done: list[int]) -> None:
    """4 KiB overwritten and fdatasync'd, again and again: cache flushes, and
    next to no bytes (a group commit makes one or more of these per round).
    `done` counts the flushes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, os.urandom(4096), 0)
        os.fsync(fd)
        while not stop.is_set():
            os.pwrite(fd, os.urandom(4096), 0)
            os.fdatasync(fd)
            done[0] += 1
    finally:
        os.close(fd)


@contextlib.contextmanager
def _beside(jobs: list[tuple]):
    """Each `(target, *args)` of `jobs` run as `target(*args, stop, done)` on a thread
    of its own while the body runs, `done` a one-item list of its own to count in;
    yields a one-item list that holds (their counts' sum, the seconds they ran) once
    they stopped."""
    stop, counts, out = threading.Event(), [[0] for _ in jobs], [(0, 0.0)]
    threads = [threading.Thread(target=target, args=(*args, stop, count), daemon=True)
               for (target, *args), count in zip(jobs, counts)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    try:
        yield out
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        out[0] = (sum(c[0] for c in counts), time.perf_counter() - t0)


def _device_flushes(path: pathlib.Path) -> int | None:
    """Cache flushes the block device under `path` completed so far (its stat's
    17th field), None where the kernel does not say."""
    dev = os.stat(path).st_dev
    try:
        fields = pathlib.Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    return int(fields[15]) if len(fields) > 15 else None


def _probe(cluster_address: str, prompt: list[int], seconds: float, restorers: int, transport: str,
           pool: BufferPool, root: pathlib.Path, gbps: float, direct: bool, alone_p99: float) -> dict:
    """Restores beside the disk's own work without kvfs writing: raw overwrites at the
    write-backs' disk rate, then back-to-back flushes; how much each alone slows them."""
    out = {}
    rings = [root / f"probe-ring-{i}" for i in range(PROBE_WRITERS)]
    for ring in rings:
        _ring_file(ring, direct)
    share = max(gbps, 0.01) / PROBE_WRITERS
    with _beside([(_raw_overwrites, ring, share, direct) for ring in rings]) as result:
        times = asyncio.run(_restores(cluster_address, prompt, seconds, restorers, transport, pool))
    written, took = result[0]
    out["raw_writes"] = {**_summary(times), "gbps": written / took / 1e9}
    with _beside([(_flushes, root / "probe-flush")]) as result:
        times = asyncio.run(_restores(cluster_address, prompt, seconds, restorers, transport, pool))
    flushed, took = result[0]
    out["flushes"] = {**_summary(times), "per_s": flushed / took}
    for ring in rings:
        ring.unlink()
    for probe in out.values():
        probe["p99_ratio"] = probe["p99_ms"] / alone_p99
    return out


def _summary(seconds: list[float]) -> dict:
    return {"count": len(seconds), "p50_ms": percentile(seconds, 0.5) * 1e3, "p99_ms": percentile(seconds, 0.99) * 1e3,
            "mean_ms": statistics.mean(seconds) * 1e3}


async def _deferred(cluster: LocalCluster) -> tuple[int, float]:
    writes = seconds = 0
    for cs in cluster.chunkservers:
        async with ChunkClient(cs.address, credentials=cluster.admin) as c:
            counters = (await c.stat()).counters
        writes, seconds = writes + counters.writes_deferred, seconds + counters.deferred_seconds
    return writes, seconds


def one_config(root: pathlib.Path, write_yield: str, write_nice: int, restore_tokens: int, write_tokens: int,
               writers: int, restorers: int, seconds: float, transport: str, chunkservers: int, io_mode: str,
               disk_probe: bool = True) -> dict:
    cluster = LocalCluster(root / "cluster", chunkservers=chunkservers, replicas=REPLICAS, capacity="32GiB",
                           chunk_extra=["--io-mode", io_mode, "--write-yield", write_yield,
                                        "--write-nice", str(write_nice)])
    with cluster, cluster.worker_env():
        prompt = tokens(restore_tokens, 1)

        async def write() -> None:
            async with Client(cluster.meta_address) as client:
                await client.write(NS, prompt, os.urandom(LAYOUT.buffer_bytes(len(prompt))), LAYOUT)

        asyncio.run(write())
        raw = raw_write(root / "raw-write", 2 << 30, chunkservers, io_mode == "direct")
        pool = BufferPool(arena_bytes=restorers * LAYOUT.buffer_bytes(restore_tokens) + (1 << 20))
        servers = {"restorers": [os.getpid()], "chunkservers": [cs.pid for cs in cluster.chunkservers],
                   "metaserver": [m.pid for m in cluster.metas]}
        window = CpuWindow(servers).start()
        alone = asyncio.run(_restores(cluster.meta_address, prompt, seconds, restorers, transport, pool))
        cpu_alone = window.stop()
        stop, written, failed = SPAWN.Event(), SPAWN.Value("Q", 0), SPAWN.Value("Q", 0)
        with in_own_process(_write_backs, (cluster.meta_address, write_tokens, writers, transport, write_nice, stop,
                                           written, failed), stop, written) as writer:
            window = CpuWindow({**servers, "writer": [writer.pid]}).start()
            t0, w0, f0 = time.perf_counter(), written.value, _device_flushes(root)
            mixed = asyncio.run(_restores(cluster.meta_address, prompt, seconds, restorers, transport, pool))
            write_rate = (written.value - w0) / (time.perf_counter() - t0)
            f1 = _device_flushes(root)
            flushes = (f1 - f0) / (time.perf_counter() - t0) if f0 is not None and f1 is not None else None
            cpu_mixed = window.stop()
        alone_p99 = _summary(alone)["p99_ms"]
        probe = (_probe(cluster.meta_address, prompt, seconds, restorers, transport, pool, root,
                        REPLICAS * write_rate / 1e9, io_mode == "direct", alone_p99) if disk_probe else None)
        deferred, deferred_s = asyncio.run(_deferred(cluster))
    report = {"write_yield": write_yield, "write_nice": write_nice, "alone": _summary(alone),
              "with_writes": _summary(mixed), "raw_write_gbps": raw, "write_gbps": write_rate / 1e9,
              "write_disk_gbps": REPLICAS * write_rate / 1e9,
              "write_failures": failed.value, "writes_deferred": deferred, "deferred_seconds": deferred_s,
              "cpu_alone": cpu_alone, "cpu_with_writes": cpu_mixed, "device_flushes_per_s": flushes,
              "disk_probe": probe}
    report["p99_ratio"] = report["with_writes"]["p99_ms"] / report["alone"]["p99_ms"]
    report["p50_ratio"] = report["with_writes"]["p50_ms"] / report["alone"]["p50_ms"]
    report["write_over_raw"] = report["write_disk_gbps"] / raw
    return report


def _cpu_line(cpu: dict) -> str:
    roles = ", ".join(f"{name} {used:.2f}" for name, used in cpu["roles"].items())
    return f"host {cpu['host_busy_cpus']:.2f} ({roles})"


def run_mixed(restore_tokens: int, write_tokens: int, writers: int, restorers: int, seconds: float,
              transport: str, chunkservers: int, io_mode: str, write_yields: list[str],
              write_nices: list[int], disk_probe: bool = True) -> list[dict]:
    console.print(f"[bold]kvfs-bench mixed[/]: restores of {restore_tokens} MLA tokens "
                  f"({LAYOUT.buffer_bytes(restore_tokens) / 1e6:.0f} MB) from {restorers} loops for {seconds:.0f} s, "
                  f"alone, then while another process writes back {write_tokens}-token prompts from {writers} loops; "
                  f"{chunkservers} chunkservers ({io_mode} mode), {REPLICAS} replicas, {transport}; write_yield "
                  f"{', '.join(write_yields)} by write_nice {', '.join(map(str, write_nices))}; {os.cpu_count()} "
                  f"CPUs shared by all of it")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-mixed-") as tmp:
        pairs = [(y, n) for y in write_yields for n in write_nices]
        for i, (write_yield, write_nice) in enumerate(pairs):
            rows.append(one_config(pathlib.Path(tmp) / f"config-{i}", write_yield, write_nice, restore_tokens,
                                   write_tokens, writers, restorers, seconds, transport, chunkservers, io_mode,
                                   disk_probe))
    table = Table(title=f"restores of {LAYOUT.buffer_bytes(restore_tokens) / 1e6:.0f} MB, alone and under "
                        f"write-backs (ms; ratios from this run)")
    for col in ("write_yield", "write_nice", "p50 alone", "p99 alone", "p50 writes", "p99 writes", "p99 ratio",
                "write-backs GB/s (payload / disks)", "/ raw write", "writes deferred"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["write_yield"], str(r["write_nice"]), f"{r['alone']['p50_ms']:.1f}",
                      f"{r['alone']['p99_ms']:.1f}",
                      f"{r['with_writes']['p50_ms']:.1f}", f"{r['with_writes']['p99_ms']:.1f}",
                      f"{r['p99_ratio']:.2f}x", f"{r['write_gbps']:.2f} / {r['write_disk_gbps']:.2f}",
                      f"{r['write_over_raw']:.2f}", f"{r['writes_deferred']} ({r['deferred_seconds']:.1f} s)")
    console.print(table)
    raws = ", ".join(f"{r['raw_write_gbps']:.2f}" for r in rows)
    failures = ", ".join(str(r["write_failures"]) for r in rows)
    console.print(f"raw O_DIRECT write {raws} GB/s; write-backs failed: {failures}")
    for r in rows:
        console.print(f"CPUs in use (of {r['cpu_alone']['cpus']}), write_yield {r['write_yield']}, write_nice "
                      f"{r['write_nice']}: alone {_cpu_line(r['cpu_alone'])}; under writes {_cpu_line(r['cpu_with_writes'])}")
        if r["device_flushes_per_s"] is not None:
            console.print(f"  the disk completed {r['device_flushes_per_s']:.0f} cache flushes a second under the writes")
        if (probe := r["disk_probe"]) is not None:
            raw, fl = probe["raw_writes"], probe["flushes"]
            console.print(f"  the disk alone, no kvfs writes (restore p99 ratio): raw writes at {raw['gbps']:.2f} GB/s, "
                          f"never flushed, {raw['p99_ratio']:.2f}x; {fl['per_s']:.0f} flushes a second of 4 KiB, "
                          f"{fl['p99_ratio']:.2f}x")
    return rows
