"""Full disks: a real cluster written far past its capacity keeps accepting writes,
evicting old blocks (leaves first) and freeing their chunks on the chunkservers."""

import asyncio
import os

from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import layer_major, restore_all, tokens_for, until

NS = Namespace("acme", "evict")
LAYOUT = BlockLayout(layers=16, block_tokens=64, kv_dim=64, dtype="bfloat16")  # 128 KiB blocks: one 128 KiB slot
MiB = 1 << 20
SYSTEM = tokens_for(2, seed=1)  # a 2-block system prompt every request shares
SYSTEM_KV = [os.urandom(LAYOUT.payload_bytes) for _ in range(2)]  # its cache is the same for every request
PROMPT_BLOCKS = 8


def prompt(i: int) -> list[int]:
    return SYSTEM + tokens_for(PROMPT_BLOCKS - 2, seed=1000 + i)


async def request(client: Client, i: int) -> bytes:
    """What an inference worker does: look the prompt up, write the whole prompt back
    (blocks already there are skipped). Returns the payload written."""
    tokens = prompt(i)
    await client.lookup(NS, tokens)
    payload = layer_major(LAYOUT, SYSTEM_KV + [os.urandom(LAYOUT.payload_bytes) for _ in range(PROMPT_BLOCKS - 2)])
    res = await client.write(NS, tokens, payload, LAYOUT)
    assert res.committed + res.already_present == PROMPT_BLOCKS, res
    return payload


async def test_writing_three_times_the_capacity_evicts_instead_of_failing(local_cluster):
    cluster = local_cluster(capacity="32MiB")  # 3 x 32 MiB / 2 replicas: 48 MiB of blocks
    writes, batch = 200, 4
    payloads: dict[int, bytes] = {}
    async with Client(cluster.meta_address) as client:
        hot = await request(client, 0)
        for start in range(1, writes, batch):
            # a few writers at once, as from several inference workers; every write must succeed
            done = await asyncio.gather(*(request(client, i) for i in range(start, min(start + batch, writes))))
            payloads.update(zip(range(start, start + batch), done))
            for old in [i for i in payloads if i < start - 8]:
                del payloads[old]
            if start % 20 == 1:  # prompt 0 keeps being used
                assert (await client.lookup(NS, prompt(0))).matched == PROMPT_BLOCKS
        written = writes * (PROMPT_BLOCKS - 2) * LAYOUT.payload_bytes
        status = await client.status()
        print(f"did: {writes} prompts of {PROMPT_BLOCKS} blocks ({written / MiB:.0f} MiB of unique blocks, "
              f"2 shared), {batch} writers at a time, prompt 0 looked up every 20 writes")
        print(f"saw: every write committed; {status.evicted_blocks} blocks evicted, {status.blocks} cached, "
              f"cache {status.cache_bytes / MiB:.1f} of {status.cache_capacity_bytes / MiB:.0f} MiB")
        assert status.cache_capacity_bytes == 48 * MiB and written > 3 * status.cache_capacity_bytes
        assert status.evicted_blocks > 0
        assert status.cache_bytes <= 0.9 * status.cache_capacity_bytes
        assert status.blocks * LAYOUT.payload_bytes == status.cache_bytes  # payload fills its slot exactly

        async def disks_hold_only_cached_blocks():
            st = await client.status()
            used = [s.used_bytes for s in st.servers]
            return sum(used) == st.replicas * st.cache_bytes and used

        used = await until(disks_hold_only_cached_blocks, 20, "evicted chunks deleted and heartbeats reporting it")
        stats = []
        for cs in cluster.chunkservers:
            async with ChunkClient(cs.address) as c:
                stats.append(await c.stat())
        print(f"saw: chunkservers hold {[round(u / MiB, 1) for u in used]} MiB (capacity 32 MiB each), "
              f"slot files {[round(s.allocated_bytes / MiB) for s in stats]} MiB")
        assert all(s.allocated_bytes <= 32 * MiB and s.used_bytes < 32 * MiB for s in stats)

        # the most recent prompts and the hot one are whole and exact; the oldest kept only the shared prefix
        for i, payload in [(0, hot), *sorted(payloads.items())[-4:]]:
            match = await client.lookup(NS, prompt(i))
            assert match.matched == PROMPT_BLOCKS, f"prompt {i}: {match.matched} blocks matched"
            out, _, _ = await restore_all(client, match, LAYOUT)
            assert bytes(out) == payload, f"prompt {i} restored other bytes"
        assert (await client.lookup(NS, prompt(1))).matched == 2
        print("saw: prompt 0 and the last 4 prompts restore exactly; prompt 1 matches only the shared system prompt")
