"""The bulk data protocol on a chunkserver's data port (the control plane stays gRPC).

Every frame starts with a 24-byte header, little-endian:

    magic "KVFS" | version u8 | kind u8 | flags u16 | request id u64 | count u32 | body length u32

Requests (client -> server):
  READ          grant_len u8, grant (the read grant of the lookup that found the
                chunks, kvfs/grants.py; empty for an --insecure server), then count
                ranges: id_len u8, chunk id, offset u64, length u64 (0: to the end)
  READ_SHM      as READ, each range (length > 0) followed by mapping u8, n u16 and n
                pieces (offset u64 in the mapping, length u32) that its bytes fill in order
  WRITE         one chunk, count 1: id_len u8, chunk id, length u64, checksum u64
                (kvfs/checksum.py, computed once by the writer for every replica),
                owner_len u16, owner record (the ChunkOwner the metaserver sealed
                at allocation, kvfs/grants.py; empty for an --insecure server);
                the chunk's `length` bytes follow the body (they are not in body
                length), sent only once the server cannot refuse them unseen: a
                writer sends the frame and its bytes back to back, and the server
                checks the owner record and the size before it reads any of them
  WRITE_SHM     as WRITE, then mapping u8 and offset u64: the chunk's bytes are not
                sent but lie in the writer's registered mapping at that offset
                (local socket only); the server copies them into its own buffer
                before it checks them, so the writer changing them meanwhile can
                only make its own write fail its checksum. Nothing follows the
                body, so a refused WRITE_SHM is answered WRITE_REPLY and the
                connection goes on
  SHM_REGISTER  size u64: map the memory file sent with this request as mapping `flags`
                (0: the connection's staging buffer, 1: the client's buffer arena).
                Only on the chunkserver's local socket (`local_socket_name`), the
                file passed as a descriptor (SCM_RIGHTS) with the request's bytes: a
                memfd sealed against shrinking, so it cannot be truncated under the
                server, and one the client itself could open (never a name)
Replies (server -> client), same request id:
  READ_REPLY    flags: the server's read backlog as it took the request, in MiB (at most
                65535): bytes of reads it had accepted before this one and not yet
                sent, from every client (what a worker's admission controller cannot
                see from its own side). Then count range results: code u16, msg_len
                u16, message, data start u64,
                data length u64, chunk length u64, n u32, n x xxh3-64 of every 64 KiB
                block of the chunk (they hash to its committed checksum,
                kvfs/checksum.py); for READ, the data of every OK range follows the
                body, in order; for READ_SHM it is in the shared buffer
  WRITE_REPLY   count 1: code u16, msg_len u16, message, created u8 (0: an identical
                chunk was there), receipt_len u8, receipt (what CommitBlocks shows
                the metaserver; empty from an --insecure server)
  STATUS        code u16, msg_len u16, message (SHM_REGISTER's answer, or why a
                malformed or refused request closed the connection: a WRITE
                whose bytes the server will not read is answered so and the
                connection closed, since those bytes are already on their way)

The data of a range is widened to whole 64 KiB checksum blocks (clamped to the
chunk's end): [data start, data start + data length) covers the requested
range. For READ the client checks that the block checksums hash to the chunk
checksum the metaserver committed, and every block it received against its
checksum, before any of it is handed over. For READ_SHM the server reads the widened range, puts
the requested bytes into the pieces (straight into the client's destination
when that lies in its registered arena) and the widening into its own scratch,
verifies every block, and answers DATA_LOSS (15) for a range that failed; the
client still checks the block checksums against the committed chunk checksum. Codes
are google.rpc codes (0 OK, 5 NOT_FOUND, ...).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvfs.checksum import BLOCK, blocks_covering

MAGIC = b"KVFS"
VERSION = 4  # 2: replies carry every block checksum of the chunk; 3: reads carry a read grant;
# 4: shared memory registered by descriptor on the local socket, not by path. WRITE and
# WRITE_REPLY were added within 4: a server without them answers STATUS and closes
HEADER = struct.Struct("<4sBBHQII")

READ, READ_SHM, SHM_REGISTER, WRITE, WRITE_SHM = 1, 2, 3, 4, 5
READ_REPLY, WRITE_REPLY, STATUS = 0x81, 0x82, 0x83
REQUEST_KINDS = (READ, READ_SHM, SHM_REGISTER, WRITE, WRITE_SHM)
REPLY_KINDS = (READ_REPLY, WRITE_REPLY, STATUS)

MAX_ID = 64
MAX_GRANT = 64
MAX_RANGES = 4096
MAX_PIECES = 1024  # per READ_SHM range
MAX_MAPPINGS = 2
MAX_BODY = 4 << 20  # the largest request body a server reads
MAX_MESSAGE = 1024
MAX_OWNER = 1024  # a sealed ChunkOwner is ~120 bytes
MAX_CHUNK = 64 << 20  # the most bytes a WRITE may announce (a server may accept fewer: max_chunk_size)

_RANGE = struct.Struct("<QQ")
_SHM_RANGE = struct.Struct("<QQBH")
_PIECE = struct.Struct("<QI")
_RESULT = struct.Struct("<HH")
_DATA = struct.Struct("<QQQI")
_WRITE = struct.Struct("<QQH")  # length, checksum, owner length
_WRITTEN = struct.Struct("<BB")  # created, receipt length
_IN_SHM = struct.Struct("<BQ")  # WRITE_SHM: mapping, offset
# the largest legal reply body: every range with a full message and a 64 MiB chunk's checksums
MAX_REPLY_BODY = MAX_RANGES * (_RESULT.size + MAX_MESSAGE + _DATA.size + 8 * ((64 << 20) // BLOCK))


class WireError(Exception):
    """A malformed frame; `code` is the google.rpc code to answer with."""

    def __init__(self, message: str, code: int = 3):  # 3 = INVALID_ARGUMENT
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    flags: int
    request_id: int
    count: int
    body_len: int


@dataclass(frozen=True, slots=True)
class Range:
    chunk_id: bytes
    offset: int
    length: int
    mapping: int = 0  # READ_SHM only: which registered mapping, and where in it
    pieces: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class RangeResult:
    code: int = 0
    message: str = ""
    data_start: int = 0
    data_len: int = 0
    chunk_len: int = 0
    checksums: tuple[int, ...] = ()  # every block of the chunk

    def covering(self) -> tuple[int, ...]:
        """The checksums of the blocks the data covers, in order."""
        return self.checksums[blocks_covering(self.data_start, self.data_len)]


def encode_header(kind: int, request_id: int, count: int, body_len: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, request_id, count, body_len)


def parse_header(raw: bytes | memoryview, requests: bool = True) -> Header:
    if len(raw) != HEADER.size:
        raise WireError(f"truncated header: {len(raw)} of {HEADER.size} bytes")
    magic, version, kind, flags, request_id, count, body_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a kvfs data connection")
    if version != VERSION:
        raise WireError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if requests:
        if kind not in REQUEST_KINDS:
            raise WireError(f"unknown request kind {kind}")
        if count > MAX_RANGES:
            raise WireError(f"{count} ranges in one request; at most {MAX_RANGES}")
        if body_len > MAX_BODY:
            raise WireError(f"request body of {body_len} bytes; at most {MAX_BODY}")
    elif kind not in REPLY_KINDS or count > MAX_RANGES or body_len > MAX_REPLY_BODY:
        raise WireError(f"malformed reply header (kind {kind}, {count} ranges, {body_len} bytes)")
    return Header(kind, flags, request_id, count, body_len)


def encode_read(request_id: int, ranges: list[Range], shm: bool = False, grant: bytes = b"") -> bytes:
    parts = [bytes([len(grant)]), grant]
    for r in ranges:
        parts += [bytes([len(r.chunk_id)]), r.chunk_id]
        if shm:
            parts.append(_SHM_RANGE.pack(r.offset, r.length, r.mapping, len(r.pieces)))
            parts += [_PIECE.pack(off, n) for off, n in r.pieces]
        else:
            parts.append(_RANGE.pack(r.offset, r.length))
    body = b"".join(parts)
    return encode_header(READ_SHM if shm else READ, request_id, len(ranges), len(body)) + body


def parse_ranges(header: Header, body: bytes | memoryview) -> list[Range]:
    """The ranges of a READ or READ_SHM body; WireError if it is malformed."""
    return parse_read(header, body)[1]


def parse_read(header: Header, body: bytes | memoryview) -> tuple[bytes, list[Range]]:
    """The read grant and the ranges of a READ or READ_SHM body; WireError if it is malformed."""
    if len(body) != header.body_len:
        raise WireError(f"truncated body: {len(body)} of {header.body_len} bytes")
    if not body or body[0] > MAX_GRANT or 1 + body[0] > len(body):
        raise WireError(f"the body must start with a read grant of at most {MAX_GRANT} bytes")
    grant = bytes(body[1 : 1 + body[0]])
    fixed = _SHM_RANGE if header.kind == READ_SHM else _RANGE
    out, pos = [], 1 + len(grant)
    for i in range(header.count):
        if pos >= len(body):
            raise WireError(f"body ends before range {i} of {header.count}")
        n = body[pos]
        if not 0 < n <= MAX_ID:
            raise WireError(f"range {i}: chunk id length {n} is outside 1..{MAX_ID}")
        end = pos + 1 + n + fixed.size
        if end > len(body):
            raise WireError(f"body ends inside range {i}")
        chunk_id = bytes(body[pos + 1 : pos + 1 + n])
        values = fixed.unpack_from(body, pos + 1 + n)
        if header.kind == READ_SHM:
            offset, length, mapping, npieces = values
            if length == 0 or mapping >= MAX_MAPPINGS or not 0 < npieces <= MAX_PIECES:
                raise WireError(f"range {i}: mapping {mapping} or {npieces} pieces out of bounds")
            if end + npieces * _PIECE.size > len(body):
                raise WireError(f"body ends inside the pieces of range {i}")
            pieces = tuple(_PIECE.unpack_from(body, end + k * _PIECE.size) for k in range(npieces))
            if sum(n for _, n in pieces) != length:
                raise WireError(f"range {i}: pieces hold {sum(n for _, n in pieces)} bytes, the range {length}")
            end += npieces * _PIECE.size
            out.append(Range(chunk_id, offset, length, mapping, pieces))
        else:
            out.append(Range(chunk_id, *values))
        pos = end
    if pos != len(body):
        raise WireError(f"{len(body) - pos} stray bytes after {header.count} ranges")
    return grant, out


@dataclass(frozen=True, slots=True)
class WriteRequest:
    chunk_id: bytes
    length: int  # WRITE: the bytes that follow the body; WRITE_SHM: the bytes at `offset` in `mapping`
    checksum: int
    owner: bytes
    mapping: int = -1  # WRITE_SHM only
    offset: int = 0


def encode_write(request_id: int, chunk_id: bytes, length: int, checksum: int, owner: bytes = b"",
                 shm: tuple[int, int] | None = None) -> bytes:
    """A WRITE frame, whose `length` bytes are sent right after it; with `shm`
    (mapping, offset), a WRITE_SHM of the bytes there instead."""
    body = bytes([len(chunk_id)]) + chunk_id + _WRITE.pack(length, checksum, len(owner)) + owner
    if shm is not None:
        body += _IN_SHM.pack(*shm)
    return encode_header(WRITE if shm is None else WRITE_SHM, request_id, 1, len(body)) + body


def parse_write(header: Header, body: bytes | memoryview) -> WriteRequest:
    """What a WRITE or WRITE_SHM announces; WireError if it is malformed or out of bounds."""
    if len(body) != header.body_len:
        raise WireError(f"truncated body: {len(body)} of {header.body_len} bytes")
    if header.count != 1:
        raise WireError(f"a WRITE carries one chunk, not {header.count}")
    n = body[0] if body else 0
    if not 0 < n <= MAX_ID or 1 + n + _WRITE.size > len(body):
        raise WireError(f"a WRITE body starts with a chunk id of 1..{MAX_ID} bytes and its length, checksum "
                        f"and owner record length")
    chunk_id = bytes(body[1 : 1 + n])
    length, checksum, owner_len = _WRITE.unpack_from(body, 1 + n)
    if not 0 < length <= MAX_CHUNK:
        raise WireError(f"a WRITE announces {length} bytes; a chunk has 1..{MAX_CHUNK}")
    at = 1 + n + _WRITE.size + owner_len
    tail = _IN_SHM.size if header.kind == WRITE_SHM else 0
    if owner_len > MAX_OWNER or at + tail != len(body):
        raise WireError(f"a WRITE's owner record is {owner_len} bytes in a {len(body)}-byte body (at most "
                        f"{MAX_OWNER}, and nothing after it{' but its mapping and offset' if tail else ''})")
    owner = bytes(body[1 + n + _WRITE.size : at])
    if not tail:
        return WriteRequest(chunk_id, length, checksum, owner)
    mapping, offset = _IN_SHM.unpack_from(body, at)
    if mapping >= MAX_MAPPINGS:
        raise WireError(f"WRITE_SHM from mapping {mapping}: at most {MAX_MAPPINGS} per connection")
    return WriteRequest(chunk_id, length, checksum, owner, mapping, offset)


def encode_write_reply(request_id: int, code: int, message: str = "", created: bool = False,
                       receipt: bytes = b"") -> bytes:
    msg = message.encode()[:MAX_MESSAGE]
    body = _RESULT.pack(code, len(msg)) + msg + _WRITTEN.pack(created, len(receipt)) + receipt
    return encode_header(WRITE_REPLY, request_id, 1, len(body)) + body


def parse_write_reply(header: Header, body: bytes | memoryview) -> tuple[int, str, bool, bytes]:
    """(code, message, created, receipt) of a WRITE_REPLY."""
    if len(body) != header.body_len or len(body) < _RESULT.size:
        raise WireError("malformed WRITE_REPLY body")
    code, n = _RESULT.unpack_from(body)
    at = _RESULT.size + n
    if at + _WRITTEN.size > len(body):
        raise WireError("WRITE_REPLY ends inside its message")
    created, k = _WRITTEN.unpack_from(body, at)
    if at + _WRITTEN.size + k != len(body):
        raise WireError("WRITE_REPLY's receipt does not fill its body")
    return code, bytes(body[_RESULT.size : at]).decode(errors="replace"), bool(created), \
        bytes(body[at + _WRITTEN.size :])


def encode_shm_register(request_id: int, size: int, mapping: int = 0) -> bytes:
    """The request's bytes; the memory file's descriptor goes with them (socket.send_fds)."""
    return encode_header(SHM_REGISTER, request_id, 0, 8, flags=mapping) + struct.pack("<Q", size)


def parse_shm_register(header: Header, body: bytes | memoryview) -> int:
    """The size to map."""
    if len(body) != header.body_len or len(body) != 8:
        raise WireError("malformed SHM_REGISTER body: a size u64 and nothing else")
    return struct.unpack("<Q", body)[0]


def local_socket_name(address: str) -> str:
    """The chunkserver's local socket for the data port at `address` (host:port as
    advertised): an abstract Unix socket, named after it, in the network namespace
    of both (the same one a client reaches the port through)."""
    return f"\0kvfs-data/{address}"


def encode_status(request_id: int, code: int, message: str) -> bytes:
    raw = message.encode()[:MAX_MESSAGE]
    body = _RESULT.pack(code, len(raw)) + raw
    return encode_header(STATUS, request_id, 0, len(body)) + body


def parse_status(header: Header, body: bytes | memoryview) -> tuple[int, str]:
    if len(body) < 4:
        raise WireError("malformed STATUS body")
    code, n = _RESULT.unpack_from(body)
    return code, bytes(body[4 : 4 + n]).decode(errors="replace")


MAX_BACKLOG_MIB = 0xFFFF


def backlog_flags(nbytes: int) -> int:
    """READ_REPLY's flags for a backlog of `nbytes`: whole MiB, at most MAX_BACKLOG_MIB."""
    return min(MAX_BACKLOG_MIB, max(0, nbytes) >> 20)


