"""The restore path: every chunk of a matched prefix, read in parallel from all
chunkservers straight into the caller's buffer, delivered layer by layer.

Chunks are cut at layer boundaries (kvfs/layout.py), so a chunk holds whole
layers of one block. Reads are ordered by first layer, then block, so layer 0
of every block is requested first; each server gets up to `per_server` batched
ReadChunks calls in flight, each of up to `batch` chunks. Layer l is ready when
every chunk holding layers <= l has landed, so readiness arrives in order. A
chunk whose server fails, or that comes back NOT_FOUND or DATA_LOSS, is read
again from another replica; only when every replica failed does the restore fail.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvfs.buffers import address_of, byte_view
from kvfs.errors import Aborted, DataLoss, Internal, InvalidArgument, KvfsError, NotFound, Unavailable
from kvfs.layout import BlockLayout

from .hedge import Fence, HedgeBudget, ServerLatency
from .pool import arena_of
from .transport import ReadSpec, ServerInfo

log = logging.getLogger(__name__)

RESCUE_AFTER = 8  # p95s a batch may wait before its server is given up on for this restore
RESCUE_MIN = 0.5  # seconds: and never sooner than this


@dataclass(slots=True)
class _Item:
    block: int
    spec: ReadSpec
    layers: list[int]
    replicas: list[ServerInfo]  # in preference order
    tried: set[str] = field(default_factory=set)  # addresses that failed it
    last_error: KvfsError | None = None
    all_data_loss: bool = True  # every replica tried failed for its bytes: corrupt, not the committed chunk, gone
    reading: int = 0  # reads of it in flight (2 while hedged)
    done: bool = False

    @property
    def read_length(self) -> int:
        return self.spec.length


@dataclass(slots=True)
class RestoreStats:
    bytes: int = 0
    chunks: int = 0
    retries: int = 0
    hedges: int = 0  # chunks also requested from another replica because their server was slow
    hedges_won: int = 0  # of those, chunks the hedge delivered first
    seconds: float = 0.0
    finished_at: float = 0.0  # time.perf_counter() when the last byte was in
    first_layer: float = 0.0  # seconds from the start until the first layer was whole in the buffer
    per_server: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class Restore:
    """A restore in progress. `await r.layer_ready(l)` returns once layers 0..l
    are in the buffer; `async for l in r` yields layers in order; `await r.wait()`
    returns RestoreStats once everything is in, or raises why it could not be.

    With `hedging` (a client's ServerLatency and HedgeBudget), a batch still out
    after its server's p95 is also requested from other replicas (see hedge.py).
    Not when the destination lies in a shared arena: there the chunkserver writes
    it itself, and such a write can't be fenced off.

    `on_done(stats, failed)` hears once when it ends (the client's metrics)."""

    def __init__(self, transport_for, match, out, layers: Iterable[int] | None, blocks: int | None,
                 buffer_tokens: int | None, per_server: int, batch: int,
                 hedging: tuple[ServerLatency, HedgeBudget] | None = None,
                 on_done: Callable[[RestoreStats, bool], None] | None = None):
        self._on_done = on_done
        self.layout: BlockLayout = match.layout
        self.blocks = match.matched if blocks is None else min(blocks, match.matched)
        layout = self.layout
        self.layers = sorted(set(range(layout.layers) if layers is None else layers))
        if any(not 0 <= l < layout.layers for l in self.layers):
            raise InvalidArgument(f"layers must be within 0..{layout.layers - 1}")
        tokens = buffer_tokens or self.blocks * layout.block_tokens
        self._out = byte_view(out)
        if len(self._out) < layout.buffer_bytes(tokens):
            raise InvalidArgument(f"destination holds {len(self._out)} bytes; {self.blocks} blocks of "
                                  f"{tokens} tokens need {layout.buffer_bytes(tokens)}")
        if hedging is not None and arena_of(address_of(self._out), len(self._out)) is not None:
            hedging = None
        self._hedging = hedging
        self._transport_for = transport_for
        self._per_server = per_server
        self._batch = batch
        self.stats = RestoreStats()
        wanted = set(self.layers)
        self._remaining = collections.Counter()
        self._events = {l: asyncio.Event() for l in self.layers}
        self._error: KvfsError | None = None
        self._queues: dict[str, collections.deque[_Item]] = collections.defaultdict(collections.deque)
        self._load: dict[str, int] = collections.defaultdict(int)
        self._workers: dict[str, int] = collections.defaultdict(int)
        self._tasks: set[asyncio.Task] = set()
        self.reads_in_flight = 0  # batch reads not yet answered (a hedge's loser may outlive the restore)
        self._aborted: set[str] = set()  # servers whose stalled reads this restore gave up on
        self._done = asyncio.Event()
        self._started = time.perf_counter()
        items = []
        layer_bytes = layout.layer_bytes
        for b, block in enumerate(match.blocks[: self.blocks]):
            for c in block.chunks:
                span = layout.span_of(c.offset, c.length)
                need = [l for l in range(span.first_layer, span.last_layer + 1) if l in wanted]
                if not need:
                    continue
                lo = max(span.offset, need[0] * layer_bytes)
                hi = min(span.offset + span.length, (need[-1] + 1) * layer_bytes)
                sub = layout.span_of(lo, hi - lo)
                holders = match.holders(c)
                spec = ReadSpec(c.chunk_id, lo - span.offset, hi - lo, c.length, c.checksum,
                                layout.scatter(sub, b, tokens),
                                Fence() if hedging is not None and len(holders) > 1 else None, match.read_grant)
                items.append(_Item(b, spec, need, holders))
                self._remaining.update(need)
        items.sort(key=lambda it: (it.layers[0], it.block))
        self._left = len(items)  # items not yet in the buffer
        self._ready_upto = 0  # index into self.layers of the first layer not yet ready
        self._advance()
        for it in items:
            self._enqueue(it)
        if not items:
            self._finish()

    # ---- scheduling ------------------------------------------------------

    def _enqueue(self, item: _Item, avoid: str = "") -> None:
        choices = [s for s in item.replicas if s.address not in item.tried]
        choices = [s for s in choices if s.address != avoid] or choices
        if not choices:
            # corrupt, not the committed chunk, or gone on every replica: say so (DATA_LOSS); else unavailable
            kind = DataLoss if item.all_data_loss and item.last_error is not None else Unavailable
            self._fail(kind(f"chunk {item.spec.chunk_id.hex()[:16]} of block {item.block}: every replica failed "
                            f"({', '.join(sorted(item.tried))}); the last: {item.last_error}"))
            return
        server = min(choices, key=lambda s: (self._load[s.address], item.replicas.index(s)))
        self._load[server.address] += item.read_length
        self._queues[server.address].append(item)
        if self._workers[server.address] < self._per_server:
            self._workers[server.address] += 1
            self._spawn(self._worker(server))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _worker(self, server: ServerInfo) -> None:
        queue = self._queues[server.address]
        try:
            while queue and self._error is None:
                batch = [queue.popleft() for _ in range(min(self._batch, len(queue)))]
                for it in batch:
                    it.reading += 1
                await self._read_batch(server, batch)
        finally:
            self._workers[server.address] -= 1

    async def _read_batch(self, server: ServerInfo, batch: list[_Item], hedge: bool = False) -> None:
        transport = self._transport_for(server)
        timer = None
        if self._hedging is not None and not hedge:
            latency, budget = self._hedging
            budget.issued()
            p95 = latency.p95(server.address)
            if p95 is not None:
                timer = asyncio.get_running_loop().call_later(p95, self._hedge, server, batch)
        t0 = time.perf_counter()
        self.reads_in_flight += 1
        try:
            errors = await transport.read(server, [it.spec for it in batch], self._out)
        except Exception as exc:  # a bug must fail the restore, not leave it waiting for ever
            log.exception("restore: %s transport failed on %s", transport.name, server.address)
            self._fail(Internal(f"{transport.name} transport failed on {server.address}: {exc!r}"))
            return
        finally:
            self.reads_in_flight -= 1
            if timer is not None:
                timer.cancel()
        if self._hedging is not None:
            self._hedging[0].observe(server.address, time.perf_counter() - t0)
        failed = [e for it, e in zip(batch, errors) if e is not None and not isinstance(e, Aborted) and not it.done]
        if failed:
            log.warning("restore: %d of %d chunks from %s failed (%s); trying other replicas",
                        len(failed), len(batch), server.address, failed[0].message)
        for it, err in zip(batch, errors):
            it.reading -= 1
            self._load[server.address] -= it.read_length
            if it.done:
                continue  # the other reader of a hedged chunk delivered it
            if err is None:
                it.done = True
                self._left -= 1
                self.stats.bytes += it.read_length
                self.stats.chunks += 1
                self.stats.per_server[server.address] += it.read_length
                if hedge:
                    self.stats.hedges_won += 1
                    self._hedging[1].won += 1
                self._remaining.subtract(it.layers)
                self._advance()
                continue
            if not isinstance(err, Aborted):  # Aborted: its bytes lost a race, the server is fine
                it.tried.add(server.address)
                it.last_error = err
                # a copy the metaserver listed but its server no longer has (a corrupt one it
                # removed) is lost data too; a server that did not answer may yet come back
                it.all_data_loss = it.all_data_loss and isinstance(err, (DataLoss, NotFound))
            if it.reading == 0:  # no other read of it is still coming
                self.stats.retries += 1
                self._enqueue(it)
        if self._left == 0 and self._error is None and self._ready_upto == len(self.layers):
            self._finish()

    def _hedge(self, server: ServerInfo, batch: list[_Item], waited: int = 1) -> None:
        """`batch` has been out on `server` for `waited` x its p95: ask other replicas.

        Within the budget this trims the tail; the batch is looked at again every
        p95. Once it has waited RESCUE_AFTER p95s (and at least RESCUE_MIN seconds)
        the server is failing (cut off, stopped), not slow: this restore gives up on
        its reads in flight there (the transport drops its connections to it, which
        also releases ranges those reads had begun to receive), and they are read
        from other replicas instead of waiting for the transport's stall timeout."""
        if self._error is not None or self._done.is_set() or all(it.done for it in batch):
            return
        latency, budget = self._hedging
        if waited >= RESCUE_AFTER:
            if server.address not in self._aborted:
                self._aborted.add(server.address)
                budget.rescues += 1
                self._transport_for(server).abort(server)
        else:
            step = max(latency.p95(server.address) or 0.0, RESCUE_MIN / RESCUE_AFTER)
            asyncio.get_running_loop().call_later(step, self._hedge, server, batch, waited + 1)
        by_server: dict[str, tuple[ServerInfo, list[_Item]]] = {}
        for it in batch:
            if it.done or it.reading > 1 or it.spec.fence is None:
                continue
            others = [s for s in it.replicas if s.address != server.address and s.address not in it.tried]
            if others:
                other = min(others, key=lambda s: (self._load[s.address], it.replicas.index(s)))
                by_server.setdefault(other.address, (other, []))[1].append(it)
        if not by_server:
            return
        # what still waits in the slow server's queue goes to other replicas instead
        queue, kept = self._queues[server.address], collections.deque()
        while queue:
            it = queue.popleft()
            if any(s.address != server.address and s.address not in it.tried for s in it.replicas):
                self._load[server.address] -= it.read_length
                self._enqueue(it, avoid=server.address)
            else:
                kept.append(it)
        queue.extend(kept)
        for other, items in by_server.values():
            if waited < RESCUE_AFTER and not budget.take():
                return  # over budget: looked at again in a p95
            for it in items:
                it.reading += 1
                self._load[other.address] += it.read_length
            self.stats.hedges += len(items)
            budget.hedged_chunks += len(items)
            self._spawn(self._read_batch(other, items, hedge=True))

    def _advance(self) -> None:
        was = self._ready_upto
        while self._ready_upto < len(self.layers) and self._remaining[self.layers[self._ready_upto]] <= 0:
            self._events[self.layers[self._ready_upto]].set()
            self._ready_upto += 1
        if not was and self._ready_upto:
            self.stats.first_layer = time.perf_counter() - self._started

    def _finish(self) -> None:
        if self._done.is_set():  # e.g. the late loser of a hedge
            return
        self.stats.finished_at = time.perf_counter()
        self.stats.seconds = self.stats.finished_at - self._started
        self._done.set()
        if self._on_done is not None:
            self._on_done(self.stats, self._error is not None)

    def _fail(self, err: KvfsError) -> None:
        if self._error is None:
            self._error = err
            log.warning("restore failed: %s", err.message)
            for ev in self._events.values():
                ev.set()
            self._finish()

    # ---- what callers use ------------------------------------------------

    async def layer_ready(self, layer: int) -> None:
        """Returns once layers 0..layer (of those requested) are in the buffer."""
        if layer not in self._events:
            raise InvalidArgument(f"layer {layer} is not part of this restore")
        await self._events[layer].wait()
        if self._error is not None and self.layers.index(layer) >= self._ready_upto:
            raise self._error

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for layer in self.layers:
            await self.layer_ready(layer)
            yield layer

    async def wait(self) -> RestoreStats:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self.stats

    def done(self) -> bool:
        return self._done.is_set()

    def ready(self, layer: int) -> bool:
        """Whether layers 0..layer (of those requested) are in the buffer; never, past a
        failure. Safe from any thread: the engine's compute thread asks it between layers."""
        upto = self._ready_upto
        return upto > 0 and self.layers[upto - 1] >= layer

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        self._fail(Unavailable("restore cancelled"))

