"""BufferPool: reusable host buffers for restores.

With CUDA, buffers are pinned (page-locked) torch tensors, so a restore's bytes
can go to the GPU by DMA. Without CUDA (`torch.empty(pin_memory=True)` raises
there), they are page-aligned anonymous mappings viewed as torch tensors.
"""

from __future__ import annotations

import collections
import mmap
import threading


class BufferPool:
    """Hands out uint8 torch tensors of a requested size and takes them back.

    Up to `max_bytes` of returned buffers are kept for reuse.
    """

    def __init__(self, max_bytes: int = 4 << 30, pinned: bool | None = None):
        import torch

        self._torch = torch
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        if self.pinned and not torch.cuda.is_available():
            raise RuntimeError("pinned buffers need CUDA, and torch sees no CUDA device")
        self.max_bytes = max_bytes
        self._free: dict[int, list] = collections.defaultdict(list)
        self._kept = 0
        self._lock = threading.Lock()

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
        # anonymous mappings are page-aligned; the tensor keeps its mapping alive
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)

    def put(self, tensor) -> None:
        """Returns a buffer from get() for reuse."""
        n = tensor.numel()
        with self._lock:
            if self._kept + n <= self.max_bytes:
                self._free[n].append(tensor)
                self._kept += n
