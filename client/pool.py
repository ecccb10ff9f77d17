"""BufferPool: reusable host buffers for restores.

With CUDA, buffers are pinned (page-locked) torch tensors, so a restore's bytes
can go to the GPU by DMA. Without CUDA (`torch.empty(pin_memory=True)` raises
there), they come from a shared-memory arena (a sparse, sealed memory file mapped
by this process): chunkservers on the same host, handed its descriptor, map the
arena too and read from disk straight into a restore's buffer, with no copy on
the client. Past the
arena's size, buffers are plain page-aligned anonymous mappings.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import logging
import mmap
import os
import threading
import weakref

from kvfs.buffers import PAGE, address_of, sealed_memfd

log = logging.getLogger(__name__)


class SharedArena:
    """A sparse memory file (a sealed memfd, kvfs.buffers.sealed_memfd) mapped
    here, carved into page-aligned buffers. A connection to a chunkserver's local
    socket passes `fd` to it; the file goes when the arena is closed (or at exit)
    and every mapping of it is gone.

    A released buffer's pages go back to a free list (first fit, lowest address
    first, neighbours merged), so buffers of any size reuse pages this process and
    the chunkservers have already touched: a first touch costs a page fault on each
    side, and an engine's first 2K-token hit into fresh pages restored in 28 ms
    against 18 ms into touched ones (tiny DeepSeek-V2 in vLLM, 4 alternated pairs).
    Carving only fresh pages, as this did before, also spent the arena on the
    first few prompt lengths, after which restores fell back to copies.
    """

    def __init__(self, size: int):
        self.fd = sealed_memfd("kvfs-arena", size)  # sparse: pages exist only once reserved
        self.map = mmap.mmap(self.fd, size)
        self.size = size
        self.address = address_of(self.map)
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, end) by address, none adjacent
        self._reserved = 0  # pages below this are reserved in the file
        self._held: dict[int, int] = {}  # offset -> bytes of each buffer handed out
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, self.fd)
        atexit.register(self._finalizer)

    def allocate(self, nbytes: int) -> memoryview | None:
        """A buffer in the arena, or None when the arena or memory is full."""
        span = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            i = next((i for i, (a, b) in enumerate(self._free) if b - a >= span), None)
            if i is None:
                return None
            start, end = self._free[i]
            if start + span > self._reserved:
                try:
                    # reserve the pages now: a full memory cgroup refuses here, not on first touch
                    os.posix_fallocate(self.fd, self._reserved, start + span - self._reserved)
                except OSError:
                    return None
                self._reserved = start + span
            if start + span == end:
                del self._free[i]
            else:
                self._free[i] = (start + span, end)
            self._held[start] = span
        return memoryview(self.map)[start : start + nbytes]

    def release(self, offset: int) -> None:
        """Gives back the buffer allocate() returned at `offset`; its pages stay reserved."""
        with self._lock:
            span = self._held.pop(offset, None)
            if span is None:
                raise ValueError(f"no arena buffer starts at {offset}: released twice, or never allocated")
            start, end = offset, offset + span
            i = bisect.bisect(self._free, (start, end))
            if i < len(self._free) and self._free[i][0] == end:
                end = self._free.pop(i)[1]
            if i and self._free[i - 1][1] == start:
                i -= 1
                start = self._free.pop(i)[0]
            self._free.insert(i, (start, end))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b - a for a, b in self._free)

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """Where [address, address + nbytes) lies in the arena, if it does."""
        off = address - self.address
        return off if 0 <= off and off + nbytes <= self.size else None

    def close(self) -> None:
        self._finalizer()


def _release(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_arenas: weakref.WeakSet[SharedArena] = weakref.WeakSet()


def arena_of(address: int, nbytes: int) -> tuple[SharedArena, int] | None:
    """The arena holding a buffer, and the buffer's offset in it."""
    for arena in list(_arenas):
        off = arena.offset_of(address, nbytes)
        if off is not None:
            return arena, off
    return None


def current_arena() -> SharedArena | None:
    arenas = list(_arenas)
    return arenas[0] if arenas else None


class BufferPool:
    """Hands out uint8 torch tensors of a requested size and takes them back.

    Up to `max_bytes` of returned buffers are kept for reuse. Without CUDA the
    first `arena_bytes` of buffers come from a shared-memory arena (see above);
    `arena_bytes=0` turns that off.
    """

    def __init__(self, max_bytes: int = 4 << 30, pinned: bool | None = None, arena_bytes: int = 4 << 30):
        import torch

        self._torch = torch
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        if self.pinned and not torch.cuda.is_available():
            raise RuntimeError("pinned buffers need CUDA, and torch sees no CUDA device")
        self.max_bytes = max_bytes
        self._free: dict[int, list] = collections.defaultdict(list)
        self._kept = 0
        self._lock = threading.Lock()
        self.arena = None
        if not self.pinned and arena_bytes:
            try:
                self.arena = SharedArena(arena_bytes)
                _arenas.add(self.arena)
            except OSError as err:  # no sealable memfd here: plain buffers, restores copy once more
                log.warning("no shared buffer arena (%s); restores over shm will be copied once", err)
                self.arena = None

    def get(self, nbytes: int):
        """A uint8 tensor of `nbytes` (contents undefined)."""
        with self._lock:
            if self._free[nbytes]:
                self._kept -= nbytes
                return self._free[nbytes].pop()
        torch = self._torch
        if self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        region = self.arena.allocate(nbytes) if self.arena else None
        if region is None:  # anonymous mappings are page-aligned too
            region = mmap.mmap(-1, nbytes)
        return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps its memory alive

    def prefault(self, nbytes: int) -> int:
        """Reserves and touches the arena's first `nbytes` now, so the first restores
        into them take no page faults on this side (4.7 MB of fresh pages cost a first
        hit about 10 ms on this project's VM); they are the pages get() hands out first.
        Returns the bytes touched (0 without an arena, or where they are in use)."""
        if self.arena is None or nbytes <= 0:
            return 0
        region = self.arena.allocate(min(nbytes, self.arena.size))
        if region is None:
            return 0
        buf = self._torch.frombuffer(region, dtype=self._torch.uint8)
        buf.zero_()
        self.put(buf)
        return buf.numel()

    def put(self, tensor) -> None:
        """Returns a buffer from get() for reuse (the caller no longer touches it);
        an arena buffer's pages serve the next get() of any size."""
        n = tensor.numel()
        off = self.arena.offset_of(tensor.data_ptr(), n) if self.arena is not None and n else None
        if off is not None:
            self.arena.release(off)
            return
        with self._lock:
            if self._kept + n <= self.max_bytes:
                self._free[n].append(tensor)
                self._kept += n
