"""Helpers the test suites share (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import struct
import time


class Clock:
    """A settable clock for servers' logic run in-process (MetaState(cfg, clock))."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def credentials():
    """The suite's own identity (a worker of any tenant and an admin; tests/conftest.py
    issues it), for raw gRPC channels: kvfs.tls.channel(address, credentials())."""
    from kvfs.tls import Credentials

    env = os.environ
    return Credentials.from_files(env["KVFS_CLIENT_TLS_CA"], env["KVFS_CLIENT_TLS_CERT"], env["KVFS_CLIENT_TLS_KEY"])


def free_port() -> int:
    """A loopback TCP port nobody holds right now (for servers that want one named)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback TCP ports nobody holds right now (all held while choosing)."""
    from kvfs.cli.launcher import free_loopback_ports

    return free_loopback_ports(n)


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


def block_rows(state) -> dict:
    """Every block row a MetaState holds: full key -> records.Row. Checks that each
    row is where its block's slot entry points, and that no two share a slot."""
    from kvfs.metaserver import groups, records

    rows = {}
    for k, v in state.db.scan(records.ROW):
        exact = groups.pack(groups.unpack(v))  # rows cut out leave a superset of servers, a lower bound of copies
        assert groups.occupied(exact) == groups.occupied(v) and all(
            f(exact, 0, groups.GROUP_SLOTS) == f(v, 0, groups.GROUP_SLOTS)
            for f in (groups.expiry_times, groups.locations)), "a row group's keys, expiry or ends are stale"
        assert set(groups.server_numbers(v)) >= set(groups.server_numbers(exact)), "a row group lacks a server"
        assert groups.fewest_copies(v) <= groups.fewest_copies(exact), "a row group overstates its copies"
        base = records.read_u64(k[-8:]) * groups.GROUP_SLOTS
        for offset in groups.occupied(v):
            row = records.Row.decode(groups.row_at(v, offset))
            full = k[1:17] + row.key
            assert full not in rows, "a block has two rows"
            assert row.slot == base + offset, "a row's slot is not where it is stored"
            rows[full] = row
    slots = {k[1:]: records.read_u64(v) for k, v in state.db.scan(records.BLOCK)}
    assert slots == {f: r.slot for f, r in rows.items()}, "slot entries and rows disagree"
    return rows


def keys_under(state, prefix: bytes) -> set[bytes]:
    """The keys of a MetaState's RocksDB under `prefix`."""
    return {k for k, _ in state.db.scan(prefix)}


