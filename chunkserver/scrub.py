"""Scrubbing: every stored chunk is read again in the background and verified.

Bit rot and misdirected writes are found while another replica still has good
bytes, not when a restore needs the chunk. The scrubber walks the index in id
order and reads each chunk in small pieces through the store's own read path
(same io_uring / O_DIRECT reads, same per-64 KiB checksums), paced to
`scrub_rate` so client reads queued behind it wait little. A chunk that fails,
here or on a client read (a "suspect", read again first), is removed and
reported lost with the next heartbeat; the metaserver then stops sending
readers here for it and re-replicates it from a good copy.

A standalone chunkserver (no metaserver) only logs and counts: nobody could
copy the chunk back, and its intact blocks are still readable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import grpc

from kvfs.config import KiB

from .store import ChunkRecord, ChunkStore, short_id

log = logging.getLogger(__name__)

PIECE = 256 * KiB  # bytes per scrub read: whole 64 KiB blocks, small enough to slip between client reads
LIST_PAGE = 256


class Pacer:
    """Spaces reads out to average `rate` bytes/s, without bursts after idling."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate = rate
        self.clock = clock
        self._next = clock()  # when the next read may start

    def delay(self, nbytes: int) -> float:
        """Seconds to wait before reading `nbytes`; books them."""
        now = self.clock()
        start = max(self._next, now)
        self._next = start + nbytes / self.rate
        return start - now


@dataclass(slots=True)
class PassResult:
    chunks: int = 0
    bytes: int = 0
    corrupt: int = 0
    unreadable: int = 0  # I/O errors: tried again next pass
    seconds: float = 0.0


class Scrubber:
    def __init__(self, store: ChunkStore, rate: int, interval: float, remove: bool, piece: int = PIECE):
        self.store = store
        self.pacer = Pacer(rate) if rate > 0 else None
        self.interval = interval
        self.remove = remove
        self.piece = piece
        self.current = PassResult()  # the pass under way, or the last one (what a scrape reports)
        self.last_pass_end = 0.0  # time.time() when the last full pass ended; 0: none yet
        self._wake = asyncio.Event()
        self._stopping = False

    async def run_forever(self) -> None:
        """Passes every `interval` (if a rate is set); suspects as reads report them."""
        loop = asyncio.get_running_loop()
        self.store.on_suspect = lambda: loop.call_soon_threadsafe(self._wake.set)
        try:
            while not self._stopping:
                try:
                    if self.pacer:
                        await self.scrub_pass()
                    end = loop.time() + (self.interval if self.pacer else math.inf)
                    while not self._stopping and (left := end - loop.time()) > 0:
                        if await self._sleep(left):
                            await self.check_suspects()
                except Exception:  # keep scrubbing; the next pass starts after the interval
                    log.exception("scrub on %s failed", self.store.cfg.id)
                    await self._sleep(self.interval)
        finally:
            self.store.on_suspect = None

    def stop(self) -> None:
        """Ends run_forever after the read in flight (cancelling one would leave the
        disk writing into a buffer already given back)."""
        self._stopping = True
        self._wake.set()

    async def _sleep(self, seconds: float) -> bool:
        """Waits `seconds`, or less if woken (a suspect, or stop()); True if woken."""
        try:
            await asyncio.wait_for(self._wake.wait(), None if math.isinf(seconds) else seconds)
        except TimeoutError:
            return False
        self._wake.clear()
        return True

    async def scrub_pass(self) -> PassResult:
        """Verifies every chunk in the index once, at the paced rate."""
        result, started, after = PassResult(), time.monotonic(), b""
        self.current = result
        while not self._stopping:
            page, after = self.store.list(after, LIST_PAGE)
            for chunk_id, rec in page:
                await self.check_suspects()
                if self._stopping:
                    break
                ok = await self.verify(chunk_id, rec, paced=True)
                result.chunks += 1
                result.bytes += rec.length if ok else 0
                result.corrupt += ok is False
                result.unreadable += ok is None
            if not after:
                break
        result.seconds = time.monotonic() - started
        if self._stopping:
            return result
        self.store.counters.scrub_passes += 1
        self.last_pass_end = time.time()
        log.log(logging.WARNING if result.corrupt or result.unreadable else logging.INFO,
                "scrub pass on %s: %d chunks, %d bytes verified in %.1fs; %d corrupt, %d unreadable",
                self.store.cfg.id, result.chunks, result.bytes, result.seconds, result.corrupt, result.unreadable)
        return result

    async def check_suspects(self) -> None:
        """Reads again, whole and at once, the chunks client reads found corrupt."""
        for chunk_id, rec in self.store.take_suspects().items():
            if not self.remove or self.store.get(chunk_id) != rec:
                continue  # standalone, or deleted or replaced since
            if await self.verify(chunk_id, rec, paced=False):
                log.warning("chunk %s on %s failed a read's checksum but verified when read again; kept",
                            short_id(chunk_id), self.store.cfg.id)

    async def verify(self, chunk_id: bytes, rec: ChunkRecord, paced: bool) -> bool | None:
        """True if the chunk verified (or is gone), False if it was corrupt (and
        is removed), None if the disk refused to read it."""
        for offset in range(0, rec.length, self.piece):
            if self._stopping:
                return None
            n = min(self.piece, rec.length - offset)
            if paced and self.pacer:
                await self._sleep(self.pacer.delay(n))
            (r,) = await self.store.read([(chunk_id, offset, n)], scrub=True)
            if r.code == grpc.StatusCode.OK:
                self.store.counters.scrubbed_bytes += n
            elif r.code == grpc.StatusCode.NOT_FOUND:
                return True  # deleted meanwhile
            elif r.code == grpc.StatusCode.DATA_LOSS:  # the store logged which block and slot
                await self._corrupt(chunk_id, rec)
                return False
            else:
                log.warning("scrub: chunk %s on %s: %s; tried again next pass",
                            short_id(chunk_id), self.store.cfg.id, r.message)
                return None
        return True

    async def _corrupt(self, chunk_id: bytes, rec: ChunkRecord) -> None:
        if not self.remove:
            log.error("chunk %s on %s is corrupt; kept: standalone, no metaserver to report it to",
                      short_id(chunk_id), self.store.cfg.id)
        elif await self.store.remove_corrupt(chunk_id, rec):
            log.error("chunk %s removed from %s after failing verification; reported lost with the "
                      "next heartbeat", short_id(chunk_id), self.store.cfg.id)
