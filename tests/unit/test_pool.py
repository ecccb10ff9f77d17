"""BufferPool on a machine without CUDA: page-aligned shared-memory buffers."""

import fcntl
import os

import pytest

from kvfs.buffers import SHARED_SEALS
from kvfs.client.pool import BufferPool, arena_of


def test_buffers_come_from_the_arena_until_it_is_full_then_from_plain_memory():
    pool = BufferPool(arena_bytes=3 * 4096)
    assert not pool.pinned
    # a memory file that can never shrink under a chunkserver that maps it
    assert fcntl.fcntl(pool.arena.fd, fcntl.F_GET_SEALS) & SHARED_SEALS == SHARED_SEALS
    with pytest.raises(PermissionError):
        os.ftruncate(pool.arena.fd, 4096)
    a, b = pool.get(4096), pool.get(5000)
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert arena_of(a.data_ptr(), 4096)[1] == 0 and arena_of(b.data_ptr(), 5000)[1] == 4096
    c = pool.get(4096)  # the arena has no room left
    assert c.numel() == 4096 and arena_of(c.data_ptr(), 4096) is None and c.data_ptr() % 4096 == 0
    a[:] = 7
    assert int(a.sum()) == 7 * 4096
    pool.put(a)
    assert pool.get(4096) is a
    fd = pool.arena.fd
    pool.arena.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is closed: the file goes with the last mapping
