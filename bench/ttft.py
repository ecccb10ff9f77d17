"""`kvfs-bench ttft`: time to first token, recompute vs restore, per prompt length.

For each length, one engine serves a fresh prompt (a miss: full prefill, then
write-back), and a second engine on the same cluster serves it again (a hit:
restore layer by layer while the last partial block prefills). Both engines
have the same weights; only kvfs connects them. Beside each hit's restore rate,
the SDK's own for the same blocks with nothing computing beside it.
"""

from __future__ import annotations

import random
import tempfile
import pathlib
import shutil

from kvfs.client import BufferPool, Client
from kvfs.engine import Engine, ModelConfig
from kvfs.keys import Namespace
from kvfs.cli.launcher import LocalCluster


async def sdk_restore(client: Client, ns: Namespace, prompt: list[int], cfg: ModelConfig, pool: BufferPool,
                      rounds: int = 3) -> float:
    """GB/s of the SDK restoring the same blocks alone (no model running beside it),
    into a pool buffer as the engine does: median of `rounds`."""
    layout = cfg.block_layout()
    rates = []
    for _ in range(rounds):
        match = await client.lookup(ns, prompt)
        out = pool.get(layout.buffer_bytes(match.tokens))
        try:
            stats = await client.read(match, out).wait()
        finally:
            pool.put(out)
        rates.append(stats.bytes / stats.seconds / 1e9)
    return sorted(rates)[len(rates) // 2]


async def run_ttft(preset: str, lengths: list[int], chunkservers: int, log=print) -> dict:
    cfg = ModelConfig.preset(preset)
    root = pathlib.Path(tempfile.mkdtemp(prefix="kvfs-bench-"))
    cluster = LocalCluster(root, chunkservers=chunkservers, replicas=2, capacity="16GiB")
    cluster.start()
    rows = []
    try:
        pool = BufferPool(arena_bytes=2 * cfg.block_layout().buffer_bytes(max(lengths) + 64) + (64 << 20))
        async with Client(cluster.meta_address, credentials=cluster.worker) as client:
            ns = Namespace("bench", f"ttft-{preset}")
            miss_engine = Engine(cfg, client, ns, pool=pool)
            hit_engine = Engine(cfg, client, ns, pool=pool)
            rng = random.Random(0)
            for n in lengths:
                prompt = [rng.randrange(cfg.vocab_size) for _ in range(n)]
                miss = await miss_engine.agenerate(prompt, 1)
                await miss.write_back
                hit = await hit_engine.agenerate(prompt, 1)
                if hit.tokens != miss.tokens:
                    raise RuntimeError(f"{n} tokens: restored answer {hit.tokens} != recomputed {miss.tokens}")
                h, m = hit.timings, miss.timings
                sdk = await sdk_restore(client, ns, prompt, cfg, pool)
                row = {"tokens": n, "ttft_recompute_s": m.ttft, "ttft_restore_s": h.ttft,
                       "speedup": m.ttft / h.ttft, "bytes_written": m.bytes_written,
                       "bytes_restored": h.bytes_restored, "restore_s": h.restore,
                       "restore_gbps": h.bytes_restored / h.restore / 1e9 if h.restore else 0.0,
                       "restore_wait_s": h.restore_wait, "suffix_prefill_s": h.prefill,
                       "hidden_fraction": max(0.0, 1 - h.restore_wait / h.restore) if h.restore else 0.0,
                       "sdk_restore_gbps": sdk}
                row["restore_over_sdk"] = row["restore_gbps"] / sdk
                rows.append(row)
                log(f"{n} tokens: TTFT recompute {m.ttft:.2f}s, restore {h.ttft:.3f}s ({row['speedup']:.1f}x); "
                    f"restored {h.bytes_restored / 1e6:.0f} MB at {row['restore_gbps']:.2f} GB/s, "
                    f"{row['hidden_fraction']:.0%} of the restore hidden behind suffix compute; the SDK alone "
                    f"restores the same bytes at {sdk:.2f} GB/s ({row['restore_over_sdk']:.2f})")
            miss_engine.close()
            hit_engine.close()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"preset": preset, "rows": rows}
