"""`kvfs-bench meta`: one real metaserver process at scale, through its real RPCs.

The metaserver is started as users start it (cli/launcher.py), with its
defaults; its chunkservers are fakes in a child process (bench/fakes.py) that
store nothing, so what is measured is the metaserver alone. In order:

  fill      - `blocks` MLA blocks in chains of `chain`, from `clients` writers:
              AllocateBlocks + CommitBlocks of BATCH keys, each batch's parent the
              block before it (as Client.write sends them); the rate per decile;
              with `evict`, the fakes' capacity is sized so that the fill ends at
              95% of the cache, past the eviction high watermark;
  memory    - the metaserver's VmRSS and VmHWM and its data folder, per block held;
  steady    - once the eviction the fill started is done: MatchPrefix latency
              of hits (prefixes of filled chains) and of misses after block 1,
              every answer checked;
  lifecycle - the same while RunLifecycle runs back to back;
  writes    - the same while writers (in a process of their own) add chains, until
              the metaserver begins to evict: the fill's eviction left the cache at
              the low watermark, and these writes take it up to the high one;
  eviction  - the same while the writers go on and the metaserver evicts (in their
              allocations, and in its background pass once that runs), until a
              twentieth of the fill (at most 500,000 blocks) went;
  repair    - the same once one fake server stopped heartbeating, was found
              dead and its chunks are being re-replicated;
  restart   - SIGTERM, start on the same data: time until it serves and until a
              lookup of a filled chain matches in full.

A run leaves beside its database (in --data-dir, when kept) the lookup chains'
keys (SAVED). `reuse` starts instead on a copy of such a run's database, with the
fakes' capacity set so that what it holds sits at the low watermark, as after a
fill and its eviction, and goes on from the steady phase: at 10M blocks 21 minutes
instead of about 50, for comparing builds on a store of that size.

A probe process times a health Check every 10 ms throughout: per phase, the
longest the metaserver kept a cheap call waiting, whatever held it up (its
event loop, or the machine's cores busy with the writers and fakes). The
metaserver's own count of event-loop stalls (Status.loop_stalls) tells the two
apart: per phase, the stalls over 50 and 100 ms, and of those the ones its
loop's thread spent on the CPU. Every call has a
deadline, so a metaserver that stalls or dies shows as timeouts and wrong
answers in the report, not as a hung bench.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import pathlib
import shutil
import time
from dataclasses import asdict, dataclass, fields

import grpc

from kvfs.cli.launcher import LaunchError, ServerProcess, start_metaserver
from kvfs.config import MiB
from kvfs.keys import KEY_BYTES
from kvfs.layout import BlockLayout
from kvfs.metaserver.blocks import footprint
from kvfs.metaserver.config import MetaserverConfig
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS
from kvfs.serving import schedstat_times

from .fakes import FAST_RECONNECT, Child, FakeChunkservers, StallProbe, server_id

NS = meta_pb2.Namespace(tenant="bench", model="meta")
LAYOUT = BlockLayout.mla()  # 27 layers x 64 tokens x 576 x bf16: 1,990,656 bytes, 2 chunks of 1 MiB
LAYOUT_MSG = meta_pb2.BlockLayout(layers=LAYOUT.layers, block_tokens=LAYOUT.block_tokens, kv_dim=LAYOUT.kv_dim,
                                  dtype=LAYOUT.dtype)
CHUNK_SIZE = 1 * MiB  # the metaserver's default cut
BATCH = 500  # keys per AllocateBlocks / CommitBlocks
HIT_SIZES = (32, 512, 2000)
LOOKUP_CHAINS = 4  # the chains lookups use: written last, then hit, so eviction keeps them
CHECKSUM = 0x6B76_6673_6265_6E63  # any uint64: the fakes hold no bytes to check
EVICTION_SHARE = 20  # the eviction phase lasts until a 1/EVICTION_SHARE of the fill was evicted,
EVICTION_BLOCKS = 500_000  # or this many blocks if fewer
FILL_SHARE = 0.95  # with evict: the fill ends at this share of the cache
NO_EVICT_CAPACITY = 100 << 40  # per fake server: 100 TiB
# where a reused database's blocks sit in the cache: the metaserver's default low watermark,
# where a fill's eviction leaves them
REUSED_SHARE = next(f.default for f in fields(MetaserverConfig) if f.name == "evict_low")
SAVED = "bench-meta.json"  # beside the metaserver's folder: what `reuse` needs of the run
STATUS_COUNTERS = ("blocks", "evicted_blocks", "expired_blocks", "blocks_lost", "stranded_blocks",
                   "gc_deleted_chunks", "open_allocations")


class BenchAborted(RuntimeError):
    """The metaserver gave the bench nothing left to measure."""


def parse_count(text: str) -> int:
    """'100K' -> 100000, '1.5M' -> 1500000, '20000' -> 20000."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


def block_footprint() -> int:
    """What one block takes of chunkserver capacity, as the metaserver counts it."""
    return footprint(LAYOUT.chunks(CHUNK_SIZE))


