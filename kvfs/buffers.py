"""Page-aligned host buffers.

The liburing binding reads only into `bytearray`s, and O_DIRECT needs their
start aligned to the page. CPython's bytearray drops bytes from its front by
moving its start pointer (no copy), so over-allocate and trim to the boundary.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import threading

PAGE = 4096
# what a memory file shared with a chunkserver must be sealed with: it can then
# never shrink under the server's mapping (a truncated mapping is SIGBUS on access)
SHARED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def address_of(buf) -> int:
    """The address of a writable buffer's first byte (bytearray, mmap, memoryview)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0


def memmove(dst: int, src: int, n: int) -> None:
    """Copies n bytes between addresses without holding the GIL (ctypes drops it
    around foreign calls; a memoryview slice assignment keeps it), so receiver
    threads and the event loop copy in parallel."""
    ctypes.memmove(dst, src, n)


def sealed_memfd(name: str, size: int) -> int:
    """A sparse memory file of `size` bytes (memfd_create), sealed with SHARED_SEALS:
    its descriptor can be passed to a chunkserver (SCM_RIGHTS), which can map it and
    write into it but never be made to fault on it. Close the descriptor when done."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARED_SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def aligned_bytearray(n: int, align: int = PAGE) -> bytearray:
    """A bytearray of exactly n bytes whose first byte is `align`-aligned.

    n must be at least 2 * align: trimming a larger share of the allocation makes
    CPython move the bytes to a fresh (unaligned) block.
    """
    if n < 2 * align:
        raise ValueError(f"aligned buffers must be at least {2 * align} bytes, not {n}")
    buf = bytearray(n + align)
    del buf[: (-address_of(buf)) % align]
    del buf[n:]
    if address_of(buf) % align:
        raise RuntimeError("could not align a bytearray; CPython's resize policy changed")
    return buf


def byte_view(buf, writable: bool = True) -> memoryview:
    """A flat byte view of a buffer: bytes-like, mmap, numpy array, or a
    contiguous CPU torch tensor (viewed through its data pointer, no copy)."""
    if hasattr(buf, "data_ptr"):  # torch.Tensor, without importing torch here
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("tensor buffers must be contiguous and in host memory")
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("the destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class AlignedBuffers:
    """Reused page-aligned buffers, by size, up to `max_bytes` kept: a fresh one
    costs its page faults and zeroing every time (a chunkserver's reads and
    O_DIRECT writes, a writer's chunks)."""

    def __init__(self, max_bytes: int):
        self._free: dict[int, list[bytearray]] = collections.defaultdict(list)
        self._bytes = 0
        self._max = max_bytes
        self._lock = threading.Lock()

    def get(self, n: int) -> bytearray:
        with self._lock:
            free = self._free.get(n)
            if free:
                self._bytes -= n
                return free.pop()
        return aligned_bytearray(n)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if self._bytes + len(buf) <= self._max:
                self._free[len(buf)].append(buf)
                self._bytes += len(buf)
