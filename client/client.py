"""Client and SyncClient: what an inference worker uses to find, restore and
write back KV blocks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfs import tls
from kvfs.buffers import PAGE, AlignedBuffers, byte_view
from kvfs.config import MiB
from kvfs.errors import InvalidArgument, KvfsError, Unavailable
from kvfs.grants import owner_record
from kvfs.keys import Namespace, block_keys
from kvfs.layout import BlockLayout
from kvfs.priority import WRITE_NICE, lower_thread_priority
from kvfs.proto import meta_pb2

from .chunks import ChunkClient, chunk_checksum
from .config import resolve_credentials
from .metrics import ClientMetrics
from .hedge import HedgeBudget, ServerBacklog, ServerLatency
from .restore import Restore, RestoreStats
from .routing import MetaRouter
from .transport import DataWriter, GrpcTransport, ServerInfo, ShmTransport, TcpTransport, Transport, is_local

TRANSPORTS = ("auto", "grpc", "tcp", "shm")

log = logging.getLogger(__name__)

GRPC_WRITES_AFTER_FAILURE = 30.0  # seconds a server's chunk writes take gRPC after its data port failed one


def _ns(namespace: Namespace) -> meta_pb2.Namespace:
    return meta_pb2.Namespace(tenant=namespace.tenant, model=namespace.model,
                              cache_format=namespace.cache_format)


def _layout_msg(layout: BlockLayout) -> meta_pb2.BlockLayout:
    return meta_pb2.BlockLayout(layers=layout.layers, block_tokens=layout.block_tokens,
                                kv_dim=layout.kv_dim, dtype=layout.dtype)


@dataclass
class PrefixMatch:
    """The longest cached prefix of a prompt and where its chunks are.

    `matched` blocks (`tokens` tokens) are cached, out of `len(keys)` full blocks
    in the prompt. `blocks` and `servers` come straight from the metaserver, so a
    restore needs no further metadata call.
    """

    namespace: Namespace
    keys: list[bytes]
    matched: int
    block_tokens: int
    blocks: Sequence = field(repr=False)  # meta_pb2.BlockLocation: chunks only (the layout is `layout`)
    servers: list[ServerInfo] = field(repr=False)
    lookup_seconds: float = 0.0
    read_grant: bytes = field(default=b"", repr=False)  # chunkservers ask for it with every read
    layout: BlockLayout | None = None  # every matched block's; None when nothing matched

    @property
    def tokens(self) -> int:
        return self.matched * self.block_tokens

    def holders(self, chunk) -> list[ServerInfo]:
        """The live servers holding a copy of `chunk` (a ChunkLocation of `blocks`); a
        replica on a server that is down has an empty entry in `servers`."""
        return [s for s in map(self.servers.__getitem__, chunk.replicas) if s.address]

    @property
    def nbytes(self) -> int:
        return sum(c.length for b in self.blocks for c in b.chunks)


@dataclass
class WriteResult:
    committed: int
    already_present: int
    bytes_written: int  # payload bytes, counted once (not per replica)
    seconds: float


def _gather(view: memoryview, pieces, src) -> int:
    """Copies a chunk's pieces out of the payload into `view`; its checksum."""
    for s, d, n in pieces:
        view[s : s + n] = src[d : d + n]
    return chunk_checksum(view)


