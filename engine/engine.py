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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvfs.errors import KvfsError
from kvfs.keys import Namespace

from .admission import AdmissionController, Decision, ImmediateWriteBacks, NoAdmission, WriteBackQueue
from .cache import KVCache
from .compute_queue import ComputeQueue
from .config import ModelConfig
from .simulated import SimulatedCompute, SimulatedModel
from .weights import build_model

log = logging.getLogger(__name__)

PREFILL_CHUNK = 2048
# a compute job runs layers back to back for up to this long when none of them waits for a
# restore: one job (and one event-loop round trip) a layer made a simulated 61-layer prefill
# of 40 ms take over a second while restores kept the loop busy; the bound keeps the queue's
# most-urgent-first order within about this much of a layer's time
LAYER_SLICE_S = 0.02


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


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity, the admission controller's compute backlog key
class Request:
    """One request in flight: its prompt, the cache its KV lives in, and the plan for it."""

    tokens: list[int]
    max_tokens: int  # prompt + new tokens: the cache's length
    arrived: float  # perf_counter() at arrival; compute queue deadlines count from it
    timings: Timings = field(default_factory=Timings)
    match: object = None  # the lookup's result (kvfs.client PrefixMatch)
    buf: object = None  # the BufferPool buffer behind `cache`; back to the pool after the write-back
    cache: KVCache | None = None
    restore_blocks: int = 0  # leading matched blocks restored from kvfs
    start: int = 0  # first prompt token the prefill computes


