"""`kvfs-bench faults`: restores while a chunkserver dies, beside steady state.

A local cluster (defaults an operator gets: heartbeat timeout, repair rate) is
filled with `gib` GiB of MLA prompts; `concurrency` workers restore random
prompts throughout, every restored byte checked against what was written. After
`steady_s` seconds one chunkserver is SIGKILLed. Reported, per window (steady;
kill to detection; detection to full replication; after): restore latency
percentiles and failures; and the time to detect the dead server and to get
every chunk back to `replicas` live copies.
"""

from __future__ import annotations

import asyncio
import math
import os
import pathlib
import random
import time

import xxhash

from kvfs.buffers import byte_view
from kvfs.client import BufferPool, Client
from kvfs.keys import Namespace
from kvfs.cli.launcher import LocalCluster, meta_status
from kvfs.layout import BlockLayout

from .restore import percentiles

NS = Namespace("bench", "faults")


def _holders_ok(match, replicas: int, dead: str) -> bool:
    return all(len(held := match.holders(c)) >= replicas and all(s.id != dead for s in held)
               for b in match.blocks for c in b.chunks)


async def run_faults(root: pathlib.Path, chunkservers: int = 4, gib: float = 1.0, prompt_blocks: int = 16,
                     concurrency: int = 4, steady_s: float = 10.0, after_s: float = 3.0, log=print) -> dict:
    layout = BlockLayout.mla()
    prompt_bytes = layout.buffer_bytes(prompt_blocks * layout.block_tokens)
    n_prompts = max(1, math.ceil(gib * (1 << 30) / prompt_bytes))
    cluster = LocalCluster(root, chunkservers=chunkservers, replicas=2, capacity="64GiB")
    cluster.start()
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(100_000) for _ in range(prompt_blocks * layout.block_tokens)]
                   for _ in range(n_prompts)]
        digests = []
        pool = BufferPool(arena_bytes=(concurrency + 1) * prompt_bytes)
        async with Client(cluster.meta_address, credentials=cluster.worker) as client:
            t0 = time.perf_counter()
            for i in range(0, n_prompts, 4):
                jobs = []
                for tokens in prompts[i : i + 4]:
                    payload = os.urandom(prompt_bytes)
                    digests.append(xxhash.xxh3_64_intdigest(payload))
                    jobs.append(client.write(NS, tokens, payload, layout))
                await asyncio.gather(*jobs)
            written_s = time.perf_counter() - t0
            total = n_prompts * prompt_bytes
            log(f"wrote {total / 2**30:.2f} GiB in {n_prompts} prompts of {prompt_blocks} blocks "
                f"({total * 2 / written_s / 1e9:.2f} GB/s to disks, 2 replicas)")

            samples: list[tuple[float, float, bool]] = []  # (start, seconds, ok)
            stop = asyncio.Event()

            async def worker(k: int):
                out = pool.get(prompt_bytes)
                wrng = random.Random(k)
                while not stop.is_set():
                    i = wrng.randrange(n_prompts)
                    s = time.perf_counter()
                    try:
                        match = await client.lookup(NS, prompts[i])
                        await client.read(match, out).wait()
                        ok = match.matched == prompt_blocks and \
                            xxhash.xxh3_64_intdigest(byte_view(out)[:prompt_bytes]) == digests[i]
                        if not ok:
                            raise AssertionError(f"prompt {i} restored wrong bytes")
                    except AssertionError:
                        raise
                    except Exception:  # a failed restore is a sample too: it is what users see
                        ok = False
                    samples.append((s, time.perf_counter() - s, ok))

            workers = [asyncio.create_task(worker(k)) for k in range(concurrency)]
            await asyncio.sleep(steady_s)
            victim = cluster.chunkservers[1]
            victim_id = "cs-1"
            killed = time.perf_counter()
            victim.kill()
            log("injected: SIGKILL cs-1")
            while True:
                st = await asyncio.to_thread(meta_status, cluster.meta_address, credentials=cluster.admin)
                if not any(s.id == victim_id and s.live for s in st.servers):
                    break
                await asyncio.sleep(0.1)
            detected = time.perf_counter()
            log(f"cs-1 detected dead after {detected - killed:.1f}s")
            pending = list(range(n_prompts))
            while pending:
                still = []
                for i in pending:
                    if not _holders_ok(await client.lookup(NS, prompts[i]), 2, victim_id):
                        still.append(i)
                pending = still
                if pending:
                    await asyncio.sleep(0.25)
            replicated = time.perf_counter()
            log(f"every chunk on 2 live servers {replicated - killed:.1f}s after the kill")
            await asyncio.sleep(after_s)
            stop.set()
            await asyncio.gather(*workers)
    finally:
        cluster.stop()

    def window(lo: float, hi: float) -> dict:
        picked = [(d, ok) for s, d, ok in samples if lo <= s < hi]
        return {**percentiles([d for d, _ in picked]), "failed": sum(not ok for _, ok in picked)}

    first = samples[0][0] if samples else killed
    windows = {"steady": window(first, killed), "kill_to_detect": window(killed, detected),
               "detect_to_replicated": window(detected, replicated), "after": window(replicated, math.inf)}
    return {"gib": total / 2**30, "prompts": n_prompts, "prompt_blocks": prompt_blocks, "chunkservers": chunkservers,
            "concurrency": concurrency, "detect_s": detected - killed, "replicated_s": replicated - killed,
            "windows": windows,
            "p99_fault_over_steady": (max(windows["kill_to_detect"].get("p99", 0),
                                          windows["detect_to_replicated"].get("p99", 0))
                                      / windows["steady"]["p99"]) if windows["steady"].get("p99") else None}
