"""`kvfs-bench`: measurements that print ratios taken side by side in one run
and write JSON (validated for shape by the tests, never for speed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import shutil
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from kvfs.config import parse_size

from .io import default_root, run_io

console = Console(width=None if sys.stdout.isatty() else 120)


def _io(args) -> int:
    root = pathlib.Path(args.data_dir) if args.data_dir else default_root()
    chunk = parse_size(args.chunk_size)
    console.print(f"kvfs-bench io: {args.chunks} chunks of {chunk} bytes, ReadChunks batches of "
                  f"{args.batch}, {args.concurrency} in flight, {args.rounds} rounds, data in {root}")
    results = []
    try:
        for mode in args.modes.split(","):
            results.append(asyncio.run(run_io(mode, args.chunks, chunk, args.batch, args.concurrency,
                                              args.rounds, root, log=console.print)))
    finally:
        if not args.data_dir:
            shutil.rmtree(root, ignore_errors=True)
    table = Table(title="chunkserver reads: gRPC ReadChunks vs the raw io_uring reader (medians)")
    for col in ("mode", "raw io_uring GB/s", "ReadChunks GB/s", "ReadChunks / raw", "write GB/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.mode, f"{statistics.median(r.raw_gbps):.2f}", f"{statistics.median(r.grpc_gbps):.2f}",
                      f"{r.ratio:.2f}", f"{r.write_gbps:.2f}")
    console.print(table)
    report = {
        "bench": "io",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                 "kernel": platform.release()},
        "config": {"chunks": args.chunks, "chunk_bytes": chunk, "batch": args.batch,
                   "concurrency": args.concurrency, "rounds": args.rounds},
        "results": [r.as_json() for r in results],
    }
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs-bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    io = sub.add_parser("io", help="chunkserver ReadChunks throughput beside the raw disk reader")
    io.add_argument("--chunks", type=int, default=256)
    io.add_argument("--chunk-size", default="1MiB")
    io.add_argument("--batch", type=int, default=8, help="ranges per ReadChunks call")
    io.add_argument("--concurrency", type=int, default=16, help="calls in flight")
    io.add_argument("--rounds", type=int, default=5)
    io.add_argument("--modes", default="direct,buffered")
    io.add_argument("--data-dir", help="where the chunkservers keep data (default: a temp folder, removed)")
    io.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    return _io(args)


if __name__ == "__main__":
    sys.exit(main())
