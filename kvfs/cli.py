"""`kvfs`: the admin and demo command line."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import pathlib
import random
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvfs.client import ChunkClient
from kvfs.launcher import start_chunkserver

console = Console()

# One MLA block of DeepSeek-V2/V3 shapes: 64 tokens x 27 layers x 576 values x 2 bytes.
MLA_BLOCK_BYTES = 64 * 27 * 576 * 2


def _stat_table(stats) -> Table:
    table = Table(title="chunkservers")
    for col in ("id", "domain", "engine", "mode", "chunks", "used", "allocated", "capacity",
                "reads", "writes", "checksum errors"):
        table.add_column(col, justify="right" if col not in ("id", "domain", "engine", "mode") else "left")
    for s in stats:
        c = s.counters
        table.add_row(s.server_id, s.failure_domain, s.io_engine, s.io_mode, str(s.chunk_count),
                      _human(s.used_bytes), _human(s.allocated_bytes), _human(s.capacity_bytes),
                      str(c.reads), str(c.writes), str(c.checksum_errors))
    return table


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


async def _demo(args) -> int:
    root = pathlib.Path(args.data_dir or tempfile.mkdtemp(prefix="kvfs-demo-"))
    console.print(f"[bold]kvfs demo[/]: a local chunkserver in {root}")
    server = start_chunkserver(root / "cs-1", capacity=args.capacity, run_dir=root)
    console.print(f"chunkserver cs-1 serving on {server.address} (pid {server.pid}, log {server.log_path})")
    try:
        rng = random.Random(args.seed)
        sizes = [MLA_BLOCK_BYTES if i % 2 == 0 else rng.randint(1, 4 << 20) for i in range(args.chunks)]
        chunks = {hashlib.blake2b(f"demo-{args.seed}-{i}".encode(), digest_size=16).digest(): rng.randbytes(n)
                  for i, n in enumerate(sizes)}
        async with ChunkClient(server.address) as client:
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(8)

            async def put(cid, data):
                async with sem:
                    return await client.write(cid, data, owner=b"demo")

            created = await asyncio.gather(*(put(c, d) for c, d in chunks.items()))
            t_write = time.perf_counter() - t0
            total = sum(sizes)
            console.print(f"wrote {sum(created)} chunks ({_human(total)}, sizes 1 B to 4 MiB, half of them "
                          f"one MLA block of {_human(MLA_BLOCK_BYTES)}) in {t_write:.2f}s: "
                          f"{total / t_write / 1e6:.0f} MB/s, each durable before acknowledged")
            again = await client.write(next(iter(chunks)), next(iter(chunks.values())))
            console.print(f"rewrote the first chunk with the same bytes: created={again} (write-once, idempotent)")
            ids = list(chunks)
            t0 = time.perf_counter()
            batches = [ids[i : i + 8] for i in range(0, len(ids), 8)]
            replies = await asyncio.gather(*(client.read([(c, 0, 0) for c in b]) for b in batches))
            t_read = time.perf_counter() - t0
            exact = sum(r.code == 0 and r.data == chunks[c]
                        for b, rs in zip(batches, replies) for c, r in zip(b, rs))
            console.print(f"read back {exact}/{len(chunks)} chunks byte-exact in {len(batches)} batched "
                          f"ReadChunks calls, {t_read:.2f}s: {total / t_read / 1e6:.0f} MB/s, "
                          f"checksums verified by the server before sending")
            cid = ids[0]
            part = await client.read_chunk(cid, 100_000, 65_536)
            console.print(f"ranged read of 64 KiB at offset 100000: "
                          f"{'exact' if part == chunks[cid][100_000:165_536] else 'WRONG'}")
            console.print(_stat_table([await client.stat()]))
            return 0 if exact == len(chunks) and part == chunks[cid][100_000:165_536] else 1
    finally:
        server.stop()
        console.print("chunkserver stopped")


async def _chunk_admin(args) -> int:
    async with ChunkClient(args.address) as client:
        if args.chunk_cmd == "stat":
            console.print(_stat_table([await client.stat()]))
        elif args.chunk_cmd == "ls":
            table = Table(title=f"chunks on {args.address}")
            for col in ("chunk id", "length", "xxh3", "created", "owner bytes"):
                table.add_column(col)
            n = 0
            async for info in client.list():
                n += 1
                if n <= args.limit:
                    table.add_row(info.chunk_id.hex(), str(info.length), f"{info.checksum:016x}",
                                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created)),
                                  str(len(info.owner)))
            console.print(table)
            console.print(f"{n} chunks" + (f" (first {args.limit} shown)" if n > args.limit else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs", description="kvfs admin and demo commands.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="start a local chunkserver and round-trip chunks through it")
    demo.add_argument("--chunks", type=int, default=64)
    demo.add_argument("--seed", type=int, default=1)
    demo.add_argument("--capacity", default="2GiB")
    demo.add_argument("--data-dir", help="keep data here (default: a new temporary folder)")
    chunk = sub.add_parser("chunk", help="inspect one chunkserver")
    chunk_sub = chunk.add_subparsers(dest="chunk_cmd", required=True)
    for name, text in (("stat", "capacity, usage and I/O counters"), ("ls", "list stored chunks")):
        p = chunk_sub.add_parser(name, help=text)
        p.add_argument("address", help="host:port of the chunkserver")
        p.add_argument("--limit", type=int, default=50, help="rows to show (ls)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "demo":
            return asyncio.run(_demo(args))
        return asyncio.run(_chunk_admin(args))
    except Exception as err:  # a clear one-line error for operators
        from kvfs.errors import KvfsError

        if isinstance(err, KvfsError):
            console.print(f"[red]error[/]: {err.message}")
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
