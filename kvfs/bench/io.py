"""`kvfs-bench io`: chunkserver read throughput over gRPC beside the raw disk.

For each I/O mode (O_DIRECT, buffered) it starts a real chunkserver, fills it
with chunks, then alternates two measurements over the same slot files:
  raw  - the chunkserver's own io_uring reader, in this process, no gRPC;
  grpc - ReadChunks from this process to the server, the same batches.
Both use the same batch size and concurrency; the ratio grpc/raw is the price
of the control-plane RPC path that the bulk data path will remove. Buffered
passes start cold: each pass first drops the slot files from the page cache.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from kvfs.buffers import aligned_bytearray
from kvfs.chunkserver.uring import UringReader  # the server's reader, used here without a server
from kvfs.client import ChunkClient
from kvfs.launcher import start_chunkserver


@dataclass
class IoResult:
    mode: str
    chunks: int
    chunk_bytes: int
    write_gbps: float
    raw_gbps: list[float]
    grpc_gbps: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.grpc_gbps) / statistics.median(self.raw_gbps)

    def as_json(self) -> dict:
        return {**asdict(self), "raw_gbps_median": statistics.median(self.raw_gbps),
                "grpc_gbps_median": statistics.median(self.grpc_gbps), "grpc_over_raw": self.ratio}


def _drop_cache(files: list[pathlib.Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def _batches(ops: list, batch: int, concurrency: int, run) -> float:
    """Runs `run(batch_of_ops)` over all ops with `concurrency` batches in flight; GB/s."""
    groups = [ops[i : i + batch] for i in range(0, len(ops), batch)]
    queue = asyncio.Queue()
    for g in groups:
        queue.put_nowait(g)
    moved = 0

    async def worker():
        nonlocal moved
        while not queue.empty():
            done = await run(queue.get_nowait())  # not `moved += await ...`: that loses updates
            moved += done

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return moved / (time.perf_counter() - t0) / 1e9


async def _raw_pass(reader: UringReader, files: list[pathlib.Path], chunk: int, direct: bool,
                    batch: int, concurrency: int, buffers: list[bytearray]) -> float:
    fds = [os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in files]
    try:
        ops = [(fd, off) for fd, p in zip(fds, files) for off in range(0, p.stat().st_size, chunk)]
        free = list(buffers)

        async def run(group):
            bufs = [free.pop() for _ in group]
            try:
                got = await asyncio.wrap_future(reader.read_batch(
                    [(fd, off, b) for (fd, off), b in zip(group, bufs)]))
                if min(got) < chunk:
                    raise RuntimeError(f"raw read failed: {got}")
                return sum(got)
            finally:
                free.extend(bufs)

        return await _batches(ops, batch, concurrency, run)
    finally:
        for fd in fds:
            os.close(fd)


async def _grpc_pass(client: ChunkClient, ids: list[bytes], chunk: int, batch: int, concurrency: int) -> float:
    async def run(group):
        results = await client.read([(c, 0, 0) for c in group])
        if any(r.code or len(r.data) != chunk for r in results):
            raise RuntimeError(f"ReadChunks failed: {[r.message for r in results if r.code]}")
        return sum(len(r.data) for r in results)

    return await _batches(ids, batch, concurrency, run)


async def run_io(mode: str, chunks: int, chunk: int, batch: int, concurrency: int, rounds: int,
                 root: pathlib.Path, log=print) -> IoResult:
    server = start_chunkserver(root / f"cs-{mode}", server_id=f"cs-{mode}", capacity=f"{chunks * chunk * 2}",
                               extra=["--io-mode", mode], run_dir=root)
    reader = UringReader(256)
    try:
        rng = random.Random(0)
        payload = rng.randbytes(chunk)
        ids = [f"bench-{i:06d}".encode() for i in range(chunks)]
        async with ChunkClient(server.address) as client:
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(8)

            async def put(i, cid):
                async with sem:  # distinct bytes per chunk: xor one word
                    data = bytearray(payload)
                    data[:8] = i.to_bytes(8, "little")
                    await client.write(cid, data)

            await asyncio.gather(*(put(i, c) for i, c in enumerate(ids)))
            write_gbps = chunks * chunk / (time.perf_counter() - t0) / 1e9
            files = sorted((root / f"cs-{mode}" / "slots").glob("*/*.slots"))
            buffers = [aligned_bytearray(chunk) for _ in range(batch * concurrency)]
            await _grpc_pass(client, ids[: batch * concurrency], chunk, batch, concurrency)  # warm-up
            raw, rpc = [], []
            for r in range(rounds):
                rng.shuffle(ids)
                if mode == "buffered":
                    _drop_cache(files)
                raw.append(await _raw_pass(reader, files, chunk, mode == "direct", batch, concurrency, buffers))
                if mode == "buffered":
                    _drop_cache(files)
                rpc.append(await _grpc_pass(client, ids, chunk, batch, concurrency))
                log(f"  {mode} round {r + 1}: raw io_uring {raw[-1]:.2f} GB/s, ReadChunks {rpc[-1]:.2f} GB/s")
        return IoResult(mode, chunks, chunk, write_gbps, raw, rpc)
    finally:
        reader.close()
        server.stop()


def default_root() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="kvfs-bench-"))



