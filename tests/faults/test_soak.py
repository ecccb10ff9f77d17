"""A bounded soak: writers and readers run concurrently while chunkservers are
SIGKILLed and restarted at random, one at a time. Every restored byte is the
byte written for its key, every acknowledged write restores exactly once the
cluster is whole again, and processes, file descriptors, threads and memory stay
bounded.

KVFS_SOAK_SECONDS (default 60) sets how long the chaos runs, KVFS_SOAK_SEED the
random seed (printed, to replay a run)."""

import asyncio
import contextlib
import functools
import os
import pathlib
import random
import threading
import time
from collections import Counter

import pytest

from kvfs.client import Client
from kvfs.errors import KvfsError
from kvfs.keys import Namespace
from kvfs.cli.launcher import meta_status
from kvfs.layout import BlockLayout

from helpers import layer_major, restore_all, tokens_for, until

NS = Namespace("acme", "soak")
# 128 KiB blocks cut into two 64 KiB chunks: a block can lose one chunk and not the other
LAYOUT = BlockLayout(layers=8, block_tokens=64, kv_dim=128, dtype="bfloat16")
META = ["--chunk-size", "64KiB"]
SERVERS, REPLICAS = 4, 2
WRITERS, READERS = 3, 3
SOAK_SECONDS = float(os.environ.get("KVFS_SOAK_SECONDS", "60"))
WARMUP_SECONDS = 5
OP_DEADLINE = 45  # seconds a write or restore may take before it counts as hung
RESTART_DEADLINE = 120  # a returning server is live once a repair round ends and it is reconciled
FAMILIES = [tokens_for(4, seed=900 + f) for f in range(6)]  # shared prefixes
# how far resources may grow from the warm soak to its end
FD_MARGIN, THREAD_MARGIN, RSS_MARGIN = 64, 16, 64 << 20


@functools.lru_cache(maxsize=64)
def payload_of(key: bytes) -> bytes:
    """A block's bytes, fixed by its key: any reader can check any block, and
    concurrent writers of one block write the same bytes."""
    return random.Random(key).randbytes(LAYOUT.payload_bytes)


def buffer_for(keys: list[bytes]) -> bytearray:
    return layer_major(LAYOUT, [payload_of(k) for k in keys])


def prompt_for(rng: random.Random) -> tuple[int, ...]:
    """A family prefix of 1-4 blocks, then 0-3 blocks of one of 100 tails: the data
    stays bounded however long the soak runs."""
    prefix = rng.choice(FAMILIES)[: rng.randint(1, 4) * 64]
    return tuple(prefix + tokens_for(rng.choice([0, 1, 2, 3]), seed=rng.randrange(100)))


def fd_kinds(pid: int) -> Counter:
    """A process's open file descriptors by kind (socket, pipe, anon_inode, /memfd) or a file's folder."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds[target.split(":")[0] if ":" in target else os.path.dirname(target)] += 1
    return kinds


def figures(pid: int) -> dict:
    """Open file descriptors (and their kinds), resident memory (bytes) and OS threads of a process."""
    lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    kinds = fd_kinds(pid)
    return {"fds": sum(kinds.values()), "fd_kinds": kinds, "rss": int(status["VmRSS"].split()[0]) * 1024,
            "threads": int(status["Threads"])}


def children(pid: int) -> list[str]:
    """`pid state` of every child process of `pid` (zombies included)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
                state, ppid = stat.rsplit(")", 1)[1].split()[:2]
                if int(ppid) == pid:
                    out.append(f"{entry} {state}")
    return out


def sample(cluster) -> dict[str, dict[str, int]]:
    me = {**figures(os.getpid()), "py_threads": threading.active_count(), "children": len(children(os.getpid()))}
    return {"test": me, **{p.name: {**figures(p.pid), "pid": p.pid} for p in cluster.processes()}}


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}MiB"


def check_bounded(before: dict, after: dict) -> list[str]:
    problems = []
    for name, a in after.items():
        b = before[name]
        if a["fds"] > b["fds"] + FD_MARGIN:
            grew = dict(a["fd_kinds"] - b["fd_kinds"])
            problems.append(f"{name}: open files {b['fds']} -> {a['fds']} (more of: {grew})")
        if a["threads"] > b["threads"] + THREAD_MARGIN:
            problems.append(f"{name}: threads {b['threads']} -> {a['threads']}")
        if a["rss"] > 2 * b["rss"] + RSS_MARGIN:
            problems.append(f"{name}: RSS {mib(b['rss'])} -> {mib(a['rss'])}")
    return problems


