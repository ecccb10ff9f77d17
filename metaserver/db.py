"""The metaserver's RocksDB: opened with a bounded block cache, written
without waiting for the disk, made durable in groups.

Rows are updated in place in the memtable (`inplace_update_support`): a hot
prompt's rows are rewritten on every flush of its hits, and with a new version
per rewrite an iterator steps over all of them until the memtable is flushed.
Measured on one 2,000-block row run: a lookup took 1.8 ms with one version of
each row and 10.5 ms after 260 rewrites; in place, 1.8 ms after as many. In-place
updates give up point-in-time iterators and snapshots under concurrent writes:
this database is read and written from one thread (the event loop) and takes no
snapshots.

Every change is one WriteBatch applied at once (readers see it immediately);
a caller that must not answer before its change is on disk awaits `durable()`,
and all the callers waiting at one time share one WAL fsync, on a thread. A
crash loses at most changes nobody was told about: RocksDB recovers a prefix of
the batches, never part of one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from rocksdict import BlockBasedOptions, Cache, Options, Rdict, ReadOptions, WriteBatch

from kvfs.priority import lower_threads_named

from . import groups
from .records import COUNTER, FORMAT, FORMAT_KEY, read_u64, u64

log = logging.getLogger(__name__)

SLOW_WRITE = 0.025  # seconds: a write longer than this is counted and reported (MetaDB._slow_write)
SLOW_REPORT_EVERY = 10.0  # seconds: at most one line per this


def successor(prefix: bytes) -> bytes | None:
    """The least key above every key that starts with `prefix` (None: no such key)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


class Batch:
    """One atomic change: a RocksDB WriteBatch, and the block rows it puts or
    removes, which go into their row groups (groups.py) when it is written, with
    the index entries of row groups the rows it puts need (replica, expiry), each once."""

    __slots__ = ("wb", "rows", "marks")

    def __init__(self):
        self.wb = WriteBatch(raw_mode=True)
        self.rows: dict[tuple[bytes, int], bytes | None] = {}  # (namespace digest, slot) -> row; None: removed
        self.marks: set[bytes] = set()  # group index entries to put (records.replica_key, expiry_key)

    def put(self, key: bytes, value: bytes) -> None:
        self.wb.put(key, value)

    def delete(self, key: bytes) -> None:
        self.wb.delete(key)

    def put_row(self, namespace_digest: bytes, slot: int, raw: bytes) -> None:
        self.rows[(namespace_digest, slot)] = raw

    def delete_row(self, namespace_digest: bytes, slot: int) -> None:
        self.rows[(namespace_digest, slot)] = None


@dataclass(frozen=True, slots=True)
class OffLoop:
    """What a step generator (state.run_steps) yields to have `fn(*args)`, a read,
    made off the event loop, on the database's reader thread; its result is sent
    back into the generator. A read of a page the page cache no longer holds waits
    on the disk, and rocksdict lets go of the GIL meanwhile, so the loop serves
    lookups and heartbeats instead of waiting too (on this project's machines such a
    read of an SST page took up to 200 ms while compactions wrote). Only for reads
    whose answer may be a moment old: the loop writes meanwhile."""

    fn: Callable
    args: tuple


