"""Shared fixtures: real server processes, started with the users' launcher and
stopped at teardown whatever the test did."""

from __future__ import annotations

import os
import time

import pytest

from kvfs.launcher import ServerProcess, start_chunkserver


def wait_until(condition, timeout: float = 10, interval: float = 0.02, what: str = "condition"):
    """Polls `condition` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def chunkservers(tmp_path):
    """Factory: chunkservers(n=1, **kwargs) starts chunkserver processes."""
    started: list[ServerProcess] = []

    def start(server_id: str = "cs-1", data_dir=None, **kwargs) -> ServerProcess:
        server = start_chunkserver(data_dir or tmp_path / server_id, server_id=server_id,
                                   run_dir=tmp_path / "run", **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def random_bytes(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


@pytest.fixture
def rng_bytes():
    return random_bytes


def pytest_report_header(config):
    return f"kvfs tests, pid {os.getpid()}"
