"""The chunkserver's gRPC health on real processes: NOT_SERVING until it has
registered with its metaserver and while its store is full, SERVING otherwise;
reads are served all along."""

from __future__ import annotations

import os
import signal

from kvfs.cli.launcher import health, meta_status, start_metaserver
from kvfs.client import ChunkClient
from kvfs.errors import ResourceExhausted

from helpers import credentials, wait_until
from test_disk_full import MiB, fill_until_exhausted

FAST_META = ["--heartbeat-interval", "200ms", "--heartbeat-timeout", "3s", "--lifecycle-interval", "1h"]


def test_not_serving_until_registered_with_the_metaserver(chunkservers, tmp_path):
    meta = start_metaserver(tmp_path / "meta", run_dir=tmp_path / "run", extra=FAST_META)
    try:
        os.kill(meta.pid, signal.SIGSTOP)  # reachable but silent: the chunkserver's Register waits
        try:
            cs = chunkservers(extra=["--meta", meta.address], healthy=False)
            assert health(cs.address, credentials()) == "NOT_SERVING"
        finally:
            os.kill(meta.pid, signal.SIGCONT)
        wait_until(lambda: health(cs.address, credentials()) == "SERVING", 30, "SERVING once registered")
        listed = meta_status(meta.address, credentials=meta.credentials).servers
        assert [s.id for s in listed] == ["cs-1"]  # SERVING came after the metaserver took it in
        log = cs.log_path.read_text()
        assert log.index("registered with metaserver") < log.index("health SERVING")
    finally:
        meta.stop()


def test_not_serving_from_when_a_new_metaserver_asks_it_to_register_again_until_it_did(chunkservers, tmp_path):
    first = start_metaserver(tmp_path / "meta", run_dir=tmp_path / "run", extra=FAST_META)
    cs = chunkservers(extra=["--meta", first.address])
    assert health(cs.address, credentials()) == "SERVING"
    first.stop()
    # the same address, an empty database: it knows no chunkserver, so the next heartbeat hears "register again"
    second = start_metaserver(tmp_path / "meta-2", listen=first.address, run_dir=tmp_path / "run", extra=FAST_META)
    try:
        wait_until(lambda: [s.id for s in meta_status(second.address, credentials=second.credentials).servers],
                   30, "cs-1 registered with the new metaserver")
        wait_until(lambda: health(cs.address, credentials()) == "SERVING", 10, "SERVING again")
        log = cs.log_path.read_text()
        dropped = log.index("health NOT_SERVING: not registered with the metaserver")
        assert log.index("registered with metaserver", dropped) < log.index("health SERVING", dropped)
    finally:
        second.stop()


async def test_not_serving_while_full_and_serving_again_once_a_delete_makes_room(chunkservers):
    server = chunkservers(capacity="20MiB")  # standalone: nothing to register with, SERVING at once
    assert health(server.address, credentials()) == "SERVING"
    stored = await fill_until_exhausted(server.address, 64)
    wait_until(lambda: health(server.address, credentials()) == "NOT_SERVING", 10, "NOT_SERVING when full")
    async with ChunkClient(server.address) as client:
        assert await client.read_chunk(b"fill-3") == stored[b"fill-3"]  # reads go on
        await client.delete([b"fill-0"])
        wait_until(lambda: health(server.address, credentials()) == "SERVING", 10, "SERVING after a delete")
        await client.write(b"after-delete", os.urandom(MiB))  # the room the delete made
        assert health(server.address, credentials()) == "SERVING"
        try:
            await client.write(b"one-too-many", os.urandom(MiB))
            raise AssertionError("a write past the capacity was stored")
        except ResourceExhausted:
            pass
    wait_until(lambda: health(server.address, credentials()) == "NOT_SERVING", 10, "NOT_SERVING when full again")
    assert "health NOT_SERVING: full" in server.log_path.read_text()
