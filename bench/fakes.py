"""Child processes for `kvfs-bench meta`: fake chunkservers and a stall probe.

Both run in their own (spawned) processes, so the bench's own load cannot
delay a heartbeat or a probe. Each child exits when told to, or when its parent
is gone; the parent kills it in any case when the bench ends.

FakeChunkservers: N servers in distinct failure domains that register with a
large capacity, heartbeat as real chunkservers do (every heartbeat_interval,
10 s deadline, registering again when told) and answer the calls the
metaserver makes (ListChunks: an empty page, or with `inventory` a synthetic
one, see Inventory; DeleteChunks: all deleted; CopyChunk: copied). They store
nothing and report nothing used. One server's heartbeats can be stopped and
resumed, to make the metaserver repair.

StallProbe: a health Check to the metaserver every 10 ms, one at a time; its
latency is how long the metaserver's event loop leaves a cheap call waiting.
"""

from __future__ import annotations

import array
import asyncio
import collections
import hashlib
import multiprocessing
import os
import threading
import time

import grpc

from kvfs.proto import chunk_pb2, chunk_pb2_grpc, meta_pb2, meta_pb2_grpc

# reconnect quickly after a metaserver restart: the bench measures the metaserver, not gRPC's backoff
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


def _niced(nice: int, target, *args) -> None:
    os.nice(nice)
    target(*args)


class Child:
    """A spawned process driven over a pipe: commands in, one answer per command.
    `nice` lowers its CPU priority (os.nice): load a bench generates beside the
    server it measures, standing for other machines."""

    def __init__(self, target, *args, nice: int = 0):
        ctx = multiprocessing.get_context("spawn")  # the parent holds gRPC channels: no fork
        self._conn, child_conn = ctx.Pipe()
        self._asking = threading.Lock()  # callers in several threads (asyncio.to_thread): one exchange at a time
        self.proc = ctx.Process(target=_niced, args=(nice, target, child_conn, *args), daemon=True)

    def start(self, timeout: float):
        self.proc.start()
        return self._answer(timeout)

    def ask(self, *command, timeout: float = 30):
        with self._asking:
            self._conn.send(command)
            return self._answer(timeout)

    def _answer(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name} did not answer within {timeout}s")
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def kill(self) -> None:
        if self.proc.pid is None:  # never started
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


class Inventory:
    """What `kvfs-bench rebuild`'s fakes list: `blocks` MLA blocks of 2 chunks (1 MiB
    cut) in prompts of `chain` blocks, block b's chunks on servers b, b+1, ... (mod n),
    `replicas` of them, with owner records as a metaserver issues them (each block's
    parent and depth; unsealed: the bench's metaserver runs --insecure, as every fake
    does). Chunk ids start with the block number, so a page resumes from its cursor
    without any state."""

    def __init__(self, blocks: int, n: int, replicas: int, chain: int = 1):
        from kvfs.layout import BlockLayout
        from kvfs.shards import hash_slot

        self.blocks, self.n, self.replicas, self.chain, self._slot = blocks, n, replicas, max(1, chain), hash_slot
        layout = BlockLayout.mla()
        self.layout = meta_pb2.BlockLayout(layers=layout.layers, block_tokens=layout.block_tokens,
                                           kv_dim=layout.kv_dim, dtype=layout.dtype)
        self.spans = layout.chunks(1 << 20)
        self.namespace = hashlib.blake2b(b"kvfs-bench rebuild", digest_size=16).digest()

    def block_key(self, b: int) -> bytes:
        return hashlib.blake2b(b.to_bytes(8, "big"), digest_size=16).digest()

    def page(self, server: int, start_after: bytes, limit: int) -> chunk_pb2.ListChunksReply:
        b = int.from_bytes(start_after[:8], "big") + 1 if start_after else 0
        reply = chunk_pb2.ListChunksReply()
        while b < self.blocks and len(reply.chunks) < limit:
            if (server - b) % self.n < self.replicas:
                key, depth = self.block_key(b), b % self.chain
                first = self.block_key(b - depth)  # the prompt's first block: its slot is the prompt's
                for span in self.spans:
                    chunk_id = b.to_bytes(8, "big") + key[:7] + bytes([span.index])
                    owner = meta_pb2.ChunkOwner(namespace_digest=self.namespace, block_key=key,
                                                chunk_index=span.index, chunk_count=len(self.spans),
                                                layout=self.layout, chunk_size=1 << 20, hash_slot=self._slot(first),
                                                parent=self.block_key(b - 1) if depth else b"", depth=depth)
                    reply.chunks.add(chunk_id=chunk_id, length=span.length, checksum=b, created=1e9,
                                     owner=owner.SerializeToString())
                last = b
            b += 1
        if b < self.blocks and reply.chunks:
            reply.next_start_after = last.to_bytes(8, "big") + bytes(8)
        return reply


class FakeChunkservers(Child):
    def __init__(self, meta_address: str, n: int, capacity_bytes: int, inventory: int = 0, replicas: int = 2,
                 chain: int = 1, nice: int = 0):
        super().__init__(_fakes_main, meta_address, n, capacity_bytes, inventory, replicas, chain, nice=nice)
        self.n = n
        self.addresses: list[str] = []
        self.heartbeat_interval = 0.0

    def start(self, timeout: float = 60) -> FakeChunkservers:
        self.addresses, self.heartbeat_interval = super().start(timeout)
        return self

    def silence(self, i: int) -> None:
        """Stops fake-i's heartbeats (it keeps answering chunk calls)."""
        self.ask("silence", i)

    def resume(self, i: int) -> None:
        self.ask("resume", i)

    def counts(self) -> dict[str, int]:
        """Calls served so far: lists, deletes, deleted, copies, heartbeats, failed heartbeats."""
        return self.ask("counts")

    def stop(self) -> dict[str, int]:
        """Stops the child; returns its final counts (empty if it had to be killed)."""
        try:
            return self.ask("stop", timeout=10) if self.proc.is_alive() else {}
        except (TimeoutError, OSError, EOFError):
            return {}
        finally:
            self.kill()


