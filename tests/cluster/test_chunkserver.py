"""Real chunkserver processes on loopback, started with the users' launcher."""

import asyncio
import os
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfs import tls
from kvfs.chunkserver.uring import binding_refused
from kvfs.client import ChunkClient, chunk_checksum
from kvfs.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound, OutOfRange
from kvfs.proto import chunk_pb2, chunk_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS

from helpers import credentials

MiB = 1 << 20
# what a chunkserver reads with here: io_uring, unless the liburing binding cannot run on
# this CPU (then it falls back, saying so: test_uring.py)
ENGINE = "io_uring" if binding_refused() is None else "preadv"


async def test_random_sizes_round_trip_byte_exact(chunkservers):
    server = chunkservers()
    rng = random.Random(7)
    sizes = [1, 4095, 4096, 65535, 65536, 65537, MiB - 1, MiB, MiB + 1, 9 * MiB + 7] + \
            [rng.randint(1, 5 * MiB) for _ in range(30)]
    chunks = {f"chunk-{i}".encode(): rng.randbytes(n) for i, n in enumerate(sizes)}
    async with ChunkClient(server.address) as client:
        assert all(await asyncio.gather(*(client.write(c, d, owner=c[::-1]) for c, d in chunks.items())))
        ids = list(chunks)
        results = await client.read([(c, 0, 0) for c in ids])
        assert [r.code for r in results] == [0] * len(ids)
        assert all(r.data == chunks[c] for c, r in zip(ids, results))
        for c in ids[:10]:
            n = len(chunks[c])
            off = rng.randrange(n)
            length = rng.randint(1, n - off)
            assert await client.read_chunk(c, off, length) == chunks[c][off : off + length]
        listed = {info.chunk_id: info async for info in client.list(page_size=7)}
        assert set(listed) == set(chunks)
        assert all(listed[c].owner == c[::-1] and listed[c].length == len(d) and
                   listed[c].checksum == chunk_checksum(d) for c, d in chunks.items())
        stat = await client.stat()
        assert stat.chunk_count == len(chunks) and stat.used_bytes == sum(sizes)
        assert stat.io_engine == ENGINE and stat.io_mode == "direct"
        assert stat.counters.writes == len(chunks)


async def test_chunks_survive_a_clean_restart(chunkservers, tmp_path):
    first = chunkservers()
    data = os.urandom(3 * MiB)
    async with ChunkClient(first.address) as client:
        await client.write(b"keep", data)
    assert first.stop() == 0
    second = chunkservers(data_dir=tmp_path / "cs-1")
    async with ChunkClient(second.address) as client:
        assert await client.read_chunk(b"keep") == data


@pytest.mark.parametrize("extra,engine,mode", [
    (["--io-engine", "preadv"], "preadv", "direct"),
    (["--io-mode", "buffered"], ENGINE, "buffered"),
    (["--io-engine", "preadv", "--io-mode", "buffered"], "preadv", "buffered"),
])
async def test_every_engine_and_mode_serves_the_same_bytes(chunkservers, extra, engine, mode):
    server = chunkservers(extra=extra)
    data = os.urandom(2 * MiB + 3)
    async with ChunkClient(server.address) as client:
        await client.write(b"e", data)
        assert await client.read_chunk(b"e") == data
        assert await client.read_chunk(b"e", MiB, 100) == data[MiB : MiB + 100]
        stat = await client.stat()
        assert (stat.io_engine, stat.io_mode) == (engine, mode)


async def test_refused_io_uring_falls_back_to_preadv_and_says_so(chunkservers):
    # More entries than the kernel's IORING_MAX_ENTRIES: io_uring_setup is refused.
    server = chunkservers(env={"KVFS_CHUNKSERVER_URING_ENTRIES": "65536"})
    data = os.urandom(MiB)
    async with ChunkClient(server.address) as client:
        await client.write(b"f", data)
        assert await client.read_chunk(b"f") == data
        assert (await client.stat()).io_engine == "preadv"
    assert "FALLING BACK to preadv" in server.log_path.read_text()


async def test_config_comes_from_file_env_and_flags(chunkservers, tmp_path):
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text('[chunkserver]\nfailure_domain = "rack-9"\ncapacity = "256MiB"\n')
    server = chunkservers(extra=["--config", str(cfg)])
    async with ChunkClient(server.address) as client:
        stat = await client.stat()
    assert (stat.failure_domain, stat.capacity_bytes) == ("rack-9", 256 * MiB)
    server2 = chunkservers(server_id="cs-2", capacity="128MiB",
                           env={"KVFS_CONFIG": str(cfg), "KVFS_CHUNKSERVER_FAILURE_DOMAIN": "rack-env"})
    async with ChunkClient(server2.address) as client:
        stat = await client.stat()
    assert (stat.failure_domain, stat.capacity_bytes) == ("rack-env", 128 * MiB)