def backlog_of(header: Header) -> int:
    """The read backlog a READ_REPLY's server told, in bytes (whole MiB)."""
    return header.flags << 20


def encode_read_reply(request_id: int, results: list[RangeResult], backlog: int = 0) -> bytes:
    parts = []
    for r in results:
        msg = r.message.encode()[:MAX_MESSAGE]
        parts += [_RESULT.pack(r.code, len(msg)), msg,
                  _DATA.pack(r.data_start, r.data_len, r.chunk_len, len(r.checksums)),
                  struct.pack(f"<{len(r.checksums)}Q", *r.checksums)]
    body = b"".join(parts)
    return encode_header(READ_REPLY, request_id, len(results), len(body), backlog_flags(backlog)) + body


def parse_read_reply(header: Header, body: bytes | memoryview) -> list[RangeResult]:
    if len(body) != header.body_len:
        raise WireError(f"truncated reply body: {len(body)} of {header.body_len} bytes")
    out, pos = [], 0
    for i in range(header.count):
        if pos + _RESULT.size > len(body):
            raise WireError(f"reply ends before result {i}")
        code, n = _RESULT.unpack_from(body, pos)
        pos += _RESULT.size
        message = bytes(body[pos : pos + n]).decode(errors="replace")
        pos += n
        if pos + _DATA.size > len(body):
            raise WireError(f"reply ends inside result {i}")
        start, length, chunk_len, nblocks = _DATA.unpack_from(body, pos)
        pos += _DATA.size
        if pos + 8 * nblocks > len(body):
            raise WireError(f"reply ends inside the checksums of result {i}")
        sums = struct.unpack_from(f"<{nblocks}Q", body, pos)
        pos += 8 * nblocks
        if code == 0 and (nblocks != -(-chunk_len // BLOCK) or start % BLOCK or start + length > chunk_len):
            raise WireError(f"result {i}: {nblocks} checksums, {length} bytes at {start} do not fit a "
                            f"{chunk_len}-byte chunk")
        out.append(RangeResult(code, message, start, length, chunk_len, sums))
    if pos != len(body):
        raise WireError("stray bytes after the last result")
    return out


def widen(offset: int, length: int, chunk_len: int) -> tuple[int, int]:
    """The data a range is served as: whole checksum blocks, clamped to the chunk."""
    start = offset - offset % BLOCK
    end = min(-(-(offset + length) // BLOCK) * BLOCK, chunk_len)
    return start, end - start


class BlockVerifier:
    """Checks bytes that arrive in pieces against per-64 KiB xxh3 checksums."""

    __slots__ = ("_sums", "_index", "_fill", "_hash", "ok")

    def __init__(self, checksums: tuple[int, ...]):
        self._sums = checksums
        self._index = 0
        self._fill = 0
        self._hash = xxhash.xxh3_64()
        self.ok = True

    def feed(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            take = min(BLOCK - self._fill, len(view) - pos)
            self._hash.update(view[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == BLOCK:
                self._close_block()

    def _close_block(self) -> None:
        if self._index >= len(self._sums) or self._hash.intdigest() != self._sums[self._index]:
            self.ok = False
        self._index += 1
        self._fill = 0
        self._hash.reset()

    def finish(self) -> bool:
        if self._fill:
            self._close_block()
        return self.ok and self._index == len(self._sums)


def verified(views, checksums: tuple[int, ...]) -> bool:
    """Whether bytes (one buffer, or pieces in order) match these block checksums."""
    verifier = BlockVerifier(checksums)
    for view in [views] if isinstance(views, (bytes, bytearray, memoryview)) else views:
        verifier.feed(memoryview(view))
    return verifier.finish()
