"""A chunkserver that stalls (SIGSTOP: connections open, nothing answered) is read
around by hedged reads; its late answers never touch the delivered bytes."""

import os
import pathlib
import signal

import pytest

from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import restore_all, tokens_for, until

NS = Namespace("acme", "hedging")
MLA = BlockLayout.mla()


def scramble_slot_files(data_dir: pathlib.Path) -> int:
    """Overwrites every stored byte of a chunkserver with garbage (page cache included)."""
    n = 0
    for slot_file in (data_dir / "slots").rglob("*.slots"):
        size = slot_file.stat().st_size
        with open(slot_file, "r+b") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())
        n += size
    return n


@pytest.mark.parametrize("transport", ["tcp", "shm", "grpc"])
async def test_stalled_chunkserver_is_hedged_and_its_late_bytes_are_dropped(local_cluster, transport):
    cluster = local_cluster(chunk_extra=["--io-mode", "buffered"])
    tokens = tokens_for(16, seed=21)
    payload = os.urandom(MLA.buffer_bytes(16 * 64))
    # one chunk per batch: many latency samples per restore; a budget that lets every slow batch hedge
    async with Client(cluster.meta_address, transport=transport, read_batch=1, hedge_budget=1.0) as client:
        await client.write(NS, tokens, payload, MLA)
        match = await client.lookup(NS, tokens)
        assert match.matched == 16
        addresses = [cs.address for cs in cluster.chunkservers]
        for _ in range(20):  # until every server has a measured p95
            out, _, stats = await restore_all(client, match, MLA)
            assert bytes(out) == payload
            if all(client.latency.p95(a) is not None for a in addresses):
                break
        assert all(client.latency.p95(a) is not None for a in addresses), client.latency.snapshot()

        stalled = cluster.chunkservers[1]
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            print(f"injected: SIGSTOP {stalled.address} (p95 {client.latency.p95(stalled.address) * 1e3:.1f} ms)")
            out = bytearray(MLA.buffer_bytes(match.tokens))
            restore = client.read(match, out)
            order = [layer async for layer in restore]
            stats = await restore.wait()
            assert order == list(range(MLA.layers))
            assert bytes(out) == payload
            assert stats.hedges > 0 and stats.hedges_won > 0
            assert stats.per_server.get(stalled.address, 0) == 0
            assert restore.reads_in_flight > 0  # the stalled server still owes answers
            # what it will answer late is garbage: were it let into the buffer, the buffer would change
            scrambled = scramble_slot_files(cluster.root / "cs-1")
            print(f"saw: restore exact with {stats.hedges} chunks hedged ({stats.hedges_won} won); "
                  f"scrambled {scrambled >> 20} MiB on the stalled server")
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        await until(lambda: restore.reads_in_flight == 0, 30, "the stalled server's late answers")
        assert bytes(out) == payload
        assert client.hedges.won >= stats.hedges_won
        print("saw: the late answers arrived after SIGCONT and the buffer is unchanged")
