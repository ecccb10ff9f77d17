"""The engine's compute queue: most urgent first, one job at a time."""

import asyncio
import threading

import pytest

from kvfs.engine.compute_queue import ComputeQueue


def test_jobs_run_by_deadline_then_arrival_one_at_a_time():
    queue = ComputeQueue()
    started, gate, ran, running = threading.Event(), threading.Event(), [], []

    def job(name):
        running.append(name)
        assert len(running) == 1  # never two at once
        ran.append(name)
        running.pop()
        return name

    try:
        blocker = queue.submit(0.0, lambda: started.set() or gate.wait())  # holds the thread meanwhile
        assert started.wait(10)
        futures = [queue.submit(d, lambda n=n: job(n)) for n, d in
                   [("late", 9.0), ("soon", 1.0), ("tie-a", 5.0), ("tie-b", 5.0), ("sooner", 0.5)]]
        assert queue.waiting == 5
        gate.set()
        results = [f.result(timeout=10)[0] for f in futures]
        assert blocker.result(timeout=10)[1] >= 0
        assert ran == ["sooner", "soon", "tie-a", "tie-b", "late"]
        assert results == ["late", "soon", "tie-a", "tie-b", "sooner"]
        assert queue.jobs == 6
    finally:
        gate.set()
        queue.close()


def test_a_failing_job_fails_its_caller_only_and_close_refuses_more():
    queue = ComputeQueue()

    async def go():
        with pytest.raises(ZeroDivisionError):
            await queue.run(0.0, lambda: 1 / 0)
        value, seconds = await queue.run(0.0, lambda: 42)
        return value, seconds

    assert asyncio.run(go())[0] == 42
    queue.close()
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(0.0, lambda: None)
