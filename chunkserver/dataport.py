"""The bulk read path: kvfs/wire.py frames on the chunkserver's data port.

One thread per connection (socketserver), blocking sockets, requests served in
the order they arrive (a client pipelines many and opens a few connections).
Memory per connection is bounded: one request body (<= wire.MAX_BODY) and, in
direct mode, the aligned buffers of one request (<= max_read_bytes). Time and
slots are bounded too: a request must arrive whole within `data_request_timeout`
of its first byte (a connection may idle IDLE_TIMEOUT between requests), a
client that stops reading is cut off after SEND_TIMEOUT, and one client host
holds at most `data_peer_connections` of the MAX_CONNECTIONS slots: a host that
opens connections and sends half a header holds them seconds, not minutes, and
never all of them.

  buffered mode: the reply header, then every range straight from the page cache
                 with sendfile(2): the bytes never enter this process;
  direct mode:   every range of a request read together through io_uring into
                 pooled aligned buffers, then sent from them;
  shm:           a client on the same host registers a /dev/shm file; READ_SHM
                 ranges are read from disk straight into it (preadv, since the
                 io_uring binding reads only into bytearrays) and the socket
                 carries only requests and completions.

The server sends each range widened to whole 64 KiB blocks with their stored
checksums, and the client verifies them before handing anything over: the
server never touches the bytes it sends from the page cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import os
import socket
import socketserver
import struct
import threading
import time

from kvfs import wire
from kvfs.buffers import PAGE, address_of
from kvfs.errors import KvfsError, PermissionDenied
from kvfs.grants import require_read_grant

from .store import ChunkStore, PlannedRead, short_id

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvfs-"
MAX_SHM = 4 << 30
MAX_CONNECTIONS = 256
SEND_TIMEOUT = 30.0
IDLE_TIMEOUT = 600.0


class _Closed(Exception):
    pass


def _aligned(address: int, length: int) -> bool:
    return address % 512 == 0 and length % 512 == 0


def _fail_range(reply: wire.RangeResult, code: int, message: str) -> None:
    reply.code, reply.message = code, message
    reply.data_start = reply.data_len = 0
    reply.checksums = ()


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """n bytes; with `deadline` (time.monotonic()), BlockingIOError once it passes
    first, however the bytes trickle in (the socket's receive timeout is set to
    what is left before each receive)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlockingIOError("request deadline passed")
            _set_recv_timeout(sock, max(left, 0.001))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise _Closed()
        got += k
    return bytes(buf)


