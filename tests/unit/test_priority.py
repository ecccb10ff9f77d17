"""Reads first on the CPU (kvfs.priority): write threads, and the metaserver's compaction
threads, run nicer, only they."""

import os
import threading

from helpers import thread_names
from kvfs.checksum import chunk_checksum
from kvfs.priority import MAX_NICE, lower_thread_priority, lower_threads_named, thread_nice

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


def test_rocksdb_compaction_threads_are_lowered_by_name_and_only_they(tmp_path):
    from rocksdict import Options, Rdict

    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))  # starts RocksDB's flush and compaction pools
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        before = {tid: thread_nice(tid) for tid in thread_names(os.getpid())}
        n = lower_threads_named("rocksdb:low", 5)
        names = thread_names(os.getpid())
        low = [tid for tid, name in names.items() if name.startswith("rocksdb:low")]
        # an in-process metaserver (another test's) may have lowered them further already
        want = {tid: max(before.get(tid, base), min(MAX_NICE, base + 5)) for tid in low}
        assert n == len(low) >= 1
        assert {tid: thread_nice(tid) for tid in low} == want
        others = [tid for tid in names if tid not in low and tid in before]
        assert any(names[tid].startswith("rocksdb:high") for tid in others)
        assert all(thread_nice(tid) == before[tid] for tid in others)  # flushes and Python's threads keep theirs
        assert lower_threads_named("rocksdb:low", 5) == n  # again: counted, not lowered further
        assert {tid: thread_nice(tid) for tid in low} == want
        assert lower_threads_named("rocksdb:low", 0) == 0
        assert lower_threads_named("no such thread", 5) == 0
    finally:
        db.close()


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
