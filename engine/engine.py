"""Engine: generation with kvfs as the prefix cache.

A request hashes its prompt's blocks and makes one MatchPrefix. The matched
prefix is restored straight into the request's KV cache (a BufferPool buffer,
so chunkservers on this host read into it directly) while the unmatched suffix
is prefilled: the model waits for layer l of the restore only when it reaches
layer l, so I/O hides behind compute. New full blocks are written back in the
background; a failed write-back is logged and never fails the request. If a
restore fails midway, the prompt is recomputed in full and the answer is the
same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvfs.errors import KvfsError
from kvfs.keys import Namespace

from .admission import AdmissionController, Decision, PrefillModel, WriteBackQueue
from .cache import KVCache
from .config import ModelConfig
from .scheduler import ComputeQueue
from .weights import build_model

log = logging.getLogger(__name__)

PREFILL_CHUNK = 2048


@dataclass
class Timings:
    """Seconds and bytes of one request."""

    lookup: float = 0.0
    restore: float = 0.0  # from issuing the restore to its last layer landing
    restore_wait: float = 0.0  # time prefill spent waiting for restored layers (I/O not hidden)
    prefill: float = 0.0
    ttft: float = 0.0
    decode: float = 0.0
    compute: float = 0.0  # of the prefill, the compute itself (no waits for other requests or restores)
    tokens_cached: int = 0  # leading tokens the lookup found in kvfs
    tokens_matched: int = 0  # of those, the ones restored (all, unless admission decided otherwise)
    bytes_restored: int = 0
    bytes_written: int = 0  # known once the write-back finished (see GenerateResult.write_back)
    recomputed_after_failed_restore: bool = False
    decision: Decision | None = None  # the admission controller's, when the engine has one
    write_back_dropped: bool = False  # the write-back queue was full (admission only)
    hedges: int = 0  # restore chunk reads also sent to another replica (the server was slow)
    hedges_won: int = 0


@dataclass
class GenerateResult:
    tokens: list[int]
    timings: Timings
    first_logits: torch.Tensor = field(repr=False)
    write_back: asyncio.Future | None = field(default=None, repr=False)  # None: nothing to write, or dropped


class Engine:
    """A DeepSeek-V2-style MLA model serving requests with a kvfs prefix cache.

    `client` is a kvfs.client.Client (use `agenerate` from async code) or a
    SyncClient (then `generate` works from plain code). Requests may run
    concurrently; their model compute shares one thread, a layer at a time, most
    urgent first (scheduler.py), while restores and write-backs proceed on the
    event loop.
    """

    def __init__(self, config: ModelConfig, client, namespace: Namespace, *, checkpoint=None, pool=None,
                 ttl_class: str = "chat", write_back: bool = True, admission: AdmissionController | None = None):
        from kvfs.client import BufferPool, SyncClient

        self.cfg = config
        self.namespace = namespace
        self._sync = client if isinstance(client, SyncClient) else None
        self.client = client._client if self._sync else client
        self.layout = config.block_layout(self.client.block_tokens)
        self.model = build_model(config, checkpoint)
        self.pool = pool if pool is not None else BufferPool()
        self.ttl_class = ttl_class
        self.write_back = write_back
        # decides, per request, how much of a cached prefix to restore (default: all of it),
        # and holds write-backs back while restores wait
        self.admission = admission
        self.writebacks: WriteBackQueue | None = None
        if admission is not None:
            if admission.server_latency is None:
                admission.server_latency = self.client.latency
            idle = asyncio.Event()
            admission.on_idle = idle.set
            self.writebacks = WriteBackQueue(lambda: admission.queued_bytes > 0, idle)
        # what a prefill costs, learned online: the compute queue's priorities and admission's estimates
        self.prefill_cost = admission.prefill if admission is not None else PrefillModel()
        self.compute = ComputeQueue()

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 16) -> GenerateResult:
        """Blocking form; needs the engine to have been given a SyncClient."""
        if self._sync is None:
            raise TypeError("Engine.generate needs a SyncClient; with an async Client, await agenerate()")
        return self._sync._run(self.agenerate(token_ids, max_new_tokens))

    async def agenerate(self, token_ids: Sequence[int], max_new_tokens: int = 16) -> GenerateResult:
        """Greedy generation of up to `max_new_tokens` after the prompt."""
        if not token_ids or max_new_tokens < 1:
            raise ValueError("needs a prompt and max_new_tokens >= 1")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        tokens = list(token_ids)
        n = len(tokens)
        timings = Timings()
        match = await self.client.lookup(self.namespace, tokens)
        timings.lookup = match.lookup_seconds
        timings.tokens_cached = match.tokens
        max_tokens = n + max_new_tokens
        buf = self.pool.get(self.layout.buffer_bytes(max_tokens))
        cache = KVCache(self.cfg, max_tokens, buf)
        restore = None
        blocks = match.matched
        if blocks and self.admission is not None:
            decision = self.admission.decide(blocks, n, self.layout.payload_bytes, now=t0)
            timings.decision = decision
            blocks = decision.restore_blocks
        if blocks:
            restore = self.client.read(match, cache.bytes(), blocks=blocks, buffer_tokens=max_tokens)
            if self.admission is not None:
                self.admission.restore_issued(blocks * self.layout.payload_bytes, time.perf_counter())
        # a fully cached prompt still runs its last token, for the logits
        start = min(blocks * self.layout.block_tokens, n - 1)
        p0 = time.perf_counter()
        if self.admission is not None:
            predicted = self.prefill_cost.seconds(start, n)
            request = object()  # this request's entry in the controller's compute backlog
            self.admission.compute_started(request, t0 + predicted, predicted)
        try:
            logits, computed, waited = await self._prefill(tokens, cache, start, restore, t0)
            if restore is not None:
                stats = await restore.wait()
                timings.bytes_restored, timings.restore = stats.bytes, stats.seconds
                timings.hedges, timings.hedges_won = stats.hedges, stats.hedges_won
                timings.tokens_matched = blocks * self.layout.block_tokens
                if self.admission is not None:
                    self.admission.restore_finished(stats.bytes, stats.seconds, blocks * self.layout.payload_bytes,
                                                    time.perf_counter())
        except KvfsError as err:
            log.warning("restore of %d blocks failed (%s); recomputing the prompt", match.matched, err.message)
            restore.cancel()
            if self.admission is not None:
                self.admission.restore_finished(0, 0.0, blocks * self.layout.payload_bytes, time.perf_counter())
            timings.recomputed_after_failed_restore = True
            # a fresh buffer: reads still in flight may land in the old one, which is not reused
            buf = self.pool.get(self.layout.buffer_bytes(max_tokens))
            cache = KVCache(self.cfg, max_tokens, buf)
            start = 0
            logits, computed, waited = await self._prefill(tokens, cache, 0, None, t0)
        finally:
            if self.admission is not None:
                self.admission.compute_finished(request)
        timings.prefill = time.perf_counter() - p0
        timings.restore_wait = waited
        timings.compute = computed
        self.prefill_cost.observe(start, n, computed)  # the compute alone, not the waits
        first_logits = logits[-1].clone()
        out = [int(first_logits.argmax())]
        timings.ttft = time.perf_counter() - t0
        d0 = time.perf_counter()
        for pos in range(n, n + max_new_tokens - 1):
            step, _ = await self.compute.run(t0, lambda p=pos: self.model(torch.tensor(out[-1:]), cache, p))
            out.append(int(step[-1].argmax()))
        timings.decode = time.perf_counter() - d0
        task = None
        full_blocks = n // self.layout.block_tokens
        first_new = 0 if timings.recomputed_after_failed_restore else blocks
        if self.write_back and full_blocks > first_new:
            job = lambda: self._write_back(tokens[: full_blocks * self.layout.block_tokens], cache, buf,  # noqa: E731
                                           first_new, max_tokens, timings)
            if self.writebacks is None:
                task = loop.create_task(job())
            else:
                task = self.writebacks.submit(self.namespace.tenant,
                                              (full_blocks - first_new) * self.layout.payload_bytes, job)
                timings.write_back_dropped = task is None
                if task is None:
                    self.pool.put(buf)
        else:
            self.pool.put(buf)
        return GenerateResult(out, timings, first_logits, task)

    async def _write_back(self, tokens, cache: KVCache, buf, first_block: int, max_tokens: int,
                          timings: Timings) -> None:
        try:
            res = await self.client.write(self.namespace, tokens, cache.bytes(), self.layout, self.ttl_class,
                                          first_block=first_block, buffer_tokens=max_tokens)
            timings.bytes_written = res.bytes_written
            if self.admission is not None:
                self.admission.write_finished(res.bytes_written, res.seconds)
        except KvfsError as err:  # the answer is out already; a cache miss later is the only cost
            log.warning("write-back of %d blocks failed: %s", len(tokens) // self.layout.block_tokens - first_block,
                        err.message)
        finally:
            self.pool.put(buf)

    async def _prefill(self, tokens: list[int], cache: KVCache, begin: int, restore, arrived: float):
        """Computes tokens[begin:] one layer job at a time on the compute queue; between
        jobs, waits (on the event loop) for the restore to deliver the next layer.
        Returns (logits, seconds of compute, seconds waited for restored layers)."""
        n, computed, waited, logits = len(tokens), 0.0, 0.0, None
        # in chunks, so attention's memory stays chunk x context, not context^2;
        # only the first chunk can meet a layer the restore has not delivered
        for s in range(begin, n, PREFILL_CHUNK):
            steps = self.model.steps(torch.tensor(tokens[s : s + PREFILL_CHUNK]), cache, s)
            deadline = arrived + self.prefill_cost.seconds(s, n)
            while True:
                (kind, value), seconds = await self.compute.run(deadline, functools.partial(next, steps))
                computed += seconds
                if kind == "logits":
                    logits = value
                    break
                if restore is not None and s == begin:
                    w0 = time.perf_counter()
                    await restore.layer_ready(value)
                    waited += time.perf_counter() - w0
        return logits, computed, waited

    def close(self) -> None:
        self.compute.close()
