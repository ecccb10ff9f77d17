"""`kvfs demo`: a real local cluster and a workload of prompts sharing prefixes.

Prompts are drawn from a few prefix families (think system prompts and agents'
growing histories): each prompt takes a leading part of one family's blocks and
adds a block or two of its own. For every prompt the demo does what an inference
worker does: one lookup, restore the matched prefix layer by layer, check every
restored byte, and write the missing blocks back. Block payloads are
deterministic functions of their keys, so any wrong byte would be caught.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import statistics
import time
from dataclasses import dataclass, field

from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

MLA_LAYOUT = BlockLayout.mla()  # 64 tokens x 27 layers x 576 values x bf16 = 1.9 MB a block


def block_payload(key: bytes, nbytes: int) -> bytes:
    """A block's bytes as a function of its key (what a real prefill would compute)."""
    return random.Random(hashlib.blake2b(key, digest_size=8).digest()).randbytes(nbytes)


def prompt_buffer(layout: BlockLayout, keys: list[bytes], tokens: int) -> bytearray:
    """The `[layer][tokens][kv_dim]` cache of a prompt whose blocks have these keys."""
    buf = bytearray(layout.buffer_bytes(tokens))
    whole = layout.span_of(0, layout.payload_bytes)
    for b, key in enumerate(keys):
        payload = block_payload(key, layout.payload_bytes)
        for src, dst, n in layout.scatter(whole, b, tokens):
            buf[dst : dst + n] = payload[src : src + n]
    return buf


@dataclass
class DemoStats:
    prompts: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    restored_bytes: int = 0
    restore_seconds: list[float] = field(default_factory=list)
    lookup_seconds: list[float] = field(default_factory=list)
    written_bytes: int = 0
    write_seconds: float = 0.0
    mismatches: int = 0


