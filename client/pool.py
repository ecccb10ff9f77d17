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
    """

    def __init__(self, size: int):
        self.fd = sealed_memfd("kvfs-arena", size)  # sparse: pages exist only once reserved
        self.map = mmap.mmap(self.fd, size)
        self.size = size
        self.address = address_of(self.map)
        self._next = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, self.fd)
        atexit.register(self._finalizer)

    def allocate(self, nbytes: int) -> memoryview | None:
        """A buffer in the arena, or None when the arena or memory is full."""
        with self._lock:
            start = self._next
            end = start + -(-nbytes // PAGE) * PAGE
            if end > self.size:
                return None
            try:
                # reserve the pages now: a full memory cgroup refuses here, not on first touch
                os.posix_fallocate(self.fd, start, end - start)
            except OSError:
                return None
            self._next = end
        return memoryview(self.map)[start : start + nbytes]

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

    def put(self, tensor) -> None:
        """Returns a buffer from get() for reuse."""
        n = tensor.numel()
        with self._lock:
            if self._kept + n <= self.max_bytes:
                self._free[n].append(tensor)
                self._kept += n