class Client:
    """The kvfs SDK, on asyncio (grpc.aio).

    >>> client = Client("127.0.0.1:7000")
    >>> match = await client.lookup(ns, token_ids)           # one MatchPrefix RPC
    >>> restore = client.read(match, out)                    # starts reading at once
    >>> async for layer in restore: ...                      # layers arrive in order
    >>> await client.write(ns, token_ids, kv, layout)        # allocate, write replicas, commit

    `metaserver` is its address, or where there are several, some of their addresses
    (comma-separated): the client reads their shard map and sends each prompt's
    calls to the metaserver holding its hash slot (routing.py).

    Buffers (`out` for reads, `payload` for writes) are laid out
    `[layer][tokens][kv_dim]` in the cache dtype: a bytearray, mmap, numpy array
    or contiguous CPU torch tensor (see BufferPool for pinned ones).

    `transport` picks how restore bytes travel: "auto" (default) uses a
    chunkserver's data port, through shared memory when the server is on this
    host and TCP otherwise, and gRPC for servers without a data port; "tcp",
    "shm" and "grpc" force one. Chunk writes take the data port too (WRITE
    frames on `write_connections` connections per server of their own: the
    local socket for a server on this host, TCP otherwise; TCP only with
    "tcp"), and gRPC WriteChunk with "grpc", for a server without a data port,
    or when its data connection fails (logged). Metadata is always gRPC.

    `hedge` (default on): a batch of chunk reads still out after its server's
    measured p95 is also requested from another replica, the first good answer
    is used (at most `hedge_budget` of batches are hedged). `latency` holds the
    per-server measurements, `hedges` the counts, `backlog` what the servers
    last said of the reads they had queued from every client.

    `credentials` (kvfs.tls.Credentials: a worker certificate naming the tenants
    this process may act for, its key and the cluster CA) authenticate every gRPC
    call and every data-port connection over TCP (mutual TLS there too; the local
    socket of shared-memory reads needs none); without them the client reads KVFS_CLIENT_TLS_CA / _CERT / _KEY (or
    KVFS_CONFIG's [client] table). `insecure=True` speaks plaintext, to a cluster
    started with --insecure only.

    `metrics` (kvfs.client.ClientMetrics on the host process's Prometheus
    registry) counts lookups, restores and write-backs as this process saw them.

    `write_nice` (default 10): a write-back's CPU work (gathering each chunk out of
    the payload, checksumming it, sending it) runs on threads this much nicer than
    the caller's (kvfs.priority, Linux), so on a host whose cores are busy the
    restores of the same process, and of other processes in its scheduling group
    (niceness ranks threads within one cgroup), come first; 0 keeps the caller's
    priority.

    `warm_reads` (default on): the data connections restores use are opened in
    the background as soon as the client learns of a server, from a lookup that
    matched or a write-back's placement, so that a restore finds them open (an
    engine's first hit otherwise pays for opening them; `data_connections` per
    server).
    """

    def __init__(self, metaserver: str, *, block_tokens: int = 64, per_server_reads: int = 4,
                 read_batch: int = 8, write_concurrency: int = 16, timeout: float = 30.0,
                 transport: str = "auto", data_connections: int = 2, hedge: bool = True,
                 hedge_budget: float = 0.05, credentials: tls.Credentials | None = None, insecure: bool = False,
                 metrics: ClientMetrics | None = None, write_connections: int = 4,
                 write_nice: int = WRITE_NICE, warm_reads: bool = True):
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.credentials = resolve_credentials(credentials, insecure)
        self.metaserver = metaserver
        self.transport = transport
        self.metrics = metrics
        data_tls = self.credentials.ssl_context(server=False) if self.credentials is not None else None
        self.backlog = ServerBacklog()
        self._transports: dict[str, Transport] = {
            "grpc": GrpcTransport(self.chunkserver),
            "tcp": TcpTransport(data_connections, data_tls, self.backlog),
            "shm": ShmTransport(data_connections, data_tls, self.backlog),
        }
        # a write-back's gathers, checksums and sends: lower priority than restores (kvfs.priority)
        self._write_threads = concurrent.futures.ThreadPoolExecutor(
            write_concurrency, thread_name_prefix="kvfs-write", initializer=lower_thread_priority,
            initargs=(write_nice,))
        self._writer = DataWriter(write_connections, data_tls, local=transport != "tcp", sender=self._write_threads)
        self._chunk_buffers = AlignedBuffers(write_concurrency * 4 * MiB)  # chunks being written
        self._grpc_writes: dict[str, float] = {}  # data port -> until when (monotonic) writes to it take gRPC
        self.block_tokens = block_tokens
        self.per_server_reads = per_server_reads
        self.read_batch = read_batch
        self.write_concurrency = write_concurrency
        self.timeout = timeout
        self.router = MetaRouter(metaserver, self.credentials, timeout)  # which metaserver to ask
        self._chunk_clients: dict[str, ChunkClient] = {}
        self._tenant_keys: dict[str, bytes] = {}
        self.hedge = hedge
        self.warm_reads = warm_reads
        self.latency = ServerLatency()
        self.hedges = HedgeBudget(hedge_budget)

    async def close(self) -> None:
        try:
            for t in [*self._transports.values(), self._writer]:
                await t.close()
            for c in self._chunk_clients.values():
                await c.close()
            await self.router.close()
        finally:
            self._write_threads.shutdown(wait=False)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def chunkserver(self, address: str) -> ChunkClient:
        """The pooled client of one chunkserver (one channel per address)."""
        client = self._chunk_clients.get(address)
        if client is None:
            client = self._chunk_clients[address] = ChunkClient(address, credentials=self.credentials,
                                                                insecure=self.credentials is None)
        return client

    def transport_for(self, server: ServerInfo) -> Transport:
        """The transport restores use for one server (see `transport`)."""
        if self.transport == "grpc" or not server.data_address:
            return self._transports["grpc"]
        if self.transport == "tcp":
            return self._transports["tcp"]
        if self.transport == "shm" or is_local(server.data_address):
            return self._transports["shm"]
        return self._transports["tcp"]

    def _warm(self, data_addresses) -> list[asyncio.Task]:
        """Opens the restores' data connections to these servers in the background
        (warm_reads; Transport.warm where the transport has one); the tasks doing it."""
        tasks = []
        if not self.warm_reads:
            return tasks
        for address in set(data_addresses):
            if address:
                warm = getattr(self.transport_for(ServerInfo("", "", address)), "warm", None)
                task = warm(address) if warm is not None else None
                if task is not None:
                    tasks.append(task)
        return tasks

    async def warm_up(self, tenants: Iterable[str] = (), *, reads: bool = True) -> int:
        """Makes a first lookup and restore as fast as the ones after: fetches the
        tenants' keys (which opens the metaserver channel and its TLS session) and,
        with `reads`, opens the restores' data connections to every live chunkserver
        the metaserver knows (warm_reads). A fresh client pays these on its first hit
        instead: a 2K-token MLA hit took 8-14 ms to read against 4.5 ms after. Returns
        once they are open; how many servers it opened connections to. A server
        that cannot be reached now is left to the restore that needs it."""
        for tenant in tenants:
            await self.tenant_key(tenant)
        if not reads:
            return 0
        status = await self.status()
        tasks = self._warm(s.data_address for s in status.servers if s.live)
        if tasks:
            await asyncio.wait(tasks)
        return len(tasks)

    async def _meta_call(self, name: str, request, first_key: bytes | None = None):
        """MetaService method `name` at the metaserver holding the prompt that starts
        with `first_key` (routing.py; None: any); a typed error if it fails."""
        return await self.router.call(name, request, first_key)

    async def tenant_key(self, tenant: str) -> bytes:
        """The secret `tenant`'s block keys chain under, from the metaserver (once per
        tenant and client; empty on an --insecure cluster)."""
        key = self._tenant_keys.get(tenant)
        if key is None:
            reply = await self._meta_call("TenantKey", meta_pb2.TenantKeyRequest(tenant=tenant))
            key = self._tenant_keys[tenant] = reply.key
        return key

    async def keys(self, namespace: Namespace, token_ids: Sequence[int], *,
                   salt: str | bytes | None = None) -> list[bytes]:
        """The block keys lookups and writes of `token_ids` use (kvfs.keys.block_keys
        under the tenant's secret)."""
        return block_keys(namespace, token_ids, self.block_tokens, salt, await self.tenant_key(namespace.tenant))

    async def lookup(self, namespace: Namespace, token_ids: Sequence[int], *,
                     salt: str | bytes | None = None) -> PrefixMatch:
        """The longest cached prefix of `token_ids` (whole blocks, exact from token 0)
        written under the same `salt` (kvfs.keys.Namespace.root_key)."""
        keys = await self.keys(namespace, token_ids, salt=salt)
        t0 = time.perf_counter()
        reply = await self._meta_call("MatchPrefix", meta_pb2.MatchPrefixRequest(
            namespace=_ns(namespace), joined_keys=b"".join(keys)), keys[0] if keys else None)
        seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.looked_up(len(keys), reply.matched, seconds)
        if reply.matched:
            self._warm(s.data_address for s in reply.servers)
        m = reply.layout
        return PrefixMatch(namespace, keys, reply.matched, self.block_tokens, reply.blocks,
                           [ServerInfo(s.id, s.address, s.data_address) for s in reply.servers],
                           seconds, reply.read_grant,
                           BlockLayout(m.layers, m.block_tokens, m.kv_dim, m.dtype) if reply.matched else None)

    def read(self, match: PrefixMatch, out, *, layers: Iterable[int] | None = None, blocks: int | None = None,
             buffer_tokens: int | None = None) -> Restore:
        """Starts restoring `match` into `out` and returns at once.

        `out` is `[layer][buffer_tokens][kv_dim]` (buffer_tokens defaults to the
        matched tokens); `layers` restricts the restore to some layers, `blocks`
        to the first blocks. Await `restore.layer_ready(l)` or iterate the
        restore to consume layers as they land; `await restore.wait()` for stats.
        """
        if match.matched == 0:
            raise InvalidArgument("nothing matched: there is nothing to read")
        on_done = None
        if self.metrics is not None:
            by_address = {s.address: s for s in match.servers}

            def on_done(stats: RestoreStats, failed: bool) -> None:
                self.metrics.restored(stats, lambda a: self.transport_for(by_address[a]).name, failed)

        return Restore(self.transport_for, match, out, layers, blocks, buffer_tokens,
                       self.per_server_reads, self.read_batch,
                       (self.latency, self.hedges) if self.hedge else None, on_done)

    async def write(self, namespace: Namespace, token_ids: Sequence[int], payload, layout: BlockLayout,
                    ttl_class: str = "", *, first_block: int = 0, buffer_tokens: int | None = None,
                    salt: str | bytes | None = None) -> WriteResult:
        """Writes the full blocks of `token_ids` from `first_block` on, under `salt`
        (only lookups with the same salt find them).

        `payload` is `[layer][buffer_tokens][kv_dim]` holding at least every full
        block of the prompt. Each chunk goes to every replica; the blocks are
        committed only once all are durable. A replica failure raises, naming
        the server, and leaves the blocks uncommitted (their chunks are garbage
        collected). Blocks someone else committed first are left as they are.
        """
        try:
            result = await self._write(namespace, token_ids, payload, layout, ttl_class, first_block,
                                       buffer_tokens, salt)
        except BaseException:
            if self.metrics is not None:
                self.metrics.write_failed()
            raise
        if self.metrics is not None:
            self.metrics.wrote(result.committed, result.bytes_written, result.seconds)
        return result

    async def _write(self, namespace, token_ids, payload, layout, ttl_class, first_block, buffer_tokens,
                     salt) -> WriteResult:
        if layout.block_tokens != self.block_tokens:
            raise InvalidArgument(f"layout has {layout.block_tokens}-token blocks, client {self.block_tokens}")
        t0 = time.perf_counter()
        keys = await self.keys(namespace, token_ids, salt=salt)
        tokens = buffer_tokens or len(keys) * self.block_tokens
        src = byte_view(payload, writable=False)
        if len(src) < layout.buffer_bytes(tokens) or tokens < len(keys) * self.block_tokens:
            raise InvalidArgument(f"payload holds {len(src)} bytes; {len(keys)} blocks in a "
                                  f"{tokens}-token buffer need {layout.buffer_bytes(tokens)}")
        if first_block >= len(keys):
            return WriteResult(0, 0, 0, 0.0)
        alloc = await self._meta_call("AllocateBlocks", meta_pb2.AllocateBlocksRequest(
            namespace=_ns(namespace), keys=keys[first_block:], layout=_layout_msg(layout),
            parent=keys[first_block - 1] if first_block else b"", first_key=keys[0]), keys[0])
        # the next lookup of this prompt will hit: its restore finds the connections open
        self._warm(a for b in alloc.blocks for c in b.chunks for a in c.data_addresses)
        limit = asyncio.Semaphore(self.write_concurrency)
        commit = meta_pb2.CommitBlocksRequest(namespace=_ns(namespace), allocation_id=alloc.allocation_id,
                                              ttl_class=ttl_class)
        jobs, written = [], 0
        for i, block in enumerate(alloc.blocks):
            if block.already_present:
                continue
            entry = commit.blocks.add(key=block.key)
            entry.chunk_checksums.extend([0] * len(block.chunks))  # each job sets its own
            for index, placement in enumerate(block.chunks):
                span = layout.span_of(placement.offset, placement.length)
                owner = owner_record(namespace.digest, block.key, index, len(block.chunks), _layout_msg(layout),
                                     alloc.chunk_size, placement.owner_seal, alloc.hash_slot, ttl_class,
                                     parent=keys[first_block + i - 1] if first_block + i else b"",
                                     depth=first_block + i)
                pieces = layout.scatter(span, first_block + i, tokens)
                jobs.append(self._write_chunk(limit, placement, span.length, pieces, src, owner, entry, index,
                                              alloc.chunk_size))
                written += span.length
        if not commit.blocks:  # another writer committed all of them since our lookup
            return WriteResult(0, len(alloc.blocks), 0, time.perf_counter() - t0)
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            err = failures[0]
            if isinstance(err, KvfsError):
                raise type(err)(f"write-back of {len(commit.blocks)} blocks failed, nothing committed: "
                                f"{err.message}")
            raise err
        reply = await self._meta_call("CommitBlocks", commit, keys[0])  # where it was allocated
        already = sum(b.already_present for b in alloc.blocks) + reply.already_present
        return WriteResult(reply.committed, already, written, time.perf_counter() - t0)

    async def _write_chunk(self, limit, placement, length: int, pieces, src, owner: bytes, entry, index: int,
                           chunk_size: int) -> None:
        """Gathers one chunk out of the payload when its turn comes (at most
        write_concurrency at once: into a write slot, which chunkservers on this host
        copy it from, when a replica is local, else into a reused buffer), checksums
        it once and writes it to every replica in parallel; its checksum and
        receipts go into the commit entry."""
        data_addresses = list(placement.data_addresses) or [""] * len(placement.addresses)
        async with limit:
            slots = (self._writer.write_slots(chunk_size, self.write_concurrency)
                     if self.transport != "grpc" and any(a and self._writer.is_local(a) for a in data_addresses)
                     else None)
            if slots is not None:
                slot, buf = await slots.take(), None
                view = slots.view(slot, length)
            else:
                slot, buf = None, self._chunk_buffers.get(-(-length // PAGE) * PAGE)
                view = memoryview(buf)[:length]
            gathered = asyncio.get_running_loop().run_in_executor(self._write_threads, _gather, view, pieces, src)
            try:
                xxh = entry.chunk_checksums[index] = await asyncio.shield(gathered)
            except asyncio.CancelledError:
                await asyncio.wait([gathered])  # it still reads the payload: the caller may free it once we return
                raise
            copies = await asyncio.gather(*(self._store_chunk(address, data_address, placement.chunk_id, view, owner,
                                                              xxh, slot)
                                            for address, data_address in zip(placement.addresses, data_addresses)),
                                          return_exceptions=True)
            # every copy has finished with the bytes (gather waited for all): they can be reused
            view.release()
            if slots is not None:
                slots.give(slot)
            else:
                self._chunk_buffers.put(buf)
        for copy in copies:
            if isinstance(copy, BaseException):
                raise copy
            if copy:  # none from an --insecure chunkserver
                entry.receipts.append(copy)

    async def _store_chunk(self, address, data_address, chunk_id, data, owner, xxh, slot) -> bytes:
        """One copy of a chunk, over the server's data port when it has one, else
        (or when that connection fails) over gRPC; its receipt."""
        if data_address and self.transport != "grpc" and self._grpc_writes.get(data_address, 0) < time.monotonic():
            try:
                return (await self._writer.write(data_address, chunk_id, data, xxh, owner, self.timeout, slot))[1]
            except Unavailable as err:
                if self._grpc_writes.get(data_address, 0) < time.monotonic():
                    log.warning("chunk writes to %s go over gRPC for %.0f s: its data port failed a write (%s)",
                                address, GRPC_WRITES_AFTER_FAILURE, err.message)
                self._grpc_writes[data_address] = time.monotonic() + GRPC_WRITES_AFTER_FAILURE
        return (await self.chunkserver(address).store(chunk_id, data, owner, xxh, timeout=self.timeout)).receipt

    async def status(self) -> meta_pb2.StatusReply:
        """Servers, liveness, capacity, blocks and bytes, as the metaserver sees them."""
        return await self._meta_call("Status", meta_pb2.StatusRequest())


class SyncClient:
    """Client's blocking twin, for synchronous callers: it runs its own event
    loop in a thread. Same methods; `read` blocks until the restore is complete
    and returns its RestoreStats (use Client for layer-by-layer consumption)."""

    def __init__(self, metaserver: str, **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvfs-client", daemon=True)
        self._thread.start()
        self._client: Client = self._run(self._make(metaserver, options))

    @staticmethod
    async def _make(metaserver, options) -> Client:
        return Client(metaserver, **options)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, namespace: Namespace, token_ids: Sequence[int], **kw) -> PrefixMatch:
        return self._run(self._client.lookup(namespace, token_ids, **kw))

    def read(self, match: PrefixMatch, out, **kw):
        async def go():
            return await self._client.read(match, out, **kw).wait()

        return self._run(go())

    def write(self, namespace: Namespace, token_ids: Sequence[int], payload, layout: BlockLayout,
              ttl_class: str = "", **kw) -> WriteResult:
        return self._run(self._client.write(namespace, token_ids, payload, layout, ttl_class, **kw))

    def status(self) -> meta_pb2.StatusReply:
        return self._run(self._client.status())

    def warm_up(self, tenants: Iterable[str] = (), *, reads: bool = True,
                wait: bool = True) -> int | concurrent.futures.Future:
        """Client.warm_up; `wait=False` returns its future at once (a caller's start-up
        need not wait on the network)."""
        fut = asyncio.run_coroutine_threadsafe(self._client.warm_up(tenants, reads=reads), self._loop)
        return fut.result() if wait else fut

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
