"""Admission: should a request restore its cached prefix, part of it, or recompute?

Pure decisions over online estimates (no I/O here, so a trace can be replayed
through it offline). The engine tells the controller what it observes:

  - every finished restore (bytes, seconds)          -> read bandwidth
  - every finished write-back (bytes, seconds)       -> write bandwidth
  - restore bytes issued and completed               -> bytes queued ahead
  - every prefill (context before, tokens, seconds)  -> prefill cost model
  - per-chunkserver read latency (the SDK's ServerLatency, which hedged reads use)
  - per-chunkserver read backlog, from every client (the SDK's ServerBacklog: each
    data-port reply says what the server had queued ahead of it)
  - prefills admitted and not yet finished          -> compute queued ahead

and asks `decide()` for each request with a cached prefix. Restoring k blocks
costs (bytes queued ahead + k blocks) / read bandwidth, where the bytes ahead are
this engine's restores in flight or, when more, the servers' backlogs (other
workers' reads are in those), and overlaps the prefill of the rest layer by
layer, from the moment the first layer is whole: the expected time to first
token of restoring k blocks is about max(restore(k), lag x restore(k) +
prefill(k..n)), lag the measured share of a restore's time before its first
layer is whole, and of recomputing all of it prefill(0..n). The controller picks
the k with the smallest estimate (policy `adaptive`), or always k = all
(`always-restore`) or k = 0 (`always-recompute`), and returns the estimates
behind the choice.

An engine without admission control gets `NoAdmission` and `ImmediateWriteBacks`
instead: the same calls, restoring every matched block and starting every
write-back at once.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from dataclasses import dataclass, field

POLICIES = ("adaptive", "always-restore", "always-recompute")
MOST_BUSY = 0.9  # the accelerator's share in use that a recompute's charge assumes at most (AdmissionController.decide)


class Ewma:
    """An exponentially weighted mean, `None` until the first sample."""

    def __init__(self, alpha: float = 0.2, initial: float | None = None):
        self.alpha = alpha
        self.value = initial

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class Throughput:
    """Bytes a second over the recent past: decayed sums of bytes and of the seconds
    they took, the older halved every `half_life` seconds of samples. A sample weighs
    by the time it covers: a mean of per-sample rates (an EWMA of them) is pulled up by
    the short gaps between restores that end close together (three ending 10 ms apart
    after one that took 300 ms read as fast as 10 ms a restore). Starts as if it had
    seen `initial` for a tenth of a second."""

    def __init__(self, initial: float, half_life: float = 2.0):
        self.half_life = half_life
        self.bytes, self.seconds = initial * 0.1, 0.1

    def add(self, nbytes: float, seconds: float) -> None:
        keep = 0.5 ** (seconds / self.half_life)
        self.bytes = self.bytes * keep + nbytes
        self.seconds = self.seconds * keep + seconds

    @property
    def value(self) -> float:
        return self.bytes / self.seconds


class PrefillModel:
    """Seconds to prefill tokens p..n, as a*(n - p) + b*(n^2 - p^2): a linear part
    (projections, MLP) and a quadratic one (attention over the context). Fitted by
    least squares over the most recent observations."""

    def __init__(self, window: int = 64, a: float = 1e-3, b: float = 0.0):
        self._obs: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=window)
        self.a, self.b = a, b

    def observe(self, start: int, end: int, seconds: float) -> None:
        if end <= start or seconds <= 0:
            return
        self._obs.append((end - start, end * end - start * start, seconds))
        self._fit()

    def _fit(self) -> None:
        # normal equations for seconds ~ a*x + b*y, with a, b >= 0
        sxx = sum(x * x for x, _, _ in self._obs)
        syy = sum(y * y for _, y, _ in self._obs)
        sxy = sum(x * y for x, y, _ in self._obs)
        sxt = sum(x * t for x, _, t in self._obs)
        syt = sum(y * t for _, y, t in self._obs)
        det = sxx * syy - sxy * sxy
        if len(self._obs) >= 2 and det > 1e-12 * sxx * syy:
            a = (sxt * syy - syt * sxy) / det
            b = (syt * sxx - sxt * sxy) / det
            if a >= 0 and b >= 0:
                self.a, self.b = a, b
                return
        # too few or collinear observations (or a negative term): the linear fit alone
        self.a, self.b = (sxt / sxx if sxx else self.a), 0.0

    def seconds(self, start: int, end: int) -> float:
        if end <= start:
            return 0.0
        return self.a * (end - start) + self.b * (end * end - start * start)


@dataclass
class Decision:
    """What to do with one request, and why."""

    policy: str
    kind: str  # "restore" (all matched blocks), "partial" (a leading part), "recompute"
    restore_blocks: int
    matched_blocks: int
    est_ttft: float  # of the chosen option
    est_restore_all: float
    est_recompute_all: float
    read_gbps: float
    queued_bytes: int
    slowest_p95_s: float = 0.0  # the slowest chunkserver's measured batch-read p95 (what hedges wait for)


@dataclass
class AdmissionController:
    policy: str = "adaptive"
    block_tokens: int = 64
    read_bandwidth: Throughput = field(default_factory=lambda: Throughput(initial=1e9))  # bytes/s
    write_bandwidth: Ewma = field(default_factory=lambda: Ewma(initial=2e8))
    prefill: PrefillModel = field(default_factory=PrefillModel)
    queued_bytes: int = 0
    margin: float = 0.1  # restore less than all only if that is expected to be this much faster
    decisions: collections.Counter = field(default_factory=collections.Counter)
    on_idle: object = None  # called when the read queue empties (write-backs wait for that)
    server_latency: object = None  # per-chunkserver read latency (kvfs.client.hedge.ServerLatency)
    server_backlog: object = None  # per-chunkserver read backlog (kvfs.client.hedge.ServerBacklog)
    # prefills admitted and not finished: request -> (its compute queue deadline, predicted seconds)
    compute_ahead: dict = field(default_factory=dict)
    # the share of a restore's time before its first layer is whole: the prefill of the rest
    # (which needs each layer restored before it computes it) starts no earlier. Near 0 when
    # layers arrive in order; near 1 when concurrent reads share a slow link and all end together
    layer_lag: Ewma = field(default_factory=lambda: Ewma(initial=0.5))
    # prefills admitted a second (every request computes, a hit at least its last token)
    prefill_rate: Throughput = field(default_factory=lambda: Throughput(initial=0.0))
    # their predicted compute, on average: with the rate, the share of the accelerator they keep busy
    prefill_seconds: Ewma = field(default_factory=lambda: Ewma(alpha=0.1, initial=0.0))
    _last_prefill: float | None = None  # when the last one was admitted
    _busy_since: float | None = None  # when the read queue last went from empty to busy
    _last_done: float | None = None  # when the last restore finished

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")

    # ---- what the engine observes -------------------------------------------

    def restore_issued(self, nbytes: int, now: float | None = None) -> None:
        if self.queued_bytes == 0:
            self._busy_since = now
        self.queued_bytes += nbytes

    def restore_finished(self, nbytes: int, seconds: float, issued: int | None = None,
                         now: float | None = None, first_layer: float | None = None) -> None:
        """A restore ended: `nbytes` moved in `seconds`; `issued` is what it had queued;
        its first layer was whole after `first_layer` seconds (layer_lag).

        With `now`, the sample is the read path's throughput: these bytes over the
        time since the previous restore finished (or the path became busy). Under
        concurrency a single restore's own rate is its share, not what the path
        delivers, and would make the queue look slower to drain than it is."""
        self.queued_bytes = max(0, self.queued_bytes - (nbytes if issued is None else issued))
        if first_layer is not None and seconds > 0:
            self.layer_lag.add(min(1.0, first_layer / seconds))
        if nbytes and seconds > 0:
            since = None if now is None else max(self._last_done or now - seconds, self._busy_since or now - seconds)
            self.read_bandwidth.add(nbytes, now - since if since is not None and now > since else seconds)
        if now is not None:
            self._last_done = now
        if self.queued_bytes == 0 and self.on_idle is not None:
            self.on_idle()

    def write_finished(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.write_bandwidth.add(nbytes / seconds)

    def prefill_done(self, start: int, end: int, seconds: float) -> None:
        self.prefill.observe(start, end, seconds)

    def compute_started(self, request: object, deadline: float, seconds: float) -> None:
        self.compute_ahead[request] = (deadline, seconds)
        self.prefill_seconds.add(seconds)
        arrived = deadline - seconds
        if self._last_prefill is not None and arrived > self._last_prefill:
            self.prefill_rate.add(1, arrived - self._last_prefill)
        self._last_prefill = arrived if self._last_prefill is None else max(self._last_prefill, arrived)

    def compute_finished(self, request: object) -> None:
        self.compute_ahead.pop(request, None)

    def compute_wait(self, deadline: float) -> float:
        """Predicted compute the queue runs before a job due at `deadline` (compute_queue.py's order)."""
        return sum(seconds for due, seconds in self.compute_ahead.values() if due <= deadline)

    def compute_behind(self, deadline: float) -> int:
        """Prefills admitted and not finished that a job due at `deadline` runs before."""
        return sum(1 for due, _ in self.compute_ahead.values() if due > deadline)

    # ---- the decision -----------------------------------------------------------

    def bytes_ahead(self) -> int:
        """Restore bytes ahead of a new one: this engine's in flight, or the servers' backlogs
        if they say more (they count every worker's reads, ours among them)."""
        backlog = self.server_backlog.total() if self.server_backlog is not None else 0
        return max(self.queued_bytes, backlog)

    def restore_seconds(self, nbytes: int, ahead: int | None = None) -> float:
        """Seconds to restore `nbytes` behind `ahead` bytes (default: bytes_ahead())."""
        return ((self.bytes_ahead() if ahead is None else ahead) + nbytes) / self.read_bandwidth.value

    def decide(self, matched_blocks: int, prompt_tokens: int, bytes_per_block: int,
               now: float | None = None) -> Decision:
        """Restore how many of the `matched_blocks` leading blocks of a prompt?

        With `now` (the request's arrival on the compute queue's clock), the compute
        already queued ahead of each option counts too: recomputing more means a
        later deadline, so more of the queue runs first. And an option is charged the
        wait its compute adds to other prefills: its own compute for each queued
        behind it (due later), and for those expected to arrive before the accelerator
        is free again (the admission rate times the compute queued ahead of it and half
        of its own, over 1 - the accelerator's share in use). A recompute takes the one
        accelerator every miss needs: at 5 requests/s over 1 Gbit/s links the hits
        adaptive recomputed or partly restored for a small gain of their own put misses'
        p99 from 1.7 to 2.3 s. Charged only for the arrivals during its own run, at 6
        requests/s with a 10x faster accelerator adaptive still recomputed enough hits
        to double misses' p50 (0.66 to 1.48 s) and lose to always-restore (p99 4.23
        against 2.23 s; docs/operations.md)."""
        bt = self.block_tokens
        ahead = self.bytes_ahead()  # once: the servers' reports are summed for it

        @functools.cache  # ttft() and cost() both ask, and the queue ahead is summed for each
        def compute_of(k: int) -> tuple[float, float]:
            """(this option's own prefill, the compute queued ahead of it)."""
            # a request still computes its last token: a full hit prefills from n - 1
            own = self.prefill.seconds(min(k * bt, prompt_tokens - 1), prompt_tokens)
            return own, self.compute_wait(now + own) if now is not None else 0.0

        def ttft(k: int) -> float:
            own, queued = compute_of(k)
            if not k:
                return own + queued
            restore = self.restore_seconds(k * bytes_per_block, ahead)
            return max(restore, self.layer_lag.value * restore + own + queued)

        arriving = self.prefill_rate.value
        busy = min(MOST_BUSY, arriving * self.prefill_seconds.value)  # the accelerator's share in use

        def cost(k: int) -> tuple[float, int]:
            own, queued = compute_of(k)
            behind = self.compute_behind(now + own) if now is not None else 0
            # the prefills expected to arrive before the accelerator is free again: those during the work
            # queued ahead of this one (each waits `own` longer), those during its own run (half of it on
            # average), and those the busy period they make goes on to gather, 1 / (1 - busy) times as
            # many at that load (the length of a single-server queue's busy period)
            return ttft(k) + own * (behind + arriving * (queued + own / 2) / (1 - busy)), -k

        restore_all, recompute_all = ttft(matched_blocks), ttft(0)
        if self.policy == "always-restore":
            k = matched_blocks
        elif self.policy == "always-recompute":
            k = 0
        else:
            # the cost is the max of a rising line and a falling curve, plus a rising one:
            # try every k at a coarse step, then refine around the best
            step = max(1, matched_blocks // 64)
            best = min(range(0, matched_blocks + 1, step), key=cost)
            lo, hi = max(0, best - step), min(matched_blocks, best + step)
            k = min(range(lo, hi + 1), key=cost)
            # estimates are noisy: read less than everything only for a clear gain
            if cost(k)[0] > cost(matched_blocks)[0] * (1 - self.margin):
                k = matched_blocks
        kind = "recompute" if k == 0 else "restore" if k == matched_blocks else "partial"
        self.decisions[kind] += 1
        return Decision(self.policy, kind, k, matched_blocks, ttft(k), restore_all, recompute_all,
                        self.read_bandwidth.value / 1e9, ahead, self.slowest_p95())

    def slowest_p95(self) -> float:
        if self.server_latency is None:
            return 0.0
        return max((v["p95_s"] or 0.0 for v in self.server_latency.snapshot().values()), default=0.0)


class NoAdmission:
    """No admission control: every matched block is restored and no decision is
    recorded. It keeps only the prefill cost model, which the compute queue's
    deadlines need with or without admission."""

    def __init__(self):
        self.prefill = PrefillModel()

    def decide(self, matched_blocks: int, prompt_tokens: int, bytes_per_block: int,
               now: float | None = None) -> None:
        return None  # no decision: the engine restores all `matched_blocks`

    def restore_issued(self, nbytes: int, now: float | None = None) -> None:
        pass

    def restore_finished(self, nbytes: int, seconds: float, issued: int | None = None,
                         now: float | None = None, first_layer: float | None = None) -> None:
        pass

    def write_finished(self, nbytes: int, seconds: float) -> None:
        pass

    def compute_started(self, request: object, deadline: float, seconds: float) -> None:
        pass

    def compute_finished(self, request: object) -> None:
        pass


class ImmediateWriteBacks:
    """WriteBackQueue's `submit` without the queue: each write-back starts at once on
    the running loop, none waits for restores and none is dropped."""

    def submit(self, tenant: str, nbytes: int, job) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(job())


class WriteBackQueue:
    """Write-backs wait behind restores: run one at a time, only while no restore is
    queued, dropped (and counted) past `max_bytes` queued, or past a tenant's cap.

    `busy()` says whether restores are waiting; `idle` is an asyncio.Event the
    engine sets whenever the read queue empties, so deferred write-backs wake
    without polling.
    """

    def __init__(self, busy, idle: asyncio.Event, max_bytes: int = 1 << 30, per_tenant_bytes: int = 256 << 20):
        self._busy = busy
        self._idle = idle
        self.max_bytes = max_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self.queued_bytes = 0
        self.per_tenant: collections.Counter = collections.Counter()
        self.dropped = 0
        self.dropped_bytes = 0
        self.deferred = 0  # write-backs that had to wait for restores
        self._queue: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None

    def submit(self, tenant: str, nbytes: int, job) -> asyncio.Future | None:
        """Queues `job()` (a coroutine factory); None if it was dropped."""
        if self.queued_bytes + nbytes > self.max_bytes or self.per_tenant[tenant] + nbytes > self.per_tenant_bytes:
            self.dropped += 1
            self.dropped_bytes += nbytes
            return None
        done = asyncio.get_running_loop().create_future()
        self._queue.append((tenant, nbytes, job, done))
        self.queued_bytes += nbytes
        self.per_tenant[tenant] += nbytes
        self._wake.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())
        return done

    async def _run(self) -> None:
        while self._queue:
            if self._busy():
                self.deferred += 1
                while self._busy():
                    self._idle.clear()
                    await self._idle.wait()
            tenant, nbytes, job, done = self._queue.popleft()
            try:
                done.set_result(await job())
            except Exception as exc:  # the job logs its own failures; keep draining
                done.set_exception(exc)
            finally:
                self.queued_bytes -= nbytes
                self.per_tenant[tenant] -= nbytes

    async def drain(self) -> None:
        """Waits until every queued write-back has run."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)
