"""watch_event_loop: what an operator reads when a server's event loop was held;
freeze_startup_heap: what full garbage collections no longer walk."""

import asyncio
import gc
import logging
import mmap
import os
import subprocess
import sys
import time

import pytest

from kvfs import serving
from kvfs.bench.meta import stall_sites


@pytest.mark.asyncio
@pytest.mark.parametrize("busy", [True, False])
async def test_a_held_event_loop_is_reported_with_how_much_of_it_was_cpu(busy, caplog, monkeypatch):
    monkeypatch.setattr(serving, "STALL_REPORT_EVERY", 0.3)
    log = logging.getLogger("test.watch")
    stats = serving.LoopStats()
    watcher = asyncio.create_task(serving.watch_event_loop(log, stats, threshold=0.1))
    try:
        await asyncio.sleep(0.05)
        end = time.monotonic() + 0.25  # hold the loop: spinning (our code) or sleeping (starved)
        while time.monotonic() < end:
            if not busy:
                time.sleep(0.25)
        deadline = time.monotonic() + 5
        while not any("event loop held" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        watcher.cancel()
    lines = [r for r in caplog.records if "event loop held" in r.getMessage()]
    assert lines and lines[0].levelno == logging.WARNING
    held, cpu = lines[0].args[0], lines[0].args[1]
    assert held >= 200
    # spinning is on the CPU (some of it, however loaded the machine); sleeping is not
    assert (cpu >= 50) if busy else (cpu < held / 2)
    # counted for Status: over 100 ms (and the smaller bounds), none over 1 s; a sleep is never "busy"
    over = dict(zip(serving.STALL_BOUNDS, stats.over))
    assert over[0.1] >= 1 and over[0.025] >= over[0.1] and over[1.0] == 0 and stats.longest >= 0.2
    # and summed, for the metaserver's heartbeat timeouts (membership.py): none of it was time awake
    assert 0.2 <= stats.stalled_s <= stats.stalled_now() and stats.stalled_s < 5
    if not busy:  # asleep, the thread is neither on the CPU nor waiting for one
        assert dict(zip(serving.STALL_BOUNDS, stats.over_busy))[0.1] == 0
        assert dict(zip(serving.STALL_BOUNDS, stats.over_waiting))[0.1] == 0


def hold_the_loop_here(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.asyncio
async def test_a_stall_line_says_where_the_loop_was_held(caplog, monkeypatch):
    monkeypatch.setattr(serving, "STALL_REPORT_EVERY", 0.3)
    log = logging.getLogger("test.watch")
    stats = serving.LoopStats()
    sampler = serving.StallSampler(stats, after=0.05, every=0.005).start()
    watcher = asyncio.create_task(serving.watch_event_loop(log, stats, threshold=0.05, sampler=sampler))
    try:
        await asyncio.sleep(0.05)
        hold_the_loop_here(0.4)  # Python code: the sampler gets the GIL every switch interval and looks
        deadline = time.monotonic() + 5
        while not any("event loop held" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        watcher.cancel()
        sampler.stop()
    (line,) = [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]
    assert "; held at tests/unit/test_serving.py:" in line and "hold_the_loop_here" in line, line
    assert sampler.take() == []  # what was reported is forgotten
    # kvfs-bench meta reads them back out of the log, summed over its lines
    ((site, samples),) = stall_sites([f"2026-12-01 12:00:00 WARNING kvfs.metaserver: {line}"] * 2, n=1)
    assert site.startswith("tests/unit/test_serving.py:") and "hold_the_loop_here" in site
    assert samples == 2 * int(line.split(f"{site} (", 1)[1].split()[0])  # the line may name other sites too


def held_briefly_here(seconds: float) -> None:
    hold_the_loop_here(seconds)


@pytest.mark.asyncio
async def test_only_the_stalls_worth_a_line_leave_their_samples():
    stats = serving.LoopStats()
    sampler = serving.StallSampler(stats, after=0.01, every=0.003, keep_over=0.15).start()
    watcher = asyncio.create_task(serving.watch_event_loop(logging.getLogger("test.watch"), stats, threshold=1.0,
                                                           tick=0.002))
    try:
        await asyncio.sleep(0.05)
        held_briefly_here(0.04)  # sampled while held, then dropped: it ended under keep_over
        await asyncio.sleep(0.05)
        hold_the_loop_here(0.4)
        await asyncio.sleep(0.05)
        sites = sampler.take(5)
    finally:
        watcher.cancel()
        sampler.stop()
    assert sites and all("held_briefly_here" not in site for site, _ in sites), sites
    assert "hold_the_loop_here" in sites[0][0] and sites[0][1] >= 10, sites


def asleep_here(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.asyncio
async def test_a_stall_site_says_whether_the_thread_ran_or_waited_in_the_kernel():
    """A loop held by our own code is sampled running ([R]); one held in a call that
    let go of the GIL and sleeps in the kernel is sampled waiting there ([S: ...],
    with the kernel function where /proc names it)."""
    stats = serving.LoopStats()
    sampler = serving.StallSampler(stats, after=0.02, every=0.005, keep_over=0.1).start()
    watcher = asyncio.create_task(serving.watch_event_loop(logging.getLogger("test.watch"), stats, threshold=1.0,
                                                           tick=0.002))
    try:
        await asyncio.sleep(0.05)
        hold_the_loop_here(0.3)
        await asyncio.sleep(0.05)
        asleep_here(0.3)
        await asyncio.sleep(0.05)
        sites = dict(sampler.take(10))
    finally:
        watcher.cancel()
        sampler.stop()
    spun = [s for s in sites if "hold_the_loop_here" in s]
    slept = [s for s in sites if "asleep_here" in s]
    assert spun and all(s.endswith(" [R]") for s in spun), sites
    assert slept and any(s.endswith("]") and " [S" in s for s in slept), sites


def touch_fresh_pages(size: int = 64 << 20) -> None:
    """Maps `size` bytes, writes a byte to every page (each a fault the kernel fills with
    zeros), unmaps them."""
    m = mmap.mmap(-1, size)
    m[::4096] = bytes(size // 4096)
    m.close()


async def stall_line(caplog, monkeypatch, work) -> logging.LogRecord:
    """The stall line of a loop held 0.3 s calling `work` over and over."""
    monkeypatch.setattr(serving, "STALL_REPORT_EVERY", 0.3)
    watcher = asyncio.create_task(serving.watch_event_loop(logging.getLogger("test.watch"), serving.LoopStats(),
                                                           threshold=0.1))
    try:
        await asyncio.sleep(0.05)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            work()
        deadline = time.monotonic() + 5
        while not any("event loop held" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        watcher.cancel()
    (line,) = [r for r in caplog.records if "event loop held" in r.getMessage()]
    return line


@pytest.mark.asyncio
@pytest.mark.parametrize("collecting", [True, False])
async def test_a_stall_line_says_how_long_the_garbage_collector_held_it(collecting, caplog, monkeypatch):
    heap = [[i] for i in range(300_000)]  # tracked, not frozen: each full collection walks them
    line = await stall_line(caplog, monkeypatch, gc.collect if collecting else lambda: None)
    assert len(heap) == 300_000
    held, collected = line.args[0], line.args[3]
    assert (collected >= held / 2) if collecting else (collected < held / 4), line.getMessage()


@pytest.mark.asyncio
@pytest.mark.parametrize("in_kernel", [True, False])
async def test_a_stall_line_says_how_much_of_the_threads_cpu_was_in_the_kernel(in_kernel, caplog, monkeypatch):
    """Touching fresh memory page by page is the kernel's work (page faults, zeroing,
    unmapping); spinning in Python is not. Mapped here, not allocated: malloc may hand
    back memory already touched (it did, late in the full suite)."""
    line = await stall_line(caplog, monkeypatch, touch_fresh_pages if in_kernel else lambda: None)
    cpu, kernel = line.args[1], line.args[2]
    assert cpu >= 100, line.getMessage()
    assert (kernel >= cpu / 2) if in_kernel else (kernel < cpu / 4), line.getMessage()


SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def on_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as fh:
        return int(fh.read().split()[0]) / 1e9


@pytest.mark.asyncio
async def test_a_loop_whose_thread_waits_for_a_core_is_told_from_one_its_own_work_holds(caplog, monkeypatch):
    """The loop's thread on one core with three processes spinning on it: it spends
    most of a hold runnable but off the CPU, and the stall counts as waiting for a
    core, not as busy (Linux schedstat: this test needs a kernel that keeps it)."""
    assert serving.RunQueueWait()() is not None, "no /proc/thread-self/schedstat on this kernel"
    monkeypatch.setattr(serving, "STALL_REPORT_EVERY", 0.3)
    log = logging.getLogger("test.watch")
    mine = os.sched_getaffinity(0)
    core = min(mine)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(core)]) for _ in range(3)]
    stats = serving.LoopStats()
    watcher = None
    try:
        deadline = time.monotonic() + 20
        while min(on_cpu_s(p.pid) for p in spinners) < 0.05:  # all three pinned and spinning
            assert time.monotonic() < deadline, "the spinners never ran"
            await asyncio.sleep(0.02)
        os.sched_setaffinity(0, {core})  # this thread: the event loop's
        watcher = asyncio.create_task(serving.watch_event_loop(log, stats, threshold=0.1))
        await asyncio.sleep(0.05)
        hold_the_loop_here(0.6)  # spinning too, but given about a quarter of the core
        deadline = time.monotonic() + 5
        while not any("event loop held" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        os.sched_setaffinity(0, mine)
        if watcher is not None:
            watcher.cancel()
        for p in spinners:
            p.kill()
            p.wait()
    (line,) = [r for r in caplog.records if "event loop held" in r.getMessage()]
    held, cpu, waited = line.args[0], line.args[1], line.args[4]
    assert held >= 500 and waited >= held / 2 and cpu < 0.8 * held, line.getMessage()
    assert dict(zip(serving.STALL_BOUNDS, stats.over_waiting))[0.1] >= 1
    assert dict(zip(serving.STALL_BOUNDS, stats.over_busy))[0.1] == 0


def test_objects_alive_at_start_up_leave_the_collectors_walk_and_later_ones_do_not():
    class SetUp:  # a server's set-up: alive as long as it is
        pass

    made = [SetUp() for _ in range(1000)]
    try:
        assert serving.freeze_startup_heap() >= 1000
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in walked for o in made)
        later = SetUp()
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
