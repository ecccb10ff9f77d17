"""How restore bytes travel from a chunkserver into the caller's buffer.

One small interface, three implementations:

  GrpcTransport  ReadChunks over gRPC, each range widened to whole 64 KiB
                 blocks; the client verifies them and copies the range out of
                 its message (one copy);
  TcpTransport   the chunkserver's data port (kvfs/wire.py): a few pipelined
                 connections per server, each drained by a thread that receives
                 every range with recv_into straight into its places in the
                 destination buffer and verifies its 64 KiB blocks as they land;
  ShmTransport   same host: each connection goes to the port's local socket
                 and passes the descriptors of a sealed staging memfd and of the
                 process's BufferPool arena; the server reads from disk straight
                 into the destination when it lies in the arena (else into
                 staging, copied out), verifies the bytes there, and the socket
                 carries only requests and completions.

Writes go over the data port too (DataWriter): WRITE frames on connections of
their own, the local socket for a server on this host, gRPC WriteChunk when a
server has no data port or its connection fails.

Every transport checks, per range, that the chunk's block checksums the
server sent hash to the checksum the metaserver committed for the chunk
(kvfs/checksum.py): a chunk rewritten behind the metaserver's back, with other
bytes and checksums of their own, is refused whichever way it travels. A range
that fails (missing, corrupt, not the committed chunk, server gone) comes back
as an error for that range only; the restore retries it on another replica.
Bytes that fail their checksum are never reported as read.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import socket
import ssl
import struct
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from kvfs import wire
from kvfs.buffers import address_of, memmove, sealed_memfd
from kvfs.checksum import blocks_covering, checksum_of_blocks
from kvfs.errors import Aborted, DataLoss, DeadlineExceeded, KvfsError, Unavailable, from_code

from .chunks import ChunkClient
from .hedge import Fence, ServerBacklog
from .pool import SharedArena, arena_of, current_arena

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
STALL_TIMEOUT = 30.0  # a connection with requests in flight and no byte for this long is dead
SHM_REGION = 16 << 20
SHM_REGIONS = 4


@dataclass(frozen=True, slots=True)
class ServerInfo:
    id: str
    address: str  # gRPC
    data_address: str = ""  # the bulk data port; empty when the server has none


@dataclass(slots=True)
class ReadSpec:
    """One range to read and where its bytes go in the destination."""

    chunk_id: bytes
    offset: int
    length: int
    chunk_length: int
    checksum: int  # the chunk's, as the metaserver committed it (kvfs/checksum.py)
    pieces: list[tuple[int, int, int]]  # (offset within the range, offset in the destination, length)
    # set when another reader may race this one for the range (a hedged read): only
    # the reader that claims it writes into the destination; a fenced range is never
    # read by a server straight into the destination, since that write can't be fenced
    fence: Fence | None = None
    grant: bytes = b""  # the read grant of the lookup that found the chunk (PrefixMatch.read_grant)

    def claim(self, reader: object) -> bool:
        return self.fence is None or self.fence.claim(reader)

    def release(self, reader: object) -> None:
        if self.fence is not None:
            self.fence.release(reader)


def not_committed(spec: ReadSpec, sums, address: str) -> DataLoss | None:
    """None if a chunk's block checksums (as a server sent them) hash to the
    committed checksum; else the error for the range, logged."""
    got = checksum_of_blocks(sums)
    if got == spec.checksum:
        return None
    message = (f"chunk {spec.chunk_id.hex()[:16]} on {address} is not the chunk committed: its block checksums "
               f"hash to {got:#018x}, the metaserver committed {spec.checksum:#018x}; not used")
    log.warning("%s", message)
    return DataLoss(message)


def superseded(spec: ReadSpec, address: str) -> Aborted:
    return Aborted(f"chunk {spec.chunk_id.hex()[:16]} from {address} arrived after a hedged duplicate; dropped")


class Transport(Protocol):
    name: str

    async def read(self, server: ServerInfo, specs: list[ReadSpec], out: memoryview) -> list[KvfsError | None]:
        """Reads every spec into `out`; one error (or None) per spec. A fenced spec
        whose fence another reader holds comes back Aborted, its bytes dropped."""

    async def close(self) -> None: ...

    def abort(self, server: ServerInfo) -> None:
        """Gives up on what is in flight to `server` (it stopped answering): those
        reads fail, and ranges they were receiving are released to other readers."""


class TlsSocket:
    """A client's TLS connection over a socket, through memory BIOs: one thread sends
    requests while another receives replies, which one ssl.SSLSocket must not be
    used for (OpenSSL's connection state is not safe to share between threads).
    Offers the few socket calls _Connection makes."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str):
        self.sock, self.family = sock, sock.family
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_hostname=host)
        self._state = threading.Lock()  # the TLS connection's state
        self._sending = threading.Lock()  # the socket's send side: records leave in the order they were made
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self.sock.sendall(self._out.read())
                    if not self._feed():  # e.g. refused by the port's per-host connection cap
                        raise ConnectionError("the data port closed the connection during the TLS handshake")
            self.sock.sendall(self._out.read())
        finally:
            sock.settimeout(None)

    def _feed(self) -> bool:
        data = self.sock.recv(1 << 18)
        if not data:
            return False
        with self._state:
            self._in.write(data)
        return True

    def _flush(self) -> None:
        with self._sending:
            with self._state:
                records = self._out.read()
            self.sock.sendall(records)

    def sendall(self, data) -> None:
        with self._sending:
            with self._state:
                self._tls.write(data)
                records = self._out.read()
            self.sock.sendall(records)

    def recv_into(self, view: memoryview, n: int = 0, flags: int = 0) -> int:
        """Up to n bytes (0: len(view)); 0 once the server closed."""
        n = n or len(view)
        while True:
            with self._state:
                try:
                    got = self._tls.read(n, view)
                except ssl.SSLWantReadError:
                    got = None
                except ssl.SSLZeroReturnError:
                    return 0
                answer = self._out.pending  # a post-handshake message wants an answer
            if answer:
                self._flush()
            if got is not None:
                return got
            if not self._feed():
                return 0

    def recvmsg_into(self, views, ancbufsize: int = 0, flags: int = 0):
        return self.recv_into(views[0]), [], 0, None

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def _connect(address: str, local: bool, context: ssl.SSLContext | None = None) -> socket.socket | TlsSocket:
    """A data connection: to the port's local socket when asked and there is one
    (shared memory needs it), else over TCP: mutual TLS with `context`, plaintext
    without (--insecure)."""
    if local:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(wire.local_socket_name(address))
            sock.settimeout(None)
            return sock
        except OSError as err:
            sock.close()
            log.warning("no local socket for the data port at %s (%s); reading from it over TCP, "
                        "without shared memory", address, err.strerror or err)
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if context is None:
        return sock
    try:
        return TlsSocket(sock, context, host.strip("[]"))
    except (OSError, ValueError):
        sock.close()
        raise


