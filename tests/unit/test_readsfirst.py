"""Lookups first (metaserver/readsfirst.py): steps of writes and background passes wait
for lookups under way, boundedly, and leave more turns of the loop while lookups keep
coming; CountsLookups counts a real grpc.aio server's calls in and out."""

import asyncio

import grpc
import pytest

from kvfs.metaserver import readsfirst
from kvfs.metaserver.readsfirst import CountsLookups, ReadsFirst

from helpers import Clock

pytestmark = pytest.mark.asyncio


class Turns:
    """Counts the event loop's turns: a callback that runs once in each."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.n, self.running = 0, True
        self.loop.call_soon(self._tick)

    def _tick(self):
        self.n += 1
        if self.running:
            self.loop.call_soon(self._tick)

    def stop(self):
        self.running = False


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


async def test_a_lookup_that_never_ends_holds_each_step_at_most_max_wait_and_is_dropped_when_stale():
    clock = Clock(100.0)
    reads = ReadsFirst(clock)
    reads.began()  # never ended: its handler was never reached
    await asyncio.wait_for(reads.before_step(), readsfirst.MAX_WAIT * 200)  # bounded by MAX_WAIT
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


async def test_counts_lookups_counts_a_real_servers_calls_of_its_method_in_and_out():
    reads = ReadsFirst()
    seen = {}

    async def lookup(request, context):
        seen[request] = reads.under_way()
        if request == b"refuse":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        return b"ok"

    async def other(request, context):
        seen["other"] = reads.under_way()
        return b"ok"

    handlers = {"Lookup": grpc.unary_unary_rpc_method_handler(lookup),
                "Other": grpc.unary_unary_rpc_method_handler(other)}
    server = grpc.aio.server(interceptors=[CountsLookups(reads, "/t.S/Lookup")])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await ch.unary_unary("/t.S/Lookup")(b"a", timeout=10) == b"ok"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/t.S/Lookup")(b"refuse", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await ch.unary_unary("/t.S/Other")(b"x", timeout=10) == b"ok"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while reads.under_way() and loop.time() < deadline:  # gRPC reports the ends after the replies
                await asyncio.sleep(0.01)
    finally:
        await server.stop(None)
    assert seen == {b"a": 1, b"refuse": 1, "other": 0}
    assert reads.under_way() == 0  # both lookups, the refused one too, counted out
