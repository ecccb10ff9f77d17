"""Lookups first (metaserver/readsfirst.py): steps of writes and background passes wait
for lookups under way, boundedly, and leave more turns of the loop while lookups keep
coming; CountsLookups counts a real grpc.aio server's calls in and out."""

import asyncio
import gc
import time

import grpc
import pytest

from kvfs.metaserver import readsfirst
from kvfs.metaserver.readsfirst import STEP_BOUNDS, CountsLookups, ReadsFirst
from kvfs.metaserver.state import step_slot

from helpers import Clock, Turns

pytestmark = pytest.mark.asyncio


async def test_without_lookups_a_step_neither_waits_nor_leaves_more_than_one_turn():
    reads, turns = ReadsFirst(), Turns()
    try:
        await reads.before_step()
        at = turns.n
        await reads.after_step()
        assert turns.n - at <= 2  # the turn this one ends in, and the next
    finally:
        turns.stop()
    assert reads.waits == 0


async def test_while_lookups_keep_coming_a_step_leaves_turns_then_a_wait_in_the_loops_poll():
    """Turns alone, however many, left a lookup behind 2-4 steps between its send and
    its handler: the loop must also wait in its poll, where gRPC's poller hands it calls."""
    reads, turns = ReadsFirst(), Turns()
    reads.ended(reads.began())  # a lookup just ended: more are coming
    assert reads.coming()
    try:
        at, t0 = turns.n, time.perf_counter()
        await reads.after_step()
        assert turns.n - at >= readsfirst.TURNS
        assert time.perf_counter() - t0 >= readsfirst.GAP
    finally:
        turns.stop()


async def test_a_step_waits_until_the_lookup_under_way_ends():
    reads = ReadsFirst()
    token = reads.began()
    order = []

    async def step():
        await reads.before_step()
        order.append("step")

    task = asyncio.create_task(step())
    for _ in range(20):  # the step is held while the lookup runs its turns
        await asyncio.sleep(0)
    assert order == []
    order.append("lookup ended")
    reads.ended(token)
    await asyncio.wait_for(task, 5)
    assert order == ["lookup ended", "step"]
    assert reads.waits == 1 and reads.under_way() == 0


async def test_a_lookup_that_never_ends_holds_each_step_for_max_wait_and_is_dropped_when_stale():
    clock = Clock(100.0)
    reads = ReadsFirst(clock)
    reads.began()  # never ended: gRPC never reported its end
    t0 = time.perf_counter()
    await reads.before_step()
    assert readsfirst.MAX_WAIT * 0.9 < time.perf_counter() - t0 < 0.5  # MAX_WAIT, not more
    assert reads.waits == 1 and reads.under_way() == 1
    clock.now += readsfirst.STALE + 0.1
    assert reads.under_way() == 0
    await reads.before_step()
    assert reads.waits == 1  # no longer held


async def test_while_lookups_keep_coming_steps_leave_more_turns():
    clock = Clock(100.0)
    reads, turns = ReadsFirst(clock), Turns()
    try:
        reads.ended(reads.began())
        at = turns.n
        await reads.after_step()
        recent = turns.n - at
        clock.now += readsfirst.RECENT * 2
        at = turns.n
        await reads.after_step()
        later = turns.n - at
    finally:
        turns.stop()
    assert recent >= readsfirst.TURNS and later <= 2, (recent, later)


