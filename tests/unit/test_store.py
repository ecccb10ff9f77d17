"""ChunkStore in-process: real slot files and a real RocksDB index, no sockets."""

import asyncio
import os
import threading
import time

import grpc
import pytest

from kvfs.checksum import chunk_checksum as checksum
from kvfs.chunkserver.store import BLOCK, ChunkRecord, ChunkStore
from kvfs.chunkserver.slots import SlotRef
from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.errors import AlreadyExists, DataLoss, InvalidArgument, Unavailable

MiB = 1 << 20


async def put(store, cid, data, owner=b""):
    return await store.write(cid, data, checksum(data), owner)


def test_record_round_trips():
    rec = ChunkRecord(SlotRef(MiB, 3, 17), 1_000_000, 2**64 - 1, (1, 2, 3), 1234.5, b"owner\x00")
    assert ChunkRecord.unpack(rec.pack()) == rec


async def test_write_read_ranges_exact(make_store):
    store = make_store()
    data = os.urandom(3 * MiB + 12345)
    assert await put(store, b"a", data) is True
    ranges = [(b"a", 0, 0), (b"a", 1, 10), (b"a", BLOCK - 3, 7), (b"a", len(data) - 5, 5), (b"a", 2 * MiB, 0)]
    results = await store.read(ranges)
    for (_, off, n), r in zip(ranges, results):
        assert r.code == grpc.StatusCode.OK
        assert r.data == data[off : off + n if n else None]
        assert r.length == len(data) and r.checksum == checksum(data)


async def test_write_is_idempotent_and_write_once(make_store):
    store = make_store()
    data = os.urandom(100_000)
    assert await put(store, b"x", data)
    assert await put(store, b"x", data) is False
    with pytest.raises(AlreadyExists, match="write-once"):
        await put(store, b"x", data[:-1] + bytes([data[-1] ^ 1]))  # other bytes (b"?" was the last one 1 time in 256)
    assert store.chunk_count == 1


async def test_concurrent_writers_of_one_id_store_it_once(make_store):
    store = make_store()
    data = os.urandom(2 * MiB)
    created = await asyncio.gather(*(put(store, b"same", data) for _ in range(6)))
    assert sorted(created) == [False] * 5 + [True]
    assert store.slots.allocator.used_slots[2 * MiB] == 1


async def test_bad_checksum_stores_nothing(make_store):
    store = make_store()
    with pytest.raises(DataLoss, match="checksum mismatch on arrival"):
        await store.write(b"bad", b"payload", checksum(b"payload") ^ 1)
    assert store.get(b"bad") is None and store.chunk_count == 0


@pytest.mark.parametrize("cid,data,match", [(b"", b"x", "chunk id"), (b"i" * 65, b"x", "chunk id"),
                                            (b"ok", b"", "chunk length")])
async def test_malformed_writes_are_invalid(make_store, cid, data, match):
    with pytest.raises(InvalidArgument, match=match):
        await make_store().write(cid, data, checksum(data))


async def test_missing_and_out_of_range_are_per_range(make_store):
    store = make_store()
    await put(store, b"c", b"z" * 1000)
    results = await store.read([(b"nope", 0, 0), (b"c", 1000, 0), (b"c", 990, 11), (b"c", 0, 1000)])
    assert [r.code for r in results] == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                                         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.OK]
    assert results[3].data == b"z" * 1000 and not results[0].data


async def test_oversize_read_is_refused_whole(make_store):
    store = make_store(max_read_bytes=2 * MiB, max_ranges=4)
    await put(store, b"big", os.urandom(MiB))
    with pytest.raises(InvalidArgument, match="at most"):
        await store.read([(b"big", 0, 0)] * 3)
    with pytest.raises(InvalidArgument, match="ranges"):
        await store.read([(b"big", 0, 1)] * 5)
    assert not store._pins  # nothing left pinned by a refused request


async def test_delete_frees_the_slot_for_reuse(make_store):
    store = make_store()
    await put(store, b"d1", os.urandom(MiB))
    slot = store.get(b"d1").slot
    assert await store.delete([b"d1", b"never"]) == (1, 1)
    assert (await store.read([(b"d1", 0, 0)]))[0].code == grpc.StatusCode.NOT_FOUND
    await put(store, b"d2", os.urandom(MiB))
    assert store.get(b"d2").slot == slot


async def test_a_slot_is_not_reused_while_a_read_holds_it(make_store):
    store = make_store()
    data = os.urandom(MiB)
    await put(store, b"r", data)
    slot = store.get(b"r").slot
    store._pins[slot] += 1  # as a read in flight does
    await store.delete([b"r"])
    await put(store, b"other", os.urandom(MiB))
    assert store.get(b"other").slot != slot
    store._unpin(slot)
    await put(store, b"third", os.urandom(MiB))
    assert store.get(b"third").slot == slot


async def test_listing_pages_in_id_order_with_owner(make_store):
    store = make_store()
    ids = [bytes([i]) * 3 for i in range(1, 26)]
    for cid in ids:
        await put(store, cid, cid * 10, owner=b"own-" + cid)
    seen, after = [], b""
    while True:
        page, after = store.list(after, 7)
        seen += page
        if not after:
            break
    assert [cid for cid, _ in seen] == sorted(ids)
    assert all(rec.owner == b"own-" + cid for cid, rec in seen)


