"""The bulk data path: kvfs/wire.py frames on the chunkserver's data port.

One thread per connection (socketserver), blocking sockets, requests served in
the order they arrive (a client pipelines many and opens a few connections).
Memory per connection is bounded: one request body (<= wire.MAX_BODY) and, in
direct mode, the aligned buffers of one request (<= max_read_bytes), which wait
for room among all connections' (BufferBudget, data_read_buffers); a WRITE's
aligned buffer (<= max_chunk_size) waits likewise under data_write_buffers. Time and
slots are bounded too: a request must arrive whole within `data_request_timeout`
of its first byte (a connection may idle IDLE_TIMEOUT between requests), a
client that stops reading is cut off after SEND_TIMEOUT, and one client host
holds at most `data_peer_connections` of the MAX_CONNECTIONS slots, and the last
quarter of them only go to hosts holding few (NEWCOMER_SLOTS): a host that opens
connections and sends half a header holds them seconds, not minutes, and neither
it nor a few such hosts together hold all of them.

  buffered mode: the reply header, then every range straight from the page cache
                 with sendfile(2): the bytes never enter this process;
  direct mode:   every range of a request read together through io_uring into
                 pooled aligned buffers, then sent from them;
  shm:           a client on the same host connects to the port's local socket (an
                 abstract Unix socket, wire.local_socket_name) and passes the
                 descriptors of its sealed memory files (SCM_RIGHTS): the server
                 maps only what the client could open itself, and only files that
                 can never shrink under the mapping. READ_SHM ranges are read from
                 disk straight into them (preadv, since the io_uring binding reads
                 only into bytearrays) and the socket carries only requests and
                 completions. Local connections count against a per-user limit
                 (SO_PEERCRED) as remote ones count per host.

Writes: a WRITE frame announces one chunk (id, length, checksum, owner record);
its bytes follow. The owner record's seal and the size are checked before any
byte of it is read (a refused WRITE is answered STATUS and its connection
closed: its bytes are already on the way); then they are received straight
into a page-aligned buffer that O_DIRECT writes from without another copy,
checked against the writer's checksum, and stored by the same group commit as
gRPC's WriteChunk, all on the connection's own thread (ChunkStore.store_chunk:
no turn of the event loop per chunk), which runs at `write_nice` once it has
carried a write. The receipt comes back in WRITE_REPLY.

The server sends each range widened to whole 64 KiB blocks with their stored
checksums, and the client verifies them before handing anything over: the
server never touches the bytes it sends from the page cache.
"""

from __future__ import annotations

import array
import concurrent.futures
import fcntl
import logging
import mmap
import os
import socket
import socketserver
import ssl
import stat
import struct
import threading
import time
from typing import TYPE_CHECKING

from kvfs import tls, wire
from kvfs.buffers import PAGE, address_of, memmove
from kvfs.errors import KvfsError, PermissionDenied
from kvfs.grants import require_owner, require_read_grant, write_receipt
from kvfs.priority import lower_thread_priority

from .store import ChunkStore, PlannedRead, short_id

if TYPE_CHECKING:  # metrics.py imports this module
    from .metrics import ChunkMetrics

log = logging.getLogger(__name__)

MAX_SHM = 4 << 30
FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)  # one descriptor per receive; the kernel closes extras
MAX_CONNECTIONS = 256
# The last quarter of the slots is kept for hosts holding few connections: past
# MAX_CONNECTIONS - NEWCOMER_SLOTS open, a host holding NEWCOMER_CONNECTIONS or more
# gets no other, so a few hosts at their data_peer_connections each never hold every slot
NEWCOMER_SLOTS = MAX_CONNECTIONS // 4
NEWCOMER_CONNECTIONS = 8
SEND_TIMEOUT = 30.0
IDLE_TIMEOUT = 600.0
TLS_READ = 1 << 20  # bytes read from the page cache at a time for a TLS connection (no sendfile through TLS)