class Refuses(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata say so before their handler runs, as kvfs.auth's
    Authorizer refuses a caller without the role."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if ("refuse", "1") not in (details.invocation_metadata or ()):
            return handler

        async def refused(request, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "refused")

        return grpc.unary_unary_rpc_method_handler(refused, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


async def test_counts_lookups_counts_a_real_servers_calls_of_its_method_in_and_out():
    clock = Clock(100.0)  # still: nothing goes stale by itself
    reads = ReadsFirst(clock)
    seen = {}

    async def lookup(request, context):
        seen[request] = (len(reads._under_way), len(reads._arriving))
        if request == b"abort":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "aborted")
        return b"ok"

    async def other(request, context):
        seen["other"] = reads.under_way()
        return b"ok"

    handlers = {"Lookup": grpc.unary_unary_rpc_method_handler(lookup),
                "Other": grpc.unary_unary_rpc_method_handler(other)}
    server = grpc.aio.server(interceptors=[Refuses(), CountsLookups(reads, "/t.S/Lookup")],
                             options=[("grpc.max_receive_message_length", 1024)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            lookup_call = ch.unary_unary("/t.S/Lookup")
            assert await lookup_call(b"a", timeout=10) == b"ok"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await lookup_call(b"abort", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await ch.unary_unary("/t.S/Other")(b"x", timeout=10) == b"ok"
            deadline = loop.time() + 10
            while reads._under_way and loop.time() < deadline:  # gRPC reports the ends after the replies
                await asyncio.sleep(0.01)
            assert not reads._under_way and not reads._arriving  # both lookups counted out, the aborted one too
            reached = reads.last_began
            # calls that never reach the handler: refused first, or too large to be read
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await lookup_call(b"b", timeout=10, metadata=(("refuse", "1"),))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await lookup_call(b"x" * 4096, timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(None)
    assert seen == {b"a": (1, 0), b"abort": (1, 0), "other": 0}
    # never reported ended, they count as arriving until ARRIVING_STALE, not STALE, and never as begun
    assert not reads._under_way and reads.under_way() == 2 and reads.last_began == reached
    clock.now += readsfirst.ARRIVING_STALE * 1.5
    assert reads.under_way() == 0


async def test_counting_lookups_out_leaves_the_garbage_collector_nothing_more_to_free():
    """CountsLookups counts a call out without a reference cycle of its own: calls of its
    method leave no more cyclic garbage than calls of another method on the same server
    (a callback on the call's context, as before, left 9 objects more a call)."""
    reads = ReadsFirst()

    async def handler(request, context):
        return b"ok"

    handlers = {"Lookup": grpc.unary_unary_rpc_method_handler(handler),
                "Other": grpc.unary_unary_rpc_method_handler(handler)}
    server = grpc.aio.server(interceptors=[CountsLookups(reads, "/t.S/Lookup")])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()

    async def cyclic_garbage_a_call(call, n=300) -> float:
        for _ in range(20):  # the channel and the server warmed up
            await call(b"x", timeout=10)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage, to count
        try:
            for _ in range(n):
                assert await call(b"x", timeout=10) == b"ok"
            deadline = loop.time() + 10
            while reads._under_way and loop.time() < deadline:
                await asyncio.sleep(0.01)
            gc.collect()
            return len(gc.garbage) / n
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            other = await cyclic_garbage_a_call(ch.unary_unary("/t.S/Other"))
            counted = await cyclic_garbage_a_call(ch.unary_unary("/t.S/Lookup"))
    finally:
        await server.stop(None)
    assert not reads._under_way and not reads._arriving  # every lookup counted out
    assert other > 0  # grpc.aio's own (5 objects a call on the server)
    assert counted < other + 1


async def test_while_lookups_keep_coming_eight_writers_steps_leave_the_turns_between_them_to_lookups():
    """Spacing each writer's own steps is not enough: the gate would pass the turns
    after one writer's step to the next writer's."""
    from kvfs.metaserver.state import run_steps_async

    clock = Clock(100.0)
    reads, turns = ReadsFirst(clock), Turns()
    seen = []

    def steps():
        for _ in range(4):
            seen.append(turns.n)
            yield

    try:
        reads.ended(reads.began())  # a lookup just now (the still clock keeps it recent)
        gate = asyncio.Lock()
        await asyncio.gather(*(run_steps_async(steps(), gate, reads, "commit") for _ in range(8)))
        coming = sorted(seen)
        seen.clear()
        clock.now += readsfirst.RECENT * 2  # none since
        await asyncio.gather(*(run_steps_async(steps(), gate, reads, "commit") for _ in range(8)))
        quiet = sorted(seen)
    finally:
        turns.stop()
    assert len(coming) == len(quiet) == 32
    assert min(b - a for a, b in zip(coming, coming[1:])) >= readsfirst.TURNS
    assert max(b - a for a, b in zip(quiet, quiet[1:])) <= 2  # without lookups, a step every turn or so


async def test_steps_are_counted_by_kind_with_how_long_they_held_the_loop():
    """A lookup arriving during a step waits for its end: the long ones are counted,
    by kind, over each bound, and apart those long on the CPU alone; a step that raises
    is counted too."""
    reads, gate = ReadsFirst(), asyncio.Lock()
    long_step = STEP_BOUNDS[1] + 0.0005  # over the first two bounds, under the third
    async with step_slot(gate, reads, "commit"):
        time.sleep(long_step)  # holds the loop off the CPU, as a step waiting for the disk does
    async with step_slot(gate, reads, "commit"):
        cpu0 = time.thread_time()
        while time.thread_time() - cpu0 < long_step:  # holds it on the CPU, as a step's work does
            pass
    for _ in range(3):
        async with step_slot(gate, reads, "commit"):
            pass
    with pytest.raises(RuntimeError):
        async with step_slot(gate, reads, "evict"):
            raise RuntimeError("a step that fails")
    commit, evict = reads.steps.kinds["commit"], reads.steps.kinds["evict"]
    assert commit[0] == 5 and commit[1] >= 2 * long_step
    # both long steps (either may overrun a busy machine's 5 ms); the sleeping one not on the CPU
    assert commit[2][:2] == [2, 2] and commit[2][2] <= 2
    assert long_step <= commit[3] < commit[1] - long_step / 2
    assert commit[4][:2] == [1, 1] and commit[4][2] <= 1
    assert evict[0] == 1 and evict[2] == [0, 0, 0] and evict[4] == [0, 0, 0]
    assert set(reads.steps.kinds) == {"commit", "evict"}
