"""`kvfs-bench restore`: time to first token of many concurrent requests, some
restoring long cached prefixes, some missing (prefill, then write-back), all
sharing one read path and one write path, under each admission policy.

The workload is seeded: prompt lengths from a distribution, a share of requests
(`hit_ratio`) that reuse a prefix written beforehand, the rest fresh. Every
policy runs the same requests in the same order on the same cluster.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass

from kvfs.client import BufferPool, Client
from kvfs.engine import Engine, ModelConfig
from kvfs.engine.admission import AdmissionController
from kvfs.engine.simulated import SimulatedCompute
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


def prompt_maker(cfg: ModelConfig, workload: list[Request], seed: int, run: int):
    """`prompt(i)`: the tokens of request i (the workload cycles past its end).

    A hit's tokens are the same in every run and cycle (its prefix was written
    beforehand); a miss gets tokens of its own per run and per cycle, so neither
    another policy's write-backs nor its own earlier pass turn it into a hit."""

    def prompt(i: int) -> list[int]:
        r = workload[i % len(workload)]
        rng = random.Random(f"{seed}-hit-{i % len(workload)}" if r.hit else f"{seed}-{run}-miss-{i}")
        return [rng.randrange(cfg.vocab_size) for _ in range(r.length)]

    return prompt


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    s = sorted(values)

    def q(p):
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"count": len(s), "mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "p999": q(0.999)}


async def warm_up(meta: str, cfg: ModelConfig, workload: list[Request], prompt, namespace: Namespace,
                  progress=None, simulated: SimulatedCompute | None = None) -> None:
    """Computes and writes back every hit's prompt, so the hits hit."""
    async with Client(meta) as client:
        engine = Engine(cfg, client, namespace, pool=BufferPool(arena_bytes=0), simulated=simulated)
        for i, req in enumerate(workload):
            if req.hit:
                result = await engine.agenerate(prompt(i), 1)
                if result.write_back is not None:
                    await result.write_back
            if progress:
                progress()
        engine.close()


async def _serve(meta: str, cfg: ModelConfig, policy: str, namespace: Namespace, requests, concurrency: int,
                 speed: float = 1.0, duration: float | None = None, progress=None,
                 simulated: SimulatedCompute | None = None, from_arrival: bool = False) -> dict:
    """Serves (arrival seconds, tokens, hit) requests through one engine under `policy`,
    at most `concurrency` at a time, arrivals divided by `speed`, none started after
    `duration` seconds. `hit` None means "counted a hit when kvfs held a prefix of it".
    With `from_arrival`, time to first token counts from the arrival, so a wait for a
    free slot counts too (an open loop's queue)."""
    admission = AdmissionController(policy=policy)
    async with Client(meta) as client:
        engine = Engine(cfg, client, namespace, pool=BufferPool(arena_bytes=0), admission=admission,
                        simulated=simulated)
        slots = asyncio.Semaphore(concurrency)
        ttft = {"hit": [], "miss": []}
        totals = {"prompt_tokens": 0, "cached_tokens": 0, "restored": 0, "restore_s": 0.0, "dropped": 0,
                  "hedges": 0, "hedges_won": 0}
        write_backs, running = [], []
        estimates = collections.defaultdict(list)  # decision kind -> time to first token over the estimate
        t0 = time.perf_counter()

        async def serve(tokens, hit, due):
            queued = max(0.0, time.perf_counter() - due) if from_arrival else 0.0
            try:
                result = await engine.agenerate(tokens, 1)
            finally:
                slots.release()
            t = result.timings
            ttft["hit" if (t.tokens_cached if hit is None else hit) else "miss"].append(t.ttft + queued)
            if t.decision is not None and t.decision.est_ttft > 0:
                estimates[t.decision.kind].append(t.ttft / t.decision.est_ttft)
            totals["prompt_tokens"] += len(tokens)
            totals["cached_tokens"] += t.tokens_cached
            totals["restored"] += t.bytes_restored
            totals["restore_s"] += t.restore
            totals["dropped"] += t.write_back_dropped
            totals["hedges"] += t.hedges
            totals["hedges_won"] += t.hedges_won
            if result.write_back is not None:
                write_backs.append((result.write_back, t))
            if progress:
                progress()

        # requests start in order: one waits for its arrival, then for a free slot
        for arrival, tokens, hit in requests:
            delay = arrival / speed - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            if duration is not None and time.perf_counter() - t0 > duration:
                slots.release()
                break
            running.append(asyncio.get_running_loop().create_task(serve(tokens, hit, t0 + arrival / speed)))
        served_s = time.perf_counter() - t0
        await asyncio.gather(*running)
        await engine.writebacks.drain()
        written = 0
        for fut, t in write_backs:
            await asyncio.gather(fut, return_exceptions=True)
            written += t.bytes_written
        wall = time.perf_counter() - t0
        engine.close()
    return {
        "policy": policy,
        "requests": len(running),
        "ttft_hit": percentiles(ttft["hit"]),
        "ttft_miss": percentiles(ttft["miss"]),
        "ttft_all": percentiles(ttft["hit"] + ttft["miss"]),
        "ttft_samples": {k: sorted(v) for k, v in ttft.items()},
        "token_hit_ratio": totals["cached_tokens"] / max(1, totals["prompt_tokens"]),
        "restore_gbps": totals["restored"] / totals["restore_s"] / 1e9 if totals["restore_s"] else 0.0,
        "bytes_restored": totals["restored"],
        "restore_s": totals["restore_s"],
        "bytes_written": written,
        "write_back_gbps": written / wall / 1e9,
        "write_backs_dropped": totals["dropped"],
        "write_backs_deferred": engine.writebacks.deferred,
        "decisions": dict(admission.decisions),
        # how the controller's estimates fared: per kind of decision, the median of time to first
        # token (from the request's start, as the estimate) over the estimate of the option taken
        "actual_over_estimate": {k: statistics.median(v) for k, v in estimates.items()},
        "hedges": totals["hedges"],
        "hedges_won": totals["hedges_won"],
        "server_p95_ms": {a: (v["p95_s"] or 0.0) * 1e3 for a, v in client.latency.snapshot().items()},
        "load_s": served_s,
        "wall_s": wall,
    }


