"""`kvfs-bench restore`: time to first token of many concurrent requests, some
restoring long cached prefixes, some missing (prefill, then write-back), all
sharing one read path and one write path, under each admission policy.

The workload is seeded: prompt lengths from a distribution, a share of requests
(`hit_ratio`) that reuse a prefix written beforehand, the rest fresh. Every
policy runs the same requests in the same order on the same cluster.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass

from kvfs.client import BufferPool, Client
from kvfs.engine import Engine, ModelConfig
from kvfs.engine.admission import AdmissionController
from kvfs.keys import Namespace


def parse_lengths(spec: str, rng: random.Random, count: int) -> list[int]:
    """`8192`, `1024,4096,8192` (cycled), or `lognormal:median=4096,sigma=0.8`."""
    if spec.startswith("lognormal:"):
        params = dict(p.split("=") for p in spec.removeprefix("lognormal:").split(","))
        median, sigma = float(params["median"]), float(params["sigma"])
        return [max(2, int(rng.lognormvariate(math.log(median), sigma))) for _ in range(count)]
    values = [int(v) for v in spec.split(",")]
    if not values or min(values) < 2:
        raise ValueError(f"prompt lengths must be at least 2 tokens: {spec!r}")
    return [values[i % len(values)] for i in range(count)]


@dataclass
class Request:
    length: int
    hit: bool


def make_workload(lengths: str, hit_ratio: float, requests: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(n, rng.random() < hit_ratio) for n in parse_lengths(lengths, rng, requests)]


def prompts_for(cfg: ModelConfig, workload: list[Request], seed: int, run: int) -> list[list[int]]:
    """Hits get the same tokens in every run (their prefixes were written beforehand);
    misses get tokens of their own per run, so one policy's write-backs never turn
    another policy's misses into hits."""
    shared, own = random.Random(seed), random.Random(f"{seed}-{run}")
    return [[(shared if r.hit else own).randrange(cfg.vocab_size) for _ in range(r.length)] for r in workload]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    s = sorted(values)

    def q(p):
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"count": len(s), "mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "p999": q(0.999)}


async def warm_up(meta: str, cfg: ModelConfig, workload: list[Request], prompts: list[list[int]],
                  namespace: Namespace, progress=None) -> None:
    """Computes and writes back every hit's prompt, so the hits hit."""
    async with Client(meta) as client:
        engine = Engine(cfg, client, namespace, pool=BufferPool(arena_bytes=0))
        for req, tokens in zip(workload, prompts):
            if req.hit:
                result = await engine.agenerate(tokens, 1)
                if result.write_back is not None:
                    await result.write_back
            if progress:
                progress()
        engine.close()


async def _serve(meta: str, cfg: ModelConfig, policy: str, namespace: Namespace,
                 requests: list[tuple[float, list[int], bool | None]], concurrency: int, speed: float = 1.0,
                 progress=None) -> dict:
    """Serves (arrival seconds, tokens, hit) requests through one engine under `policy`,
    at most `concurrency` at a time, arrivals divided by `speed`. `hit` None means
    "counted a hit when kvfs held a prefix of it"."""
    admission = AdmissionController(policy=policy)
    async with Client(meta) as client:
        engine = Engine(cfg, client, namespace, pool=BufferPool(arena_bytes=0), admission=admission)
        slots = asyncio.Semaphore(concurrency)
        ttft = {"hit": [], "miss": []}
        totals = {"prompt_tokens": 0, "cached_tokens": 0, "restored": 0, "restore_s": 0.0, "dropped": 0}
        write_backs = []
        t0 = time.perf_counter()

        async def serve(arrival, tokens, hit):
            await asyncio.sleep(max(0.0, arrival / speed - (time.perf_counter() - t0)))
            async with slots:
                result = await engine.agenerate(tokens, 1)
            t = result.timings
            ttft["hit" if (t.tokens_cached if hit is None else hit) else "miss"].append(t.ttft)
            totals["prompt_tokens"] += len(tokens)
            totals["cached_tokens"] += t.tokens_cached
            totals["restored"] += t.bytes_restored
            totals["restore_s"] += t.restore
            totals["dropped"] += t.write_back_dropped
            if result.write_back is not None:
                write_backs.append((result.write_back, t))
            if progress:
                progress()

        await asyncio.gather(*(serve(*r) for r in requests))
        await engine.writebacks.drain()
        written = 0
        for fut, t in write_backs:
            await asyncio.gather(fut, return_exceptions=True)
            written += t.bytes_written
        wall = time.perf_counter() - t0
        engine.close()
    return {
        "policy": policy,
        "ttft_hit": percentiles(ttft["hit"]),
        "ttft_miss": percentiles(ttft["miss"]),
        "ttft_all": percentiles(ttft["hit"] + ttft["miss"]),
        "token_hit_ratio": totals["cached_tokens"] / max(1, totals["prompt_tokens"]),
        "restore_gbps": totals["restored"] / totals["restore_s"] / 1e9 if totals["restore_s"] else 0.0,
        "bytes_restored": totals["restored"],
        "bytes_written": written,
        "write_back_gbps": written / wall / 1e9,
        "write_backs_dropped": totals["dropped"],
        "decisions": dict(admission.decisions),
        "hedges": 0,  # hedged reads are not implemented yet
        "wall_s": wall,
    }


async def run_policy(meta: str, cfg: ModelConfig, policy: str, workload: list[Request], prompts: list[list[int]],
                     concurrency: int, namespace: Namespace, progress=None) -> dict:
    """The whole workload at once, in order, `concurrency` requests in service."""
    result = await _serve(meta, cfg, policy, namespace, [(0.0, t, r.hit) for r, t in zip(workload, prompts)],
                          concurrency, progress=progress)
    del result["token_hit_ratio"]  # the workload sets it
    return result

def load_trace(path: str, limit: int | None, vocab: int, block: int = 512) -> list[tuple[float, list[int], int]]:
    """A Mooncake-format trace as (arrival seconds, prompt tokens, cacheable tokens).

    Each hash id becomes a deterministic `block`-token run (equal ids, equal
    tokens, hence equal chained keys); the tail past the last full block is
    unique to the request.
    """
    import json

    out = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            tokens: list[int] = []
            for h in rec["hash_ids"]:
                rng = random.Random(f"block-{h}")
                tokens += [rng.randrange(vocab) for _ in range(block)]
            tokens = tokens[: rec["input_length"]]
            own = random.Random(f"request-{i}")
            tokens += [own.randrange(vocab) for _ in range(rec["input_length"] - len(tokens))]
            out.append((rec["timestamp"] / 1000.0, tokens, min(len(rec["hash_ids"]) * block, rec["input_length"])))
    return out


async def replay(meta: str, cfg: ModelConfig, policy: str, trace, speed: float, concurrency: int,
                 namespace: Namespace, progress=None) -> dict:
    """Replays arrivals (compressed by `speed`) with at most `concurrency` requests in service."""
    return await _serve(meta, cfg, policy, namespace, [(arrival, tokens, None) for arrival, tokens, _ in trace],
                        concurrency, speed, progress)
