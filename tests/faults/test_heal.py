"""A chunkserver dies: its replicas leave lookups, the cluster copies what it held
to the others, and when it comes back its stale copies are deleted before it
serves again."""

import os
import time

from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import restore_all, tokens_for, until

NS = Namespace("acme", "heal")
MLA = BlockLayout.mla()


def holders(match) -> list[set[str]]:
    """Server ids holding each chunk of each matched block."""
    return [{s.id for s in match.holders(c)} for b in match.blocks for c in b.chunks]


async def test_dead_server_is_detected_re_replicated_and_reconciled_on_return(local_cluster):
    cluster = local_cluster(chunkservers=3, replicas=2)
    tokens = tokens_for(24, seed=31)
    payload = os.urandom(MLA.buffer_bytes(24 * 64))
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, payload, MLA)
        first = await client.lookup(NS, tokens)
        before = holders(first)
        on_victim = sum("cs-1" in h for h in before)
        victim_bytes = sum(c.length for b in first.blocks for c in b.chunks if "cs-1" in {s.id for s in first.holders(c)})
        assert on_victim > 0 and all(len(h) == 2 for h in before)

        cluster.chunkservers[1].kill()
        killed = time.monotonic()
        print(f"injected: SIGKILL cs-1, which held {on_victim} of {len(before)} chunks")

        async def victim_gone():
            m = await client.lookup(NS, tokens)
            return m.matched == 24 and not any("cs-1" in h for h in holders(m))

        async def fully_replicated():
            m = await client.lookup(NS, tokens)
            return m.matched == 24 and all(len(h) == 2 and "cs-1" not in h for h in holders(m))

        await until(victim_gone, 30, "cs-1 to leave lookups", interval=0.1)
        detected = time.monotonic() - killed
        await until(fully_replicated, 60, "two live copies of every chunk", interval=0.1)
        healed = time.monotonic() - killed
        out, _, stats = await restore_all(client, await client.lookup(NS, tokens), MLA)
        assert bytes(out) == payload
        print(f"saw: cs-1 out of lookups after {detected:.1f}s, every chunk on two live servers after {healed:.1f}s")
        # Status counts the copies (kvfs top and the metrics show them), and the backlog
        # empties once a round finds nothing short
        async def copies_counted():
            return (await client.status()).repair_copied_chunks >= on_victim

        await until(copies_counted, 10, "Status to count the copies", interval=0.1)
        status = await client.status()
        assert (status.repair_copied_chunks, status.repair_copied_bytes, status.repair_failed_copies) == \
            (on_victim, victim_bytes, 0)

        cs1 = cluster.start_chunkserver(1)  # waits until the metaserver lists it live, i.e. reconciled
        async with ChunkClient(cs1.address) as c:
            assert (await c.stat()).chunk_count == 0  # every copy it held had been re-created elsewhere
        assert "stale chunks deleted" in cluster.meta.log_path.read_text()
        m = await client.lookup(NS, tokens)
        assert m.matched == 24 and all(len(h) == 2 for h in holders(m))
        out, _, _ = await restore_all(client, m, MLA)
        assert bytes(out) == payload
        print(f"saw: cs-1 back with its {on_victim} stale copies deleted before it served; restores exact")


async def test_a_metaserver_stall_past_the_heartbeat_timeout_drops_nothing(local_cluster):
    import signal

    cluster = local_cluster(chunkservers=3, replicas=2)
    tokens = tokens_for(8, seed=33)
    payload = os.urandom(MLA.buffer_bytes(8 * 64))
    async with Client(cluster.meta_address) as client:
        await client.write(NS, tokens, payload, MLA)
        os.kill(cluster.meta.pid, signal.SIGSTOP)
        time.sleep(3.5)  # the fault itself: longer than the 3 s heartbeat timeout
        os.kill(cluster.meta.pid, signal.SIGCONT)
        resumed = time.monotonic()
        print("injected: SIGSTOP the metaserver for 3.5 s (heartbeat timeout 3 s)")
        # every server looked silent when it woke up; give repair rounds past the grace (2 timeouts)
        cluster.wait_live(3, timeout=30)
        await until(lambda: time.monotonic() - resumed > 8, 15, "repair rounds past the grace period")
        match = await client.lookup(NS, tokens)
        assert match.matched == 8, "blocks were dropped because the metaserver itself stalled"
        status = await client.status()
        assert status.blocks_lost == 0 and status.blocks == 8
        out, _, _ = await restore_all(client, match, MLA)
        assert bytes(out) == payload
        # silence during its own stall did not count: no server was ever declared dead and back
        assert status.loop_longest_stall_s >= 3
        assert "is back" not in cluster.meta.log_path.read_text()
        print("saw: all 8 blocks kept and exact; no server counted as silent for the metaserver's own stall")