async def assert_still_serving(address: str):
    async with tls.aio_channel(address, credentials()) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with ChunkClient(address) as client:
        await client.write(b"canary", b"still here")
        assert await client.read_chunk(b"canary") == b"still here"


async def test_bad_input_gets_clear_statuses_and_the_server_serves_on(chunkservers):
    server = chunkservers(extra=["--max-read-bytes", "4MiB", "--max-ranges", "16",
                                 "--max-chunk-size", "8MiB"])
    async with ChunkClient(server.address) as client:
        await client.write(b"known", b"k" * 5000)
        with pytest.raises(NotFound, match="not found on cs-1"):
            await client.read_chunk(b"unknown")
        with pytest.raises(OutOfRange, match="outside chunk"):
            await client.read_chunk(b"known", 4990, 20)
        with pytest.raises(DataLoss, match="checksum mismatch on arrival"):
            await client.write(b"corrupt-in-flight", b"abc", checksum=chunk_checksum(b"abd"))
        with pytest.raises(NotFound):  # nothing was stored
            await client.read_chunk(b"corrupt-in-flight")
        with pytest.raises(AlreadyExists, match="write-once"):
            await client.write(b"known", b"x" * 5000)
        with pytest.raises(InvalidArgument, match="chunk id"):
            await client.write(b"", b"x")
        with pytest.raises(InvalidArgument, match="chunk id"):
            await client.read_chunk(b"y" * 65)
        # a header announcing an oversize chunk is refused before any data is taken (only the
        # header is sent: a client still streaming data would race the refusal)
        stub = chunk_pb2_grpc.ChunkServiceStub(client._channel)
        header = chunk_pb2.ChunkHeader(chunk_id=b"huge", length=8 * MiB + 1, checksum=1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.WriteChunk(iter([chunk_pb2.WriteChunkRequest(header=header)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk length" in info.value.details()
        with pytest.raises(InvalidArgument, match="at most 16"):
            await client.read([(b"known", 0, 0)] * 17)
        await client.write(b"three", os.urandom(3 * MiB))
        with pytest.raises(InvalidArgument, match="at most"):
            await client.read([(b"three", 0, 0), (b"three", 0, 0)])
        stat = await client.stat()
        assert stat.counters.rejected_requests >= 5
    await assert_still_serving(server.address)
    log = server.log_path.read_text()
    for text in ("checksum mismatch on arrival", "write-once", "INVALID_ARGUMENT", "ALREADY_EXISTS"):
        assert text in log


async def test_malformed_write_streams_are_invalid(chunkservers):
    server = chunkservers()
    async with tls.aio_channel(server.address, credentials(), CHANNEL_OPTIONS) as channel:
        stub = chunk_pb2_grpc.ChunkServiceStub(channel)
        header = chunk_pb2.ChunkHeader(chunk_id=b"m", length=10, checksum=chunk_checksum(b"0123456789"))
        cases = {
            "no header": [chunk_pb2.WriteChunkRequest(data=b"0123456789")],
            "empty stream": [],
            "short": [chunk_pb2.WriteChunkRequest(header=header, data=b"01234")],
            "long": [chunk_pb2.WriteChunkRequest(header=header, data=b"0123456789"),
                     chunk_pb2.WriteChunkRequest(data=b"!")],
            "two headers": [chunk_pb2.WriteChunkRequest(header=header, data=b"01234"),
                            chunk_pb2.WriteChunkRequest(header=header, data=b"56789")],
            "zero length": [chunk_pb2.WriteChunkRequest(header=chunk_pb2.ChunkHeader(chunk_id=b"z"))],
        }
        for name, messages in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.WriteChunk(iter(messages), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert info.value.details(), name
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListChunks(chunk_pb2.ListChunksRequest(limit=10**6), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with ChunkClient(server.address) as client:
        assert [c async for c in client.list()] == []  # nothing half-written became visible
    await assert_still_serving(server.address)


async def test_delete_frees_space_and_reports_unknown_ids(chunkservers):
    server = chunkservers()
    async with ChunkClient(server.address) as client:
        for i in range(4):
            await client.write(b"d%d" % i, os.urandom(MiB))
        assert await client.delete([b"d0", b"d1", b"nope"]) == (2, 1)
        stat = await client.stat()
        assert stat.chunk_count == 2 and stat.used_bytes == 2 * MiB and stat.counters.deletes == 2
        with pytest.raises(NotFound):
            await client.read_chunk(b"d0")
        assert len(await client.read_chunk(b"d2")) == MiB
