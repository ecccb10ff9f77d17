"""Multi-host: the metaserver and three chunkservers each in a network namespace
of their own, joined by a bridge (veth pairs), all on this machine. One host is
cut off mid-restore: the restore completes from replicas, the host is detected,
its chunks are copied to the others, and when its link comes back its stale
copies are deleted before it serves again. Needs root (`ip netns`)."""

import asyncio
import os
import time

import pytest

from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.cli.hosts import Hosts, Link
from kvfs.cli.launcher import meta_status, start_chunkserver, start_metaserver
from kvfs.layout import BlockLayout

from conftest import FAST_META
from helpers import restore_all, tokens_for, until, wait_until

pytestmark = pytest.mark.root

NS = Namespace("acme", "netns")
MLA = BlockLayout.mla()


@pytest.fixture
def hosts():
    with Hosts(4) as h:
        yield h


def holders(match) -> list[set[str]]:
    return [{s.id for s in match.holders(c)} for b in match.blocks for c in b.chunks]


async def test_host_cut_off_mid_restore_is_read_around_detected_healed_and_reconciled(hosts, tmp_path):
    started = []
    try:
        meta = start_metaserver(tmp_path / "meta", listen=f"{hosts.address(0)}:0", replicas=2, extra=FAST_META,
                                run_dir=tmp_path, netns=hosts.names[0])
        started.append(meta)
        for i in (1, 2, 3):
            started.append(start_chunkserver(
                tmp_path / f"cs-{i}", server_id=f"cs-{i}", failure_domain=f"host-{i}", capacity="2GiB",
                listen=f"{hosts.address(i)}:0", run_dir=tmp_path, netns=hosts.names[i],
                extra=["--meta", meta.address]))
        wait_until(lambda: sum(s.live for s in meta_status(meta.address, credentials=meta.credentials).servers) == 3,
                   30, "3 live chunkservers")
        print(f"hosts: metaserver {meta.address}, chunkservers {[s.address for s in started[1:]]}")

        tokens = tokens_for(48, seed=41)
        payload = os.urandom(MLA.buffer_bytes(48 * 64))
        async with Client(meta.address) as client:
            await client.write(NS, tokens, payload, MLA)
            match = await client.lookup(NS, tokens)
            assert match.matched == 48 and not any(s.address.startswith("127.") for s in match.servers)
            for _ in range(30):  # until the SDK has a p95 for every server (what hedges wait for)
                out, _, _ = await restore_all(client, match, MLA)
                assert bytes(out) == payload
                if all(client.latency.p95(s.data_address or s.address) is not None or
                       client.latency.p95(s.address) is not None for s in match.servers):
                    break

            out = bytearray(MLA.buffer_bytes(match.tokens))
            restore = client.read(match, out)
            await until(lambda: restore.stats.bytes > 0, 10, "the restore under way")
            hosts.cut(2)
            cut_at = time.monotonic()
            assert not restore.done()
            print("injected: cut host 2 (cs-2) off the bridge mid-restore")
            stats = await asyncio.wait_for(restore.wait(), 20)  # before the transport gives up on cs-2 (30 s)
            assert bytes(out) == payload
            print(f"saw: restore exact {time.monotonic() - cut_at:.2f}s after the cut, {stats.hedges} chunks hedged, "
                  f"{stats.retries} retried")

            def cs2_live():
                servers = meta_status(meta.address, credentials=meta.credentials).servers
                return next(s.live for s in servers if s.id == "cs-2")

            wait_until(lambda: not cs2_live(), 30, "cs-2 detected", interval=0.1)
            detected = time.monotonic() - cut_at

            async def healed():
                m = await client.lookup(NS, tokens)
                return m.matched == 48 and all(len(h) == 2 and "cs-2" not in h for h in holders(m))

            await until(healed, 60, "two live copies of every chunk", interval=0.2)
            print(f"saw: cs-2 detected after {detected:.1f}s; full replication after {time.monotonic() - cut_at:.1f}s")

            hosts.reconnect(2)
            wait_until(cs2_live, 60, "cs-2 back and reconciled", interval=0.1)
            async with ChunkClient(started[2].address) as c:
                assert (await c.stat()).chunk_count == 0  # its copies had all been re-created elsewhere
            out, _, _ = await restore_all(client, await client.lookup(NS, tokens), MLA)
            assert bytes(out) == payload
            print("saw: cs-2 reconnected, its stale copies deleted before it served; restores exact")
    finally:
        for s in started:
            s.kill()


def test_a_shaped_host_link_is_a_token_bucket_both_ways():
    with Hosts(2) as h:
        h.shape(1, Link.parse("1500mbit"))
        sending, receiving = h.qdiscs(1)
        for side in (sending, receiving):
            assert "qdisc tbf" in side and "rate 1500Mbit" in side, side
        assert all("tbf" not in side for side in h.qdiscs(0))  # the other host's link is left as it was
        assert h.links == [None, Link(1_500_000_000)]
