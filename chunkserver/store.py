"""The chunk store: slot files for bytes, a RocksDB index for where they are.

Write path (crash-safe): checksum on arrival -> take a free slot -> pwrite ->
group commit (one fdatasync per dirty slot file and one synced RocksDB batch for
every write that arrived meanwhile) -> acknowledge. A chunk becomes visible only
through its index entry, which is written after its bytes are durable, so a
crash at any instant leaves every acknowledged chunk intact and no torn one
visible; a slot written but not yet indexed is free again after restart.

Read path: index lookups, then all ranges of a request go to the disk together
(io_uring), each verified against per-64 KiB xxh3 checksums before any byte of
it leaves the store.

Corruption: a chunk that fails its checksums (on a client read or in the
scrubber, chunkserver/scrub.py) is removed, and its id and owner record are
kept under b"l" in the index until a heartbeat has told the metaserver it is
lost; the removal and that note are one synced batch, so a crash loses neither.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import pathlib
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from kvfs.buffers import PAGE, AlignedBuffers, address_of
from kvfs.checksum import BLOCK, block_checksum, block_checksums, checksum_of_blocks
from kvfs.config import MiB
from kvfs.errors import AlreadyExists, DataLoss, Internal, InvalidArgument, ResourceExhausted, Unavailable
from kvfs import wire
from kvfs.grants import owner_namespace
from kvfs.priority import lower_thread_priority

from .config import ChunkserverConfig
from .pacing import ReadPacer
from .slots import SlotFiles, SlotRef, probe_direct
from .uring import open_reader, settle

log = logging.getLogger(__name__)

MAX_ID = 64
_KEY_PREFIX = b"c"
_LOST_PREFIX = b"l"  # chunk id -> owner record of a chunk removed as corrupt, until reported
_HEAD = struct.Struct("<BBIIIQdI")  # version, log2(class), file, slot, length, xxh3, created, blocks
_VERSION = 1


def short_id(chunk_id: bytes) -> str:
    return "0x" + chunk_id.hex()[:16] + ("…" if len(chunk_id) > 8 else "")


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    slot: SlotRef
    length: int
    checksum: int
    blocks: tuple[int, ...]
    created: float
    owner: bytes

    def pack(self) -> bytes:
        head = _HEAD.pack(_VERSION, self.slot.cls.bit_length() - 1, self.slot.file, self.slot.slot,
                          self.length, self.checksum, self.created, len(self.blocks))
        return head + struct.pack(f"<{len(self.blocks)}Q", *self.blocks) + self.owner

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkRecord:
        version, log2, file, slot, length, xxh, created, n = _HEAD.unpack_from(raw)
        if version != _VERSION:
            raise ValueError(f"index record version {version} is not {_VERSION}")
        blocks = struct.unpack_from(f"<{n}Q", raw, _HEAD.size)
        owner = raw[_HEAD.size + 8 * n :]
        return cls(SlotRef(1 << log2, file, slot), length, xxh, blocks, created, owner)


@dataclass(slots=True)
class ReadResult:
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    data: bytes = b""
    length: int = 0
    checksum: int = 0
    blocks: tuple[int, ...] = ()  # every block checksum of the chunk


@dataclass(frozen=True, slots=True)
class PlannedRead:
    index: int  # position in the request
    chunk_id: bytes
    rec: ChunkRecord
    offset: int
    length: int


@dataclass(slots=True)
class Counters:
    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    deletes: int = 0
    checksum_errors: int = 0
    rejected_requests: int = 0
    scrubbed_bytes: int = 0
    scrub_passes: int = 0
    corrupt_chunks_removed: int = 0
    reads_paced: int = 0  # reads that waited for their tenant's pace (pacing.py)
    paced_seconds: float = 0.0  # how long, in all
    writes_deferred: int = 0  # writes that waited for client reads in flight (reads first, write_yield)
    deferred_seconds: float = 0.0  # how long, in all


@dataclass(slots=True)
class _Commit:
    puts: list[tuple[bytes, bytes]]
    deletes: list[bytes]
    fds: set[int]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _GroupCommitter:
    """One thread that makes many writers' data and index entries durable together."""

    def __init__(self, db: Rdict):
        self._db = db
        self._sync = WriteOptions()
        self._sync.sync = True
        self._queue: queue.SimpleQueue[_Commit | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def submit(self, puts=(), deletes=(), fds=()) -> concurrent.futures.Future:
        item = _Commit(list(puts), list(deletes), set(fds))
        self._queue.put(item)
        return item.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                for fd in set().union(*(c.fds for c in batch)):
                    os.fdatasync(fd)
                wb = WriteBatch(raw_mode=True)
                for c in batch:
                    for k, v in c.puts:
                        wb.put(k, v)
                    for k in c.deletes:
                        wb.delete(k)
                self._db.write(wb, self._sync)
            except BaseException as exc:  # every waiter learns of the failure
                for c in batch:
                    settle(c.future, exc=exc)
            else:
                for c in batch:
                    settle(c.future, None)


def run_to_completion(awaitable):
    """Awaits `awaitable` but lets it finish if the caller is cancelled (a client
    deadline, a hedged read that lost): slot writes, commits and kernel reads into
    pooled buffers run on other threads and must complete before their buffers and
    slots are reused or freed."""
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" noise
    return asyncio.shield(task)


def _page_aligned_whole(view: memoryview, padded: int) -> memoryview | None:
    """`view` grown to `padded` bytes if it starts a page-aligned bytearray that long
    or longer (the data port's receive buffers), else None."""
    buf = view.obj
    if not isinstance(buf, bytearray) or len(buf) < padded or address_of(buf) % PAGE:
        return None
    whole = memoryview(buf)
    return whole[:padded] if address_of(whole) == address_of(view) else None


class ChunkStore:
    """Chunks in slot files, indexed in RocksDB. Use from one asyncio loop."""

    def __init__(self, cfg: ChunkserverConfig):
        self.cfg = cfg
        root = pathlib.Path(cfg.data_dir)
        root.mkdir(parents=True, exist_ok=True)
        slots_dir = root / "slots"
        if cfg.io_mode == "auto":
            self.io_mode = "direct" if probe_direct(slots_dir) else "buffered"
        else:
            self.io_mode = cfg.io_mode
        if cfg.io_mode == "auto" and self.io_mode == "buffered":
            log.warning("filesystem under %s refuses O_DIRECT; reading buffered", slots_dir)
        self.slots = SlotFiles(slots_dir, self.io_mode == "direct", cfg.reserve, cfg.capacity)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_avoid_unnecessary_blocking_io(True)  # obsolete files deleted off the loop (metaserver/db.py)
        self._db = Rdict(str(root / "index"), opts)
        self.counters = Counters()
        self.pacer = ReadPacer(cfg.tenant_read_rate, self.counters)
        self.chunk_count = 0
        self.used_bytes = 0
        self._recover()
        self.reader = open_reader(cfg.io_engine, cfg.uring_entries)
        self._committer = _GroupCommitter(self._db)
        # writes' checksums and disk writes (reads have threads of their own): nicer, so restores come first
        self._io = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="chunk-io",
                                                         initializer=lower_thread_priority,
                                                         initargs=(cfg.write_nice,))
        self._pool = AlignedBuffers(256 * MiB)
        self._writing: dict[bytes, threading.Event] = {}  # chunk id -> set once its write is done
        self._write_lock = threading.Lock()  # over _writing: writes come from the loop's threads and the data port's
        self._writes_in_flight = 0  # store_chunk calls under way (close() waits for them)
        self._writes_done = threading.Condition(self._write_lock)
        self._closing = False
        self._pins: collections.Counter[SlotRef] = collections.Counter()
        self._free_after_read: set[SlotRef] = set()
        self._pin_lock = threading.Lock()  # pins are taken by gRPC reads and data-port threads
        # reads first: a write waits up to cfg.write_yield for the client reads in flight
        # (counted under _pin_lock) before it takes the disk
        self._client_reads = 0
        self.writes_waiting = 0  # for them, now
        self._no_client_reads = threading.Event()
        self._no_client_reads.set()
        self._delete_lock = asyncio.Lock()
        # chunks a client read found corrupt, for the scrubber to verify again and remove;
        # on_suspect (set by the scrubber) wakes it, from whichever thread found one
        self._suspects: dict[bytes, ChunkRecord] = {}
        self.on_suspect: Callable[[], None] | None = None
        # full: the last write that needed a slot found no room (capacity or filesystem),
        # until a write is stored or a delete frees a slot; on_full hears each change
        # (the health service, chunkserver/health.py). Known only from writes: a store
        # filled before a restart looks full at its first refused write.
        self.full = False
        self.on_full: Callable[[bool], None] = lambda full: None

    def _recover(self) -> None:
        started = time.monotonic()
        for key, raw in self._db.items():
            if not key.startswith(_KEY_PREFIX):
                continue
            rec = ChunkRecord.unpack(raw)
            self.slots.allocator.mark_used(rec.slot)
            self.chunk_count += 1
            self.used_bytes += rec.length
        self.slots.allocator.finish_startup()
        log.info("index recovered: %d chunks, %d bytes, in %.3fs (io_mode=%s)",
                 self.chunk_count, self.used_bytes, time.monotonic() - started, self.io_mode)

    def close(self) -> None:
        """Refuses new writes, lets the ones under way finish (their group commits
        included: the committer is still running), then closes everything."""
        with self._write_lock:
            self._closing = True
            while self._writes_in_flight:
                self._writes_done.wait()
        self._io.shutdown(wait=True, cancel_futures=True)
        self._committer.close()
        self.reader.close()
        self._db.close()
        self.slots.close()

    # -- lookups -----------------------------------------------------------

    def _check_id(self, chunk_id: bytes) -> None:
        if not 0 < len(chunk_id) <= MAX_ID:
            raise InvalidArgument(f"chunk id must be 1..{MAX_ID} bytes, got {len(chunk_id)}")

    def get(self, chunk_id: bytes) -> ChunkRecord | None:
        raw = self._db.get(_KEY_PREFIX + chunk_id)
        return None if raw is None else ChunkRecord.unpack(raw)

    # -- writes ------------------------------------------------------------

    async def write(self, chunk_id: bytes, data: bytes | bytearray, expected: int, owner: bytes = b"") -> bool:
        """Stores a chunk durably; False if an identical one was already there. The
        work is store_chunk's, on one of the store's write threads."""
        loop = asyncio.get_running_loop()
        return await run_to_completion(loop.run_in_executor(self._io, self.store_chunk, chunk_id, data, expected,
                                                            owner))

    def store_chunk(self, chunk_id: bytes, data: bytes | bytearray | memoryview, expected: int,
                    owner: bytes = b"") -> bool:
        """write(), blocking, from any thread but the event loop's (a data-port
        connection calls it on its own: a chunk's checksums, its disk write and the
        wait for its group commit take no turn of the loop and no other thread)."""
        self._check_id(chunk_id)
        if not 0 < len(data) <= self.cfg.max_chunk_size:
            raise InvalidArgument(f"chunk length must be 1..{self.cfg.max_chunk_size} bytes, got {len(data)}")
        blocks = block_checksums(data)
        actual = checksum_of_blocks(blocks)
        if actual != expected:
            raise DataLoss(f"chunk {short_id(chunk_id)}: checksum mismatch on arrival "
                           f"(sent {expected:#018x}, received bytes hash to {actual:#018x}); nothing stored")
        with self._write_lock:
            if self._closing:
                raise Unavailable(f"chunk {short_id(chunk_id)}: this chunkserver is shutting down; write it "
                                  f"elsewhere")
            self._writes_in_flight += 1
        try:
            return self._store_admitted(chunk_id, data, actual, blocks, owner)
        finally:
            with self._write_lock:
                self._writes_in_flight -= 1
                self._writes_done.notify_all()

    def _store_admitted(self, chunk_id: bytes, data, actual: int, blocks: list[int], owner: bytes) -> bool:
        while True:  # a concurrent writer of the same id goes first
            with self._write_lock:
                busy = self._writing.get(chunk_id)
                if busy is None:
                    done = self._writing[chunk_id] = threading.Event()
                    break
            busy.wait()
        try:
            existing = self.get(chunk_id)
            if existing is not None:
                if existing.checksum == actual and existing.length == len(data):
                    return False
                raise AlreadyExists(f"chunk {short_id(chunk_id)} exists with other bytes ({existing.length} "
                                    f"bytes, xxh3 {existing.checksum:#018x}); chunks are write-once")
            ref = None
            try:
                ref = self._place(data)
                rec = ChunkRecord(ref, len(data), actual, tuple(blocks), time.time(), bytes(owner))
                self._committer.submit(puts=[(_KEY_PREFIX + chunk_id, rec.pack())],
                                       fds=[self.slots.fds(ref).fd]).result()
            except BaseException as err:
                if ref is not None:
                    self.slots.free(ref)
                elif isinstance(err, ResourceExhausted):  # no slot for it: capacity or filesystem full
                    with self._pin_lock:  # as a write stored or a delete clears it: one order of changes
                        self._set_full(True)
                raise
        finally:
            with self._write_lock:
                del self._writing[chunk_id]
            done.set()
        with self._pin_lock:  # the loop's deletes change the same counts
            self.chunk_count += 1
            self.used_bytes += len(data)
            self.counters.writes += 1
            self.counters.write_bytes += len(data)
            self._set_full(False)
        return True

    def _yield_to_reads(self) -> None:
        """Reads first: waits (in an I/O thread) until no client read is in flight,
        at most write_yield; counted when it waited."""
        if self.cfg.write_yield <= 0 or self._no_client_reads.is_set():
            return
        t0 = time.perf_counter()
        with self._pin_lock:
            self.writes_waiting += 1
        self._no_client_reads.wait(self.cfg.write_yield)
        with self._pin_lock:
            self.writes_waiting -= 1
            self.counters.writes_deferred += 1
            self.counters.deferred_seconds += time.perf_counter() - t0

    def _place(self, data) -> SlotRef:
        """Takes a slot and writes the chunk into it (in an I/O thread), after the
        client reads in flight (or write_yield)."""
        self._yield_to_reads()
        ref = self.slots.allocate(len(data))
        staging = None
        try:
            view = memoryview(data)
            if self.io_mode == "direct":
                # O_DIRECT wants an aligned source and whole pages; the slot has room
                # for the padding. Here it writes ~4x faster than buffered + fdatasync.
                padded = max(2 * PAGE, -(-len(view) // PAGE) * PAGE)
                whole = _page_aligned_whole(view, padded)
                if whole is not None:  # received into one of our aligned buffers (the data port): no copy
                    view = whole
                else:
                    staging = self._pool.get(padded)
                    staging[: len(view)] = view
                    view = memoryview(staging)
            fd, pos = self.slots.fds(ref).fd_io, 0
            while pos < len(view):
                pos += os.pwrite(fd, view[pos:], ref.offset + pos)
        except OSError as err:
            self.slots.free(ref)
            if err.errno == 28:  # ENOSPC despite preallocation (thin-provisioned disk)
                raise ResourceExhausted(f"disk full writing slot {ref}") from err
            raise Internal(f"write to slot {ref} failed: {err}") from err
        finally:
            if staging is not None:
                self._pool.put(staging)
        return ref

    def _set_full(self, full: bool) -> None:
        """Notes whether the store is full; on_full hears a change, on the thread
        that found it (writes' threads or the loop), so it must be thread-safe."""
        if full != self.full:
            self.full = full
            self.on_full(full)

    # -- reads -------------------------------------------------------------

    def plan_reads(self, ranges: list[tuple[bytes, int, int]], namespace: bytes | None = None,
                   client: bool = True) -> tuple[list[ReadResult], list[PlannedRead]]:
        """Validates (chunk id, offset, length) ranges (length 0: to the end) and
        pins the slots of the good ones. Bad ranges get their error result
        (NOT_FOUND, OUT_OF_RANGE; with `namespace`, the one a read grant is for,
        PERMISSION_DENIED for a chunk whose owner record names another); a bad
        request as a whole raises InvalidArgument. Callers must release() the
        plan (with the same `client`: a client's read, which writes wait for,
        not the scrubber's). Safe from any thread."""
        if len(ranges) > self.cfg.max_ranges:
            raise InvalidArgument(f"{len(ranges)} ranges in one read; at most {self.cfg.max_ranges}")
        results = [ReadResult() for _ in ranges]
        plan: list[PlannedRead] = []
        total = 0
        records: dict[bytes, ChunkRecord | None] = {}  # each chunk's record read once, however many ranges name it
        for i, (chunk_id, offset, length) in enumerate(ranges):
            self._check_id(chunk_id)
            if chunk_id not in records:
                records[chunk_id] = self.get(chunk_id)
            rec = records[chunk_id]
            if rec is not None and namespace is not None and owner_namespace(rec.owner) != namespace:
                results[i] = ReadResult(grpc.StatusCode.PERMISSION_DENIED,
                                        f"chunk {short_id(chunk_id)} is not in the namespace the read grant is for")
                continue
            if rec is not None:
                length = length or rec.length - offset
                if offset >= rec.length or length <= 0 or offset + length > rec.length:
                    results[i] = ReadResult(grpc.StatusCode.OUT_OF_RANGE,
                                            f"range [{offset}, {offset + length}) is outside chunk "
                                            f"{short_id(chunk_id)} of {rec.length} bytes")
                    continue
                total += wire.widen(offset, length, rec.length)[1]  # what is read and sent, not what was asked
                if total > self.cfg.max_read_bytes:  # refused as soon as it is known, the rest unread
                    raise InvalidArgument(f"read of more than {self.cfg.max_read_bytes} bytes in one call (its ranges "
                                          f"widened to whole {BLOCK >> 10} KiB checksum blocks); at most "
                                          f"{self.cfg.max_read_bytes}")
                plan.append(PlannedRead(i, chunk_id, rec, offset, length))
            else:
                results[i] = ReadResult(grpc.StatusCode.NOT_FOUND, f"chunk {short_id(chunk_id)} not found on {self.cfg.id}")
        with self._pin_lock:
            for p in plan:
                self._pins[p.rec.slot] += 1
        # a delete that committed between the lookup and the pin may have freed the
        # slot: look again now that the pin holds it
        kept = []
        now = {chunk_id: self.get(chunk_id) for chunk_id in {p.chunk_id for p in plan}}
        for p in plan:
            if now[p.chunk_id] == p.rec:
                kept.append(p)
            else:
                self._unpin(p.rec.slot)
                results[p.index] = ReadResult(grpc.StatusCode.NOT_FOUND,
                                              f"chunk {short_id(p.chunk_id)} not found on {self.cfg.id}")
        if client and kept:
            with self._pin_lock:
                self._client_reads += 1
                self._no_client_reads.clear()
        return results, kept

    def release(self, plan: list[PlannedRead], client: bool = True) -> None:
        for p in plan:
            self._unpin(p.rec.slot)
        if client and plan:
            with self._pin_lock:
                self._client_reads -= 1
                if not self._client_reads:
                    self._no_client_reads.set()

    @staticmethod
    def buffer_bytes(p: PlannedRead) -> int:
        """The buffer disk_reads reads a planned range into: the 64 KiB blocks it touches."""
        return (-(-(p.offset + p.length) // BLOCK) - p.offset // BLOCK) * BLOCK

    def disk_reads(self, plan: list[PlannedRead]) -> list[tuple[int, int, bytearray]]:
        """io_uring ops reading the 64 KiB blocks each planned range touches,
        into pooled aligned buffers (give them back with put_buffer)."""
        return [(self.slots.fds(p.rec.slot).fd_io, p.rec.slot.offset + p.offset // BLOCK * BLOCK,
                 self._pool.get(self.buffer_bytes(p))) for p in plan]

    def get_buffer(self, n: int) -> bytearray:
        """A pooled page-aligned buffer of n (>= 8192) bytes; give it back with put_buffer."""
        return self._pool.get(n)

    def put_buffer(self, buf: bytearray) -> None:
        self._pool.put(buf)

    def count_read(self, nbytes: int) -> None:
        with self._pin_lock:
            self.counters.reads += 1
            self.counters.read_bytes += nbytes

    def count_checksum_error(self, chunk_id: bytes, rec: ChunkRecord, scrub: bool = False) -> None:
        """Counts a failed verification; one a client read found becomes a suspect. Any thread."""
        with self._pin_lock:
            self.counters.checksum_errors += 1
            if not scrub:
                self._suspects[chunk_id] = rec
        if not scrub and self.on_suspect is not None:
            self.on_suspect()

    def take_suspects(self) -> dict[bytes, ChunkRecord]:
        with self._pin_lock:
            suspects, self._suspects = self._suspects, {}
        return suspects

    async def read(self, ranges: list[tuple[bytes, int, int]], scrub: bool = False,
                   namespace: bytes | None = None) -> list[ReadResult]:
        """Reads (chunk id, offset, length) ranges; length 0 means to the end.

        Each range gets its own result: NOT_FOUND, OUT_OF_RANGE and DATA_LOSS
        (checksum mismatch, logged and never served) are per range. `scrub`
        verifies without returning bytes or counting a client read. `namespace`:
        as plan_reads.
        """
        return await run_to_completion(self._read(ranges, scrub, namespace))

    async def _read(self, ranges: list[tuple[bytes, int, int]], scrub: bool,
                    namespace: bytes | None) -> list[ReadResult]:
        results, plan = self.plan_reads(ranges, namespace, client=not scrub)
        ops = self.disk_reads(plan)
        try:
            done = await asyncio.wrap_future(self.reader.read_batch(ops))
            for p, (_, _, buf), got in zip(plan, ops, done):
                results[p.index] = self._verify(p, buf, got, scrub)
        finally:
            for _, _, buf in ops:
                self._pool.put(buf)
            self.release(plan, client=not scrub)
        return results

    def _verify(self, p: PlannedRead, buf: bytearray, got: int, scrub: bool = False) -> ReadResult:
        chunk_id, rec, offset, length = p.chunk_id, p.rec, p.offset, p.length
        b0 = offset // BLOCK
        start = b0 * BLOCK
        need = min(-(-(offset + length) // BLOCK) * BLOCK, rec.length) - start
        if got < need:
            reason = os.strerror(-got) if got < 0 else f"short read ({got} of {need} bytes)"
            log.error("chunk %s on %s: disk read failed: %s", short_id(chunk_id), self.cfg.id, reason)
            if got >= 0:  # the slot file ends inside the chunk: as damaged as a bad checksum
                self.count_checksum_error(chunk_id, rec, scrub)
            return ReadResult(grpc.StatusCode.DATA_LOSS if got >= 0 else grpc.StatusCode.INTERNAL,
                              f"chunk {short_id(chunk_id)} on {self.cfg.id}: {reason}")
        view = memoryview(buf)
        for j in range(need // BLOCK + (need % BLOCK > 0)):
            lo = j * BLOCK
            if block_checksum(view[lo : min(lo + BLOCK, need)]) != rec.blocks[b0 + j]:
                self.count_checksum_error(chunk_id, rec, scrub)
                log.error("chunk %s on %s: checksum mismatch in block %d (slot %s, found by %s); not served",
                          short_id(chunk_id), self.cfg.id, b0 + j, rec.slot, "scrub" if scrub else "a read")
                return ReadResult(grpc.StatusCode.DATA_LOSS,
                                  f"chunk {short_id(chunk_id)} checksum mismatch on {self.cfg.id} "
                                  f"(block {b0 + j}); read another replica")
        if scrub:
            return ReadResult(length=rec.length, checksum=rec.checksum)
        self.count_read(length)
        lo = offset - start
        return ReadResult(data=bytes(view[lo : lo + length]), length=rec.length, checksum=rec.checksum,
                          blocks=tuple(rec.blocks))

    def _unpin(self, ref: SlotRef) -> None:
        with self._pin_lock:
            self._pins[ref] -= 1
            if self._pins[ref] == 0:
                del self._pins[ref]
                if ref in self._free_after_read:
                    self._free_after_read.discard(ref)
                    self.slots.free(ref)

    # -- deletes and inventory ---------------------------------------------

    async def delete(self, chunk_ids: list[bytes]) -> tuple[int, int]:
        """Deletes chunks; returns (deleted, not found). A slot being read is
        freed only after the read finishes."""
        return await run_to_completion(self._delete(chunk_ids))

    async def _delete(self, chunk_ids: list[bytes]) -> tuple[int, int]:
        for chunk_id in chunk_ids:
            self._check_id(chunk_id)
        async with self._delete_lock:
            found = {cid: rec for cid in set(chunk_ids) if (rec := self.get(cid)) is not None}
            if found:
                await asyncio.wrap_future(self._committer.submit(
                    deletes=[_KEY_PREFIX + cid for cid in found]))
            self._forget(found.values())
            self.counters.deletes += len(found)
            return len(found), len(set(chunk_ids)) - len(found)

    def _forget(self, recs) -> None:
        """Frees the slots of deleted chunks (a slot being read: once the read is done)."""
        with self._pin_lock:
            for rec in recs:
                if self._pins[rec.slot]:
                    self._free_after_read.add(rec.slot)
                else:
                    self._pins.pop(rec.slot, None)
                    self.slots.free(rec.slot)
                self.chunk_count -= 1
                self.used_bytes -= rec.length
                self._set_full(False)  # a slot being read is free a moment later

    # -- corrupt chunks ----------------------------------------------------

    async def remove_corrupt(self, chunk_id: bytes, rec: ChunkRecord) -> bool:
        """Removes a chunk that failed verification and notes it for the metaserver;
        False if the index no longer holds that very copy (deleted or replaced)."""
        return await run_to_completion(self._remove_corrupt(chunk_id, rec))

    async def _remove_corrupt(self, chunk_id: bytes, rec: ChunkRecord) -> bool:
        async with self._delete_lock:
            if self.get(chunk_id) != rec:
                return False
            await asyncio.wrap_future(self._committer.submit(
                puts=[(_LOST_PREFIX + chunk_id, rec.owner)], deletes=[_KEY_PREFIX + chunk_id]))
            self._forget([rec])
            self.counters.corrupt_chunks_removed += 1
            return True

    def lost_chunks(self, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to `limit` (chunk id, owner record) of removed chunks not yet reported."""
        it = self._db.iter()
        it.seek(_LOST_PREFIX)
        out, back = [], []
        while it.valid() and it.key().startswith(_LOST_PREFIX) and len(out) < limit:
            cid = it.key()[1:]
            # stored here again since (re-replicated): not lost, and reporting it would undo that
            (back if self.get(cid) is not None else out).append((cid, it.value()))
            it.next()
        del it
        if back:  # not awaited: a note that survives a crash is dropped again next time
            self._committer.submit(deletes=[_LOST_PREFIX + cid for cid, _ in back])
        return out

    async def forget_lost(self, chunk_ids: list[bytes]) -> None:
        """The metaserver has heard of these lost chunks."""
        # the heartbeat task is cancelled at shutdown: the delete still completes
        await run_to_completion(asyncio.wrap_future(
            self._committer.submit(deletes=[_LOST_PREFIX + c for c in chunk_ids])))

    def list(self, start_after: bytes, limit: int) -> tuple[list[tuple[bytes, ChunkRecord]], bytes]:
        """Up to `limit` chunks after `start_after`, in id order, and the next page token."""
        it = self._db.iter()
        it.seek(_KEY_PREFIX + start_after)
        out: list[tuple[bytes, ChunkRecord]] = []
        while it.valid() and len(out) <= limit:
            key = it.key()
            if not key.startswith(_KEY_PREFIX):
                break
            if key[1:] != start_after:
                out.append((key[1:], ChunkRecord.unpack(it.value())))
            it.next()
        del it
        more = len(out) > limit
        out = out[:limit]
        return out, (out[-1][0] if more and out else b"")

    def stat(self) -> dict:
        return {
            "capacity_bytes": self.cfg.capacity,
            "used_bytes": self.used_bytes,
            "allocated_bytes": self.slots.allocator.allocated_bytes,
            "chunk_count": self.chunk_count,
            "io_engine": self.reader.name,
            "io_mode": self.io_mode,
        }

