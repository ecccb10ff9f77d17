"""BufferPool on a machine without CUDA: page-aligned shared-memory buffers."""

import os

from kvfs.client.pool import BufferPool, arena_of


def test_buffers_come_from_the_arena_until_it_is_full_then_from_plain_memory():
    pool = BufferPool(arena_bytes=3 * 4096)
    assert not pool.pinned and os.path.exists(pool.arena.path)
    a, b = pool.get(4096), pool.get(5000)
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert arena_of(a.data_ptr(), 4096)[1] == 0 and arena_of(b.data_ptr(), 5000)[1] == 4096
    c = pool.get(4096)  # the arena has no room left
    assert c.numel() == 4096 and arena_of(c.data_ptr(), 4096) is None and c.data_ptr() % 4096 == 0
    a[:] = 7
    assert int(a.sum()) == 7 * 4096
    pool.put(a)
    assert pool.get(4096) is a
    path = pool.arena.path
    pool.arena.close()
    assert not os.path.exists(path)  # nothing left behind in /dev/shm