class Engine:
    """A DeepSeek-V2-style MLA model serving requests with a kvfs prefix cache.

    `client` is a kvfs.client.Client (use `agenerate` from async code) or a
    SyncClient (then `generate` works from plain code). Requests may run
    concurrently; their model compute shares one thread in jobs of a layer or a few,
    most urgent first (compute_queue.py), while restores and write-backs proceed on
    the event loop.
    """

    def __init__(self, config: ModelConfig, client, namespace: Namespace, *, checkpoint=None, pool=None,
                 ttl_class: str = "chat", write_back: bool = True, admission: AdmissionController | None = None,
                 simulated: SimulatedCompute | None = None):
        """`simulated`: benchmarks only; the model's work is replaced by that compute
        model's time (simulated.py) and `config` should be its `shapes`."""
        from kvfs.client import BufferPool, SyncClient

        self.cfg = config
        self.namespace = namespace
        self._sync = client if isinstance(client, SyncClient) else None
        self.client = client._client if self._sync else client
        self.layout = config.block_layout(self.client.block_tokens)
        self.model = build_model(config, checkpoint) if simulated is None else SimulatedModel(simulated)
        self.pool = pool if pool is not None else BufferPool()
        self.ttl_class = ttl_class
        self.write_back = write_back
        # decides, per request, how much of a cached prefix to restore (without one: all of it),
        # and holds write-backs back while restores wait
        self.admission: AdmissionController | NoAdmission
        self.writebacks: WriteBackQueue | ImmediateWriteBacks
        if admission is None:
            self.admission, self.writebacks = NoAdmission(), ImmediateWriteBacks()
        else:
            if admission.server_latency is None:
                admission.server_latency = self.client.latency
            if admission.server_backlog is None:
                admission.server_backlog = self.client.backlog
            idle = asyncio.Event()
            admission.on_idle = idle.set
            self.admission = admission
            self.writebacks = WriteBackQueue(lambda: admission.queued_bytes > 0, idle)
        # what a prefill costs, learned online: the compute queue's priorities and admission's estimates
        self.prefill_cost = self.admission.prefill
        if admission is not None:
            self._calibrate()
        self.compute = ComputeQueue()

    def _calibrate(self, lengths: tuple[int, ...] = (64, 256)) -> None:
        """Times short prefills of this model, so that admission's first decisions
        rest on its speed rather than on a prior: a burst of requests is decided
        before any of its own prefills has finished (on a simulated GPU, 1,000x off
        the CPU-sized prior, every hit of a burst was restored while recomputing
        was faster)."""
        for n in lengths:
            cache = KVCache(self.cfg, n)
            t0 = time.perf_counter()
            for _ in self.model.steps(torch.zeros(n, dtype=torch.long), cache, 0):
                pass
            self.prefill_cost.observe(0, n, time.perf_counter() - t0)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 16) -> GenerateResult:
        """Blocking form; needs the engine to have been given a SyncClient."""
        if self._sync is None:
            raise TypeError("Engine.generate needs a SyncClient; with an async Client, await agenerate()")
        return self._sync._run(self.agenerate(token_ids, max_new_tokens))

    async def agenerate(self, token_ids: Sequence[int], max_new_tokens: int = 16) -> GenerateResult:
        """Greedy generation of up to `max_new_tokens` after the prompt."""
        if not token_ids or max_new_tokens < 1:
            raise ValueError("needs a prompt and max_new_tokens >= 1")
        req = Request(list(token_ids), len(token_ids) + max_new_tokens, time.perf_counter())
        await self._plan(req)
        first_logits = (await self._prefill_with_restore(req))[-1].clone()
        out = [int(first_logits.argmax())]
        req.timings.ttft = time.perf_counter() - req.arrived
        await self._decode(req, out, max_new_tokens - 1)
        return GenerateResult(out, req.timings, first_logits, self._schedule_write_back(req))

    async def _plan(self, req: Request) -> None:
        """Looks the prompt up in kvfs, gives the request its cache, and decides how many
        of the matched blocks to restore (and so where the prefill starts)."""
        req.match = match = await self.client.lookup(self.namespace, req.tokens)
        req.timings.lookup, req.timings.tokens_cached = match.lookup_seconds, match.tokens
        self._new_cache(req)
        req.restore_blocks = match.matched
        if match.matched:
            decision = self.admission.decide(match.matched, len(req.tokens), self.layout.payload_bytes,
                                             now=req.arrived)
            req.timings.decision = decision
            if decision is not None:  # None: no admission control, restore every matched block
                req.restore_blocks = decision.restore_blocks
        # a fully cached prompt still runs its last token, for the logits
        req.start = min(req.restore_blocks * self.layout.block_tokens, len(req.tokens) - 1)

    def _new_cache(self, req: Request) -> None:
        req.buf = self.pool.get(self.layout.buffer_bytes(req.max_tokens))
        req.cache = KVCache(self.cfg, req.max_tokens, req.buf)

    async def _prefill_with_restore(self, req: Request) -> torch.Tensor:
        """Restores the planned blocks into the cache while prefilling from `req.start`,
        each layer waiting for its restored part; if the restore fails, recomputes the
        whole prompt. Returns the prefill's logits."""
        n, timings = len(req.tokens), req.timings
        restore_bytes = req.restore_blocks * self.layout.payload_bytes
        restore = restored = None
        if req.restore_blocks:
            restore = self.client.read(req.match, req.cache.bytes(), blocks=req.restore_blocks,
                                       buffer_tokens=req.max_tokens)
            self.admission.restore_issued(restore_bytes, time.perf_counter())
            # the controller hears of the restore's end when it ends, not once the prefill beside it
            # has (a partial restore's compute outlasts it): its queue and bandwidth are the read path's
            restored = asyncio.ensure_future(restore.wait())
            restored.add_done_callback(lambda done: self._restore_ended(done, restore_bytes))
        p0 = time.perf_counter()
        predicted = self.prefill_cost.seconds(req.start, n)
        self.admission.compute_started(req, req.arrived + predicted, predicted)
        try:
            logits, computed, waited = await self._prefill(req.tokens, req.cache, req.start, restore, req.arrived)
            if restored is not None:
                stats = await restored
                timings.bytes_restored, timings.restore = stats.bytes, stats.seconds
                timings.hedges, timings.hedges_won = stats.hedges, stats.hedges_won
                timings.tokens_matched = req.restore_blocks * self.layout.block_tokens
        except KvfsError as err:
            log.warning("restore of %d blocks failed (%s); recomputing the prompt", req.match.matched, err.message)
            restore.cancel()
            logits, computed, waited = await self._recompute(req)
        finally:
            self.admission.compute_finished(req)
        timings.prefill = time.perf_counter() - p0
        timings.restore_wait = waited
        timings.compute = computed
        self.prefill_cost.observe(req.start, n, computed)  # the compute alone, not the waits
        return logits

    def _restore_ended(self, done: asyncio.Future, issued: int) -> None:
        if done.cancelled() or done.exception() is not None:
            self.admission.restore_finished(0, 0.0, issued, time.perf_counter())
        else:
            stats = done.result()
            self.admission.restore_finished(stats.bytes, stats.seconds, issued, stats.finished_at,
                                            stats.first_layer)

    async def _recompute(self, req: Request) -> tuple[torch.Tensor, float, float]:
        req.timings.recomputed_after_failed_restore = True
        # a fresh buffer: reads still in flight may land in the old one, which is not reused
        self._new_cache(req)
        req.start = 0
        return await self._prefill(req.tokens, req.cache, 0, None, req.arrived)

    async def _decode(self, req: Request, out: list[int], steps: int) -> None:
        """Appends `steps` greedy tokens to `out`, whose last token is the next input."""
        d0, n = time.perf_counter(), len(req.tokens)
        for pos in range(n, n + steps):
            step, _ = await self.compute.run(req.arrived,
                                             lambda p=pos: self.model(torch.tensor(out[-1:]), req.cache, p))
            out.append(int(step[-1].argmax()))
        req.timings.decode = time.perf_counter() - d0

    def _schedule_write_back(self, req: Request) -> asyncio.Future | None:
        """Writes the prompt's full blocks that kvfs lacks, in the background; the cache's
        buffer goes back to the pool when that is done (at once if nothing is written)."""
        full_blocks = len(req.tokens) // self.layout.block_tokens
        # kvfs holds every matched block, restored or not (a partial restore recomputes some it has)
        first_new = 0 if req.timings.recomputed_after_failed_restore else req.match.matched
        task = None
        if self.write_back and full_blocks > first_new:
            job = functools.partial(self._write_back, req, first_new, full_blocks)
            task = self.writebacks.submit(self.namespace.tenant,
                                          (full_blocks - first_new) * self.layout.payload_bytes, job)
            req.timings.write_back_dropped = task is None
        if task is None:
            self.pool.put(req.buf)
        return task

    async def _write_back(self, req: Request, first_block: int, end_block: int) -> None:
        try:
            res = await self.client.write(self.namespace, req.tokens[: end_block * self.layout.block_tokens],
                                          req.cache.bytes(), self.layout, self.ttl_class,
                                          first_block=first_block, buffer_tokens=req.max_tokens)
            req.timings.bytes_written = res.bytes_written
            self.admission.write_finished(res.bytes_written, res.seconds)
        except KvfsError as err:  # the answer is out already; a cache miss later is the only cost
            log.warning("write-back of %d blocks failed: %s", end_block - first_block, err.message)
        finally:
            self.pool.put(req.buf)

    async def _prefill(self, tokens: list[int], cache: KVCache, begin: int, restore, arrived: float):
        """Computes tokens[begin:] in jobs on the compute queue, each running layers for
        up to LAYER_SLICE_S: while a restore delivers the first chunk's layers, only as
        far as they are in (the job stops before a layer not yet restored, and the next
        waits, on the event loop, until it is). A job a layer would wait for the job
        running when it is queued: a hit's 61 behind other requests' 20 ms slices took
        up to a second more than its restore.
        Returns (logits, seconds of compute, seconds waited for restored layers)."""
        n, computed, waited, logits = len(tokens), 0.0, 0.0, None
        # in chunks, so attention's memory stays chunk x context, not context^2;
        # only the first chunk can meet a layer the restore has not delivered
        for s in range(begin, n, PREFILL_CHUNK):
            steps = self.model.steps(torch.tensor(tokens[s : s + PREFILL_CHUNK]), cache, s)
            deadline = arrived + self.prefill_cost.seconds(s, n)
            ready = restore.ready if restore is not None and s == begin else None
            job = functools.partial(_layers_for, steps, LAYER_SLICE_S, ready)
            while True:
                (kind, value), seconds = await self.compute.run(deadline, job)
                computed += seconds
                if kind == "logits":
                    logits = value
                    break
                if ready is not None and not ready(value):
                    w0 = time.perf_counter()
                    await restore.layer_ready(value)
                    waited += time.perf_counter() - w0
        return logits, computed, waited

    def close(self) -> None:
        self.compute.close()


def _layers_for(steps, seconds: float, ready: Callable[[int], bool] | None = None) -> tuple:
    """Runs a model's steps (MLAModel.steps) until the logits, for `seconds`, or (with
    `ready`) up to a layer whose restored part is not in yet, on the compute thread; the
    last step taken (the layer to compute next, or the logits)."""
    t0 = time.perf_counter()
    while True:
        step = next(steps)
        if step[0] == "logits" or time.perf_counter() - t0 >= seconds or (ready is not None and not ready(step[1])):
            return step