class MetaDB:
    def __init__(self, path: str, cache_bytes: int, compaction_nice: int = 0):
        os.makedirs(path, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_allow_concurrent_memtable_write(False)  # required by in-place updates
        opts.set_inplace_update_support(True)
        # Files a flush or compaction made obsolete are deleted by RocksDB's background
        # threads, not by whichever thread drops the last reference to them: that is often
        # the event loop (a read, an iterator's end), and on a filesystem mounted with
        # `discard` an unlink waits for the device to trim the file. At 10M+ blocks the
        # loop's thread was seen blocked 32 ms in ext4_free_blocks -> blkdev_issue_discard
        # under unlink (its kernel stack, sampled from /proc).
        opts.set_avoid_unnecessary_blocking_io(True)
        table = BlockBasedOptions()
        self._cache = Cache(cache_bytes)  # must outlive the database
        table.set_block_cache(self._cache)
        # Whole-key Bloom filters, 10 bits a key (about 1% false positives): a point read of
        # a key that is not there (an allocation's new blocks, each checked first) skips
        # every file the filter rules out instead of reading one of its data blocks, from
        # the page cache or the disk once the database outgrows the block cache. On 3M
        # keys in one level with an 8 MiB cache, 500 absent keys took 3.1 ms, 0.37 ms
        # filtered. The filters stay in memory beside the index blocks, about 1.25 bytes
        # per key (some 6 per block); kept in the block cache instead, partitioned, the
        # same reads took 1.0 ms.
        table.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(table)
        # The options go to the default column family by name too: reopening a database without
        # them, rocksdict opened it with the column family's options as saved (the cache's size
        # kept, but no filter policy), so every restarted metaserver read without its Bloom
        # filters (its LOG: "filter_policy: nullptr"). On a 10M-block database so reopened, a
        # multi-get of 8 absent keys within the stored range took 138 us, 17 a key.
        self.db = Rdict(os.path.join(path, "meta"), opts, column_families={"default": opts})
        # Lookups first on the CPU: compactions are background work that can wait, and
        # the event loop's thread shares the host's cores with them (at 10M blocks they
        # took 3-9% of a core while writers evicted; docs/operations.md). The pool's
        # threads (RocksDB's default environment, one per process) exist once a database
        # is open; flushes ("rocksdb:high") keep the server's priority, since writes
        # stall once memtables wait for them.
        if compaction_nice and (n := lower_threads_named("rocksdb:low", compaction_nice)):
            log.info("RocksDB compaction threads: %d at niceness +%d", n, compaction_nice)
        fmt = self.db.get(FORMAT_KEY)
        if fmt is None:
            it = self.db.iter()
            it.seek_to_first()
            if it.valid():
                raise RuntimeError(f"{path} holds metadata of an older format; move it away and start with "
                                   f"--rebuild to recover the blocks from the chunkservers' inventories")
            self.db.put(FORMAT_KEY, u64(FORMAT))
        elif read_u64(fmt) != FORMAT:
            raise RuntimeError(f"{path} holds metadata format {read_u64(fmt)}; this metaserver reads {FORMAT}")
        self._writes = 0  # batches written
        self.slow_writes = 0  # of those, the ones that took over SLOW_WRITE (_slow_write)
        # since when the next slow-write line counts (the last line, or the opening), the count then, the worst since
        self._slow_since, self._slow_counted, self._slow_worst = time.monotonic(), 0, (0.0, 0, 0, 0.0)
        self._synced = 0  # of those, the ones known durable
        self._syncing: asyncio.Future | None = None
        self._syncer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-sync")
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-read")  # OffLoop reads

    def write(self, batch: Batch) -> None:
        staged = time.perf_counter()
        if batch.rows:
            groups.stage(self.db, batch.rows, batch.wb)  # reads the row groups it changes (a multi-get)
        for key in batch.marks:
            batch.wb.put(key, b"")
        size = (batch.wb.len(), batch.wb.size_in_bytes())  # the batch is consumed by the write
        began = time.perf_counter()
        self.db.write(batch.wb)
        self._writes += 1
        if (took := time.perf_counter() - staged) > SLOW_WRITE:
            self._slow_write(took, *size, began - staged)

    def _slow_write(self, took: float, changes: int, nbytes: int, staging: float = 0.0) -> None:
        """Counts a RocksDB write that held the calling thread (and, rocksdict keeping the
        GIL through it, every thread of the process) over SLOW_WRITE; logs the worst,
        with its size, at most every SLOW_REPORT_EVERY seconds. A stall line samples the
        loop only after such a call returns, so it cannot name it."""
        self.slow_writes += 1
        now = time.monotonic()
        if took > self._slow_worst[0]:
            self._slow_worst = (took, changes, nbytes, staging)
        if self.slow_writes == 1 or now - self._slow_since >= SLOW_REPORT_EVERY:  # the first at once
            worst, keys, size, read = self._slow_worst
            log.warning("a RocksDB write took %.0f ms (%d changes, %d bytes; %.0f ms of it reading and packing "
                        "its row groups first); %d writes over %.0f ms in the last %.0f s", 1e3 * worst, keys, size,
                        1e3 * read, self.slow_writes - self._slow_counted, 1e3 * SLOW_WRITE, now - self._slow_since)
            self._slow_since = now
            self._slow_counted, self._slow_worst = self.slow_writes, (0.0, 0, 0, 0.0)

    def put(self, key: bytes, value: bytes) -> None:
        began = time.perf_counter()
        self.db.put(key, value)
        self._writes += 1
        if (took := time.perf_counter() - began) > SLOW_WRITE:
            self._slow_write(took, 1, len(key) + len(value))

    def get(self, key):
        return self.db.get(key)

    def counter(self, name: bytes) -> int:
        return read_u64(self.db.get(COUNTER + name))

    def sync(self) -> None:
        """Makes everything written so far durable, now (for start-up and shutdown)."""
        self.db.flush_wal(True)
        self._synced = self._writes

    async def durable(self) -> None:
        """Returns once every batch written before the call is on disk."""
        target = self._writes
        while self._synced < target:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync_round())
            await asyncio.shield(self._syncing)

    async def _sync_round(self) -> None:
        upto = self._writes
        try:
            await asyncio.get_running_loop().run_in_executor(self._syncer, self.db.flush_wal, True)
            self._synced = max(self._synced, upto)
        finally:
            self._syncing = None

    def scan(self, prefix: bytes, start: bytes = b"", limit: int = 1 << 62, stop: bytes | None = None):
        """Keys (and values) under `prefix`, from `start` (a key) on, before `stop`, at most `limit`.

        The iterator is bounded to the prefix: a scan that reaches its end stops
        there, instead of stepping over whatever deleted entries follow it (the
        front of the next index, a queue consumed from the front, can be tens of
        thousands of them: 4 ms for the eviction index's last key after a large
        eviction had emptied the front of the expiry index behind it)."""
        opts = ReadOptions()
        bound = successor(prefix)
        if stop is not None and (bound is None or stop < bound):
            bound = stop
        if bound is not None:
            opts.set_iterate_upper_bound(bound)
        it = self.db.iter(opts)
        it.seek(start or prefix)
        n = 0
        while it.valid() and n < limit:
            key = it.key()
            if not key.startswith(prefix) or (stop is not None and key >= stop):
                return
            yield key, it.value()
            n += 1
            it.next()

    def has_prefix(self, prefix: bytes, skip: frozenset[bytes] | set[bytes] = frozenset()) -> bool:
        """Whether some key starts with `prefix`, other than those in `skip` (keys
        being deleted in a batch not written yet). Reads at most len(skip) + 1 keys."""
        for key, _ in self.scan(prefix, limit=len(skip) + 1):
            if key not in skip:
                return True
        return False

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        self.sync()
        self._syncer.shutdown(wait=True)
        self.db.close()