def resource_table(before: dict, after: dict) -> str:
    lines = []
    for name, a in after.items():
        b = before[name]
        line = (f"  {name:10} fds {b['fds']:4} -> {a['fds']:4}  threads {b['threads']:3} -> {a['threads']:3}  "
                f"RSS {mib(b['rss']):>7} -> {mib(a['rss']):>7}")
        if name == "test":
            line += (f"  python threads {b['py_threads']} -> {a['py_threads']}, child processes "
                     f"{b['children']} -> {a['children']}")
        else:
            line += f"  pid {b['pid']} -> {a['pid']}" + ("" if a["pid"] == b["pid"] else " (restarted)")
        lines.append(line)
    return "\n".join(lines)


def meta_alarms(cluster) -> list[str]:
    """Metaserver log lines that say every server looked dead at once, or blocks were dropped."""
    return [line for line in cluster.meta.log_path.read_text(errors="replace").splitlines()
            if "over 0 live servers" in line or "lost every copy" in line]


async def replication_gaps(client: Client, prompts) -> int:
    """Chunks of the blocks `prompts` match that have fewer than REPLICAS live copies."""
    gaps = 0
    for tokens in prompts:
        m = await client.lookup(NS, tokens)
        gaps += sum(len(m.holders(c)) < REPLICAS for b in m.blocks for c in b.chunks)
    return gaps


