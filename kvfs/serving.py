"""Small pieces every kvfs server's main() shares."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from kvfs.config import add_flags, load


def bound_address(listen: str, port: int) -> str:
    """host:port actually bound (port 0 in `listen` means the kernel chose)."""
    if port == 0:
        raise SystemExit(f"cannot listen on {listen}")
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def write_ready_file(path: str, address: str) -> None:
    """Atomically writes the bound address where a launcher waits for it."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(address)
    os.replace(tmp, path)


async def until_signalled() -> None:
    """Returns when the process gets SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_server(prog: str, description: str, cfg_cls: type, section: str, serve, argv: list[str] | None) -> int:
    """Parses flags into `cfg_cls` (flags > env > TOML > defaults), sets up
    logging and runs `serve(cfg)` until it returns."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cfg_cls)
    args = parser.parse_args(argv)
    try:
        cfg = load(cfg_cls, section, vars(args))
    except (ValueError, OSError) as err:
        parser.error(str(err))
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg))
    return 0
