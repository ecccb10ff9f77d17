"""`kvfs-bench prefix`: one long MLA prefix through a real local cluster.

Measured in one run, side by side:
  write-back  - Client.write of the whole prefix (allocate, every replica, commit);
  restore     - lookup + Client.read of the whole prefix into one buffer;
  raw         - the chunkservers' own io_uring reader, in this process, reading
                the same slot files (O_DIRECT, 1 MiB reads, the same depth);
  MatchPrefix - latency of one lookup of a long prefix (small blocks: the
                metadata cost does not depend on payload size).
"""

from __future__ import annotations

import os
import pathlib
import random
import statistics
import time

from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.cli.launcher import LocalCluster
from kvfs.layout import BlockLayout

from .io import percentile, raw_disk


async def run_prefix(root: pathlib.Path, tokens: int, rounds: int, lookup_blocks: int, chunkservers: int,
                     replicas: int, log=print) -> dict:
    layout = BlockLayout.mla()
    ns = Namespace("bench", "deepseek-v3")
    rng = random.Random(0)
    prompt = [rng.randrange(100_000) for _ in range(tokens)]
    payload = bytearray(os.urandom(layout.buffer_bytes(tokens)))
    report: dict = {"tokens": tokens, "blocks": tokens // layout.block_tokens, "bytes": len(payload)}
    cluster = LocalCluster(root, chunkservers=chunkservers, replicas=replicas, capacity="16GiB")
    cluster.start()
    try:
        async with Client(cluster.meta_address, credentials=cluster.worker) as client:
            t0 = time.perf_counter()
            res = await client.write(ns, prompt, payload, layout, "chat")
            write_s = time.perf_counter() - t0
            report["write_gbps"] = res.bytes_written / write_s / 1e9
            log(f"write-back: {res.committed} blocks, {res.bytes_written / 1e9:.2f} GB x {replicas} replicas "
                f"in {write_s:.2f}s: {report['write_gbps']:.2f} GB/s of payload")
            files = sorted(root.glob("cs-*/slots/*/*.slots"))
            out = bytearray(len(payload))
            restore, raw = [], []
            for r in range(rounds):
                t0 = time.perf_counter()
                match = await client.lookup(ns, prompt)
                rs = client.read(match, out)
                stats = await rs.wait()
                restore.append(stats.bytes / (time.perf_counter() - t0) / 1e9)
                if r == 0 and bytes(out) != bytes(payload):
                    raise RuntimeError("restored bytes differ from what was written")
                raw.append((await raw_disk(files, direct=True))[0])
                log(f"  round {r + 1}: restore {restore[-1]:.2f} GB/s, raw disk read {raw[-1]:.2f} GB/s")
            report.update(restore_gbps=restore, raw_gbps=raw,
                          restore_gbps_median=statistics.median(restore), raw_gbps_median=statistics.median(raw),
                          restore_over_raw=statistics.median(restore) / statistics.median(raw))

            small = BlockLayout(layers=2, block_tokens=layout.block_tokens, kv_dim=64, dtype="bfloat16")
            long_prompt = [rng.randrange(100_000) for _ in range(lookup_blocks * small.block_tokens)]
            await client.write(ns, long_prompt, bytes(small.buffer_bytes(len(long_prompt))), small)
            rpc, total = [], []
            for _ in range(30):
                t0 = time.perf_counter()
                match = await client.lookup(ns, long_prompt)
                total.append(time.perf_counter() - t0)
                rpc.append(match.lookup_seconds)
            assert match.matched == lookup_blocks
            report.update(lookup_blocks=lookup_blocks, lookup_rpc_ms_p50=percentile(rpc, 0.5) * 1e3,
                          lookup_rpc_ms_p99=percentile(rpc, 0.99) * 1e3,
                          lookup_total_ms_p50=percentile(total, 0.5) * 1e3)
            log(f"MatchPrefix of {lookup_blocks} blocks: p50 {report['lookup_rpc_ms_p50']:.1f} ms "
                f"(p99 {report['lookup_rpc_ms_p99']:.1f} ms); with client-side key hashing "
                f"{report['lookup_total_ms_p50']:.1f} ms")
    finally:
        cluster.stop()
    return report