async def run_policy(meta: str, cfg: ModelConfig, policy: str, workload: list[Request], prompt,
                     concurrency: int, namespace: Namespace, duration: float | None = None, progress=None,
                     simulated: SimulatedCompute | None = None, rate: float | None = None, seed: int = 0) -> dict:
    """Closed loop: `concurrency` requests in service, the workload in order (cycled
    until `duration` seconds when given); `prompt(i)` is request i's tokens. With
    `rate`, open loop: Poisson arrivals at that many requests a second (seeded: every
    policy sees the same times), at most `concurrency` in service."""
    if duration is None:
        order = range(len(workload))
    else:
        order = itertools.count()
    gaps = random.Random(f"{seed}-arrivals")
    arrivals = itertools.accumulate(gaps.expovariate(rate) for _ in itertools.count()) if rate else \
        itertools.repeat(0.0)
    requests = ((at, prompt(i), workload[i % len(workload)].hit) for i, at in zip(order, arrivals))
    result = await _serve(meta, cfg, policy, namespace, requests, concurrency, duration=duration,
                          progress=progress, simulated=simulated, from_arrival=rate is not None)
    result["offered_rate"] = rate
    del result["token_hit_ratio"]  # the workload sets it
    return result

def merge_passes(passes: list[dict]) -> dict:
    """One policy's result from several passes: samples pooled, counts added."""
    if len(passes) == 1:
        return {**passes[0], "passes": 1}
    samples = {k: sorted(x for p in passes for x in p["ttft_samples"][k]) for k in ("hit", "miss")}
    total = {k: sum(p[k] for p in passes) for k in ("requests", "bytes_restored", "restore_s", "bytes_written",
                                                     "write_backs_dropped", "write_backs_deferred", "hedges",
                                                     "hedges_won", "load_s", "wall_s")}
    decisions = collections.Counter()
    for p in passes:
        decisions.update(p["decisions"])
    return {**passes[-1], **total, "passes": len(passes),
            "ttft_hit": percentiles(samples["hit"]), "ttft_miss": percentiles(samples["miss"]),
            "ttft_all": percentiles(samples["hit"] + samples["miss"]), "ttft_samples": samples,
            "restore_gbps": total["bytes_restored"] / total["restore_s"] / 1e9 if total["restore_s"] else 0.0,
            "write_back_gbps": total["bytes_written"] / total["wall_s"] / 1e9, "decisions": dict(decisions),
            "pass_means": [p["ttft_all"].get("mean", 0.0) for p in passes]}


def load_trace(path: str, limit: int | None, vocab: int, block: int = 512) -> list[tuple[float, list[int], int]]:
    """A Mooncake-format trace as (arrival seconds, prompt tokens, cacheable tokens).

    Each hash id becomes a deterministic `block`-token run (equal ids, equal
    tokens, hence equal chained keys); the tail past the last full block is
    unique to the request.
    """
    from .simulate import load_requests

    out = []
    for i, rec in enumerate(load_requests(path, limit)):
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
                        concurrency, speed, progress=progress)
