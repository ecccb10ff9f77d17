"""The compute queue: one thread runs every request's model work, a slice at a time,
most urgent first.

A request's prefill is cut into jobs of layers for up to 20 ms (engine.LAYER_SLICE_S),
each stopping before a layer whose restored part is not in yet, so a long prefill
never holds the compute thread for seconds while others wait, and a request whose
restore has not yet delivered layer l waits for it on the event loop, not on the
compute thread. Jobs run in order of `deadline`: the request's
arrival plus the compute it still needs. Short jobs (a cache hit's last token, a
decode step) go ahead of long prefills that arrived about as early, while a long
prefill still runs before anything that arrives after its expected finish, so
nothing starves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import threading
import time


class ComputeQueue:
    def __init__(self, name: str = "kvfs-engine"):
        self._heap: list = []
        self._seq = itertools.count()  # FIFO among equal deadlines
        self._cv = threading.Condition()
        self._closed = False
        self.busy_seconds = 0.0
        self.jobs = 0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, deadline: float, fn) -> concurrent.futures.Future:
        """Runs `fn()` on the compute thread; the future holds (its result, seconds it ran)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the compute queue is closed")
            heapq.heappush(self._heap, (deadline, next(self._seq), fn, future))
            self._cv.notify()
        return future

    async def run(self, deadline: float, fn):
        """`await`able submit: (result, seconds)."""
        return await asyncio.wrap_future(self.submit(deadline, fn))

    @property
    def waiting(self) -> int:
        return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, fn, future = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting request
                future.set_exception(exc)
            else:
                future.set_result((result, time.perf_counter() - t0))
            finally:
                self.busy_seconds += time.perf_counter() - t0
                self.jobs += 1

    def close(self) -> None:
        """Runs what is queued, then stops the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
