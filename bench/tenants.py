"""`kvfs-bench tenants`: one tenant's restores while another floods the same
chunkservers, without and with per-tenant read pacing (`tenant_read_rate`).

Tenant A, a well-behaved tenant, restores one prompt every `--a-interval`
seconds, one restore at a time: first alone, then while tenant B, the flooder,
restores a long prefix as fast as `--flood` concurrent loops in a process of its
own can. For each configuration (unpaced; paced at `--rate` per
tenant and chunkserver) the report gives A's restore p50/p99 alone and under the
flood, the p99 ratio (issue "Abuse resistance" asks for 2x at most), the bytes
per second B got, and how many of each tenant's reads the chunkservers paced.
Both configurations run on the same machine in one run, one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pathlib
import random
import statistics
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvfs.cli.launcher import LocalCluster
from kvfs.client import BufferPool, ChunkClient, Client
from kvfs.grants import tenant_id
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

console = Console()
A, B = Namespace("tenant-a", "deepseek-v3"), Namespace("tenant-b", "deepseek-v3")
LAYOUT = BlockLayout.mla()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n)]


SPAWN = multiprocessing.get_context("spawn")


@contextlib.contextmanager
def in_own_process(target, args: tuple, stop, progress):
    """`target(*args)` in a spawned process of its own while the body runs, which
    starts once the process has moved `progress` (a shared Value; at most 60 s, or
    once it died); then the process is told to end through `stop` (an Event in its
    args), and killed if it has not within 60 s."""
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while progress.value == 0 and time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.05)
        yield proc
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _flood(meta: str, prompt: list[int], loops: int, transport: str, stop, moved) -> None:
    """B's process: `loops` restores of its prefix at a time until `stop` is set."""

    async def run() -> None:
        async with Client(meta, transport=transport) as client:
            match = await client.lookup(B, prompt)

            async def loop() -> None:
                out = bytearray(LAYOUT.buffer_bytes(match.tokens))
                while not stop.is_set():
                    stats = await client.read(match, out).wait()
                    with moved.get_lock():
                        moved.value += stats.bytes

            await asyncio.gather(*(loop() for _ in range(loops)))

    asyncio.run(run())


async def _a_restores(meta: str, prompt: list[int], samples: int, interval: float, transport: str,
                      pool: BufferPool) -> list[float]:
    async with Client(meta, transport=transport) as client:
        out = pool.get(LAYOUT.buffer_bytes(len(prompt)))
        seconds = []
        for i in range(samples + 1):  # the first opens connections: not counted
            t0 = time.perf_counter()
            await client.read(await client.lookup(A, prompt), out).wait()
            took = time.perf_counter() - t0
            if i:
                seconds.append(took)
            await asyncio.sleep(max(0.0, interval - took))
        return seconds


async def _paced(cluster: LocalCluster) -> dict[str, int]:
    out = {A.tenant: 0, B.tenant: 0}
    for cs in cluster.chunkservers:
        async with ChunkClient(cs.address, credentials=cluster.admin) as c:
            for t in (await c.stat()).tenant_reads:
                for ns in (A, B):
                    if t.tenant_id == tenant_id(ns.tenant):
                        out[ns.tenant] += t.reads_paced
    return out


def one_config(root: pathlib.Path, rate: int, a_tokens: int, b_tokens: int, flood: int, samples: int,
               interval: float, transport: str, chunkservers: int) -> dict:
    cluster = LocalCluster(root, chunkservers=chunkservers, replicas=2, capacity="16GiB",
                           chunk_extra=["--tenant-read-rate", str(rate)])
    with cluster, cluster.worker_env():
        prompt_a, prompt_b = tokens(a_tokens, 1), tokens(b_tokens, 2)

        async def write() -> None:
            async with Client(cluster.meta_address) as client:
                for ns, prompt in ((A, prompt_a), (B, prompt_b)):
                    await client.write(ns, prompt, os.urandom(LAYOUT.buffer_bytes(len(prompt))), LAYOUT)

        asyncio.run(write())
        pool = BufferPool(arena_bytes=LAYOUT.buffer_bytes(a_tokens) + (1 << 20))
        alone = asyncio.run(_a_restores(cluster.meta_address, prompt_a, samples, interval, transport, pool))
        stop, moved = SPAWN.Event(), SPAWN.Value("Q", 0)
        with in_own_process(_flood, (cluster.meta_address, prompt_b, flood, transport, stop, moved), stop, moved):
            t0, b0 = time.perf_counter(), moved.value  # B's flood under way before A measures
            flooded = asyncio.run(_a_restores(cluster.meta_address, prompt_a, samples, interval, transport, pool))
            b_rate = (moved.value - b0) / (time.perf_counter() - t0)
        paced = asyncio.run(_paced(cluster))
    return {"rate": rate, "alone_p50_ms": percentile(alone, 0.5) * 1e3, "alone_p99_ms": percentile(alone, 0.99) * 1e3,
            "flood_p50_ms": percentile(flooded, 0.5) * 1e3, "flood_p99_ms": percentile(flooded, 0.99) * 1e3,
            "p99_ratio": percentile(flooded, 0.99) / percentile(alone, 0.99), "b_gbps": b_rate / 1e9,
            "a_paced": paced[A.tenant], "b_paced": paced[B.tenant], "alone_mean_ms": statistics.mean(alone) * 1e3}


def run_tenants(rate: int, a_tokens: int, b_tokens: int, flood: int, samples: int, interval: float, transport: str,
                chunkservers: int) -> list[dict]:
    console.print(f"[bold]kvfs-bench tenants[/]: tenant A restores {a_tokens} MLA tokens "
                  f"({LAYOUT.buffer_bytes(a_tokens) / 1e6:.0f} MB) {samples} times, one every {interval} s, alone and "
                  f"while tenant B restores "
                  f"{b_tokens} tokens ({LAYOUT.buffer_bytes(b_tokens) / 1e6:.0f} MB) from {flood} loops in another "
                  f"process; {chunkservers} chunkservers, {transport}; unpaced, then paced at {rate / 2**20:.0f} MiB/s "
                  f"per tenant and server; {os.cpu_count()} CPUs shared by all of it")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-tenants-") as tmp:
        for r in (0, rate):
            rows.append(one_config(pathlib.Path(tmp) / f"rate-{r}", r, a_tokens, b_tokens, flood, samples, interval,
                                   transport, chunkservers))
    table = Table(title="tenant A's restores, alone and under tenant B's flood (ms)")
    for col in ("B paced at", "A p50 alone", "A p99 alone", "A p50 flood", "A p99 flood", "p99 ratio",
                "B GB/s", "reads paced A / B"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row("unpaced" if not row["rate"] else f"{row['rate'] / 2**20:.0f} MiB/s",
                      f"{row['alone_p50_ms']:.1f}", f"{row['alone_p99_ms']:.1f}", f"{row['flood_p50_ms']:.1f}",
                      f"{row['flood_p99_ms']:.1f}", f"{row['p99_ratio']:.2f}x", f"{row['b_gbps']:.2f}",
                      f"{row['a_paced']} / {row['b_paced']}")
    console.print(table)
    return rows