class _Handler(socketserver.BaseRequestHandler):
    server: DataServer

    def setup(self) -> None:
        self.store = self.server.store
        self.maps: dict[int, mmap.mmap] = {}  # registered shared buffers, by mapping index
        self.sock: socket.socket = self.request
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        # blocking syscalls with kernel timeouts: a Python-level timeout would put
        # a poll() before every send and sendfile
        self.sock.settimeout(None)
        _set_recv_timeout(self.sock, IDLE_TIMEOUT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0))

    def handle(self) -> None:
        peer = self.client_address
        try:
            while True:
                try:
                    first = _recv_exact(self.sock, 1)
                except (_Closed, BlockingIOError):
                    return  # the client closed, or stayed idle past IDLE_TIMEOUT
                request_id = 0
                try:
                    deadline = time.monotonic() + self.server.request_timeout  # the rest of it, promptly
                    try:
                        header = wire.parse_header(first + _recv_exact(self.sock, wire.HEADER.size - 1, deadline))
                        request_id = header.request_id
                        body = _recv_exact(self.sock, header.body_len, deadline)
                    except BlockingIOError:
                        log.warning("data port: %s sent part of a request and nothing more for %.0f s; closing",
                                    peer, self.server.request_timeout)
                        self.store.counters.rejected_requests += 1
                        return
                    _set_recv_timeout(self.sock, IDLE_TIMEOUT)
                    if header.kind == wire.SHM_REGISTER:
                        self._register_shm(header, body)
                    else:
                        self._read(header, *wire.parse_read(header, body))
                except wire.WireError as err:
                    self.store.counters.rejected_requests += 1
                    log.warning("data port: malformed request from %s: %s; closing", peer, err.message)
                    self.sock.sendall(wire.encode_status(request_id, err.code, err.message))
                    return
        except (_Closed, OSError) as err:  # the client vanished or stopped reading
            log.info("data port: connection from %s ended: %s", peer, err.__class__.__name__)
        finally:
            for m in self.maps.values():
                m.close()

    # ---- shared memory -----------------------------------------------------

    def _register_shm(self, header: wire.Header, body: bytes) -> None:
        path, size = wire.parse_shm_register(header, body)
        if header.flags >= wire.MAX_MAPPINGS:
            raise wire.WireError(f"mapping {header.flags}: at most {wire.MAX_MAPPINGS} per connection")
        name = os.path.basename(path)
        if os.path.dirname(path) != SHM_DIR or not name.startswith(SHM_PREFIX) or not 0 < size <= MAX_SHM:
            raise wire.WireError(f"shared buffer must be {SHM_DIR}/{SHM_PREFIX}* of 1..{MAX_SHM} bytes, "
                                 f"not {path!r} of {size}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_size != size:
                    raise wire.WireError(f"{path} is {os.fstat(fd).st_size} bytes, not {size}")
                shm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as err:
            self.sock.sendall(wire.encode_status(header.request_id, 5, f"cannot map {path}: {err.strerror}"))
            return
        old = self.maps.pop(header.flags, None)
        if old is not None:
            old.close()
        self.maps[header.flags] = shm
        self.sock.sendall(wire.encode_status(header.request_id, 0, ""))

    # ---- reads -------------------------------------------------------------

    def _read(self, header: wire.Header, grant: bytes, ranges: list[wire.Range]) -> None:
        shm = header.kind == wire.READ_SHM
        if shm and any(r.mapping not in self.maps for r in ranges):
            raise wire.WireError("READ_SHM into a mapping not registered with SHM_REGISTER", code=9)
        key = self.server.cluster_key  # the data port knows no caller: with a key, every read needs its grant
        try:
            namespace = require_read_grant(key, grant, time.time()) if key is not None else None
            results, plan = self.store.plan_reads([(r.chunk_id, r.offset, r.length) for r in ranges], namespace)
        except KvfsError as err:
            if isinstance(err, PermissionDenied):
                self.store.counters.rejected_requests += 1
                log.warning("data port: read from %s without a valid read grant; refused", self.client_address)
            self.sock.sendall(wire.encode_status(header.request_id, err.code.value[0], err.message))
            return
        try:
            replies = [wire.RangeResult(r.code.value[0], r.message) for r in results]
            served: list[tuple[PlannedRead, int, int]] = []
            for p in plan:
                start, length = wire.widen(p.offset, p.length, p.rec.length)
                replies[p.index] = wire.RangeResult(0, "", start, length, p.rec.length, tuple(p.rec.blocks))
                served.append((p, start, length))
            if shm:
                self._read_into_shm(header, ranges, replies, served)
            elif self.store.io_mode == "buffered":
                self.sock.sendall(wire.encode_read_reply(header.request_id, replies))
                for p, start, length in served:
                    self._sendfile(self.store.slots.fds(p.rec.slot).fd_io, p.rec.slot.offset + start, length)
                    self.store.count_read(length)
            else:
                self._send_direct(header, replies, served)
        finally:
            self.store.release(plan)

    def _sendfile(self, fd: int, offset: int, count: int) -> None:
        out = self.sock.fileno()
        while count:
            sent = os.sendfile(out, fd, offset, count)
            if sent == 0:
                raise _Closed()
            offset += sent
            count -= sent

    def _send_direct(self, header, replies, served) -> None:
        ops = self.store.disk_reads([p for p, _, _ in served])
        try:
            done = self.store.reader.read_batch(ops).result() if ops else []
            for (p, _, length), got in zip(served, done):
                if got < length:
                    _fail_range(replies[p.index], 13, f"chunk {short_id(p.chunk_id)}: disk read failed ({got})")
                    log.error("data port: %s", replies[p.index].message)
            self.sock.sendall(wire.encode_read_reply(header.request_id, replies))
            for (p, _, length), (_, _, buf) in zip(served, ops):
                if replies[p.index].code == 0:
                    self.sock.sendall(memoryview(buf)[:length])
                    self.store.count_read(length)
        finally:
            for _, _, buf in ops:
                self.store.put_buffer(buf)

    def _read_into_shm(self, header, ranges, replies, served) -> None:
        # every range of the request is read at once (preadv in the server's pool,
        # which drops the GIL): the disk sees the whole batch, as io_uring would
        views = {k: memoryview(m) for k, m in self.maps.items()}
        try:
            jobs = [self.server.pool.submit(self._one_into_shm, views[ranges[p.index].mapping],
                                            ranges[p.index].pieces, p, start, length, replies[p.index])
                    for p, start, length in served]
            for job in jobs:
                job.result()
        finally:
            for v in views.values():
                v.release()
        self.sock.sendall(wire.encode_read_reply(header.request_id, replies))

    def _one_into_shm(self, view: memoryview, pieces, p: PlannedRead, start: int, length: int,
                      reply: wire.RangeResult) -> None:
        """Reads the widened range [start, start + length): the requested bytes into
        the pieces of the client's mapping, the widening into scratch; verifies all."""
        if any(off + n > len(view) for off, n in pieces):
            _fail_range(reply, 3, "a piece lies outside the registered shared buffer")
            return
        if p.length != sum(n for _, n in pieces):
            _fail_range(reply, 3, f"pieces hold {sum(n for _, n in pieces)} bytes, the range {p.length}")
            return
        fd = self.store.slots.fds(p.rec.slot).fd_io
        head, tail = p.offset - start, start + length - p.offset - p.length
        direct = self.store.io_mode == "direct"
        span = -(-length // PAGE) * PAGE if direct else length  # O_DIRECT: whole pages
        scratch = self.store.get_buffer(2 * wire.BLOCK + PAGE)
        try:
            sv = memoryview(scratch)
            targets = [view[off : off + n] for off, n in pieces]
            iov = ([sv[:head]] if head else []) + targets + ([sv[wire.BLOCK : wire.BLOCK + tail]] if tail else [])
            # what O_DIRECT reads past the range's end (to a page) lands after the tail
            reads = iov[:-1] + [sv[wire.BLOCK : wire.BLOCK + tail + span - length]] if tail else \
                iov + ([sv[wire.BLOCK : wire.BLOCK + span - length]] if span > length else [])
            if direct and not all(_aligned(address_of(v), len(v)) for v in reads):
                got = self._bounce(fd, p.rec.slot.offset + start, span, iov)  # O_DIRECT cannot read there
            else:
                got = os.preadv(fd, reads, p.rec.slot.offset + start)
            if got < length:
                _fail_range(reply, 13, f"chunk {short_id(p.chunk_id)}: short disk read ({got})")
            elif not wire.verified(iov, reply.covering()):
                # the bytes are in the client's buffer, but it never uses a range that failed
                _fail_range(reply, 15, f"chunk {short_id(p.chunk_id)} checksum mismatch on {self.store.cfg.id}")
                self.store.count_checksum_error(p.chunk_id, p.rec)
                log.error("data port: %s; not served", reply.message)
            else:
                self.store.count_read(length)
        finally:
            self.store.put_buffer(scratch)

    def _bounce(self, fd: int, offset: int, span: int, iov: list[memoryview]) -> int:
        buf = self.store.get_buffer(max(span, 2 * PAGE))
        try:
            got = os.preadv(fd, [memoryview(buf)[:span]], offset)
            pos = 0
            for v in iov:
                v[:] = memoryview(buf)[pos : pos + len(v)]
                pos += len(v)
            return got
        finally:
            self.store.put_buffer(buf)




class DataServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], store: ChunkStore, request_timeout: float = 10.0,
                 peer_connections: int = 64, cluster_key: bytes | None = None):
        self.store = store
        self.cluster_key = cluster_key  # checks read grants; None: --insecure, none asked for
        self.request_timeout = request_timeout
        self.peer_connections = peer_connections
        self.pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="shm-read")
        self._open: dict[socket.socket, str] = {}  # connection -> its peer's host
        self._per_peer: dict[str, int] = {}
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def verify_request(self, request, client_address) -> bool:
        host = client_address[0]
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                log.warning("data port: refusing %s: %d connections open", client_address, len(self._open))
                return False
            if self._per_peer.get(host, 0) >= self.peer_connections:
                log.warning("data port: refusing %s: %s holds %d connections already (data_peer_connections)",
                            client_address, host, self._per_peer[host])
                return False
            self._open[request] = host
            self._per_peer[host] = self._per_peer.get(host, 0) + 1
            return True

    def shutdown_request(self, request) -> None:
        with self._lock:
            host = self._open.pop(request, None)
            if host is not None:
                self._per_peer[host] -= 1
                if not self._per_peer[host]:
                    del self._per_peer[host]
        super().shutdown_request(request)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"


def start_data_server(listen: str, store: ChunkStore, request_timeout: float = 10.0,
                      peer_connections: int = 64, cluster_key: bytes | None = None) -> DataServer:
    host, port = listen.rsplit(":", 1)
    server = DataServer((host, int(port)), store, request_timeout, peer_connections, cluster_key)
    threading.Thread(target=server.serve_forever, args=(0.1,), name="data-port", daemon=True).start()
    log.info("data port serving on %s (%s reads)", server.address,
             "sendfile" if store.io_mode == "buffered" else "io_uring")
    return server
