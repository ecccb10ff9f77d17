"""Slot files: chunks live in a few large preallocated files per size class.

A chunk of n bytes takes one slot of the smallest power-of-two class >= n (64 KiB
to 64 MiB, as 3FS's chunk engine does), so there is no file per chunk and no
per-chunk filesystem metadata. Files of a class grow in fallocated groups of
slots up to FILE_BYTES, then a new file starts. Which slots are in use is not
stored here: the chunk index is the truth, and the allocator is rebuilt from it
at startup, so a slot written but never indexed (a crash) is simply free again.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import pathlib
import threading
from dataclasses import dataclass

from kvfs.config import KiB, MiB
from kvfs.errors import ResourceExhausted

log = logging.getLogger(__name__)

MIN_CLASS = 64 * KiB
MAX_CLASS = 64 * MiB
GROW_BYTES = 16 * MiB  # fallocate this much (at least one slot) at a time
FILE_BYTES = 1 << 30   # a file takes slots until it reaches this size


def size_class(length: int) -> int:
    """The slot size for a chunk of `length` bytes."""
    if not 0 < length <= MAX_CLASS:
        raise ValueError(f"chunk length {length} is outside 1..{MAX_CLASS}")
    return max(MIN_CLASS, 1 << (length - 1).bit_length())


@dataclass(frozen=True, slots=True)
class SlotRef:
    cls: int   # slot size in bytes
    file: int  # file number within the class
    slot: int  # slot number within the file

    @property
    def offset(self) -> int:
        return self.slot * self.cls


@dataclass(slots=True)
class _File:
    fd: int     # buffered: growth (fallocate) and durability (fsync)
    fd_io: int  # chunk data reads and writes: O_DIRECT in direct mode


class SlotAllocator:
    """Pure bookkeeping of which slots exist and which are free (no I/O).

    `grow(cls, file, slots, wanted)` is called when a class needs more slots: it
    must make between 1 and `wanted` more slots exist at the end of that file
    (which has `slots` now) and return how many it added, or raise.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.allocated_bytes = 0  # bytes of slots that exist in files
        self.used_slots: dict[int, int] = {}  # cls -> slots in use
        self._files: dict[int, list[int]] = {}  # cls -> slot count per file
        self._free: dict[int, list[tuple[int, int]]] = {}  # cls -> heap of (file, slot)
        self._used: set[SlotRef] = set()

    def add_file(self, cls: int, slots: int) -> None:
        """Registers an existing file (at startup, before finish_startup)."""
        self._files.setdefault(cls, []).append(slots)
        self.allocated_bytes += slots * cls

    def mark_used(self, ref: SlotRef) -> None:
        """Claims a specific slot (at startup, from the index)."""
        files = self._files.get(ref.cls, [])
        if ref.file >= len(files) or ref.slot >= files[ref.file]:
            raise ValueError(f"index names slot {ref} beyond its slot file")
        if ref in self._used:
            raise ValueError(f"index names slot {ref} twice")
        self._used.add(ref)
        self.used_slots[ref.cls] = self.used_slots.get(ref.cls, 0) + 1

    def finish_startup(self) -> None:
        """Every slot of the registered files not marked used becomes free."""
        for cls, files in self._files.items():
            heap = [(f, s) for f, n in enumerate(files) for s in range(n)
                    if SlotRef(cls, f, s) not in self._used]
            heapq.heapify(heap)
            self._free[cls] = heap

    def allocate(self, cls: int, grow) -> SlotRef:
        heap = self._free.setdefault(cls, [])
        if not heap:
            self._grow(cls, grow)
        file, slot = heapq.heappop(heap)
        ref = SlotRef(cls, file, slot)
        self._used.add(ref)
        self.used_slots[cls] = self.used_slots.get(cls, 0) + 1
        return ref

    def usage(self) -> dict[int, tuple[int, int]]:
        """Slots per size class: {class bytes: (in use, existing)}."""
        return {cls: (self.used_slots.get(cls, 0), sum(files)) for cls, files in self._files.items()}

    def free(self, ref: SlotRef) -> None:
        self._used.remove(ref)
        self.used_slots[ref.cls] -= 1
        heapq.heappush(self._free[ref.cls], (ref.file, ref.slot))

    def _grow(self, cls: int, grow) -> None:
        room = (self.capacity - self.allocated_bytes) // cls
        if room < 1:
            raise ResourceExhausted(
                f"capacity full: {self.allocated_bytes} of {self.capacity} bytes allocated, "
                f"no free {cls // KiB} KiB slot; delete chunks or raise --capacity")
        files = self._files.setdefault(cls, [])
        per_file = max(1, FILE_BYTES // cls)
        if not files or files[-1] >= per_file:
            files.append(0)
        file = len(files) - 1
        wanted = min(max(1, GROW_BYTES // cls), per_file - files[file], room)
        add = grow(cls, file, files[file], wanted)  # may raise ResourceExhausted (disk full)
        assert 1 <= add <= wanted, (add, wanted)
        heap = self._free[cls]
        for s in range(files[file], files[file] + add):
            heapq.heappush(heap, (file, s))
        files[file] += add
        self.allocated_bytes += add * cls


class SlotFiles:
    """The slot files on disk, each open twice: buffered for growth and fsync,
    and O_DIRECT (in direct mode) for chunk data."""

    def __init__(self, root: pathlib.Path, direct: bool, reserve: int, capacity: int):
        self.root = root
        self.direct = direct
        self.reserve = reserve
        self.allocator = SlotAllocator(capacity)
        self._files: dict[tuple[int, int], _File] = {}
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        for class_dir in sorted(root.iterdir()):
            cls = int(class_dir.name.removesuffix("k")) * KiB
            numbers = sorted(int(p.stem) for p in class_dir.glob("*.slots"))
            if numbers != list(range(len(numbers))):
                raise RuntimeError(f"slot files in {class_dir} are not numbered 0..n-1: {numbers}")
            for n in numbers:
                f = self._open(cls, n)
                self.allocator.add_file(cls, os.fstat(f.fd).st_size // cls)

    def path(self, cls: int, file: int) -> pathlib.Path:
        return self.root / f"{cls // KiB}k" / f"{file:05d}.slots"

    def _open(self, cls: int, file: int) -> _File:
        p = self.path(cls, file)
        new = not p.exists()
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if new:
            _fsync_dir(p.parent)
        fd_io = os.open(p, os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        f = self._files[(cls, file)] = _File(fd, fd_io)
        return f

    def allocate(self, length: int) -> SlotRef:
        with self._lock:
            return self.allocator.allocate(size_class(length), self._grow)

    def free(self, ref: SlotRef) -> None:
        with self._lock:
            self.allocator.free(ref)

    def usage(self) -> dict[int, tuple[int, int]]:
        """Slots per size class: {class bytes: (in use, existing)}. Any thread."""
        with self._lock:
            return self.allocator.usage()

    def fds(self, ref: SlotRef) -> _File:
        return self._files[(ref.cls, ref.file)]

    def _grow(self, cls: int, file: int, slots: int, wanted: int) -> int:
        f = self._files.get((cls, file)) or self._open(cls, file)
        st = os.statvfs(self.root)
        fits = (st.f_bavail * st.f_frsize - self.reserve) // cls
        add = min(wanted, fits)
        if add < 1:
            raise ResourceExhausted(
                f"disk full: {st.f_bavail * st.f_frsize} bytes free on {self.root}, another "
                f"{cls} byte slot would cut into the {self.reserve}-byte reserve kept for the index")
        try:
            os.posix_fallocate(f.fd, slots * cls, add * cls)
        except OSError as err:
            os.ftruncate(f.fd, slots * cls)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(f"disk full while preallocating {self.path(cls, file)}") from err
            raise
        os.fsync(f.fd)  # the new size must survive a crash before slots in it are indexed
        return add

    def close(self) -> None:
        for f in self._files.values():
            os.close(f.fd)
            os.close(f.fd_io)
        self._files.clear()


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_direct(root: pathlib.Path) -> bool:
    """Whether the filesystem under `root` accepts O_DIRECT opens."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True