def server_id(i: int) -> str:
    return f"fake-{i}"


def _fakes_main(conn, meta_address: str, n: int, capacity: int, inventory: int, replicas: int, chain: int) -> None:
    try:
        asyncio.run(_serve_fakes(conn, meta_address, n, capacity, inventory, replicas, chain))
    except Exception as err:  # the parent sees why, instead of a timeout
        conn.send(RuntimeError(f"fake chunkservers failed: {err!r}"))


async def _serve_fakes(conn, meta_address: str, n: int, capacity: int, inventory: int, replicas: int,
                       chain: int) -> None:
    counts: collections.Counter = collections.Counter()
    servers, registrations = [], []
    listed = Inventory(inventory, n, replicas, chain) if inventory else None
    for i in range(n):
        server = grpc.aio.server()
        chunk_pb2_grpc.add_ChunkServiceServicer_to_server(
            _FakeChunkService(server_id(i), capacity, counts, (i, listed) if listed else None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        registrations.append(meta_pb2.RegisterRequest(server_id=server_id(i), address=f"127.0.0.1:{port}",
                                                      failure_domain=f"fake-host-{i}", capacity_bytes=capacity))
    channel = grpc.aio.insecure_channel(meta_address, options=FAST_RECONNECT)
    stub = meta_pb2_grpc.MetaServiceStub(channel)
    interval = 2.0
    for reg in registrations:
        interval = (await stub.Register(reg, timeout=10)).heartbeat_interval_s or interval
    silenced: set[int] = set()

    async def heartbeat(i: int) -> None:  # as chunkserver/membership.py does
        beat = meta_pb2.HeartbeatRequest(server_id=server_id(i), capacity_bytes=capacity)
        while True:
            await asyncio.sleep(interval)
            if i in silenced:
                continue
            try:
                if (await stub.Heartbeat(beat, timeout=10)).register_again:
                    await stub.Register(registrations[i], timeout=10)
                counts["heartbeats"] += 1
            except grpc.aio.AioRpcError:
                counts["failed_heartbeats"] += 1

    beats = [asyncio.create_task(heartbeat(i)) for i in range(n)]
    conn.send(([r.address for r in registrations], interval))
    parent = os.getppid()
    while os.getppid() == parent:
        if not conn.poll():
            await asyncio.sleep(0.05)
            continue
        command, *args = conn.recv()
        if command == "silence":
            silenced.add(args[0])
        elif command == "resume":
            silenced.discard(args[0])
        conn.send({**counts, "nice": os.nice(0)})
        if command == "stop":
            break
    for t in beats:
        t.cancel()
    for server in servers:
        await server.stop(0)
    await channel.close()


class _FakeChunkService(chunk_pb2_grpc.ChunkServiceServicer):
    """The ChunkService calls the metaserver makes, answered without storing anything
    (the base class answers UNIMPLEMENTED to the rest: WriteChunk, ReadChunks)."""

    def __init__(self, sid: str, capacity: int, counts: collections.Counter, listed=None):
        self.sid, self.capacity, self.counts, self.listed = sid, capacity, counts, listed

    async def ListChunks(self, request, context):
        self.counts["lists"] += 1
        if self.listed is None:
            return chunk_pb2.ListChunksReply()
        i, inventory = self.listed
        reply = inventory.page(i, request.start_after, request.limit or 1000)
        self.counts["listed"] += len(reply.chunks)
        return reply

    async def DeleteChunks(self, request, context):
        self.counts["deletes"] += 1
        self.counts["deleted"] += len(request.chunk_ids)
        return chunk_pb2.DeleteChunksReply(deleted=len(request.chunk_ids))

    async def CopyChunk(self, request, context):
        self.counts["copies"] += 1
        return chunk_pb2.CopyChunkReply(created=True, bytes=request.length)

    async def Stat(self, request, context):
        return chunk_pb2.StatReply(server_id=self.sid, capacity_bytes=self.capacity, io_engine="fake",
                                  io_mode="fake")


class StallProbe(Child):
    """Health Checks to `address` every `every` seconds until stopped; samples are
    (monotonic start, seconds, ok), comparable with the parent's time.monotonic()."""

    def __init__(self, address: str, every: float = 0.010, deadline: float = 10.0):
        super().__init__(_probe_main, address, every, deadline)

    def start(self, timeout: float = 30) -> StallProbe:
        super().start(timeout)
        return self

    def stop(self) -> list[tuple[float, float, bool]]:
        try:
            flat = array.array("d", self.ask("stop", timeout=30))
        finally:
            self.kill()
        return [(flat[i], flat[i + 1], bool(flat[i + 2])) for i in range(0, len(flat), 3)]


def _probe_main(conn, address: str, every: float, deadline: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    samples = array.array("d")
    request = health_pb2.HealthCheckRequest()
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        conn.send("started")
        parent, tick = os.getppid(), time.monotonic()
        while not conn.poll() and os.getppid() == parent:
            t = time.monotonic()
            try:
                ok = stub.Check(request, timeout=deadline).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            samples.extend((t, time.monotonic() - t, float(ok)))
            tick = max(tick + every, time.monotonic())  # one at a time: a stalled call delays the next
            time.sleep(max(0.0, tick - time.monotonic()))
    conn.send(samples.tobytes())
