"""Batched disk reads: io_uring, with a preadv thread pool where io_uring cannot run.

Both readers take a batch of (fd, offset, buffer) reads and return a
concurrent.futures.Future of the per-read results (bytes read, or -errno). The
io_uring reader owns its ring in one thread: callers queue batches and poke an
eventfd; the ring posts completions to a second eventfd, so the thread sleeps
in select() when idle and never polls.

io_uring cannot run where the kernel refuses a ring (an OSError from its setup),
or where the liburing binding's binary cannot run on this CPU: the package's
2026.3 wheels are built with AVX-512 instructions, and on a CPU without them
(an AMD EPYC with AVX2 only, for one) their first call kills the process with
SIGILL, which nothing in the process can catch. So before the first ring, a
child process sets one up (`binding_refused`, once per process); a child killed
by a signal makes UringReader refuse with an OSError saying so.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import liburing as L

log = logging.getLogger(__name__)

ReadOp = tuple[int, int, bytearray]  # (fd, file offset, destination buffer)


def settle(future: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    """Completes a thread-side future unless its waiter cancelled it: set_result on a
    cancelled future raises, and would kill the reader or committer thread calling it."""
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and the set


_PROBE = "import liburing as L; r = L.Ring(); L.io_uring_queue_init(8, r); L.io_uring_queue_exit(r)"


@functools.cache
def binding_refused() -> str | None:
    """Why the liburing binding cannot run here (its child process died by a signal
    setting up a ring), or None. A child that fails otherwise (the kernel refusing
    a ring) leaves that for UringReader to raise, with the kernel's errno."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "a child process setting up an io_uring ring through liburing did not finish in 60 s"
    if proc.returncode >= 0:
        return None
    name = signal.Signals(-proc.returncode).name
    cause = " (its binary uses instructions this CPU lacks)" if name == "SIGILL" else ""
    return (f"the liburing binding ({getattr(L, '__version__', '?')}) killed a child process with {name} "
            f"setting up a ring{cause}")


@dataclass(slots=True)
class _Batch:
    ops: list[ReadOp]
    future: concurrent.futures.Future
    results: list[int] = field(default_factory=list)
    remaining: int = 0


class UringReader:
    """Reads through one io_uring ring driven by a dedicated thread."""

    name = "io_uring"

    def __init__(self, entries: int = 256):
        why = binding_refused()
        if why:
            raise OSError(why)
        self._ring = L.Ring()
        L.io_uring_queue_init(entries, self._ring)  # OSError if the kernel refuses
        self._entries = entries
        self._cqe = L.Cqe()
        self._completions = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wakeup = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._completions)
        self._queue: collections.deque[_Batch] = collections.deque()
        # owned by the reader thread; queue_depth() only takes their len()
        self._inflight: dict[int, tuple[_Batch, int]] = {}
        self._waiting: collections.deque[tuple[_Batch, int]] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="uring-reader", daemon=True)
        self._thread.start()

    def read_batch(self, ops: list[ReadOp]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not ops:
            fut.set_result([])
            return fut
        if self._closed:
            raise RuntimeError("reader is closed")
        self._queue.append(_Batch(ops, fut, [0] * len(ops), len(ops)))
        os.eventfd_write(self._wakeup, 1)
        return fut

    def queue_depth(self) -> tuple[int, int]:
        """(reads submitted to the ring and not completed, reads waiting for a free
        entry): the reader thread's own counts, read from any thread without a lock."""
        return len(self._inflight), len(self._waiting)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.eventfd_write(self._wakeup, 1)
        self._thread.join()
        L.io_uring_queue_exit(self._ring)
        os.close(self._completions)
        os.close(self._wakeup)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._completions, selectors.EVENT_READ)
        sel.register(self._wakeup, selectors.EVENT_READ)
        inflight, waiting = self._inflight, self._waiting
        next_id = 0
        try:
            while not (self._closed and not inflight):
                while self._queue:
                    batch = self._queue.popleft()
                    waiting.extend((batch, i) for i in range(len(batch.ops)))
                submitted = 0
                while waiting and len(inflight) < self._entries:
                    sqe = L.io_uring_get_sqe(self._ring)
                    if sqe is None:
                        break
                    batch, i = waiting.popleft()
                    fd, offset, buf = batch.ops[i]
                    L.io_uring_prep_read(sqe, fd, buf, offset)
                    L.io_uring_sqe_set_data64(sqe, next_id)
                    inflight[next_id] = (batch, i)
                    next_id += 1
                    submitted += 1
                if submitted:
                    L.io_uring_submit(self._ring)
                self._reap(inflight)
                if waiting and len(inflight) < self._entries:
                    continue
                if self._closed and not inflight:
                    break
                for key, _ in sel.select():
                    try:
                        os.eventfd_read(key.fd)
                    except BlockingIOError:
                        pass
                self._reap(inflight)
        except BaseException as exc:  # a dead reader must not hang its callers
            log.exception("io_uring reader thread failed")
            for batch, _ in list(inflight.values()) + list(waiting):
                settle(batch.future, exc=exc)
        finally:
            sel.close()

    def _reap(self, inflight: dict[int, tuple[_Batch, int]]) -> None:
        while inflight:
            try:
                L.io_uring_peek_cqe(self._ring, self._cqe)
            except BlockingIOError:
                return
            cqe = self._cqe[0]
            user_data = cqe.user_data
            try:
                res = cqe.res
            except OSError as err:  # the binding raises for a negative result
                res = -(err.errno or 5)
            L.io_uring_cqe_seen(self._ring, cqe)
            batch, i = inflight.pop(user_data)
            batch.results[i] = res
            batch.remaining -= 1
            if batch.remaining == 0:
                settle(batch.future, batch.results)


class PreadvReader:
    """The fallback: preadv(2) in a thread pool, same interface as UringReader."""

    name = "preadv"

    def __init__(self, threads: int = 8):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="preadv")

    @staticmethod
    def _read(op: ReadOp) -> int:
        fd, offset, buf = op
        try:
            return os.preadv(fd, [buf], offset)
        except OSError as err:
            return -(err.errno or 5)

    def read_batch(self, ops: list[ReadOp]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not ops:
            fut.set_result([])
            return fut
        results = [0] * len(ops)
        remaining = [len(ops)]
        lock = threading.Lock()

        def done(i: int, f: concurrent.futures.Future) -> None:
            results[i] = f.result()
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                settle(fut, results)

        for i, op in enumerate(ops):
            self._pool.submit(self._read, op).add_done_callback(lambda f, i=i: done(i, f))
        return fut

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def open_reader(engine: str, entries: int) -> UringReader | PreadvReader:
    """The reader for `engine` ("auto", "io_uring" or "preadv").

    "auto" tries io_uring and, if it cannot run (the kernel refuses a ring, or
    the binding cannot run on this CPU), logs a warning and falls back to
    preadv; "io_uring" fails instead.
    """
    if engine == "preadv":
        log.info("disk reads: preadv thread pool (io_engine=preadv)")
        return PreadvReader()
    try:
        reader = UringReader(entries)
    except OSError as err:
        if engine == "io_uring":
            raise
        log.warning("io_uring cannot run here (%s); FALLING BACK to preadv in a thread pool", err)
        return PreadvReader()
    log.info("disk reads: io_uring, %d entries", entries)
    return reader
