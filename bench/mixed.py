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
rate (payload, and to disks with the replicas) beside raw write, and the writes
the chunkservers deferred.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import statistics
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvfs.cli.launcher import LocalCluster
from kvfs.client import BufferPool, ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

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
               writers: int, restorers: int, seconds: float, transport: str, chunkservers: int, io_mode: str) -> dict:
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
        alone = asyncio.run(_restores(cluster.meta_address, prompt, seconds, restorers, transport, pool))
        stop, written, failed = SPAWN.Event(), SPAWN.Value("Q", 0), SPAWN.Value("Q", 0)
        with in_own_process(_write_backs, (cluster.meta_address, write_tokens, writers, transport, write_nice, stop,
                                           written, failed), stop, written):
            t0, w0 = time.perf_counter(), written.value  # the write-backs under way before the restores are timed
            mixed = asyncio.run(_restores(cluster.meta_address, prompt, seconds, restorers, transport, pool))
            write_rate = (written.value - w0) / (time.perf_counter() - t0)
        deferred, deferred_s = asyncio.run(_deferred(cluster))
    report = {"write_yield": write_yield, "write_nice": write_nice, "alone": _summary(alone),
              "with_writes": _summary(mixed), "raw_write_gbps": raw, "write_gbps": write_rate / 1e9,
              "write_disk_gbps": REPLICAS * write_rate / 1e9,
              "write_failures": failed.value, "writes_deferred": deferred, "deferred_seconds": deferred_s}
    report["p99_ratio"] = report["with_writes"]["p99_ms"] / report["alone"]["p99_ms"]
    report["p50_ratio"] = report["with_writes"]["p50_ms"] / report["alone"]["p50_ms"]
    report["write_over_raw"] = report["write_disk_gbps"] / raw
    return report


def run_mixed(restore_tokens: int, write_tokens: int, writers: int, restorers: int, seconds: float,
              transport: str, chunkservers: int, io_mode: str, write_yields: list[str],
              write_nices: list[int]) -> list[dict]:
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
                                   write_tokens, writers, restorers, seconds, transport, chunkservers, io_mode))
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
    return rows
