"""Reads first on the CPU (kvfs.priority): write threads run nicer, only they."""

import os
import threading

from kvfs.checksum import chunk_checksum
from kvfs.priority import MAX_NICE, lower_thread_priority, thread_nice

MiB = 1 << 20


def in_thread(fn):
    """fn() on a fresh thread: (its result, that thread's niceness after it)."""
    out = {}

    def run():
        out["result"] = fn()
        out["nice"] = thread_nice()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["result"], out["nice"]


def test_lowers_the_calling_thread_only():
    base = thread_nice()
    done, nice = in_thread(lambda: lower_thread_priority(4))
    assert done is True and nice == min(MAX_NICE, base + 4)
    assert thread_nice() == base  # the caller's thread, and so the process's others, keep theirs
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == base


def test_caps_at_19_and_zero_changes_nothing():
    base = thread_nice()
    assert in_thread(lambda: lower_thread_priority(100)) == (True, MAX_NICE)
    assert in_thread(lambda: lower_thread_priority(0)) == (False, base)


async def test_store_checksums_and_disk_writes_run_at_write_nice(make_store):
    store = make_store(write_nice=7)
    base = thread_nice()
    data = os.urandom(2 * MiB)
    assert await store.write(b"c1", data, chunk_checksum(data))
    io = [t for t in threading.enumerate() if t.name.startswith("chunk-io")]
    assert io and {thread_nice(t.native_id) for t in io} == {min(MAX_NICE, base + 7)}
    assert thread_nice() == base  # the loop's thread serves reads at the server's priority
    results = await store.read([(b"c1", 0, len(data))])
    assert results[0].data == data


async def test_write_nice_zero_keeps_the_store_threads_priority(make_store):
    store = make_store(write_nice=0)
    base = thread_nice()
    data = os.urandom(MiB)
    assert await store.write(b"c2", data, chunk_checksum(data))
    io = [t for t in threading.enumerate() if t.name.startswith("chunk-io")]
    assert io and {thread_nice(t.native_id) for t in io} == {base}