@pytest.mark.slow  # KVFS_SOAK_SECONDS of chaos (60 by default) plus the heal
async def test_soak_kills_and_restarts_chunkservers_under_concurrent_restores_and_writes(local_cluster):
    t_start = time.monotonic()
    seed = int(os.environ.get("KVFS_SOAK_SEED", random.randrange(1 << 30)))
    cluster = local_cluster(chunkservers=SERVERS, replicas=REPLICAS, meta_extra=META)
    acked: dict[tuple[int, ...], None] = {}  # prompts whose write was acknowledged, in order
    counts: Counter = Counter()
    errors: Counter = Counter()  # (operation, error type) -> count
    wrong: list[str] = []
    injected: list[str] = []
    stop, chaos_on = asyncio.Event(), asyncio.Event()

    async def writer(w: int, client: Client) -> None:
        rng = random.Random(seed * 100 + w)
        while not stop.is_set():
            # now and then rewrite an acknowledged prompt: its blocks are already present
            tokens = rng.choice(list(acked)) if acked and rng.random() < 0.2 else prompt_for(rng)
            keys = await client.keys(NS, tokens)
            try:
                await asyncio.wait_for(client.write(NS, tokens, buffer_for(keys), LAYOUT), OP_DEADLINE)
            except KvfsError as err:
                errors["write", type(err).__name__] += 1
                continue
            except TimeoutError:
                errors["write", "hung"] += 1
                continue
            counts["writes ok"] += 1
            acked[tokens] = None
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def reader(r: int, client: Client) -> None:
        rng = random.Random(seed * 100 + 50 + r)
        while not stop.is_set():
            if not acked:
                await asyncio.sleep(0.05)
                continue
            tokens = rng.choice(list(acked))
            try:
                match = await client.lookup(NS, tokens)
            except KvfsError as err:
                errors["lookup", type(err).__name__] += 1
                continue
            if match.matched < len(match.keys):
                counts["restores short"] += 1  # a chunk's copies are down, or being re-created
            if match.matched == 0:
                continue
            try:
                out, _, _ = await asyncio.wait_for(restore_all(client, match, LAYOUT), OP_DEADLINE)
            except KvfsError as err:
                errors["restore", type(err).__name__] += 1
                continue
            except TimeoutError:
                errors["restore", "hung"] += 1
                continue
            if out != buffer_for(match.keys[: match.matched]):
                wrong.append(f"prompt of {len(match.keys)} blocks restored other bytes in its first "
                             f"{match.matched} (chaos {'on' if chaos_on.is_set() else 'off'})")
            counts["restores ok"] += 1
            counts["blocks restored"] += match.matched
            await asyncio.sleep(rng.uniform(0, 0.02))

    async def chaos() -> None:
        rng = random.Random(seed)
        await chaos_on.wait()
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0, 3))  # from 0: the next kill right after a server is back
            if stop.is_set():
                break
            i = rng.randrange(SERVERS)
            down = rng.uniform(0.5, 5)  # shorter and longer than the 3 s heartbeat timeout
            at = time.monotonic() - t_start
            await asyncio.to_thread(cluster.chunkservers[i].kill)
            await asyncio.sleep(down)
            t0 = time.monotonic()
            # waits until the metaserver has reconciled it and lists it live
            await asyncio.to_thread(cluster.start_chunkserver, i, True, RESTART_DEADLINE)
            injected.append(f"t={at:.0f}s cs-{i} down {down:.1f}s, live {time.monotonic() - t0:.1f}s after restart")

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client(cluster.meta_address, timeout=10))
                   for _ in range(WRITERS + READERS)]
        tasks = [asyncio.create_task(writer(w, clients[w])) for w in range(WRITERS)]
        tasks += [asyncio.create_task(reader(r, clients[WRITERS + r])) for r in range(READERS)]
        chaos_task = asyncio.create_task(chaos())
        try:
            await until(lambda: (len(acked) >= 20 and counts["restores ok"] >= 20) or any(t.done() for t in tasks),
                        60, "warm-up writes and restores", interval=0.1)
            await asyncio.sleep(WARMUP_SECONDS)  # the workload running: sockets, pools and caches fill up
            before = await asyncio.to_thread(sample, cluster)
            warm = dict(counts)
            chaos_on.set()
            t_chaos = time.monotonic()
            await until(lambda: time.monotonic() - t_chaos >= SOAK_SECONDS or any(t.done() for t in tasks),
                        SOAK_SECONDS + 30, "the soak", interval=0.2)
            stop.set()
            done, pending = await asyncio.wait([*tasks, chaos_task], timeout=RESTART_DEADLINE + 10)
            assert not pending, f"{len(pending)} workload tasks still running after the soak"
            for t in done:
                t.result()  # a crash of the workload itself (not a kvfs error) fails here
            soak_s = time.monotonic() - t_chaos
            print(f"\nseed {seed}; soak {soak_s:.0f}s after {WARMUP_SECONDS}s warm-up; injected {len(injected)} "
                  f"SIGKILL+restart cycles:\n  " + "\n  ".join(injected))
            print(f"workload: {dict(counts)} (before chaos: {warm}); errors: "
                  f"{ {f'{op} {kind}': n for (op, kind), n in sorted(errors.items())} }")
            assert not wrong, f"{len(wrong)} restores returned wrong bytes: {wrong[:5]}"
            hung = {k: n for k, n in errors.items() if k[1] == "hung"}
            assert not hung, f"operations hung past {OP_DEADLINE}s: {hung}"
            assert injected, "the chaos task injected nothing"

            await asyncio.to_thread(cluster.wait_until, lambda st: sum(s.live for s in st.servers) == SERVERS,
                                    60, f"{SERVERS} live chunkservers")
            client = clients[0]
            t0 = time.monotonic()

            async def fully_replicated() -> bool:
                return await replication_gaps(client, list(acked)) == 0

            await until(fully_replicated, 90, "every chunk back on two live servers", interval=0.5)
            healed = time.monotonic() - t0
            status = await asyncio.to_thread(meta_status, cluster.meta_address, credentials=cluster.admin)
            acked_keys = {k for t in acked for k in await client.keys(NS, t)}
            missing: set[bytes] = set()
            for tokens in acked:
                match = await client.lookup(NS, tokens)
                missing.update(match.keys[match.matched :])
                if match.matched:
                    out, _, _ = await asyncio.wait_for(restore_all(client, match, LAYOUT), OP_DEADLINE)
                    assert out == buffer_for(match.keys[: match.matched]), "an acknowledged write restores other bytes"
            print(f"after the soak: all {SERVERS} servers live, fully replicated {healed:.1f}s later; "
                  f"{len(acked)} acknowledged prompts ({len(acked_keys)} blocks) checked, {len(missing)} blocks "
                  f"missing; metaserver: {status.blocks} blocks, {status.blocks_lost} lost, "
                  f"{status.stranded_blocks} stranded, {status.gc_deleted_chunks} stale copies deleted")
            alarms = meta_alarms(cluster)
            if alarms:
                print("metaserver alarms (every server dead at once / blocks dropped):\n  " + "\n  ".join(alarms))
            after = await asyncio.to_thread(sample, cluster)
            print(resource_table(before, after))
            assert after["test"]["children"] == len(cluster.processes()), \
                f"child processes of the test: {children(os.getpid())}, expected one per server"
            assert after["test"]["py_threads"] <= before["test"]["py_threads"] + THREAD_MARGIN
            assert len(missing) <= status.blocks_lost + status.stranded_blocks, \
                f"{len(missing)} acknowledged blocks are gone but the metaserver dropped only " \
                f"{status.blocks_lost + status.stranded_blocks}: lost without a trace"
            assert status.blocks_lost == 0, \
                f"the metaserver dropped {status.blocks_lost} blocks as having lost every copy of a chunk " \
                f"({len(missing)} acknowledged blocks missing), with one chunkserver down at a time and {REPLICAS} " \
                f"replicas; metaserver log: {alarms[-5:]}"

            problems = check_bounded(before, after)
            assert not problems, "resources grew past their bounds: " + "; ".join(problems)
        finally:  # a failed check must not leave the workload running into teardown
            stop.set()
            for t in [*tasks, chaos_task]:
                t.cancel()
            await asyncio.wait([*tasks, chaos_task], timeout=RESTART_DEADLINE + 10)
    print(f"test took {time.monotonic() - t_start:.0f}s")