class BufferBudget:
    """The bytes of buffers data-port requests hold, over all connections (one
    budget for direct-mode reads, one for writes): a request waits until its
    buffers fit under `total`, and under a quarter of it for its peer (a host, or a
    local user), so clients that stop reading (holding a request's buffers for up
    to SEND_TIMEOUT) or send a write's bytes slowly cannot take them all. A request
    with nothing else held beside it (by anyone, or by its peer) always fits."""

    def __init__(self, total: int):
        self.total = total
        self.peer_share = max(1, total // 4)
        self.used = 0
        self.by_peer: dict[str, int] = {}
        self._room = threading.Condition()

    def _fits(self, peer: str, n: int) -> bool:
        mine = self.by_peer.get(peer, 0)
        return (not self.used or self.used + n <= self.total) and (not mine or mine + n <= self.peer_share)

    def acquire(self, peer: str, n: int, deadline: float) -> bool:
        """Holds n bytes for `peer`, waiting until `deadline` (time.monotonic()) at most."""
        with self._room:
            while not self._fits(peer, n):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(left)
            self.used += n
            self.by_peer[peer] = self.by_peer.get(peer, 0) + n
            return True

    def release(self, peer: str, n: int) -> None:
        with self._room:
            self.used -= n
            self.by_peer[peer] -= n
            if not self.by_peer[peer]:
                del self.by_peer[peer]
            self._room.notify_all()


class _Closed(Exception):
    pass


def _unsafe_to_map(fd: int, size: int) -> str | None:
    """Why a client's memory file must not be mapped (None: it may). The server
    writes into the mapping and verifies the bytes there: a file that could
    shrink would make those accesses fault (SIGBUS) and kill the server."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular memory file"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "a file that cannot be sealed; pass a memfd made with MFD_ALLOW_SEALING"
    if not seals & fcntl.F_SEAL_SHRINK:
        return "not sealed against shrinking (F_SEAL_SHRINK): it could be truncated under the mapping"
    if os.fstatvfs(fd).f_bsize != mmap.PAGESIZE:
        return "not in ordinary pages (hugetlbfs can fault when its pool runs dry)"
    if not 0 < size <= min(st.st_size, MAX_SHM):
        return f"{size} bytes asked for, of a {st.st_size}-byte file (at most {MAX_SHM})"
    return None


def _aligned(address: int, length: int) -> bool:
    return address % 512 == 0 and length % 512 == 0


def _fail_range(reply: wire.RangeResult, code: int, message: str) -> None:
    reply.code, reply.message = code, message
    reply.data_start = reply.data_len = 0
    reply.checksums = ()


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    if isinstance(sock, ssl.SSLSocket):  # a kernel timeout would leave the TLS layer retrying forever
        sock.settimeout(seconds)
        return
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None, fds: list[int] | None = None) -> bytes:
    """n bytes; with `deadline` (time.monotonic()), BlockingIOError once it passes
    first, however the bytes trickle in (the socket's receive timeout is set to
    what is left before each receive). With `fds` (a local socket), descriptors
    that come with the bytes are appended to it."""
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline, fds)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None,
               fds: list[int] | None = None) -> None:
    """Fills `view` from the socket, as _recv_exact."""
    n = len(view)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlockingIOError("request deadline passed")
            _set_recv_timeout(sock, max(left, 0.001))
        if fds is None:
            try:
                k = sock.recv_into(view[got:], n - got)
            except TimeoutError:  # a TLS socket's timeout: as the kernel's on a plain one
                raise BlockingIOError("receive timed out") from None
        else:
            k, ancillary, _, _ = sock.recvmsg_into([view[got:]], FD_SPACE)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            while len(fds) > 2:  # more than one with a request is refused anyway: hold no more
                os.close(fds.pop())
        if k == 0:
            raise _Closed()
        got += k


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class _Handler(socketserver.BaseRequestHandler):
    server: DataServer

    def setup(self) -> None:
        self.store = self.server.store
        self.maps: dict[int, mmap.mmap] = {}  # registered shared buffers, by mapping index
        self.sock: socket.socket = self.request
        self.local = self.sock.family == socket.AF_UNIX
        self.fds: list[int] = []  # descriptors received with the request being read (local socket only)
        self.ahead = 0  # the read backlog the request being served found (told in its reply)
        self.reads = self.server.reads["local" if self.local else "tcp"]
        self.shm_reads = self.server.reads["shm"]
        self.tls = not self.local and self.server.tls is not None
        self.writes = False  # has this connection carried a write (its thread then runs at write_nice)
        if self.local:
            self.peer, self.client_address = local_peer(self.sock)
        else:
            self.peer = self.client_address[0]  # its host: what connections and read buffers are counted by
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        if self.tls:  # the handshake is handle()'s, within the request deadline
            self.sock = self.server.tls.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
        # blocking syscalls with kernel timeouts: a Python-level timeout would put
        # a poll() before every send and sendfile
        self.sock.settimeout(None)
        _set_recv_timeout(self.sock, IDLE_TIMEOUT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0))

    def _handshake(self) -> bool:
        """TLS over TCP: the caller must present a certificate of the cluster's CA with
        a role (auth.DATA_PORT_RULES), within the request deadline."""
        try:
            self.sock.settimeout(self.server.request_timeout)
            self.sock.do_handshake()
            caller = tls.socket_identity(self.sock)
        except (OSError, ValueError) as err:  # ssl.SSLError and timeouts are OSErrors
            log.warning("data port: TLS handshake with %s failed (%s); closing", self.client_address, err)
            self.store.counters.rejected_requests += 1
            return False
        if caller is None or not caller.roles:
            log.warning("data port: %s presented a certificate with no role (%s); closing", self.client_address,
                        caller)
            self.store.counters.rejected_requests += 1
            return False
        self.client_address = f"{self.client_address[0]} {caller}"
        return True

    def handle(self) -> None:
        if self.tls and not self._handshake():
            return
        peer = self.client_address
        try:
            while True:
                fds = self.fds if self.local else None
                if self.tls:
                    _set_recv_timeout(self.sock, IDLE_TIMEOUT)
                try:
                    first = _recv_exact(self.sock, 1, fds=fds)
                except (_Closed, BlockingIOError):
                    return  # the client closed, or stayed idle past IDLE_TIMEOUT
                request_id = 0
                try:
                    deadline = time.monotonic() + self.server.request_timeout  # the rest of it, promptly
                    try:
                        header = wire.parse_header(first + _recv_exact(self.sock, wire.HEADER.size - 1, deadline, fds))
                        arrived = time.perf_counter()
                        request_id = header.request_id
                        body = _recv_exact(self.sock, header.body_len, deadline, fds)
                    except BlockingIOError:
                        log.warning("data port: %s sent part of a request and nothing more for %.0f s; closing",
                                    peer, self.server.request_timeout)
                        self.store.counters.rejected_requests += 1
                        return
                    # the next request may be a while; over TLS the timeout also bounds the sends
                    _set_recv_timeout(self.sock, SEND_TIMEOUT if self.tls else IDLE_TIMEOUT)
                    if header.kind == wire.SHM_REGISTER:
                        self._register_shm(header, body)
                    elif header.kind in (wire.WRITE, wire.WRITE_SHM):
                        if not self.writes:  # a connection that writes is a writer's (the SDK keeps them apart)
                            self.writes = True
                            lower_thread_priority(self.store.cfg.write_nice)
                        self._write(header, arrived, wire.parse_write(header, body), deadline)
                    else:
                        self._read(header, arrived, *wire.parse_read(header, body))
                    _close_all(self.fds)  # descriptors sent with anything but SHM_REGISTER
                except wire.WireError as err:
                    self.store.counters.rejected_requests += 1
                    log.warning("data port: malformed request from %s: %s; closing", peer, err.message)
                    self.sock.sendall(wire.encode_status(request_id, err.code, err.message))
                    return
        except (_Closed, OSError) as err:  # the client vanished or stopped reading
            log.info("data port: connection from %s ended: %s", peer, err.__class__.__name__)
        finally:
            _close_all(self.fds)
            for m in self.maps.values():
                m.close()

    # ---- shared memory -----------------------------------------------------

    def _register_shm(self, header: wire.Header, body: bytes) -> None:
        size = wire.parse_shm_register(header, body)
        if not self.local:
            raise wire.WireError("SHM_REGISTER is served on the chunkserver's local socket only, the memory "
                                 "file passed by descriptor", code=9)
        if header.flags >= wire.MAX_MAPPINGS:
            raise wire.WireError(f"mapping {header.flags}: at most {wire.MAX_MAPPINGS} per connection")
        if len(self.fds) != 1:
            raise wire.WireError("SHM_REGISTER needs exactly one memory file's descriptor sent with it "
                                 f"(SCM_RIGHTS), not {'none' if not self.fds else 'several'}")
        fd = self.fds.pop()
        try:
            refused = _unsafe_to_map(fd, size)
            if refused is None:
                shm = mmap.mmap(fd, size)
        except OSError as err:
            refused = f"cannot map it: {err.strerror}"
        finally:
            os.close(fd)
        if refused is not None:
            self.store.counters.rejected_requests += 1
            log.warning("data port: shared buffer from %s refused: %s", self.client_address, refused)
            self.sock.sendall(wire.encode_status(header.request_id, 9, f"shared buffer refused: {refused}"))
            return
        old = self.maps.pop(header.flags, None)
        if old is not None:
            old.close()
        self.maps[header.flags] = shm
        self.sock.sendall(wire.encode_status(header.request_id, 0, ""))

    # ---- writes ------------------------------------------------------------

    def _refusal(self, header: wire.Header, req: wire.WriteRequest) -> tuple[int, str] | None:
        """Why a write must not be stored, from what it announced: (code, message), or None."""
        store, key = self.store, self.server.cluster_key
        if req.length > store.cfg.max_chunk_size:
            return 3, (f"chunk {short_id(req.chunk_id)}: {req.length} bytes; this server stores chunks of at most "
                       f"{store.cfg.max_chunk_size}")
        if header.kind == wire.WRITE_SHM:
            mapped = self.maps.get(req.mapping)
            if mapped is None:
                return 9, f"WRITE_SHM from mapping {req.mapping}, which is not registered (SHM_REGISTER)"
            if req.offset + req.length > len(mapped):
                return 3, (f"WRITE_SHM of {req.length} bytes at {req.offset}: past the end of the "
                           f"{len(mapped)}-byte mapping")
        if key is not None:  # the data port knows no caller: with a key, every write needs its owner seal
            try:
                require_owner(key, req.owner, req.chunk_id)
            except PermissionDenied as err:
                return err.code.value[0], err.message
        return None

    def _write(self, header: wire.Header, arrived: float, req: wire.WriteRequest, deadline: float) -> None:
        """Stores a WRITE's bytes, received into an aligned buffer, or a WRITE_SHM's,
        copied there from the writer's mapping (within the request's deadline, as its
        header and body); answers WRITE_REPLY. A refused WRITE is answered STATUS and
        its connection closed: its bytes are on their way, and the stream cannot be
        kept in step without reading them."""
        store, rid = self.store, header.request_id
        refused = self._refusal(header, req)
        size = max(2 * PAGE, -(-req.length // PAGE) * PAGE)  # O_DIRECT writes whole pages from it
        budget = self.server.write_buffers
        if refused is None and not budget.acquire(self.peer, size, deadline):
            refused = 8, (f"no room among the write buffers (data_write_buffers: {budget.used} of {budget.total} "
                          f"bytes held) within the request deadline; retry")
        if refused is not None:
            self._refuse(header, *refused)
            return
        code, message, created, receipt = 0, "", False, b""
        try:
            buf = store.get_buffer(size)
            try:
                view = memoryview(buf)[: req.length]
                if header.kind == wire.WRITE_SHM:
                    memmove(address_of(view), address_of(self.maps[req.mapping]) + req.offset, req.length)
                else:
                    try:
                        _recv_into(self.sock, view, deadline)
                    except BlockingIOError:
                        self._refuse(header, 4, f"chunk {short_id(req.chunk_id)}: its {req.length} bytes did not "
                                                f"arrive within the request deadline")
                code, message, created, receipt = self._store(req, view)
            finally:
                store.put_buffer(buf)
        finally:
            budget.release(self.peer, size)
        self.sock.sendall(wire.encode_write_reply(rid, code, message, created, receipt))
        self.server.write_seconds["local" if self.local else "tcp"].observe(time.perf_counter() - arrived)

    def _refuse(self, header: wire.Header, code: int, message: str) -> None:
        self.store.counters.rejected_requests += 1
        if header.kind == wire.WRITE_SHM:  # nothing follows its body: the connection goes on
            log.warning("data port: write from %s refused: %s", self.client_address, message)
            self.sock.sendall(wire.encode_write_reply(header.request_id, code, message))
            return
        log.warning("data port: write from %s refused: %s; closing", self.client_address, message)
        self.sock.sendall(wire.encode_status(header.request_id, code, message))
        raise _Closed()

    def _store(self, req: wire.WriteRequest, view: memoryview) -> tuple[int, str, bool, bytes]:
        """Stores the chunk on this connection's thread: (code, message, created, receipt)."""
        key = self.server.cluster_key
        try:
            created = self.store.store_chunk(req.chunk_id, view, req.checksum, req.owner)
        except KvfsError as err:
            log.warning("data port: write from %s: %s", self.client_address, err.message)
            return err.code.value[0], err.message, False, b""
        receipt = write_receipt(key, req.chunk_id, req.checksum, self.store.cfg.id) if key is not None else b""
        return 0, "", created, receipt

    # ---- reads -------------------------------------------------------------

    def _read(self, header: wire.Header, arrived: float, grant: bytes, ranges: list[wire.Range]) -> None:
        """Answers a READ or READ_SHM that arrived (its header read) at `arrived` (perf_counter)."""
        shm = header.kind == wire.READ_SHM
        if shm and any(r.mapping not in self.maps for r in ranges):
            raise wire.WireError("READ_SHM into a mapping not registered with SHM_REGISTER", code=9)
        reads = self.shm_reads if shm else self.reads
        key = self.server.cluster_key  # the data port knows no caller: with a key, every read needs its grant
        try:
            granted = require_read_grant(key, grant, time.time()) if key is not None else None
            results, plan = self.store.plan_reads([(r.chunk_id, r.offset, r.length) for r in ranges],
                                                  granted.namespace if granted else None)
        except KvfsError as err:
            if isinstance(err, PermissionDenied):
                self.store.counters.rejected_requests += 1
                log.warning("data port: read from %s without a valid read grant; refused", self.client_address)
            else:
                log.warning("data port: read from %s refused: %s", self.client_address, err.message)
            self.sock.sendall(wire.encode_status(header.request_id, err.code.value[0], err.message))
            reads.served(0, time.perf_counter() - arrived)
            return
        taken = 0
        try:
            replies = [wire.RangeResult(r.code.value[0], r.message) for r in results]
            served: list[tuple[PlannedRead, int, int]] = []
            for p in plan:
                start, length = wire.widen(p.offset, p.length, p.rec.length)
                replies[p.index] = wire.RangeResult(0, "", start, length, p.rec.length, tuple(p.rec.blocks))
                served.append((p, start, length))
            taken = sum(length for _, _, length in served)
            self.ahead = self.server.take_read(taken)  # told in the reply's header
            if granted is not None:  # its tenant's pace: only this connection waits
                time.sleep(self.store.pacer.delay(granted.tenant, taken))
            if shm:
                nbytes = self._read_into_shm(header, ranges, replies, served)
            elif self.store.io_mode == "buffered":
                self.sock.sendall(wire.encode_read_reply(header.request_id, replies, self.ahead))
                nbytes = 0
                for p, start, length in served:
                    self._sendfile(self.store.slots.fds(p.rec.slot).fd_io, p.rec.slot.offset + start, length)
                    self.store.count_read(length)
                    nbytes += length
            else:
                nbytes = self._send_direct(header, replies, served)
        finally:
            self.server.read_sent(taken)
            self.store.release(plan)
        reads.served(nbytes, time.perf_counter() - arrived)

    def _sendfile(self, fd: int, offset: int, count: int) -> None:
        if self.tls:  # the bytes must pass through the TLS layer: read into a pooled buffer, encrypt, send
            buf = self.store.get_buffer(TLS_READ)
            try:
                with memoryview(buf) as view:
                    while count:
                        got = os.preadv(fd, [view[: min(count, TLS_READ)]], offset)
                        if not got:
                            raise _Closed()
                        self.sock.sendall(view[:got])
                        offset += got
                        count -= got
            finally:
                self.store.put_buffer(buf)
            return
        out = self.sock.fileno()
        while count:
            sent = os.sendfile(out, fd, offset, count)
            if sent == 0:
                raise _Closed()
            offset += sent
            count -= sent

    def _send_direct(self, header, replies, served) -> int:
        """Reads the ranges through the store's reader, sends them; the bytes sent.
        Their buffers wait for room among everyone's (BufferBudget) first."""
        need = sum(self.store.buffer_bytes(p) for p, _, _ in served)
        budget = self.server.read_buffers
        if not budget.acquire(self.peer, need, time.monotonic() + self.server.request_timeout):
            log.warning("data port: a read of %d bytes from %s found no room among the read buffers (%d of %d held, "
                        "%d by its host) within %.0f s; refused", need, self.client_address, budget.used,
                        budget.total, budget.by_peer.get(self.peer, 0), self.server.request_timeout)
            self.store.counters.rejected_requests += 1
            self.sock.sendall(wire.encode_status(header.request_id, 8, "the chunkserver's read buffers are all in "
                                                 "use (data_read_buffers); retry"))
            return 0
        try:
            return self._read_and_send(header, replies, served)
        finally:
            budget.release(self.peer, need)

    def _read_and_send(self, header, replies, served) -> int:
        ops = self.store.disk_reads([p for p, _, _ in served])
        nbytes = 0
        try:
            done = self.store.reader.read_batch(ops).result() if ops else []
            for (p, _, length), got in zip(served, done):
                if got < length:
                    _fail_range(replies[p.index], 13, f"chunk {short_id(p.chunk_id)}: disk read failed ({got})")
                    log.error("data port: %s", replies[p.index].message)
            self.sock.sendall(wire.encode_read_reply(header.request_id, replies, self.ahead))
            for (p, _, length), (_, _, buf) in zip(served, ops):
                if replies[p.index].code == 0:
                    self.sock.sendall(memoryview(buf)[:length])
                    self.store.count_read(length)
                    nbytes += length
        finally:
            for _, _, buf in ops:
                self.store.put_buffer(buf)
        return nbytes

    def _read_into_shm(self, header, ranges, replies, served) -> int:
        """Reads the ranges into the client's mappings; the bytes that landed verified."""
        # every range of the request is read at once (preadv in the server's pool,
        # which drops the GIL): the disk sees the whole batch, as io_uring would
        views = {k: memoryview(m) for k, m in self.maps.items()}
        try:
            jobs = [self.server.pool.submit(self._one_into_shm, views[ranges[p.index].mapping],
                                            ranges[p.index].pieces, p, start, length, replies[p.index])
                    for p, start, length in served]
            nbytes = sum(job.result() for job in jobs)
        finally:
            for v in views.values():
                v.release()
        self.sock.sendall(wire.encode_read_reply(header.request_id, replies, self.ahead))
        return nbytes

    def _one_into_shm(self, view: memoryview, pieces, p: PlannedRead, start: int, length: int,
                      reply: wire.RangeResult) -> int:
        """Reads the widened range [start, start + length): the requested bytes into
        the pieces of the client's mapping, the widening into scratch; verifies all.
        Returns the bytes read and verified (0: the range failed)."""
        if any(off + n > len(view) for off, n in pieces):
            _fail_range(reply, 3, "a piece lies outside the registered shared buffer")
            return 0
        if p.length != sum(n for _, n in pieces):
            _fail_range(reply, 3, f"pieces hold {sum(n for _, n in pieces)} bytes, the range {p.length}")
            return 0
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
                return length
            return 0
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

    def __init__(self, address: tuple[str, int], store: ChunkStore, metrics: ChunkMetrics,
                 request_timeout: float = 10.0, peer_connections: int = 64,
                 cluster_key: bytes | None = None, tls_context: ssl.SSLContext | None = None):
        self.store = store
        self.tls = tls_context  # TCP connections speak mutual TLS; None: --insecure, plaintext
        self.read_buffers = BufferBudget(store.cfg.data_read_buffers)
        self.write_buffers = BufferBudget(store.cfg.data_write_buffers)
        self.write_seconds = metrics.write_seconds  # by transport: "tcp", "local" (and "grpc", not ours)
        self.reads = metrics.reads  # by transport (metrics.TRANSPORTS)
        self.cluster_key = cluster_key  # checks read grants; None: --insecure, none asked for
        self.request_timeout = request_timeout
        self.peer_connections = peer_connections
        self.pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="shm-read")
        self._open: dict[socket.socket, str] = {}  # connection -> its peer's host
        self._per_peer: dict[str, int] = {}
        self.refused = 0  # connections turned away by the limits
        self.read_backlog = 0  # bytes of reads taken and not yet sent, from every connection
        self._lock = threading.Lock()
        self.local: LocalDataServer | None = None
        super().__init__(address, _Handler)

    def verify_request(self, request, client_address) -> bool:
        return self.admit(request, client_address[0])

    def take_read(self, nbytes: int) -> int:
        """A read of `nbytes` is being served: the backlog it found ahead of it."""
        with self._lock:
            ahead = self.read_backlog
            self.read_backlog += nbytes
        return ahead

    def read_sent(self, nbytes: int) -> None:
        with self._lock:
            self.read_backlog -= nbytes

    def admit(self, request, peer: str) -> bool:
        """Counts a new connection against MAX_CONNECTIONS and its peer's share
        (a host, or on the local socket a user); False: refused."""
        with self._lock:
            if len(self._open) >= MAX_CONNECTIONS:
                log.warning("data port: refusing %s: %d connections open", peer, len(self._open))
                self.refused += 1
                return False
            held = self._per_peer.get(peer, 0)
            if held >= self.peer_connections:
                log.warning("data port: refusing another connection from %s: it holds %d already "
                            "(data_peer_connections)", peer, held)
                self.refused += 1
                return False
            if len(self._open) >= MAX_CONNECTIONS - NEWCOMER_SLOTS and held >= NEWCOMER_CONNECTIONS:
                log.warning("data port: refusing another connection from %s: it holds %d and %d of %d slots are "
                            "taken; the rest are kept for hosts holding fewer than %d", peer, held,
                            len(self._open), MAX_CONNECTIONS, NEWCOMER_CONNECTIONS)
                self.refused += 1
                return False
            self._open[request] = peer
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            return True

    def shutdown_request(self, request) -> None:
        self.release(request)
        super().shutdown_request(request)

    def release(self, request) -> None:
        with self._lock:
            peer = self._open.pop(request, None)
            if peer is not None:
                self._per_peer[peer] -= 1
                if not self._per_peer[peer]:
                    del self._per_peer[peer]

    def connections(self) -> tuple[int, int]:
        """Connections open now: (over TCP, on the local socket)."""
        with self._lock:
            local = sum(s.family == socket.AF_UNIX for s in self._open)
            return len(self._open) - local, local

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def listen_local(self, address: str) -> None:
        """Also serves on the local socket of the port as advertised at `address`."""
        self.local = LocalDataServer(wire.local_socket_name(address), self)
        threading.Thread(target=self.local.serve_forever, args=(0.1,), name="data-port-local", daemon=True).start()
        log.info("data port: local socket for %s open (shared memory by descriptor)", address)

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.shutdown()
        super().shutdown()

    def server_close(self) -> None:
        if self.local is not None:
            self.local.server_close()
        super().server_close()


