"""Fixtures of the unit tests (no processes, no sockets)."""

import asyncio
import threading

import pytest

from kvfs.chunkserver.store import ChunkStore
from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.metaserver.config import MetaserverConfig
from kvfs.metaserver.state import MetaState
from kvfs.proto import meta_pb2

from helpers import Clock


@pytest.fixture
def make_state(tmp_path):
    """Factory: make_state(clock=None, policy=None, register=True, capacity=1 GiB, **config)
    -> a MetaState on RocksDB in tmp_path with three chunkservers registered (unless
    `register` is False), each `capacity` bytes; servers stay live unless the test
    sets `heartbeat_timeout`."""
    states = []

    def make(clock=None, policy=None, register=True, capacity=1 << 30, **kw):
        kw.setdefault("heartbeat_timeout", 1e9)
        kw.setdefault("ttl_classes", "short=10s,chat=7d")
        if policy is not None:
            kw["eviction_policy"] = policy
        cfg = MetaserverConfig(data_dir=str(tmp_path / "meta"), chunk_size=64 * 1024, **kw)
        state = MetaState(cfg, clock or Clock())
        for i in range(3 if register else 0):
            state.register(meta_pb2.RegisterRequest(server_id=f"cs-{i}", address=f"127.0.0.1:{9000 + i}",
                                                    failure_domain=f"host-{i}", capacity_bytes=capacity))
        states.append(state)
        return state

    yield make
    for s in states:
        try:
            s.close()
        except Exception:
            pass


@pytest.fixture
def event_loop_thread():
    """An event loop running in a thread of its own, as the metaserver's runs beside
    the scrapes of its metrics."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


@pytest.fixture(params=["direct", "buffered"])
def make_store(tmp_path, request):
    """Factory: make_store(**config) -> a ChunkStore in tmp_path, once per I/O mode."""
    stores = []

    def make(**kw):
        kw.setdefault("io_mode", request.param)
        store = ChunkStore(ChunkserverConfig(data_dir=str(tmp_path / "cs"), capacity=1 << 30, **kw))
        stores.append(store)
        return store

    yield make
    for s in stores:
        try:
            s.close()
        except Exception:
            pass