def is_local(address: str) -> bool:
    """Whether host:port names this host (loopback, or one of its own addresses)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        mine = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return host in mine


class GrpcTransport:
    name = "grpc"

    def __init__(self, clients):
        self._clients = clients  # address -> ChunkClient

    async def read(self, server, specs, out):
        client: ChunkClient = self._clients(server.address)
        widened = [wire.widen(s.offset, s.length, s.chunk_length) for s in specs]  # whole checksum blocks
        try:
            results = await client.read([(s.chunk_id, start, n) for s, (start, n) in zip(specs, widened)],
                                        read_grant=specs[0].grant)
        except KvfsError as err:
            return [err] * len(specs)
        errors: list[KvfsError | None] = []
        reader = object()
        for spec, (start, n), res in zip(specs, widened, results):
            if res.code:
                errors.append(from_code(res.code, res.message))
            elif len(res.data) != n:
                errors.append(DataLoss(f"{server.address} returned {len(res.data)} bytes for a {n}-byte range"))
            elif (wrong := not_committed(spec, res.block_checksums, server.address)) is not None:
                errors.append(wrong)
            elif not wire.verified(res.data, res.block_checksums[blocks_covering(start, n)]):
                errors.append(DataLoss(f"chunk {spec.chunk_id.hex()[:16]} from {server.address} failed its "
                                       f"checksum"))
            elif not spec.claim(reader):
                errors.append(superseded(spec, server.address))
            else:
                data = memoryview(res.data)[spec.offset - start :]
                for src, dst, k in spec.pieces:
                    out[dst : dst + k] = data[src : src + k]
                data.release()
                errors.append(None)
        return errors

    async def close(self) -> None:
        pass

    def abort(self, server) -> None:
        pass  # a gRPC read claims its ranges only once its whole message is in: nothing to release


@dataclass(slots=True)
class _Pending:
    specs: list[ReadSpec]
    out: memoryview
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    region: int = -1  # shm staging region, if any
    zero_copy: bool = False  # the server wrote straight into `out`


@dataclass(slots=True)
class _PendingWrite:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future  # ends in (created, receipt), or the KvfsError that stopped it


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("connection closed by the chunkserver")
        got += n


def _recv_scattered(sock: socket.socket, views: list[memoryview]) -> None:
    """Fills every view, in order, from the socket (recvmsg_into: one syscall for many)."""
    i = 0
    while i < len(views):
        batch = views[i : i + 512]  # under IOV_MAX
        n = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ConnectionError("connection closed by the chunkserver")
        for v in batch:  # skip what was filled; resume inside a partly filled view
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                views[i] = v[n:]
                break


class _Connection:
    """One data-port connection: requests sent from the event loop, replies
    drained by a thread that places the bytes and then completes futures."""

    def __init__(self, address: str, shm_regions: int = 0, arena=None, tls: ssl.SSLContext | None = None,
                 local: bool = False, write_arena=None, backlog: ServerBacklog | None = None):
        self.address = address
        self.backlog = backlog  # hears each READ_REPLY's backlog
        self.sock = _connect(address, local or bool(shm_regions), tls)
        self.write_mapping: int | None = None  # where the server maps `write_arena` (WRITE_SHM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(STALL_TIMEOUT), 0))
        self.pending: dict[int, _Pending | _PendingWrite] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()  # guards pending; never held across I/O
        self.send_lock = threading.Lock()
        self.dead: KvfsError | None = None
        self.scratch = bytearray(2 * wire.BLOCK)
        self.shm: mmap.mmap | None = None
        self.shm_address = 0
        self.arena = None  # the client's buffer arena, when this server has mapped it
        self.shm_ranges = [0, 0]  # ranges served through staging, and straight into the destination
        if shm_regions and self.sock.family == socket.AF_UNIX:
            try:
                self._map_staging(shm_regions * SHM_REGION)
            except (OSError, KvfsError) as err:
                log.warning("%s; reading from it without shared memory instead", err)
                self.shm = None
        if self.shm is not None and arena is not None:
            try:
                self._register(arena.fd, arena.size, 1)
                self.arena = arena
            except KvfsError as err:
                log.warning("%s; restores from it into pool buffers will be copied once", err.message)
        if write_arena is not None and self.sock.family == socket.AF_UNIX:
            try:
                self._register(write_arena.fd, write_arena.size, 0)
                self.write_mapping = 0
            except KvfsError as err:
                log.warning("%s; writes to it send their bytes over the socket instead", err.message)
        self.thread = threading.Thread(target=self._drain, name=f"kvfs-data-{address}", daemon=True)
        self.thread.start()

    def _map_staging(self, size: int) -> None:
        fd = sealed_memfd("kvfs-staging", size)
        try:
            shm = mmap.mmap(fd, size)
            try:
                self._register(fd, size, 0)
            except KvfsError:
                shm.close()
                raise
        finally:
            os.close(fd)  # the mappings (ours, and the server's) keep the file
        self.shm = shm
        self.shm_address = address_of(self.shm)

    def _register(self, fd: int, size: int, mapping: int) -> None:
        """SHM_REGISTER with the file's descriptor, before the drain thread starts
        (so the reply is ours to read)."""
        socket.send_fds(self.sock, [wire.encode_shm_register(0, size, mapping)], [fd])
        header = bytearray(wire.HEADER.size)
        _recv_exact(self.sock, memoryview(header))
        h = wire.parse_header(bytes(header), requests=False)
        body = bytearray(h.body_len)
        _recv_exact(self.sock, memoryview(body))
        code, message = wire.parse_status(h, bytes(body))
        if code:
            raise from_code(code, f"{self.address} refused the shared buffer: {message}")

    @property
    def load(self) -> int:
        return len(self.pending)

    def submit(self, specs: list[ReadSpec], out: memoryview, loop, region: int = -1) -> asyncio.Future:
        future = loop.create_future()
        rid = next(self.ids)
        ranges = []
        zero_copy = False
        if region >= 0:
            found = self.arena and arena_of(address_of(out), len(out))
            zero_copy = bool(found) and found[0] is self.arena and not any(s.fence for s in specs)
            offset = region * SHM_REGION
            for s in specs:
                if zero_copy:  # the server reads straight into the destination
                    pieces = tuple((found[1] + dst, n) for _, dst, n in s.pieces)
                    ranges.append(wire.Range(s.chunk_id, s.offset, s.length, 1, pieces))
                else:  # into this connection's staging region, copied out on completion
                    ranges.append(wire.Range(s.chunk_id, s.offset, s.length, 0, ((offset, s.length),)))
                    offset += -(-s.length // 4096) * 4096
        else:
            ranges = [wire.Range(s.chunk_id, s.offset, s.length) for s in specs]
        frame = wire.encode_read(rid, ranges, shm=region >= 0, grant=specs[0].grant)
        with self.lock:  # checked under the lock: _fail either sees this request or ran before it
            if self.dead is not None:
                future.set_result([self.dead] * len(specs))
                return future
            self.pending[rid] = _Pending(specs, out, loop, future, region, zero_copy)
        try:
            # a few hundred bytes: the send buffer takes it without blocking the loop
            with self.send_lock:
                self.sock.sendall(frame)
        except OSError as err:
            self._fail(Unavailable(f"data connection to {self.address} lost: {err}"))
        return future

    def expect_write(self, loop) -> tuple[int, asyncio.Future]:
        """A request id and the future its WRITE_REPLY ends (on the event loop)."""
        rid, future = next(self.ids), loop.create_future()
        with self.lock:
            if self.dead is not None:
                future.set_result(self.dead)
            else:
                self.pending[rid] = _PendingWrite(loop, future)
        return rid, future

    def send_write(self, rid: int, chunk_id: bytes, data: memoryview, checksum: int, owner: bytes,
                   at: int | None = None) -> None:
        """Sends a WRITE and the chunk's bytes back to back, or with `at` (where `data`
        lies in the write arena this connection registered) a WRITE_SHM alone. It
        blocks until the socket has taken them: call it off the event loop."""
        try:
            with self.send_lock:
                if at is not None:
                    self.sock.sendall(wire.encode_write(rid, chunk_id, len(data), checksum, owner,
                                                        (self.write_mapping, at)))
                    return
                self.sock.sendall(wire.encode_write(rid, chunk_id, len(data), checksum, owner))
                self.sock.sendall(data)
        except OSError as err:
            self._fail(Unavailable(f"data connection to {self.address} lost: {err}"))

    def close(self) -> None:
        self._fail(Unavailable(f"data connection to {self.address} closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:
                pass  # its address was exported; the mapping goes with the process

    def _fail(self, err: KvfsError) -> None:
        with self.lock:
            if self.dead is None:
                self.dead = err
            pending, self.pending = self.pending, {}
        for p in pending.values():
            self._abandon(p, err)

    def _abandon(self, p: _Pending | _PendingWrite, err: KvfsError) -> None:
        """Fails every range of `p`, releasing ranges it claimed to other readers."""
        if isinstance(p, _PendingWrite):
            self._complete(p, err)
            return
        for spec in p.specs:
            spec.release(p)
        self._complete(p, [err] * len(p.specs))

    @staticmethod
    def _complete(p: _Pending | _PendingWrite, result) -> None:
        def done():
            if not p.future.done():
                p.future.set_result(result)

        p.loop.call_soon_threadsafe(done)

    def _drain(self) -> None:
        header = bytearray(wire.HEADER.size)
        try:
            while True:
                try:
                    _recv_exact(self.sock, memoryview(header))
                except BlockingIOError:  # SO_RCVTIMEO: fine while idle
                    if self.pending:
                        raise TimeoutError(f"no reply for {STALL_TIMEOUT:.0f}s") from None
                    continue
                h = wire.parse_header(bytes(header), requests=False)
                body = bytearray(h.body_len)
                _recv_exact(self.sock, memoryview(body))
                with self.lock:
                    p = self.pending.pop(h.request_id, None)
                if p is None:
                    code, message = wire.parse_status(h, body) if h.kind == wire.STATUS else (13, "")
                    raise ConnectionError(f"unexpected reply {h.request_id}: {message or 'unknown request'}")
                if h.kind == wire.STATUS:
                    code, message = wire.parse_status(h, body)
                    err = from_code(code, f"{message} (from {self.address})")
                    if isinstance(p, _PendingWrite) and code == 3:
                        # the frame itself refused (a server that predates WRITE answers "unknown request
                        # kind"): the caller may write over gRPC, which refuses what is really malformed
                        err = Unavailable(f"{self.address} refused the write's frame: {message}")
                    self._complete(p, err if isinstance(p, _PendingWrite) else [err] * len(p.specs))
                    continue
                if isinstance(p, _PendingWrite) or h.kind == wire.WRITE_REPLY:
                    if not isinstance(p, _PendingWrite) or h.kind != wire.WRITE_REPLY:
                        self._abandon(p, Unavailable(f"{self.address} answered request {h.request_id} "
                                                     f"with the wrong kind of reply"))
                        raise wire.WireError(f"reply kind {h.kind} to request {h.request_id}")
                    code, message, created, receipt = wire.parse_write_reply(h, body)
                    self._complete(p, from_code(code, f"{message} (from {self.address})") if code
                                   else (created, receipt))
                    continue
                if self.backlog is not None:
                    self.backlog.report(self.address, wire.backlog_of(h))
                try:
                    results = wire.parse_read_reply(h, body)
                    if len(results) != len(p.specs):
                        raise wire.WireError(f"{len(results)} results for {len(p.specs)} ranges")
                    self._complete(p, self._place(p, results))
                except BaseException:  # p left `pending` above: _fail would not see it
                    self._abandon(p, Unavailable(f"data connection to {self.address} lost mid-reply"))
                    raise
        except (OSError, wire.WireError, KvfsError, ConnectionError) as err:
            message = err.message if isinstance(err, (wire.WireError, KvfsError)) else str(err)
            if self.dead is None:
                log.warning("data connection to %s failed: %s", self.address, message)
            self._fail(Unavailable(f"data connection to {self.address} lost: {message}"))

    def _place(self, p: _Pending, results: list[wire.RangeResult]) -> list:
        errors: list[KvfsError | None] = []
        staged = p.region * SHM_REGION
        reader = p  # what claims fenced ranges for this request
        for spec, res in zip(p.specs, results):
            at = staged
            staged += -(-spec.length // 4096) * 4096
            if res.code:
                errors.append(from_code(res.code, f"{res.message} (from {self.address})"))
                continue
            if (res.data_start, res.data_len) != wire.widen(spec.offset, spec.length, spec.chunk_length) \
                    or res.chunk_len != spec.chunk_length:
                raise wire.WireError(f"reply data [{res.data_start}, +{res.data_len}) of a {res.chunk_len}-byte "
                                     f"chunk is not the range [{spec.offset}, +{spec.length}) widened to whole "
                                     f"blocks of the {spec.chunk_length}-byte chunk")
            wrong = not_committed(spec, res.checksums, self.address)
            if p.region < 0:
                if wrong is not None:
                    self._discard(res.data_len)  # keep the stream in step
                errors.append(wrong or self._receive(spec, res, p.out, reader))
            elif wrong is not None:  # zero-copy bytes may be in the destination: the range is not used
                errors.append(wrong)
            else:  # the server verified the bytes (wire.py); staged ones are copied out
                self.shm_ranges[p.zero_copy] += 1
                if not p.zero_copy and not spec.claim(reader):
                    errors.append(superseded(spec, self.address))
                    continue
                if not p.zero_copy:
                    out_address = address_of(p.out)
                    for src, dst, n in spec.pieces:
                        memmove(out_address + dst, self.shm_address + at + src, n)
                errors.append(None)
        return errors

    def _receive(self, spec: ReadSpec, res: wire.RangeResult, out: memoryview, reader) -> KvfsError | None:
        # one recvmsg_into per range, scattering straight into the destination's
        # pieces (plus scratch for the widening): no copies and few syscalls
        if not spec.claim(reader):  # a hedged duplicate owns the range: keep the stream in step, drop the bytes
            self._discard(res.data_len)
            return superseded(spec, self.address)
        scratch = memoryview(self.scratch)
        head = spec.offset - res.data_start
        tail = res.data_start + res.data_len - spec.offset - spec.length
        views = ([scratch[:head]] if head else []) + [out[dst : dst + n] for _, dst, n in spec.pieces]
        if tail:
            views.append(scratch[wire.BLOCK : wire.BLOCK + tail])
        _recv_scattered(self.sock, list(views))  # it trims its copy as views fill
        if not wire.verified(views, res.covering()):
            log.warning("chunk %s from %s failed its checksum; not used", spec.chunk_id.hex()[:16], self.address)
            spec.release(reader)
            return DataLoss(f"chunk {spec.chunk_id.hex()[:16]} from {self.address} failed its checksum")
        return None

    def _discard(self, n: int) -> None:
        view = memoryview(self.scratch)
        while n:
            step = min(n, len(view))
            _recv_exact(self.sock, view[:step])
            n -= step


class TcpTransport:
    """The data port over TCP: `connections` pipelined connections per server."""

    name = "tcp"
    shm_regions = 0

    def __init__(self, connections: int = 2, tls: ssl.SSLContext | None = None,
                 backlog: ServerBacklog | None = None):
        self.connections = connections
        self.tls = tls  # mutual TLS over TCP (the local socket needs none); None: plaintext, --insecure
        self.backlog = backlog  # what the servers say of their read backlogs
        self._conns: dict[str, list[_Connection]] = {}
        self._regions: dict[int, asyncio.Queue] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._warming: dict[str, asyncio.Task] = {}  # address -> the task opening its connections (warm)
        self.warmed = 0  # connections warm() opened

    async def _connection(self, address: str) -> _Connection:
        async with self._opening.setdefault(address, asyncio.Lock()):
            conns = self._conns.setdefault(address, [])
            self._drop_dead(conns)
            if len(conns) < self.connections:
                self._close_dead(address)
                try:
                    conn = await asyncio.get_running_loop().run_in_executor(None, self._open, address,
                                                                            current_arena())
                except (OSError, KvfsError) as err:
                    if not conns:
                        raise Unavailable(f"cannot open a data connection to {address}: {err}") from None
                else:
                    # abort() may have dropped the list while this one connected: not into a list no one holds
                    conns = self._conns.setdefault(address, conns)
                    conns.append(conn)
                    if self.shm_regions:
                        queue: asyncio.Queue = asyncio.Queue()
                        for r in range(self.shm_regions):
                            queue.put_nowait(r)
                        self._regions[id(conn)] = queue
            return min(conns, key=lambda c: c.load)

    def _drop_dead(self, conns: list[_Connection]) -> None:
        """Takes the dead connections out of `conns` and closes them."""
        for c in [c for c in conns if c.dead is not None]:
            conns.remove(c)
            self._regions.pop(id(c), None)
            c.close()

    def _close_dead(self, opening: str) -> None:
        """Closes the dead connections to addresses other than `opening`, and forgets
        an address once none is left. A restarted server comes back on a new data
        port, so its old address is never asked for again: without this, every
        restart of every server would leave each client its dead sockets (the soak
        test's process held 84 more descriptors after 60 s of kills). Runs only
        while a connection is opened, never on a read that finds one open."""
        for address, conns in list(self._conns.items()):
            if address == opening:
                continue
            self._drop_dead(conns)
            lock = self._opening.get(address)
            if not conns and address not in self._warming and (lock is None or not lock.locked()):
                del self._conns[address]
                self._opening.pop(address, None)

    def warm(self, address: str) -> asyncio.Task | None:
        """Opens this transport's connections to the data port at `address` in the
        background, where it has fewer open: a restore that comes later finds them
        ready instead of opening them one by one, each a connect and for shared
        memory two registrations (an engine's first 2K-token hit restored at 0.58 GB/s,
        its next ones at 0.73). A failure is left to the restore that needs the server.
        Returns the task opening them (the one already running, if any); None where
        all are open."""
        if address in self._warming:
            return self._warming[address]
        if len(self._conns.get(address, ())) >= self.connections:
            return None
        task = asyncio.get_running_loop().create_task(self._warm(address))
        self._warming[address] = task
        task.add_done_callback(lambda _: self._warming.pop(address, None))
        return task

    async def _warm(self, address: str) -> None:
        before = len(self._conns.get(address, ()))
        try:
            for _ in range(self.connections):
                await self._connection(address)
        except Unavailable as err:
            log.debug("warming data connections: %s", err.message)
        self.warmed += max(0, len(self._conns.get(address, ())) - before)

    def _open(self, address: str, arena) -> _Connection:
        """A new connection to the data port at `address` (in a thread: it connects)."""
        return _Connection(address, self.shm_regions, arena if self.shm_regions else None, self.tls,
                           backlog=self.backlog)

    async def read(self, server, specs, out):
        try:
            conn = await self._connection(server.data_address)
        except Unavailable as err:
            return [err] * len(specs)
        return await conn.submit(specs, out, asyncio.get_running_loop())

    async def close(self) -> None:
        if self._warming:  # let them finish: one cancelled while it connects would leave its connection open
            await asyncio.wait(list(self._warming.values()))
        for conns in self._conns.values():
            for c in conns:
                c.close()
        self._conns.clear()

    def abort(self, server) -> None:
        dropped = self._conns.pop(server.data_address, [])
        conns = list(dropped)
        dropped.clear()  # an opener still holding the list puts its connection back in the pool, not here
        for c in conns:
            self._regions.pop(id(c), None)
            # closing joins the receive thread: not on the event loop
            threading.Thread(target=c.close, name=f"kvfs-abort-{server.data_address}", daemon=True).start()
        if conns:
            log.warning("no answer from %s in time; dropped %d data connections to it", server.data_address,
                        len(conns))


class ShmTransport(TcpTransport):
    """The data port with a shared-memory buffer per connection (same host only)."""

    name = "shm"
    shm_regions = SHM_REGIONS

    def warm(self, address: str) -> asyncio.Task | None:
        """TcpTransport.warm, once the process has a buffer arena: a connection
        registers the arena there is when it opens, and one opened before would copy
        every restore into pool buffers through its staging region."""
        return super().warm(address) if current_arena() is not None else None

    @property
    def ranges(self) -> dict[str, int]:
        """How many ranges went through staging and how many straight into the destination."""
        conns = [c for cs in self._conns.values() for c in cs]
        return {"staged": sum(c.shm_ranges[0] for c in conns), "zero_copy": sum(c.shm_ranges[1] for c in conns)}

    async def read(self, server, specs, out):
        need = sum(-(-s.length // 4096) * 4096 for s in specs)
        if need > SHM_REGION:  # larger than a region: send it the TCP way on the same connection
            return await super().read(server, specs, out)
        try:
            conn = await self._connection(server.data_address)
        except Unavailable as err:
            return [err] * len(specs)
        if conn.shm is None:  # the server refused our shared buffer
            return await conn.submit(specs, out, asyncio.get_running_loop())
        regions = self._regions[id(conn)]
        region = await regions.get()
        try:
            return await conn.submit(specs, out, asyncio.get_running_loop(), region)
        finally:
            regions.put_nowait(region)


class WriteSlots:
    """Chunks being written, gathered into page-aligned slots of one SharedArena
    that every chunkserver on this host maps (its descriptor passed on each local
    write connection): each local replica copies a chunk straight out of its slot
    (WRITE_SHM), and none of it crosses a socket."""

    def __init__(self, slot_bytes: int, slots: int):
        self.slot_bytes = -(-slot_bytes // 4096) * 4096
        self.arena = SharedArena(self.slot_bytes * slots)
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(slots):
            if self.arena.allocate(self.slot_bytes) is None:  # memory refused: fewer slots
                break
            self._free.put_nowait(i)

    async def take(self) -> int:
        return await self._free.get()

    def give(self, slot: int) -> None:
        self._free.put_nowait(slot)

    def view(self, slot: int, length: int) -> memoryview:
        return memoryview(self.arena.map)[slot * self.slot_bytes : slot * self.slot_bytes + length]

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes


class DataWriter(TcpTransport):
    """Chunk writes over the data port (wire.WRITE): `connections` per server of
    their own, so a write's megabytes never sit between a restore's request and
    the server on one socket; a server on this host through its local socket
    (`local`), its chunks out of the write slots (WRITE_SHM), the others over TCP
    (mutual TLS with `tls`)."""

    name = "data port"
    MAX_SLOTS_BYTES = 64 << 20  # the write slots' memory file, at most

    def __init__(self, connections: int = 4, tls: ssl.SSLContext | None = None, local: bool = True,
                 sender: Executor | None = None):
        super().__init__(connections, tls)
        self.use_local = local
        self.sender = sender  # the threads that send WRITE frames (None: the loop's default executor)
        self.slots: WriteSlots | None = None
        self._local: dict[str, bool] = {}

    def is_local(self, address: str) -> bool:
        """Whether writes to the data port at `address` take its local socket."""
        if address not in self._local:
            self._local[address] = self.use_local and is_local(address)
        return self._local[address]

    def write_slots(self, chunk_bytes: int, count: int) -> WriteSlots | None:
        """The write slots, made on first use for chunks of up to `chunk_bytes`, or
        None when chunks are too large for them (or local writes are off)."""
        if self.slots is None and self.use_local and chunk_bytes * min(count, 2) <= self.MAX_SLOTS_BYTES:
            self.slots = WriteSlots(chunk_bytes, max(1, min(count, self.MAX_SLOTS_BYTES // chunk_bytes)))
        return self.slots if self.slots is not None and chunk_bytes <= self.slots.slot_bytes else None

    def _open(self, address: str, arena) -> _Connection:
        local = self.is_local(address)
        return _Connection(address, 0, None, self.tls, local, self.slots.arena if local and self.slots else None)

    async def write(self, address: str, chunk_id: bytes, data, checksum: int, owner: bytes = b"",
                    timeout: float = 60, slot: int | None = None) -> tuple[bool, bytes]:
        """Stores one chunk on the server whose data port is `address`: (created,
        receipt). `slot`: the write slot `data` lies in, for a WRITE_SHM where the
        connection has the slots mapped. Unavailable when the port cannot be reached
        or the connection fails (the caller may write over gRPC instead); the
        server's own refusals come back as their kvfs.errors types."""
        conn = await self._connection(address)
        loop = asyncio.get_running_loop()
        rid, future = conn.expect_write(loop)
        at = self.slots.offset(slot) if slot is not None and conn.write_mapping is not None else None
        if not future.done():
            await loop.run_in_executor(self.sender, conn.send_write, rid, chunk_id, memoryview(data).cast("B"),
                                       checksum, owner, at)
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"write of chunk {chunk_id.hex()[:16]} to {address}: no answer within "
                                   f"{timeout:.0f} s") from None
        if isinstance(result, KvfsError):
            raise result
        return result

    async def close(self) -> None:
        await super().close()
        if self.slots is not None:
            self.slots.arena.close()
