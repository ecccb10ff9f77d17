"""The scrubber in-process: real slot files and index, no sockets, no metaserver."""

import os

import grpc
import pytest

from kvfs.chunkserver.scrub import PIECE, Pacer, Scrubber
from kvfs.checksum import chunk_checksum as checksum

from helpers import flip_bytes

MiB = 1 << 20
KiB = 1 << 10


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_pacer_spaces_reads_to_the_rate_and_never_bursts_after_idling():
    clock = Clock()
    pacer = Pacer(1000, clock)  # bytes/s
    assert pacer.delay(500) == 0
    assert pacer.delay(500) == pytest.approx(0.5)
    assert pacer.delay(1000) == pytest.approx(1.0)
    clock.now += 60  # idle a minute: no minute's worth of credit
    assert pacer.delay(1000) == 0
    assert pacer.delay(1) == pytest.approx(1.0)


class RecordingPacer(Pacer):
    def __init__(self):
        super().__init__(1 << 40)
        self.booked: list[int] = []

    def delay(self, nbytes):
        self.booked.append(nbytes)
        return 0


def flip(store, chunk_id, at):
    """Flips byte `at` of a chunk, found through the store's own index."""
    rec = store.get(chunk_id)
    flip_bytes(store.slots.path(rec.slot.cls, rec.slot.file), rec.slot.offset + at)


async def stored(store, sizes):
    chunks = {f"c{i}".encode(): os.urandom(n) for i, n in enumerate(sizes)}
    for cid, data in chunks.items():
        await store.write(cid, data, checksum(data), owner=b"owner-" + cid)
    return chunks


async def test_a_pass_verifies_every_byte_in_small_paced_reads_and_removes_the_corrupt_chunk(make_store):
    store = make_store()
    chunks = await stored(store, [MiB, 100 * KiB, 3 * MiB + 5, 64 * KiB])
    flip(store, b"c2", 2 * MiB + 70 * KiB)  # block 33 of chunk c2
    used = dict(store.slots.allocator.used_slots)
    scrubber = Scrubber(store, rate=1, interval=3600, remove=True)
    scrubber.pacer = pacer = RecordingPacer()

    result = await scrubber.scrub_pass()

    assert (result.chunks, result.corrupt, result.unreadable) == (4, 1, 0)
    assert max(pacer.booked) <= PIECE
    # every byte of the good chunks and c2 up to its bad piece went through the pacer
    assert sum(pacer.booked) == MiB + 100 * KiB + 64 * KiB + 2 * MiB + PIECE
    c = store.counters
    assert (c.checksum_errors, c.corrupt_chunks_removed, c.scrub_passes) == (1, 1, 1)
    assert c.scrubbed_bytes == MiB + 100 * KiB + 64 * KiB + 2 * MiB
    assert c.reads == 0  # scrub reads are not client reads
    # gone: index entry and slot, never served again; the rest intact
    assert store.get(b"c2") is None and store.chunk_count == 3
    assert store.slots.allocator.used_slots[4 * MiB] == used[4 * MiB] - 1
    results = await store.read([(cid, 0, 0) for cid in chunks])
    assert results[2].code == grpc.StatusCode.NOT_FOUND
    assert [r.data for i, r in enumerate(results) if i != 2] == [d for cid, d in chunks.items() if cid != b"c2"]
    # queued for the metaserver with its owner record, until a heartbeat got through
    assert store.lost_chunks(10) == [(b"c2", b"owner-c2")]
    await store.forget_lost([b"c2"])
    assert store.lost_chunks(10) == []


async def test_the_lost_note_survives_a_restart_and_is_dropped_when_the_chunk_comes_back(make_store):
    store = make_store()
    chunks = await stored(store, [200 * KiB])
    flip(store, b"c0", 10)
    await Scrubber(store, rate=1 << 40, interval=3600, remove=True).scrub_pass()
    store.close()
    store = make_store()
    assert store.lost_chunks(10) == [(b"c0", b"owner-c0")] and store.chunk_count == 0
    # re-replicated here again: no longer lost, and reporting it would undo the copy
    await store.write(b"c0", chunks[b"c0"], checksum(chunks[b"c0"]), owner=b"owner-c0")
    assert store.lost_chunks(10) == []


async def test_a_corrupt_client_read_makes_a_suspect_that_is_verified_and_removed(make_store):
    store = make_store()
    await stored(store, [MiB, MiB])
    flip(store, b"c1", 5)
    (bad,) = await store.read([(b"c1", 0, 100)])
    assert bad.code == grpc.StatusCode.DATA_LOSS
    scrubber = Scrubber(store, rate=0, interval=3600, remove=True)  # no background passes
    await scrubber.check_suspects()
    assert store.get(b"c1") is None and store.lost_chunks(10) == [(b"c1", b"owner-c1")]
    assert store.counters.checksum_errors == 2  # the read, then the re-read that confirmed it
    # a read's mismatch that does not reproduce (say, memory) keeps the chunk
    store.count_checksum_error(b"c0", store.get(b"c0"))
    await scrubber.check_suspects()
    assert store.get(b"c0") is not None and store.counters.corrupt_chunks_removed == 1


async def test_standalone_scrub_counts_and_keeps_the_corrupt_chunk(make_store):
    store = make_store()
    await stored(store, [MiB])
    flip(store, b"c0", 4 * 64 * KiB)
    result = await Scrubber(store, rate=1 << 40, interval=3600, remove=False).scrub_pass()
    assert result.corrupt == 1 and store.counters.checksum_errors == 1
    assert store.get(b"c0") is not None and store.lost_chunks(10) == []
    # blocks before the bad one still verify and are served
    (ok,) = await store.read([(b"c0", 0, 4 * 64 * KiB)])
    assert ok.code == grpc.StatusCode.OK