def make_prompts(n: int, seed: int, block_tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    families = [[rng.randrange(100_000) for _ in range(rng.randint(4, 16) * block_tokens)] for _ in range(10)]
    prompts = []
    for _ in range(n):
        family = rng.choice(families)
        shared = family[: rng.randint(1, len(family) // block_tokens) * block_tokens]
        own = [rng.randrange(100_000) for _ in range(rng.randint(0, 2) * block_tokens + rng.randrange(block_tokens))]
        prompts.append(shared + own)
    return prompts


async def run_workload(meta_address: str, prompts: list[list[int]], concurrency: int = 4,
                       layout: BlockLayout = MLA_LAYOUT, progress=None, credentials=None) -> DemoStats:
    """Serves `prompts` through one client (`credentials`: a worker's; None: an --insecure cluster)."""
    ns = Namespace("demo", "deepseek-v3", "mla-bf16")
    stats = DemoStats()
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    async with Client(meta_address, block_tokens=layout.block_tokens, credentials=credentials,
                      insecure=credentials is None) as client:

        async def serve_prompts():
            while not queue.empty():
                tokens = queue.get_nowait()
                match = await client.lookup(ns, tokens)
                stats.lookup_seconds.append(match.lookup_seconds)
                full = len(match.keys) * layout.block_tokens
                expected = prompt_buffer(layout, match.keys, full)
                if match.matched:
                    out = bytearray(layout.buffer_bytes(match.tokens))
                    restore = client.read(match, out)
                    async for _layer in restore:
                        pass  # an engine would run this layer over the uncached suffix here
                    rs = await restore.wait()
                    stats.restored_bytes += rs.bytes
                    stats.restore_seconds.append(rs.seconds)
                    # compare layer by layer: out holds matched tokens, expected all full blocks
                    row = layout.row_bytes
                    for layer in range(layout.layers):
                        got = out[layer * match.tokens * row : (layer + 1) * match.tokens * row]
                        want = expected[layer * full * row : layer * full * row + match.tokens * row]
                        stats.mismatches += got != want
                if match.matched < len(match.keys):
                    t0 = time.perf_counter()
                    res = await client.write(ns, tokens, expected, layout, "chat", first_block=match.matched,
                                             buffer_tokens=full)
                    stats.write_seconds += time.perf_counter() - t0
                    stats.written_bytes += res.bytes_written
                stats.prompts += 1
                stats.prompt_blocks += len(match.keys)
                stats.hit_blocks += match.matched
                if progress:
                    progress(stats)

        await asyncio.gather(*(serve_prompts() for _ in range(concurrency)))
    return stats


def summary(stats: DemoStats, wall: float) -> list[str]:
    restore_time = sum(stats.restore_seconds)
    lookups = sorted(stats.lookup_seconds)
    return [
        f"prompts served: {stats.prompts}, full blocks in them: {stats.prompt_blocks}",
        f"hit ratio: {stats.hit_blocks / max(1, stats.prompt_blocks):.1%} of blocks restored from kvfs",
        f"restored: {stats.restored_bytes / 1e9:.2f} GB in {len(stats.restore_seconds)} restores, "
        f"{stats.restored_bytes / max(restore_time, 1e-9) / 1e9:.2f} GB/s while restoring "
        f"(p50 {statistics.median(stats.restore_seconds or [0]) * 1000:.0f} ms)",
        f"written back: {stats.written_bytes / 1e9:.2f} GB of new blocks (x replicas on disk), "
        f"{stats.written_bytes / max(stats.write_seconds, 1e-9) / 1e9:.2f} GB/s per write-back",
        f"lookup (MatchPrefix) p50 {lookups[len(lookups) // 2] * 1000:.2f} ms, "
        f"p99 {lookups[int(len(lookups) * 0.99)] * 1000:.2f} ms" if lookups else "no lookups",
        f"restored bytes checked: {'all exact' if stats.mismatches == 0 else f'{stats.mismatches} WRONG layers'}",
        f"wall time {wall:.1f}s",
    ]


async def engine_miss_then_hit(meta_address: str, prompt_tokens: int, preset: str = "bench",
                               credentials=None) -> list[str]:
    """One long prompt through the MLA engine twice: a miss (prefill + write-back), then a hit."""
    from kvfs.client import BufferPool
    from kvfs.engine import Engine, ModelConfig, tokenizer

    cfg = ModelConfig.preset(preset)
    text = ("You are a careful assistant. The tools you may call are listed below, with their schemas. " * 400)
    tokens = tokenizer.encode(text)[:prompt_tokens]
    pool = BufferPool(arena_bytes=2 * cfg.block_layout().buffer_bytes(prompt_tokens + 64) + (64 << 20))
    async with Client(meta_address, credentials=credentials, insecure=credentials is None) as client:
        ns = Namespace("demo", f"engine-{preset}")
        first, second = Engine(cfg, client, ns, pool=pool), Engine(cfg, client, ns, pool=pool)
        miss = await first.agenerate(tokens, 8)
        await miss.write_back
        hit = await second.agenerate(tokens, 8)
        first.close()
        second.close()
    m, h = miss.timings, hit.timings
    return [
        f"engine ({preset} model, {cfg.num_layers} layers, {cfg.kv_dim} cached values per token per layer): "
        f"a {len(tokens)}-token prompt, served twice by two engines that share only kvfs",
        f"  miss: time to first token {m.ttft:.2f}s (prefill {m.prefill:.2f}s), then "
        f"{m.bytes_written / 1e6:.0f} MB written back",
        f"  hit:  time to first token {h.ttft:.3f}s, {h.bytes_restored / 1e6:.0f} MB restored in {h.restore:.3f}s "
        f"({h.bytes_restored / max(h.restore, 1e-9) / 1e9:.2f} GB/s): {m.ttft / h.ttft:.1f}x faster",
        f"  same answer: {'yes' if hit.tokens == miss.tokens else 'NO'} (first tokens {hit.tokens[:4]})",
    ]