@dataclass(frozen=True, slots=True)
class MetaBenchConfig:
    blocks: int = 1_000_000
    chain: int = 2000
    clients: int = 8
    servers: int = 4
    evict: bool = True
    samples: int = 1000  # per lookup kind and phase: a p99 of 200 is their second slowest
    deadline: float = 10.0  # seconds, every RPC but RunLifecycle's
    heartbeat_interval: str | None = None  # None: the metaserver's default
    heartbeat_timeout: str | None = None
    # The fakes and the eviction phase's writers stand for other machines; on this one they
    # share a few cores with the metaserver and can preempt its loop thread mid-step. At a
    # lower priority they take what the metaserver leaves (on a quiet 2-core machine its loop
    # waited for a core 4.3% of the eviction phase at nice 0, 3.4% at 10: docs/operations.md).
    # The lookups and the probe are not niced.
    load_nice: int = 10
    reuse: str | None = None  # an earlier run's folder: start on a copy of its database, no fill

    def meta_flags(self) -> list[str]:
        """The metaserver settings this run changes."""
        flags = ["--insecure"]  # its chunkservers are fakes (bench/fakes.py) that speak plaintext gRPC
        for flag, value in (("--heartbeat-interval", self.heartbeat_interval),
                            ("--heartbeat-timeout", self.heartbeat_timeout)):
            if value is not None:
                flags += [flag, value]
        return flags

    def capacity_per_server(self, replicas: int, held: int | None = None) -> int:
        """The fill ends at FILL_SHARE of the cache; or, `held` blocks reused sit at REUSED_SHARE."""
        if not self.evict:
            return NO_EVICT_CAPACITY
        blocks, share = (self.blocks, FILL_SHARE) if held is None else (held, REUSED_SHARE)
        return math.ceil(blocks * block_footprint() * replicas / self.servers / share)

    def chain_lengths(self) -> list[int]:
        """The fill's chains: a short one first (if any), the lookups' full ones last."""
        full, rest = divmod(self.blocks, self.chain)
        return ([rest] if rest else []) + [self.chain] * full


def load_saved(folder: str | os.PathLike) -> dict:
    """What a run kept in `folder` (its --data-dir) for `reuse`: its config's blocks, chain
    and servers, the lookup chains' keys and their first chunks' ids."""
    path = pathlib.Path(folder) / SAVED
    try:
        saved = json.loads(path.read_text())
        return {"config": {k: int(saved["config"][k]) for k in ("blocks", "chain", "servers")},
                "chains": {int(i): [bytes.fromhex(k) for k in keys] for i, keys in saved["chains"].items()},
                "first_chunk": {bytes.fromhex(k): bytes.fromhex(c) for k, c in saved["first_chunk"].items()}}
    except FileNotFoundError:
        raise BenchAborted(f"{folder} holds no {SAVED}: not the --data-dir of a `kvfs-bench meta` run that "
                           f"finished its fill") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise BenchAborted(f"{path} is unreadable: {err!r}") from None


