"""Helpers the test suites share (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import pathlib
import time


class Clock:
    """A settable clock for servers' logic run in-process (MetaState(cfg, clock))."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(condition, timeout: float = 10, what: str = "condition", interval: float = 0.02):
    """Polls `condition` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def until(condition, timeout: float = 10, what: str = "condition", interval: float = 0.02):
    """wait_until for async tests: polls without blocking the event loop; `condition`
    may be a plain function or return an awaitable."""
    import asyncio
    import inspect

    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def layer_major(layout, block_payloads: list[bytes], tokens: int | None = None) -> bytearray:
    """Lays block payloads out `[layer][tokens][kv_dim]`, as restores deliver them."""
    tokens = tokens or len(block_payloads) * layout.block_tokens
    buf = bytearray(layout.buffer_bytes(tokens))
    whole = layout.span_of(0, layout.payload_bytes)
    for b, payload in enumerate(block_payloads):
        for src, dst, n in layout.scatter(whole, b, tokens):
            buf[dst : dst + n] = payload[src : src + n]
    return buf


def tokens_for(n_blocks: int, seed: int, tail: int = 0, block_tokens: int = 64) -> list[int]:
    """Deterministic token ids: n full blocks and a partial tail."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_blocks * block_tokens + tail)]


async def restore_all(client, match, layout, **kw):
    """Restores a whole match; returns (buffer, layers in the order they became ready, stats)."""
    out = bytearray(layout.buffer_bytes(match.tokens))
    restore = client.read(match, out, **kw)
    order = [layer async for layer in restore]
    return out, order, await restore.wait()


def flip_bytes(path: pathlib.Path, *offsets: int) -> None:
    """Inverts the byte at each of `offsets` in the file at `path`, fsyncs, and drops
    the file's cached pages, so a server reading it (direct or buffered) sees the damage."""
    with open(path, "r+b") as fh:
        for offset in offsets:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def flip_stored_byte(data_dir: pathlib.Path, chunk: bytes, at: int) -> str | None:
    """Flips byte `at` of `chunk` where a chunkserver's slot files under `data_dir`
    hold it (found by its first 4 KiB), with flip_bytes. Returns where it flipped
    ("slots/<class>/<file>.slots+<offset>"), or None if the chunk is not stored there."""
    for slot_file in sorted((data_dir / "slots").rglob("*.slots")):
        pos = slot_file.read_bytes().find(chunk[:4096])
        if pos >= 0:
            flip_bytes(slot_file, pos + at)
            return f"{slot_file.relative_to(data_dir)}+{pos + at}"
    return None