def assert_metadata_consistent(state):
    """A MetaState's rows, indexes and counters agree, and every block's parent is stored."""
    from kvfs.metaserver import records

    stored = block_rows(state)
    allocs = state.allocations  # what eviction leaves alone, kept counted, is what the allocations pin
    assert set(allocs.pinned()) == {k for a in allocs.open.values() for k in a.pins}.union(
        *(p for _, p in allocs.placing.values()))
    for alloc in allocs.open.values():  # an open allocation's pins hold its blocks' parents at least
        assert {alloc.record.namespace_digest + p for p in alloc.record.parents if p} <= set(alloc.pins)
    from kvfs.metaserver.allocations import Allocation

    for alloc in allocs.open.values():  # kept as placing and commits go, as a fresh look at the record finds them
        fresh = Allocation.of(alloc.record)
        assert (alloc.footprint, alloc.chunk_ids) == (fresh.footprint, fresh.chunk_ids)
    parent = {f: f[:16] + r.parent for f, r in stored.items() if r.parent}
    assert all(p in stored for p in parent.values()), "a cached block lost its parent"
    children = {(p, f) for f, p in parent.items()}
    assert keys_under(state, records.CHILD) == {records.child_key(p, f) for p, f in children}
    leaves = set(stored) - set(parent.values())
    victims = {records.victim_key(r.rank, r.last_used, r.depth, f) for f, r in stored.items() if f in leaves}
    assert keys_under(state, records.VICTIM) == victims
    assert keys_under(state, records.TENANT_VICTIM) == {state.blocks.tenant_victim(v) for v in victims}
    # every row's group has an expiry entry no later than the row's expiry (removals and hits
    # leave entries behind, for expiry to trim when it visits the group)
    visits: dict[tuple[bytes, int], int] = {}
    for k in keys_under(state, records.EXPIRY):
        assert len(k) == 33
        group = records.expiry_group(k)
        visits[group] = min(visits.get(group, 1 << 64), records.expiry_of(k))
    assert all(visits.get((f[:16], r.slot // 64), 1 << 64) <= int(r.last_used + r.ttl) for f, r in stored.items())
    # the replica index names every (server, row group) some row has a copy in; it may name more
    # (removals leave their entries for repair to trim), never in another shape
    replicas = keys_under(state, records.REPLICA)
    assert {records.replica_key(n, f[:16], r.slot // 64) for f, r in stored.items() for n in r.servers} <= replicas
    assert all(len(k) == 27 for k in replicas)
    assert len(state.blocks) == len(stored)
    assert state.cache_bytes == sum(r.footprint for r in stored.values())
    assert all(r.depth == (stored[parent[f]].depth + 1 if f in parent else 0) for f, r in stored.items())
    ranks = state.blocks.ranks
    if ranks.arc:  # its segments' sizes are running counts: they must stay the counts
        assert ranks.recent == sum(r.rank == ranks.rank(1, 0) for r in stored.values())
        ghosts = [struct.unpack(">IQ", v)[0] for _, v in state.db.scan(records.GHOST)]
        assert (state.blocks.ghosts, ranks.recent_ghosts) == (len(ghosts), sum(h < 2 for h in ghosts))


def local_read_grant(namespace_digest: bytes, ttl: float = 600, tenant: str = "tests") -> bytes:
    """A read grant for a namespace, minted with the tests' local CA's cluster key as
    the metaserver would mint it: for raw data-port reads from servers without one."""
    from kvfs.grants import read_grant
    from kvfs.tls import LocalCA, load_cluster_key

    key = load_cluster_key(LocalCA(os.environ["KVFS_LOCAL_CA"]).key_path)
    return read_grant(key, namespace_digest, tenant, time.time() + ttl)


def local_owner(chunk_id: bytes, namespace_digest: bytes, block_key: bytes = b"k" * 16) -> bytes:
    """A chunk's owner record sealed with the tests' local CA's cluster key, as the
    metaserver seals it at allocation: for raw data-port writes to servers without one."""
    from kvfs.grants import owner_record, owner_seal
    from kvfs.proto import meta_pb2
    from kvfs.shards import hash_slot
    from kvfs.tls import LocalCA, load_cluster_key

    key = load_cluster_key(LocalCA(os.environ["KVFS_LOCAL_CA"]).key_path)
    layout = meta_pb2.BlockLayout(layers=1, block_tokens=64, kv_dim=576, dtype="bfloat16")
    seal = owner_seal(key, namespace_digest + block_key, 0, 1, layout, 1 << 20, chunk_id, hash_slot(block_key))
    return owner_record(namespace_digest, block_key, 0, 1, layout, 1 << 20, seal, hash_slot(block_key))


def dashboard_queries(path) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of a Grafana dashboard JSON,
    rows' panels included."""
    import json

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    dashboard = json.loads(pathlib.Path(path).read_text())
    return [(p.get("title", ""), t["expr"]) for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def data_connection(address: str, creds=None, timeout: float = 10):
    """A raw connection to a chunkserver's data port over TCP, through mutual TLS
    as the port requires, with `creds` (default: the suite's own, credentials())."""
    import socket

    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    return (creds or credentials()).ssl_context(server=False).wrap_socket(sock, server_hostname=host)


def recv_exactly(sock, n: int) -> bytes:
    """n bytes from a raw socket (ConnectionError if it closes first)."""
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed")
        buf += part
    return buf


def thread_count(pid: int) -> int:
    """A process's threads (Threads: in /proc/<pid>/status; io_uring workers count too)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads")


def thread_nices(pid: int) -> dict[int, int]:
    """A process's threads' niceness, by thread id (/proc/<pid>/task/*/stat, field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile (gone, or going)
            continue
        out[int(tid)] = int(fields[16])  # fields[0] is field 3, the state
    return out


def thread_names(pid: int) -> dict[int, str]:
    """A process's threads' names, by thread id (/proc/<pid>/task/*/comm)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                out[int(tid)] = fh.read().strip()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


def fd_count(pid: int) -> int:
    """A process's open file descriptors (/proc/<pid>/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Footprint:
    """A server process's resident memory, threads and open descriptors at one moment."""

    def __init__(self, rss: int, threads: int, fds: int):
        self.rss, self.threads, self.fds = rss, threads, fds

    @classmethod
    def of(cls, pid: int) -> Footprint:
        return cls(rss_bytes(pid), thread_count(pid), fd_count(pid))

    def __str__(self) -> str:
        return f"RSS {self.rss / (1 << 20):.0f} MiB, {self.threads} threads, {self.fds} fds"


class Watch:
    """Watches a server process while an attack runs, from a thread that samples its
    Footprint every `interval` seconds: `before` at entry, `peak` (the highest RSS,
    threads and fds seen, each on its own) until exit, `after` at exit.

    >>> with Watch(server.pid) as seen:
    ...     attack()
    >>> assert seen.peak.threads <= seen.before.threads + 8, seen
    """

    def __init__(self, pid: int, interval: float = 0.05):
        import threading

        self.pid, self.interval = pid, interval
        self.before = self.peak = self.after = Footprint.of(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{pid}", daemon=True)

    def sample(self) -> Footprint:
        now = Footprint.of(self.pid)
        self.peak = Footprint(max(self.peak.rss, now.rss), max(self.peak.threads, now.threads),
                              max(self.peak.fds, now.fds))
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except (OSError, AssertionError):  # the process is gone: the test will say so
                return

    def __enter__(self) -> Watch:
        self.before = self.peak = Footprint.of(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.sample()

    def grew(self) -> str:
        """What it saw, for "saw: ..." lines: peak and after against before."""
        b, p, a = self.before, self.peak, self.after
        return (f"before {b}; peak +{(p.rss - b.rss) / (1 << 20):.0f} MiB, +{p.threads - b.threads} threads, "
                f"+{p.fds - b.fds} fds; after +{(a.rss - b.rss) / (1 << 20):.0f} MiB, {a.threads - b.threads:+d} "
                f"threads, {a.fds - b.fds:+d} fds")

    __repr__ = grew


def settled(pid: int, before: Footprint, spare: int = 2, threads: int | None = None,
            timeout: float = 30) -> Footprint:
    """Waits until a server's threads and descriptors are back within `spare` of
    `before` (`threads`, if given, for its threads: pools a test may have started), an
    attack's connections all closed; returns its footprint then."""
    threads = spare if threads is None else threads

    def back():
        now = Footprint.of(pid)
        return now if now.threads <= before.threads + threads and now.fds <= before.fds + spare else None

    try:
        return wait_until(back, timeout, "threads and descriptors back to what they were")
    except AssertionError as err:
        raise AssertionError(f"{err}: before {before}, now {Footprint.of(pid)}") from None


class Turns:
    """Counts the running event loop's turns: a callback that runs once in each
    (`n`), until stop()."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.n, self.running = 0, True
        self.loop.call_soon(self._tick)

    def _tick(self):
        self.n += 1
        if self.running:
            self.loop.call_soon(self._tick)

    def stop(self):
        self.running = False