def local_peer(sock: socket.socket) -> tuple[str, str]:
    """Who is at the other end of a local socket, from the kernel (SO_PEERCRED):
    (the user its connections are counted against, a description for logs)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return f"local uid {uid}", f"local uid {uid} pid {pid}"


class LocalDataServer(socketserver.ThreadingUnixStreamServer):
    """The data port's local socket: the same requests (and SHM_REGISTER, which
    only this socket can carry), the same limits, counted per user."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, name: str, port: DataServer):
        self.port = port
        self.store, self.cluster_key, self.pool, self.reads = port.store, port.cluster_key, port.pool, port.reads
        self.write_seconds = port.write_seconds
        self.tls = None  # the kernel vouches for a local peer; nothing on the local socket leaves the host
        self.read_buffers, self.write_buffers = port.read_buffers, port.write_buffers
        self.request_timeout = port.request_timeout
        self.take_read, self.read_sent = port.take_read, port.read_sent  # one backlog for both sockets
        super().__init__(name, _Handler)

    def verify_request(self, request, client_address) -> bool:
        return self.port.admit(request, local_peer(request)[0])

    def shutdown_request(self, request) -> None:
        self.port.release(request)
        super().shutdown_request(request)


def start_data_server(listen: str, store: ChunkStore, metrics: ChunkMetrics, request_timeout: float = 10.0,
                      peer_connections: int = 64,
                      cluster_key: bytes | None = None, credentials: tls.Credentials | None = None) -> DataServer:
    host, port = listen.rsplit(":", 1)
    server = DataServer((host, int(port)), store, metrics, request_timeout, peer_connections, cluster_key,
                        credentials.ssl_context(server=True) if credentials is not None else None)
    threading.Thread(target=server.serve_forever, args=(0.1,), name="data-port", daemon=True).start()
    log.info("data port serving on %s (%s reads, writes; TCP %s)", server.address,
             "sendfile" if store.io_mode == "buffered" else "io_uring",
             "over mutual TLS" if credentials is not None else "in PLAINTEXT (--insecure)")
    return server
