"""`kvfs-bench`: measurements that print ratios taken side by side in one run
and write JSON (validated for shape by the tests, never for speed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    _write_json(args.json, {
        "bench": "io", **_host(),
        "config": {"chunks": args.chunks, "chunk_bytes": chunk, "batch": args.batch,
                   "concurrency": args.concurrency, "rounds": args.rounds},
        "results": [r.as_json() for r in results],
    })
    return 0


def _prefix(args) -> int:
    from .prefix import run_prefix

    root = pathlib.Path(args.data_dir) if args.data_dir else default_root()
    console.print(f"kvfs-bench prefix: a {args.tokens}-token MLA prefix on {args.chunkservers} local chunkservers, "
                  f"{args.replicas} replicas, {args.rounds} rounds, data in {root}")
    try:
        report = asyncio.run(run_prefix(root, args.tokens, args.rounds, args.lookup_blocks, args.chunkservers,
                                        args.replicas, log=console.print))
    finally:
        if not args.data_dir:
            shutil.rmtree(root, ignore_errors=True)
    table = Table(title="one long prefix through the cluster (medians)")
    for col in ("restore GB/s", "raw io_uring GB/s", "restore / raw", "write-back GB/s",
                f"MatchPrefix {args.lookup_blocks} blocks p50 ms"):
        table.add_column(col, justify="right")
    table.add_row(f"{report['restore_gbps_median']:.2f}", f"{report['raw_gbps_median']:.2f}",
                  f"{report['restore_over_raw']:.2f}", f"{report['write_gbps']:.2f}",
                  f"{report['lookup_rpc_ms_p50']:.1f}")
    console.print(table)
    _write_json(args.json, {"bench": "prefix", **_host(), "config": {
        "tokens": args.tokens, "rounds": args.rounds, "lookup_blocks": args.lookup_blocks,
        "chunkservers": args.chunkservers, "replicas": args.replicas}, "results": report})
    return 0


def _host() -> dict:
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}}


def _write_json(path: str | None, report: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {path}")


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
    prefix = sub.add_parser("prefix", help="restore and write-back of one long MLA prefix on a local cluster, "
                                           "beside the raw disk reader; MatchPrefix latency")
    prefix.add_argument("--tokens", type=int, default=32768)
    prefix.add_argument("--rounds", type=int, default=3)
    prefix.add_argument("--lookup-blocks", type=int, default=2000)
    prefix.add_argument("--chunkservers", type=int, default=3)
    prefix.add_argument("--replicas", type=int, default=2)
    for p in (io, prefix):
        p.add_argument("--data-dir", help="where servers keep data (default: a temp folder, removed)")
        p.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    return _io(args) if args.cmd == "io" else _prefix(args)


if __name__ == "__main__":
    sys.exit(main())