async def test_reopen_recovers_every_chunk(make_store):
    store = make_store()
    chunks = {f"k{i}".encode(): os.urandom(n) for i, n in enumerate([1, 65536, 65537, MiB, 3 * MiB])}
    for cid, data in chunks.items():
        await put(store, cid, data)
    await store.delete([b"k0"])
    store.close()
    store = make_store()
    assert store.chunk_count == 4 and store.used_bytes == sum(len(d) for d in chunks.values()) - 1
    results = await store.read([(cid, 0, 0) for cid in chunks])
    assert results[0].code == grpc.StatusCode.NOT_FOUND
    assert [r.data for r in results[1:]] == list(chunks.values())[1:]
    # a new chunk must not land on a slot that recovered chunks still use
    await put(store, b"new", os.urandom(MiB))
    used = [store.get(c).slot for c in list(chunks)[1:] + [b"new"]]
    assert len(set(used)) == len(used)


async def test_cancelled_writes_and_reads_finish_and_leave_the_store_whole(make_store, tmp_path):
    """A caller cancelled mid-operation (a client deadline, a hedged read that lost)
    must not kill the reader or committer threads, leak or double-book a slot."""
    store = make_store()
    datas = {f"c{i}".encode(): os.urandom(MiB + i) for i in range(8)}
    writes = [asyncio.ensure_future(put(store, cid, d)) for cid, d in datas.items()]
    await asyncio.sleep(0)  # let them start
    for w in writes[::2]:
        w.cancel()
    await asyncio.gather(*writes, return_exceptions=True)
    # a cancelled caller returns at once; its write goes on to the end on its own
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while any(store.get(cid) is None for cid in datas):
        assert loop.time() < deadline, "a write whose caller was cancelled never finished"
        await asyncio.sleep(0.01)
    reads = [asyncio.ensure_future(store.read([(cid, 0, 0)])) for cid in datas]
    await asyncio.sleep(0)
    for r in reads[1::2]:
        r.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    # every write ran to the end despite its caller: all chunks are there, each in its own slot
    results = await store.read([(cid, 0, 0) for cid in datas])
    assert [r.data for r in results] == list(datas.values())
    assert len({store.get(cid).slot for cid in datas}) == len(datas)
    assert await put(store, b"after", b"z" * 5000)  # the committer thread is alive
    store.close()
    reopened = ChunkStore(ChunkserverConfig(data_dir=str(tmp_path / "cs"), capacity=1 << 30, io_mode=store.io_mode))
    try:
        assert reopened.chunk_count == len(datas) + 1  # the index names each slot once
    finally:
        reopened.close()


async def test_reads_first_a_write_waits_for_the_client_reads_in_flight(make_store):
    store = make_store(write_yield=60.0)  # a write that waits at all waits for the read's end
    await put(store, b"r", os.urandom(100_000))
    _, plan = store.plan_reads([(b"r", 0, 0)])  # a client read in flight
    write = asyncio.create_task(put(store, b"w", os.urandom(100_000)))
    deadline = asyncio.get_running_loop().time() + 30
    while not store.writes_waiting:  # the write reaches the disk's door, and waits there
        assert asyncio.get_running_loop().time() < deadline and not write.done()
        await asyncio.sleep(0.01)
    assert store.get(b"w") is None
    store.release(plan)  # the read ends: the write goes on
    assert await asyncio.wait_for(write, 30) is True
    assert (store.counters.writes_deferred, store.writes_waiting) == (1, 0) and store.counters.deferred_seconds > 0
    # the scrubber's reads are not waited for, nor is an idle disk
    _, plan = store.plan_reads([(b"r", 0, 0)], client=False)
    assert await asyncio.wait_for(put(store, b"w2", os.urandom(100_000)), 30) is True
    store.release(plan, client=False)
    assert await asyncio.wait_for(put(store, b"w3", os.urandom(100_000)), 30) is True
    assert store.counters.writes_deferred == 1


def test_close_lets_a_write_under_way_finish_and_refuses_new_ones(make_store):
    store = make_store(write_yield=60.0)
    first = os.urandom(100_000)
    assert store.store_chunk(b"r", first, checksum(first))
    _, plan = store.plan_reads([(b"r", 0, 0)])  # a client read in flight: the next write waits for it
    data = os.urandom(100_000)
    result, closed = {}, threading.Event()
    writer = threading.Thread(target=lambda: result.update(stored=store.store_chunk(b"w", data, checksum(data))))
    writer.start()
    deadline = time.monotonic() + 30
    while not store.writes_waiting:  # the write is under way, at the disk's door
        assert time.monotonic() < deadline and writer.is_alive()
        time.sleep(0.01)
    closer = threading.Thread(target=lambda: (store.close(), closed.set()))
    closer.start()
    while not store._closing:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(Unavailable, match="shutting down"):  # nothing new is taken meanwhile
        store.store_chunk(b"late", data, checksum(data))
    assert not closed.is_set()  # close waits for the write under way
    store.release(plan)
    writer.join(30)
    assert closed.wait(30) and result == {"stored": True}
    reopened = ChunkStore(store.cfg)  # the write it let finish was committed before the index closed
    try:
        assert reopened.get(b"w") is not None and reopened.get(b"late") is None
    finally:
        reopened.close()
