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
    assert pool.get(4096).data_ptr() == a.data_ptr()  # its pages again
    pool.put(c)  # plain memory is kept for a get of its size
    assert pool.get(4096) is c
    fd = pool.arena.fd
    pool.arena.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is closed: the file goes with the last mapping


def test_released_arena_pages_serve_later_buffers_of_any_size():
    page = 4096
    pool = BufferPool(arena_bytes=8 * page)
    arena = pool.arena

    def offset(t):
        return arena_of(t.data_ptr(), t.numel())[1]

    a, b, c = pool.get(2 * page), pool.get(3 * page), pool.get(page)
    assert [offset(t) for t in (a, b, c)] == [0, 2 * page, 5 * page] and arena.free_bytes == 2 * page
    pool.put(a)
    pool.put(c)  # merges with the free end: holes [0, 2) and [5, 8) pages
    f = pool.get(3 * page)  # too long for the lowest hole
    assert offset(f) == 5 * page and arena.free_bytes == 2 * page
    d = pool.get(page + 1)  # two pages, the lowest hole
    assert offset(d) == 0 and arena.free_bytes == 0
    pool.put(d)
    pool.put(b)  # [0, 2) and [2, 5) become one hole, longer than either buffer was
    e = pool.get(5 * page)
    assert offset(e) == 0 and arena.free_bytes == 0
    e[:] = 3
    assert int(e.sum()) == 3 * 5 * page
    with pytest.raises(ValueError, match="released twice"):
        arena.release(page)  # inside e: not a buffer's start
    # many lengths in turn, as prompts come: each gets the same first pages, and the arena never runs dry
    pool.put(e)
    with pytest.raises(ValueError, match="released twice"):
        pool.put(e)
    pool.put(f)
    for n in [page * k + 123 for k in range(1, 8)] * 3:
        t = pool.get(n)
        assert offset(t) == 0
        pool.put(t)
    assert arena.free_bytes == 8 * page
