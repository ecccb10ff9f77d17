"""Lookups first. A restore is waiting on every MatchPrefix; a write-back or a background
pass can wait a few milliseconds, so their steps make way for lookups.

Making steps short is not enough on grpc.aio: a unary call takes about ten turns of the
event loop from its arrival to its reply (each completion hops from gRPC's poller thread
to the loop, then to the call's task), and a task with a step ready runs one every turn.
One 1.5 ms step a turn made a trivial call take 12-15 ms (p50) instead of 1. So the
steps of writes (state.run_steps_async) and of background passes (Lifecycle.turn)

- wait, up to MAX_WAIT, while a lookup is under way (counted in by CountsLookups, the
  server's last interceptor, as the call arrives, and out when its task ends), and
- while lookups keep coming (one began within RECENT), leave TURNS turns of the loop
  between two steps (writers hold their gate through them, so all writers together do):
  a lookup's first turns, before any code of ours sees it, advance in those; and a
  commit decides and writes its blocks in smaller pieces
  (allocations.COMMIT_PIECE_BESIDE_LOOKUPS), so that a piece under way when a lookup
  comes holds it less.

Measured on a bare grpc.aio server with 1.5 ms steps ready every turn and a call every
3 ms: a health check took p50/p99 15.8/20.8 ms; waiting while calls are under way and
four turns between steps, 3.1/7.8 ms; the steps got 73% of the loop instead of 86%.
With eight writers through state.run_steps_async: 6.7-7.2/10.9-14.2 ms when only each
writer's own steps were spaced, 3.8-4.4/7.4-9.3 ms with the gate held. Without lookups
nothing changes: no wait and one turn between steps.

Turns were not enough either. `kvfs-bench meta --blocks 1M`, with each lookup's send
time (from the bench) and arrival (in CountsLookups) and every step logged, found a
lookup 2-4 steps (p50 2, p99 4) between its send and its handler during the eviction
phase, 1.4/5.1 ms (p50/p99), and its handler-to-end only 0.6/1.8 ms: a step was
followed by four quick turns, another step, and so on, and the call was handed to the
loop only across several of them. Two changes made it at most one step: writers' steps
and background passes' slices share one step slot (state.step_slot), and while
lookups keep coming, the turns after a step end with GAP spent in the loop's poll
(where gRPC's poller thread, which needs the GIL, hands over the calls it has). In the
same bench the eviction phase's 2,000-block hit went from p50/p99 2.3-2.9/6.4-8.6 ms
to 1.9/4.5 ms, with writes about a fifth slower while lookups kept coming."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

import grpc

MAX_WAIT = 0.005  # seconds a step waits for lookups under way, at most: writes are slowed, never stopped
TURNS = 4  # turns of the loop between two steps while lookups keep coming
# seconds the loop waits in its poll after a step while lookups keep coming: turns alone,
# however many, left a lookup 2-4 steps (p50 2, p99 4) between its send and its handler
GAP = 0.0003
RECENT = 0.05  # seconds: a lookup begun this recently means more are coming
# Steps are counted by how long they held the loop: over each bound (StepTimes). Beside lookups a
# step should take at most allocations.SLICE_SECONDS_BESIDE_LOOKUPS (0.5 ms).
STEP_BOUNDS = (0.001, 0.002, 0.005)
# A call is counted in as it arrives, before its body is read; it counts as under way only
# until ARRIVING_STALE unless it reaches its handler (with its caller's access checked and
# its body parsed): one that never does (refused, oversized, past its deadline) is never
# reported ended. One that reached it counts until its task ends (gRPC sent the reply), or STALE.
ARRIVING_STALE = 0.02
STALE = 1.0


class StepTimes:
    """How long steps held the event loop, by kind of work (a fixed few: "allocate",
    "commit", the background passes'): how many, their sum, and how many took longer
    than each of STEP_BOUNDS. A lookup that arrives during a step waits for its end,
    so the long ones make lookups' tail. The loop thread's CPU time in them is counted
    the same way: a step over a bound whose CPU time is not was long because the thread
    waited (for a core, the disk, or a lock), not because of its own work. (Status and
    the metrics report them.)"""

    def __init__(self):
        # kind -> [count, seconds, [over each bound], cpu seconds, [CPU time over each bound]]
        self.kinds: dict[str, list] = {}
        self.last = 0.0  # seconds the last step took (a background pass pauses as long after it)

    def record(self, kind: str, seconds: float, cpu_seconds: float) -> None:
        self.last = seconds
        entry = self.kinds.get(kind)
        if entry is None:
            entry = self.kinds[kind] = [0, 0.0, [0] * len(STEP_BOUNDS), 0.0, [0] * len(STEP_BOUNDS)]
        entry[0] += 1
        entry[1] += seconds
        entry[3] += cpu_seconds
        for over, took in ((entry[2], seconds), (entry[4], cpu_seconds)):
            for i, bound in enumerate(STEP_BOUNDS):
                if took <= bound:
                    break
                over[i] += 1


class ReadsFirst:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        # token -> when the call arrived, or reached its handler; tokens grow with time, so
        # each dict is in time order and the stale ones are at its front
        self._arriving: dict[int, float] = {}
        self._under_way: dict[int, float] = {}
        self._tokens = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self.last_began = -math.inf  # when a lookup last reached its handler
        self.waits = 0  # steps that waited for lookups
        self.waited_s = 0.0  # and how long, together
        self.steps = StepTimes()  # how long steps took (state.step_slot)

    def arrived(self) -> int:
        self._tokens += 1
        self._arriving[self._tokens] = self.clock()
        self._quiet.clear()
        return self._tokens

    def reached(self, token: int) -> None:
        """The call reached its handler: a lookup under way until ended()."""
        if self._arriving.pop(token, None) is not None:
            self._under_way[token] = self.last_began = self.clock()

    def began(self) -> int:
        """arrived() and reached() at once (for callers that count lookups themselves)."""
        token = self.arrived()
        self.reached(token)
        return token

    def ended(self, token: int) -> None:
        if self._under_way.pop(token, None) is None:
            self._arriving.pop(token, None)
        self._quiet_when_none()

    def _quiet_when_none(self) -> None:
        if not self._under_way and not self._arriving:
            self._quiet.set()

    def under_way(self) -> int:
        """Lookups under way: arrived less than ARRIVING_STALE ago, or reached their
        handler less than STALE ago and not ended."""
        now = self.clock()
        for tokens, stale in ((self._arriving, ARRIVING_STALE), (self._under_way, STALE)):
            while tokens and next(iter(tokens.values())) < now - stale:
                del tokens[next(iter(tokens))]
        self._quiet_when_none()
        return len(self._arriving) + len(self._under_way)

    async def before_step(self) -> None:
        """Waits, at most MAX_WAIT, until no lookup is under way."""
        if not self.under_way():
            return
        t0 = self.clock()
        try:
            async with asyncio.timeout(MAX_WAIT):
                await self._quiet.wait()
        except TimeoutError:
            pass
        self.waits += 1
        self.waited_s += self.clock() - t0

    def coming(self) -> bool:
        """Whether lookups keep coming: one reached its handler within RECENT."""
        return self.clock() - self.last_began < RECENT

    async def after_step(self) -> None:
        """Leaves the loop to calls for one turn, or, while lookups keep coming, TURNS
        turns and then GAP in the loop's poll."""
        if not self.coming():
            await asyncio.sleep(0)
            return
        for _ in range(TURNS):
            await asyncio.sleep(0)
        await asyncio.sleep(GAP)


class CountsLookups(grpc.aio.ServerInterceptor):
    """Counts calls of `method` in with `reads` from their arrival to their end. The
    server's last interceptor: its handler runs once the others' checks passed (the
    caller may call it, its body parsed), so only such calls reach() it.

    A call's end is when the asyncio task grpc.aio runs it in ends, once the reply and
    status are sent: a few microseconds after gRPC's own done callbacks, which it was
    counted out by before. A callback given to the call's context
    (`context.add_done_callback`) made a reference cycle of every lookup (gRPC keeps it,
    bound to the context, in the call's state, which the context holds): 9 more objects
    a call, beside the 5 of every grpc.aio call, that only the garbage collector frees.
    Under `kvfs-bench meta` they were most of the metaserver's cyclic garbage, and the
    collector runs each time 700 more objects were allocated than freed: they set how
    often it ran (its middle generation's collections took up to 9 ms, inside steps and
    lookups). A task's callbacks are dropped once called: no cycle."""

    def __init__(self, reads: ReadsFirst, method: str):
        self.reads = reads
        self.method = method

    async def intercept_service(self, continuation, details):
        if details.method != self.method:
            return await continuation(details)
        token = self.reads.arrived()
        try:
            handler = await continuation(details)
        except BaseException:
            self.reads.ended(token)
            raise
        if handler is None or handler.request_streaming or handler.response_streaming:
            self.reads.ended(token)
            return handler
        behavior = handler.unary_unary

        async def counted(request, context):
            self.reads.reached(token)
            asyncio.current_task().add_done_callback(lambda _: self.reads.ended(token))
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(counted, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