def _summary(seconds: list[float]) -> dict:
    s = sorted(seconds)
    if not s:
        return {"count": 0}

    def q(p):
        return s[min(len(s) - 1, int(p * len(s)))] * 1e3

    return {"count": len(s), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": s[-1] * 1e3}


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/status") as f:  # gone: nothing to read
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


def _main_thread_times(pid: int) -> tuple[float, float] | None:
    """Seconds a process's main thread (an asyncio server's event loop) has been on
    a CPU and runnable waiting for one (Linux schedstat); None where it is not kept."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as fh:
            return schedstat_times(fh.read())
    except (OSError, ValueError):
        return None


def _folder_bytes(path: pathlib.Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # RocksDB compacts as we walk
                total += os.stat(os.path.join(folder, name)).st_size
    return total


class Fill:
    """Writers of whole chains, like Client.write without the chunk bytes."""

    def __init__(self, stub, deadline: float, on_commit=lambda n: None, stop=lambda: False, total: int = 0):
        self.stub, self.deadline, self.on_commit, self.stop = stub, deadline, on_commit, stop
        self.committed = self.already = self.refused = self.failed_batches = 0
        self.errors: collections.Counter = collections.Counter()
        self._bounds = [math.ceil(k * total / 10) for k in range(1, 11)] if total else []
        self.marks: list[tuple[int, float]] = []  # (committed, monotonic) as each decile completes
        self.first_chunk: dict[bytes, bytes] = {}  # key -> its first chunk's id, for the kept chains' blocks

    async def run(self, lengths: list[int], clients: int, keep: dict[int, list[bytes]]) -> None:
        """Writes the chains, `clients` at a time; the keys of chain i go into keep[i] if present."""
        todo = iter(enumerate(lengths))

        async def writer():
            for i, n in todo:
                if self.stop():
                    return
                await self._chain(n, keep.get(i))

        await asyncio.gather(*(writer() for _ in range(clients)))

    async def _chain(self, n: int, keep: list[bytes] | None) -> None:
        parent = first = b""
        for start in range(0, n, BATCH):
            raw = os.urandom(16 * min(BATCH, n - start))
            keys = [raw[j : j + 16] for j in range(0, len(raw), 16)]
            first = first or keys[0]
            try:
                alloc = await self.stub.AllocateBlocks(meta_pb2.AllocateBlocksRequest(
                    namespace=NS, keys=keys, layout=LAYOUT_MSG, parent=parent, first_key=first),
                    timeout=self.deadline)
                commit = meta_pb2.CommitBlocksRequest(namespace=NS, allocation_id=alloc.allocation_id)
                for b in alloc.blocks:
                    if not b.already_present:
                        commit.blocks.add(key=b.key, chunk_checksums=[CHECKSUM] * len(b.chunks))
                reply = meta_pb2.CommitBlocksReply()
                if commit.blocks:
                    reply = await self.stub.CommitBlocks(commit, timeout=self.deadline)
            except grpc.aio.AioRpcError as err:
                self.failed_batches += 1
                self.errors[err.code().name] += 1
                return  # the rest would hang off a block that is not there
            already = sum(b.already_present for b in alloc.blocks) + reply.already_present
            self.committed += reply.committed
            self.already += already
            self._mark()
            self.on_commit(reply.committed)
            if reply.committed + already < len(keys):
                self.refused += len(keys) - reply.committed - already
                return
            if keep is not None:
                keep.extend(keys)
                self.first_chunk.update((b.key, b.chunks[0].chunk_id) for b in alloc.blocks)
            parent = keys[-1]
            if self.stop():
                return

    def _mark(self) -> None:
        while self._bounds and self.committed >= self._bounds[0]:
            self._bounds.pop(0)
            self.marks.append((self.committed, time.monotonic()))

    def deciles(self, t0: float) -> list[dict]:
        out, (prev_n, prev_t) = [], (0, t0)
        for n, t in self.marks:
            out.append({"blocks": n - prev_n, "seconds": t - prev_t,
                        "blocks_per_s": (n - prev_n) / max(t - prev_t, 1e-9)})
            prev_n, prev_t = n, t
        return out


class WriterProcess(Child):
    """Fill's writers in a spawned process of their own, on their own channel: the
    eviction phase's writes, kept off the event loop and the connection the
    lookups are timed on. In one process a lookup's reply could wait behind the
    writers' client work (building and parsing 500-block messages) and their
    megabytes on the same HTTP/2 connection, time the metaserver did not spend;
    a real worker's lookups do not queue behind another worker's write-backs.
    (At 1M, one run after the other, it made no difference that showed:
    2,000-block hits p50/p99 7.4/17.8 ms with the writers in the bench's
    process, 7.6/21.0 ms in their own.)"""

    def __init__(self, address: str, lengths: list[int], clients: int, deadline: float, nice: int = 0):
        super().__init__(_writers_main, address, lengths, clients, deadline, nice=nice)

    def start(self, timeout: float = 30) -> WriterProcess:
        super().start(timeout)
        return self

    def counts(self) -> dict:
        """committed, failed_batches, errors, and done (every chain written, or stopped)."""
        return self.ask("counts")

    def stop(self, timeout: float = 120) -> dict:
        """Stops the writers after their current batch; their final counts."""
        try:
            return self.ask("stop", timeout=timeout)
        finally:
            self.kill()


def _writers_main(conn, address: str, lengths: list[int], clients: int, deadline: float) -> None:
    try:
        asyncio.run(_write(conn, address, lengths, clients, deadline))
    except Exception as err:  # the parent sees why, instead of a timeout
        conn.send(RuntimeError(f"bench writers failed: {err!r}"))


async def _write(conn, address: str, lengths: list[int], clients: int, deadline: float) -> None:
    stopping = False
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + FAST_RECONNECT) as channel:
        fill = Fill(meta_pb2_grpc.MetaServiceStub(channel), deadline, stop=lambda: stopping)
        writes = asyncio.create_task(fill.run(lengths, clients, {}))
        conn.send("started")
        parent = os.getppid()
        while os.getppid() == parent:
            if not conn.poll():
                await asyncio.sleep(0.05)
                continue
            command = conn.recv()[0]
            if command == "stop":
                stopping = True
                await writes
            conn.send({"committed": fill.committed, "failed_batches": fill.failed_batches,
                       "errors": dict(fill.errors), "done": writes.done(), "nice": os.nice(0)})
            if command == "stop":
                return
        writes.cancel()


@dataclass(slots=True)
class Target:
    """One kind of lookup: a request per lookup chain, and the right answer."""

    name: str
    requests: list[meta_pb2.MatchPrefixRequest]
    expected: list[int]  # matched blocks, per request
    first_chunk: dict[bytes, bytes]  # key -> the id of its block's first chunk

    def right(self, i: int, reply: meta_pb2.MatchPrefixReply) -> bool:
        """The expected count, the first and last block's chunks, and the layout."""
        keys, n = self.requests[i].joined_keys, self.expected[i]
        if reply.matched != n or len(reply.blocks) != n:
            return False
        return n == 0 or (reply.layout == LAYOUT_MSG
                          and reply.blocks[0].chunks[0].chunk_id == self.first_chunk[keys[:KEY_BYTES]]
                          and reply.blocks[-1].chunks[0].chunk_id
                          == self.first_chunk[keys[KEY_BYTES * (n - 1) : KEY_BYTES * n]])


def lookup(keys: list[bytes]) -> meta_pb2.MatchPrefixRequest:
    """A MatchPrefix of `keys` as the SDK sends it (joined)."""
    return meta_pb2.MatchPrefixRequest(namespace=NS, joined_keys=b"".join(keys))


class Sampler:
    """MatchPrefix of every target in turn, one call at a time, timed at the client."""

    def __init__(self, stub, targets: list[Target], samples: int, deadline: float):
        self.stub, self.targets, self.samples, self.deadline = stub, targets, samples, deadline
        self.rounds = 0

    async def run(self, keep_going=lambda: False, at_least: int | None = None) -> dict:
        """At least `at_least` rounds (default: `samples`), and on while keep_going()."""
        seconds = {t.name: [] for t in self.targets}
        wrong = {t.name: collections.Counter() for t in self.targets}  # matched count of each wrong answer
        errors = {t.name: collections.Counter() for t in self.targets}
        least = self.samples if at_least is None else at_least
        while self.rounds < least or keep_going():
            for t in self.targets:
                i = self.rounds % len(t.requests)
                t0 = time.perf_counter()
                try:
                    reply = await self.stub.MatchPrefix(t.requests[i], timeout=self.deadline)
                except grpc.aio.AioRpcError as err:
                    seconds[t.name].append(time.perf_counter() - t0)  # what the caller waited
                    errors[t.name][err.code().name] += 1
                    continue
                seconds[t.name].append(time.perf_counter() - t0)
                if not t.right(i, reply):
                    wrong[t.name][str(reply.matched)] += 1
            self.rounds += 1
        return {t.name: {**_summary(seconds[t.name]), "wrong": sum(wrong[t.name].values()),
                         "wrong_matched": dict(wrong[t.name]), "errors": dict(errors[t.name])}
                for t in self.targets}


async def run_meta(root: pathlib.Path, cfg: MetaBenchConfig, log=print, progress=None,
                   saved: dict | None = None) -> dict:
    """The whole bench; `progress` is a rich Progress for the fill (optional); `saved`:
    load_saved(cfg.reuse) where the caller read it already."""
    run = _Run(root, cfg, log, progress, saved)
    try:
        return await run.run()
    finally:
        await run.close()


def step_change(before: meta_pb2.StatusReply, after: meta_pb2.StatusReply, seconds: float) -> dict:
    """The metaserver's steps (writes' and background passes') between two Status
    replies, by kind: how many, their mean, their share of the `seconds` between, the
    share of their time its loop thread was on the CPU, and how many held the event loop
    longer than each bound (a lookup arriving meanwhile waits), and of those how many
    took that long on the CPU alone (the others also waited: for a core, the disk, a lock)."""
    was = {s.kind: s for s in before.steps}
    out = {}
    for s in after.steps:
        b = was.get(s.kind) or meta_pb2.StepTimes()  # a kind with no step before counts from zero
        n = s.count - b.count
        if not n:
            continue
        held = s.seconds - b.seconds
        out[s.kind] = {"count": n, "mean_ms": 1e3 * held / n, "loop_share": held / seconds if seconds > 0 else None,
                       "on_cpu": (s.cpu_seconds - b.cpu_seconds) / held if held > 0 else None,
                       "over": _by_bound(s.over_s, s.over_count, b.over_count),
                       "over_on_cpu": _by_bound(s.over_s, s.over_cpu_count, b.over_cpu_count)}
    return out


def _by_bound(bounds, now, was) -> dict:
    """Counts per bound ("2ms": n) now, less those `was` (empty: none)."""
    was = list(was) or [0] * len(bounds)
    return {f"{bound * 1e3:g}ms": c - w for bound, c, w in zip(bounds, now, was)}


def stall_sites(lines: list[str], n: int = 5) -> list[tuple[str, int]]:
    """Where a server's loop was held, from its log's stall lines ("held at"
    sites, kvfs.serving.StallSampler): the `n` sampled most, with their samples."""
    sites: collections.Counter[str] = collections.Counter()
    for line in lines:
        if "event loop held" in line and "; held at " in line:
            for part in line.split("; held at ", 1)[1].split("), "):
                site, _, samples = part.rstrip(")").rpartition(" (")
                if samples.endswith(" samples"):
                    sites[site] += int(samples.split()[0])
    return sites.most_common(n)


class _Run:
    def __init__(self, root: pathlib.Path, cfg: MetaBenchConfig, log, progress, saved: dict | None = None):
        self.root, self.cfg, self.log, self.progress = root, cfg, log, progress
        self.saved = saved
        self.data_dir = root / "metaserver"
        self.meta: ServerProcess | None = None
        self.fakes: FakeChunkservers | None = None
        self.probe: StallProbe | None = None
        self.channel = None
        self.stub = None
        self.windows: dict[str, tuple[float, float]] = {}
        self.phases: dict[str, dict] = {}
        self._phase_start = self._phase_end = None  # the Status reads that began and ended the last phase
        self.chains: dict[int, list[bytes]] = {}  # the lookup chains' keys
        self.first_chunk: dict[bytes, bytes] = {}  # their blocks' first chunks' ids

    async def run(self) -> dict:
        cfg = self.cfg
        reused = await asyncio.to_thread(self._copy_reused) if cfg.reuse else None
        t0 = time.monotonic()
        self.meta = await asyncio.to_thread(start_metaserver, self.data_dir, extra=cfg.meta_flags(), run_dir=self.root,
                                            timeout=max(120.0, cfg.blocks / 10_000))
        self._connect()
        st = await self._status()
        if reused is not None:
            reused.update(blocks=st.blocks, serving_s=time.monotonic() - t0)
        replicas = st.replicas
        capacity = cfg.capacity_per_server(replicas, st.blocks if reused is not None else None)
        self.fakes = await asyncio.to_thread(FakeChunkservers(self.meta.address, cfg.servers, capacity,
                                                              nice=cfg.load_nice).start)
        await self._wait_status(lambda st: sum(s.live for s in st.servers) >= cfg.servers and st.chains > 0,
                                60, f"{cfg.servers} fake servers live")
        self.probe = await asyncio.to_thread(StallProbe(self.meta.address).start)
        report = {"metaserver": {"flags": cfg.meta_flags(), "replicas": replicas,
                                 "heartbeat_interval_s": self.fakes.heartbeat_interval},
                  "capacity_per_server": capacity, "block_footprint_bytes": block_footprint(),
                  "block_bytes": LAYOUT.payload_bytes}
        report["fill"] = reused if reused is not None else await self._fill()
        report["memory"], report["disk"] = await self._footprint()
        targets, longest = await self._targets()

        def sampler() -> Sampler:
            return Sampler(self.stub, targets, cfg.samples, cfg.deadline)

        report["settle_s"] = await self._settle()
        async with self._phase("steady") as p:
            p["lookups"] = await sampler().run()
        await self._lifecycle_phase(sampler())
        if cfg.evict:
            await self._eviction_phase(sampler)
        await self._repair_phase(sampler())
        report["memory"]["hwm_bytes_before_restart"] = _proc_status(self.meta.pid).get("VmHWM")
        samples = await asyncio.to_thread(self.probe.stop)
        self.probe = None
        for name, (t0, t1) in self.windows.items():
            picked = [(d, ok) for t, d, ok in samples if t0 <= t < t1]
            self.phases[name]["probe"] = {**_summary([d for d, _ in picked]),
                                          "failed": sum(not ok for _, ok in picked)}
        report["phases"] = self.phases
        report["restart"] = await self._restart(longest)
        final = await self._status()
        report["status"] = {k: getattr(final, k) for k in STATUS_COUNTERS} if final else None
        report["fakes"] = await asyncio.to_thread(self.fakes.counts)
        lookups = [r for p in self.phases.values() for r in p.get("lookups", {}).values()]
        report["answers"] = {"lookups": sum(r["count"] for r in lookups), "wrong": sum(r["wrong"] for r in lookups),
                             "errors": sum(sum(r["errors"].values()) for r in lookups)}
        report["metaserver"]["log_warnings"] = self._log_warnings()
        report["metaserver"]["stall_sites"] = self._stall_sites()
        if report["answers"]["wrong"] or report["answers"]["errors"] or not self.meta.alive() \
                or report["fill"].get("failed_batches") or report["restart"].get("error"):
            report["metaserver"]["log_tail"] = self.meta.log_tail(40)
        return report

    async def close(self) -> None:
        for child in (self.probe, self.fakes):
            if child is not None:
                child.kill()
        if self.channel is not None:
            await self.channel.close()
        if self.meta is not None:
            await asyncio.to_thread(self.meta.stop, 60)

    # ---- helpers ----------------------------------------------------------

    def _copy_reused(self) -> dict:
        """Copies the reused run's database and what it saved here; its lookup chains become ours."""
        source = pathlib.Path(self.cfg.reuse)
        if source.resolve() == self.root.resolve():
            raise BenchAborted(f"--reuse and --data-dir name the same folder ({source}): the run would change "
                               f"the database it reuses")
        if self.data_dir.exists():
            raise BenchAborted(f"{self.data_dir} already holds a metaserver's data; reuse copies into an empty folder")
        saved = self.saved or load_saved(source)
        t0 = time.monotonic()
        shutil.copytree(source / "metaserver", self.data_dir, ignore=shutil.ignore_patterns("LOG.old.*"))
        shutil.copyfile(source / SAVED, self.root / SAVED)
        self.chains, self.first_chunk = saved["chains"], saved["first_chunk"]
        return {"reused": str(source), "copy_s": time.monotonic() - t0}

    def _save(self) -> None:
        """The lookup chains, beside the database, for a later run's `reuse`."""
        keys = {k for chain in self.chains.values() for k in chain}
        (self.root / SAVED).write_text(json.dumps({
            "config": {"blocks": self.cfg.blocks, "chain": self.cfg.chain, "servers": self.cfg.servers},
            "chains": {i: [k.hex() for k in chain] for i, chain in self.chains.items() if chain},
            "first_chunk": {k.hex(): c.hex() for k, c in self.first_chunk.items() if k in keys}}))

    def _connect(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.meta.address, options=CHANNEL_OPTIONS)
        self.stub = meta_pb2_grpc.MetaServiceStub(self.channel)

    async def _status(self) -> meta_pb2.StatusReply | None:
        try:
            return await self.stub.Status(meta_pb2.StatusRequest(), timeout=self.cfg.deadline)
        except grpc.aio.AioRpcError:
            return None

    async def _wait_status(self, condition, timeout: float, what: str, every: float = 0.2) -> float:
        t0 = time.monotonic()
        while True:
            st = await self._status()
            if st is not None and condition(st):
                return time.monotonic() - t0
            if not self.meta.alive():
                raise TimeoutError(f"the metaserver exited ({self.meta.proc.returncode}) while waiting for {what}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(every)

    @contextlib.asynccontextmanager
    async def _phase(self, name: str, follows: bool = False):
        """Times a phase for the probe and records what Status counters did meanwhile,
        and the share of it the metaserver's event loop and this bench's (the lookups')
        spent on a CPU and waiting for one: on this machine's few cores the writers,
        fakes and probe compete with both. A phase that `follows` the last one counts
        from the Status read that ended it, so that what the metaserver did between
        the two (say, evicting) is lost in neither. That Status is `_phase_start`."""
        before = self._phase_start = self._phase_end if follows else await self._status()
        entry = self.phases[name] = {}
        threads = {"metaserver_loop": self.meta.pid, "bench_loop": os.getpid()}
        times0 = {k: _main_thread_times(pid) for k, pid in threads.items()}
        t0 = time.monotonic()
        try:
            yield entry
        finally:
            self.windows[name] = (t0, time.monotonic())
            entry["seconds"] = seconds = time.monotonic() - t0
            for k, pid in threads.items():
                t1 = _main_thread_times(pid)
                if times0[k] is not None and t1 is not None and seconds > 0:
                    entry[k] = {"on_cpu": (t1[0] - times0[k][0]) / seconds,
                                "waiting_for_a_core": (t1[1] - times0[k][1]) / seconds}
            after = self._phase_end = await self._status()
            if before is not None and after is not None:
                entry["status_change"] = {k: getattr(after, k) - getattr(before, k) for k in STATUS_COUNTERS}
                entry["loop_stalls"] = {f"{a.over_s * 1e3:.0f}ms": {"count": a.count - b.count,
                                                                     "busy": a.busy_count - b.busy_count,
                                                                     "waiting": a.waiting_count - b.waiting_count}
                                        for a, b in zip(after.loop_stalls, before.loop_stalls)}
                entry["steps"] = step_change(before, after, seconds)

    async def _settle(self, timeout: float = 600) -> float | None:
        """Waits until background eviction after the fill (down to the low watermark)
        is done, so that the steady phase has nothing running beside it: the evicted
        count still for 2 s. Seconds waited; None if it did not settle in `timeout`."""
        t0, last, still = time.monotonic(), None, time.monotonic()
        while time.monotonic() - t0 < timeout and self.meta.alive():
            st = await self._status()
            if st is not None and st.evicted_blocks != last:
                last, still = st.evicted_blocks, time.monotonic()
            elif time.monotonic() - still >= 2:
                return still - t0
            await asyncio.sleep(0.2)
        return None

    def _log_warnings(self) -> int:
        return sum(" WARNING " in line or " ERROR " in line for line in self._log_lines())

    def _stall_sites(self) -> list[tuple[str, int]]:
        return stall_sites(self._log_lines())

    def _log_lines(self) -> list[str]:
        try:
            return self.meta.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    # ---- phases -----------------------------------------------------------

    async def _fill(self) -> dict:
        cfg = self.cfg
        lengths = cfg.chain_lengths()
        for i in range(max(0, len(lengths) - LOOKUP_CHAINS), len(lengths)):
            self.chains[i] = []
        task = self.progress.add_task("fill", total=cfg.blocks) if self.progress else None
        fill = Fill(self.stub, cfg.deadline, total=cfg.blocks, stop=lambda: not self.meta.alive(),
                    on_commit=(lambda n: self.progress.advance(task, n)) if task is not None else lambda n: None)
        async with self._phase("fill"):
            t0 = time.monotonic()
            await fill.run(lengths, cfg.clients, self.chains)
            seconds = time.monotonic() - t0
        self.first_chunk = fill.first_chunk
        await asyncio.to_thread(self._save)
        if task is not None:
            self.progress.remove_task(task)
        self.log(f"fill: {fill.committed} blocks committed in {seconds:.1f}s ({fill.committed / seconds:.0f} blocks/s)"
                 f"; {fill.failed_batches} batches failed"
                 + (" (" + ", ".join(f"{n} {code}" for code, n in fill.errors.most_common()) + ")" if fill.errors else ""))
        return {"blocks": fill.committed, "chains": len(lengths), "seconds": seconds,
                "blocks_per_s": fill.committed / seconds, "deciles": fill.deciles(t0),
                "already_present": fill.already, "refused": fill.refused, "failed_batches": fill.failed_batches,
                "errors": dict(fill.errors)}

    async def _footprint(self) -> tuple[dict, dict]:
        st = await self._status()
        held = st.blocks if st else 0
        mem = _proc_status(self.meta.pid)
        disk = _folder_bytes(self.data_dir)
        per = lambda n: n / held if held and n is not None else None  # noqa: E731
        return ({"blocks": held, "rss_bytes": mem.get("VmRSS"), "hwm_bytes": mem.get("VmHWM"),
                 "rss_per_block": per(mem.get("VmRSS")), "hwm_per_block": per(mem.get("VmHWM")),
                 "evicted_blocks": st.evicted_blocks if st else None},
                {"blocks": held, "bytes": disk, "per_block": per(disk)})

    async def _targets(self) -> tuple[list[Target], Target]:
        """Hits of each size and misses after block 1, over the lookup chains, and the
        longest hit. Each chain is hit a few times first, so that eviction keeps it."""
        chains = [keys for keys in self.chains.values() if keys]
        if not chains:
            raise BenchAborted(f"none of the lookup chains was filled, nothing to look up; metaserver "
                               f"{'running' if self.meta.alive() else 'exited'}, its log ends:\n{self.meta.log_tail()}")
        shortest = min(len(k) for k in chains)
        targets = [Target(f"hit {size}", [lookup(k[:size]) for k in chains],
                          [size] * len(chains), self.first_chunk)
                   for size in sorted({min(s, shortest) for s in HIT_SIZES})]
        longest = targets[-1]
        n = len(longest.requests[0].joined_keys) // KEY_BYTES
        targets.append(Target(f"miss after 1 ({n} keys)", [lookup([k[0], *(os.urandom(KEY_BYTES) for _ in range(n - 1))])
                                                          for k in chains],
            [1] * len(chains), self.first_chunk))
        for _ in range(3):
            for keys in chains:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.stub.MatchPrefix(lookup(keys), timeout=self.cfg.deadline)
        return targets, longest

    async def _lifecycle_phase(self, sampler: Sampler) -> None:
        runs, errors, done = [], collections.Counter(), asyncio.Event()

        async def back_to_back():
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    await self.stub.RunLifecycle(meta_pb2.RunLifecycleRequest(), timeout=6 * self.cfg.deadline)
                except grpc.aio.AioRpcError as err:
                    errors[err.code().name] += 1
                    await asyncio.sleep(0.1)  # not a spin on a metaserver that is gone
                runs.append(time.perf_counter() - t0)

        async with self._phase("lifecycle") as p:
            task = asyncio.create_task(back_to_back())
            p["lookups"] = await sampler.run()
            done.set()
            await task
            p["lifecycle_runs"] = {**_summary(runs), "errors": dict(errors)}

    async def _eviction_phase(self, sampler) -> None:
        """Writers in a process of their own (WriterProcess) add chains, measured as two
        phases: "writes", until the metaserver begins to evict, and "eviction", from then
        until it has evicted 1/EVICTION_SHARE of the fill (at most EVICTION_BLOCKS) and the
        lookups have their samples. After the fill's eviction the cache stands at the low
        watermark, so the writers first fill the room up to the high one (about a tenth of
        the fill) with nothing evicted; a single phase ending at the first eviction (as
        this one did until 2026-12-06) measured that and hardly any eviction: at 10M it
        wrote 1,056,000 blocks and evicted 4,671, all in its last moments. Where the fill's
        eviction is still running (_settle gave up), "writes" ends at once. `sampler()`
        makes a phase's Sampler."""
        cfg = self.cfg
        evicted0 = 0  # the metaserver's count before the writers started (read in the writes phase)
        deleted0 = (await asyncio.to_thread(self.fakes.counts)).get("deleted", 0)
        # enough for both: the room up to the high watermark, then what is evicted
        lengths = [cfg.chain] * max(1, cfg.blocks * 3 // 10 // cfg.chain)
        least = max(1, min(cfg.blocks // EVICTION_SHARE, EVICTION_BLOCKS))
        writes_sampler, eviction_sampler = sampler(), sampler()
        writers = WriterProcess(self.meta.address, lengths, cfg.clients, cfg.deadline, nice=cfg.load_nice)
        began = asyncio.Event()  # the metaserver evicted since the writers started
        at_first_eviction: dict = {}  # the writers' counts then
        written: dict = {}

        async def watch():
            while True:
                await asyncio.sleep(0.2)
                st = await self._status()
                evicted = st.evicted_blocks - evicted0 if st is not None else 0
                counts = await asyncio.to_thread(writers.counts)
                if evicted and not began.is_set():
                    at_first_eviction.update(counts)
                    began.set()
                if not self.meta.alive() or counts["done"] \
                        or (evicted >= least and eviction_sampler.rounds >= cfg.samples):
                    written.update(await asyncio.to_thread(writers.stop))
                    began.set()
                    return

        try:
            async with self._phase("writes") as p:  # from before the writers start: no eviction outside the two
                if self._phase_start is not None:
                    evicted0 = self._phase_start.evicted_blocks
                await asyncio.to_thread(writers.start)
                watcher = asyncio.create_task(watch())
                p["lookups"] = await writes_sampler.run(keep_going=lambda: not began.is_set(), at_least=1)
                p["writes"] = {"blocks": at_first_eviction.get("committed", written.get("committed", 0)),
                               "writer": "own process"}
            if not at_first_eviction:
                self.log("the writers ended before the metaserver evicted: nothing measured under eviction")
            async with self._phase("eviction", follows=True) as p:
                p["lookups"] = await eviction_sampler.run(keep_going=lambda: not watcher.done())
                await watcher
                deleted = (await asyncio.to_thread(self.fakes.counts)).get("deleted", 0) > deleted0
                p["writes"] = {"blocks": written["committed"] - at_first_eviction.get("committed", 0),
                               "failed_batches": written["failed_batches"], "errors": written["errors"],
                               "deletes_seen": deleted, "writer": "own process", "least_evicted": least,
                               "nice": written["nice"]}
        finally:
            writers.kill()

    async def _repair_phase(self, sampler: Sampler) -> None:
        """One fake server goes silent; measured from when the metaserver marks it dead."""
        victim = self.cfg.servers - 1
        sid = server_id(victim)
        copies0 = (await asyncio.to_thread(self.fakes.counts)).get("copies", 0)
        await asyncio.to_thread(self.fakes.silence, victim)
        try:
            detect_s = error = None
            try:
                detect_s = await self._wait_status(lambda st: any(s.id == sid and not s.live for s in st.servers),
                                                   120, f"{sid} seen dead", every=1.0)
            except TimeoutError as err:  # measured all the same: what do lookups get now?
                error = str(err)
            first_copy: list[float] = []

            async def watch(t0):
                while True:
                    await asyncio.sleep(0.2)
                    if (await asyncio.to_thread(self.fakes.counts)).get("copies", 0) > copies0:
                        first_copy.append(time.monotonic() - t0)
                        return

            async with self._phase("repair") as p:
                watcher = asyncio.create_task(watch(time.monotonic()))
                p["lookups"] = await sampler.run()
                watcher.cancel()
                p["silenced"] = sid
                p["detect_s"] = detect_s
                if error:
                    p["error"] = error
                p["first_copy_s"] = first_copy[0] if first_copy else None
                p["copies"] = (await asyncio.to_thread(self.fakes.counts)).get("copies", 0) - copies0
        finally:
            await asyncio.to_thread(self.fakes.resume, victim)

    async def _restart(self, full: Target) -> dict:
        """SIGTERM, start again on the same data and address; a fresh channel afterwards,
        so gRPC's reconnect backoff is not counted."""
        out: dict = {"expected": full.expected[0]}
        t0 = time.monotonic()
        out["exit_code"] = await asyncio.to_thread(self.meta.stop, 120)
        out["stop_s"] = time.monotonic() - t0
        await self.channel.close()
        t0 = time.monotonic()
        try:
            self.meta = await asyncio.to_thread(
                start_metaserver, self.data_dir, listen=self.meta.address, extra=self.cfg.meta_flags(),
                run_dir=self.root, timeout=max(120.0, self.cfg.blocks / 10_000))
        except LaunchError as err:
            out["error"] = str(err)
            self._connect()
            return out
        out["serving_s"] = time.monotonic() - t0
        self._connect()
        deadline = t0 + max(120.0, self.cfg.blocks / 10_000)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await self.stub.MatchPrefix(full.requests[0], timeout=self.cfg.deadline)
                out["matched"] = reply.matched
                if full.right(0, reply):
                    out["full_match_s"] = time.monotonic() - t0
                    break
            await asyncio.sleep(0.05)
        else:
            out["error"] = f"no full match of a filled {full.expected[0]}-block chain within {deadline - t0:.0f}s"
        out["rss_bytes"] = _proc_status(self.meta.pid).get("VmRSS")
        return out


def config_dict(cfg: MetaBenchConfig) -> dict:
    return {**asdict(cfg), "batch": BATCH, "chunk_size": CHUNK_SIZE, "lookup_chains": LOOKUP_CHAINS,
            "layout": {"layers": LAYOUT.layers, "block_tokens": LAYOUT.block_tokens, "kv_dim": LAYOUT.kv_dim,
                       "dtype": LAYOUT.dtype}}
