"""Chunk writes on the data port (wire.WRITE), from raw frames as an attacker would
send them, against a real chunkserver holding the cluster key (mutual TLS over
TCP). A chunk is stored only under the owner record the metaserver sealed for its
id, checked with the announced size before any of its bytes are read (a refusal
comes at once, with the bytes never sent); oversized and malformed frames are
refused and their connections closed; bytes that do not match the writer's
checksum are not stored, and the connection goes on; a WRITE_SHM (bytes in a
mapping registered on the local socket) is checked the same way, and refused
ones leave the connection serving; a writer that stops
mid-chunk is cut off at the request deadline, and one host's slow writers hold
one share of the write buffers while another host writes. The server keeps
serving throughout, and nothing refused is ever listed."""

from __future__ import annotations

import mmap
import os
import struct

from kvfs import wire
from kvfs.buffers import PAGE, sealed_memfd
from kvfs.checksum import chunk_checksum
from kvfs.client import ChunkClient
from kvfs.grants import write_receipt
from kvfs.tls import LocalCA, load_cluster_key

from helpers import data_connection, local_owner, recv_exactly
from test_read_buffers import tls_from
from test_shm_descriptors import local_socket, register

MiB = 1 << 20
NS = os.urandom(16)


def cluster_key() -> bytes:
    return load_cluster_key(LocalCA(os.environ["KVFS_LOCAL_CA"]).key_path)


def answer(sock) -> tuple[int, str, bool, bytes]:
    """The next reply on a raw connection: (code, message, created, receipt); a
    STATUS comes back as its code and message."""
    header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
    body = recv_exactly(sock, header.body_len)
    if header.kind == wire.STATUS:
        return (*wire.parse_status(header, body), False, b"")
    assert header.kind == wire.WRITE_REPLY
    return wire.parse_write_reply(header, body)


def closed(sock) -> bool:
    """Whether the server closed the connection (EOF where a reply would be)."""
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


async def listed(address: str) -> set[bytes]:
    async with ChunkClient(address) as admin:
        return {c.chunk_id async for c in admin.list()}


async def data_address_of(server) -> str:
    async with ChunkClient(server.address) as admin:
        return (await admin.stat()).data_address


def write_on(sock, rid: int, chunk_id: bytes, data: bytes, owner: bytes) -> tuple[int, str, bool, bytes]:
    sock.sendall(wire.encode_write(rid, chunk_id, len(data), chunk_checksum(data), owner) + data)
    return answer(sock)


async def test_a_chunk_is_written_only_under_the_owner_record_sealed_for_its_id(chunkservers):
    server = chunkservers()
    address = await data_address_of(server)
    target, other = os.urandom(16), os.urandom(16)
    granted = local_owner(target, NS)
    edited = bytearray(granted)
    edited[5] ^= 1  # inside the namespace digest, under the same seal
    for owner in (b"", local_owner(target, os.urandom(16))[:-3] + b"xyz",  # none; a made-up seal
                  local_owner(other, NS), bytes(edited)):  # a seal for another chunk id; an edited record
        with data_connection(address) as sock:
            # 64 MiB announced and never sent: the refusal must come without them
            sock.sendall(wire.encode_write(1, target, 64 * MiB, 0, owner))
            code, message, _, _ = answer(sock)
            assert code == 7 and "owner record sealed by the metaserver" in message, message
            assert closed(sock)
    assert target not in await listed(server.address)
    # the sealed record is good for its own chunk id, and the receipt is the server's
    data = os.urandom(MiB + 5)
    with data_connection(address) as sock:
        code, message, created, receipt = write_on(sock, 1, target, data, granted)
        assert (code, created) == (0, True), message
        assert receipt == write_receipt(cluster_key(), target, chunk_checksum(data), "cs-1")
        assert write_on(sock, 2, target, data, granted)[:3] == (0, "", False)  # the same bytes again: kept
        # other bytes under the same id are refused, and the connection goes on
        code, _, _, _ = write_on(sock, 3, target, os.urandom(len(data)), granted)
        assert code == 6  # ALREADY_EXISTS: chunks are write-once
    async with ChunkClient(server.address) as admin:
        assert await admin.read_chunk(target) == data
        assert (await admin.stat()).counters.rejected_requests == 4
    assert await listed(server.address) == {target}


async def test_oversized_and_malformed_writes_are_refused_and_the_port_keeps_serving(chunkservers):
    server = chunkservers(extra=["--max-chunk-size", "1MiB"])
    address = await data_address_of(server)
    cid = os.urandom(16)
    owner = local_owner(cid, NS)
    body = bytes([16]) + cid + struct.pack("<QQH", 100, 0, len(owner)) + owner
    cases = {
        "over max_chunk_size": (wire.encode_write(1, cid, MiB + 1, 0, owner), "at most 1048576"),
        "over what a chunk may be": (wire.encode_write(1, cid, wire.MAX_CHUNK + 1, 0, owner), "1..67108864"),
        "an empty chunk": (wire.encode_write(1, cid, 0, 0, owner), "announces 0 bytes"),
        "a huge owner record": (wire.encode_write(1, cid, 100, 0, owner + b"x" * wire.MAX_OWNER), "owner record"),
        "two chunks in one frame": (wire.encode_header(wire.WRITE, 1, 2, len(body)) + body, "one chunk, not 2"),
        "a body longer than it says": (wire.encode_header(wire.WRITE, 1, 1, len(body) + 4) + body + b"pad!",
                                       "nothing after it"),
        "an over-long id": (wire.encode_header(wire.WRITE, 1, 1, 3) + bytes([200, 0, 0]), "chunk id of 1..64"),
        "a body over MAX_BODY": (wire.encode_header(wire.WRITE, 1, 1, wire.MAX_BODY + 1), "at most"),
    }
    for what, (frame, says) in cases.items():
        with data_connection(address) as sock:
            sock.sendall(frame)
            code, message, _, _ = answer(sock)
            assert code == 3 and says in message, (what, message)
            assert closed(sock), what
    # and a well-formed write after all of them
    data = os.urandom(4096)
    with data_connection(address) as sock:
        assert write_on(sock, 9, cid, data, owner)[:3] == (0, "", True)
    assert await listed(server.address) == {cid}


async def test_bytes_that_do_not_match_their_checksum_are_not_stored(chunkservers):
    server = chunkservers(extra=["--io-mode", "direct"])
    address = await data_address_of(server)
    bad, good = os.urandom(16), os.urandom(16)
    data = os.urandom(300_000)
    with data_connection(address) as sock:
        sock.sendall(wire.encode_write(1, bad, len(data), chunk_checksum(data[::-1]), local_owner(bad, NS)) + data)
        code, message, created, receipt = answer(sock)
        assert code == 15 and "checksum mismatch on arrival" in message and not created and not receipt
        # the stream stayed in step: the same connection writes the next chunk
        assert write_on(sock, 2, good, data, local_owner(good, NS))[:3] == (0, "", True)
    assert await listed(server.address) == {good}


async def test_writers_that_stop_mid_chunk_are_cut_off_and_hold_one_share_of_the_buffers(chunkservers):
    server = chunkservers(extra=["--data-request-timeout", "2s", "--data-write-buffers", "4MiB"])
    address = await data_address_of(server)
    stalled = []
    for _ in range(3):  # one host: each announces 1 MiB (its share of 4 MiB) and sends a tenth of it
        cid = os.urandom(16)
        sock = tls_from("127.0.0.2", address)
        sock.sendall(wire.encode_write(1, cid, MiB, 0, local_owner(cid, NS)) + os.urandom(MiB // 10))
        stalled.append((cid, sock))
    # another host writes meanwhile: there is room beside the stalled host's one share
    cid = os.urandom(16)
    data = os.urandom(MiB)
    with tls_from("127.0.0.1", address) as sock:
        assert write_on(sock, 1, cid, data, local_owner(cid, NS))[:3] == (0, "", True)
    # the first stalled writer is cut off at its deadline; the others waited for their host's
    # share (the first held it) and are refused at theirs: for no room (8), or, had the share
    # come back at the last moment, for bytes that did not arrive in time (4)
    codes = [answer(sock)[0] for _, sock in stalled]
    assert codes[0] == 4 and set(codes[1:]) <= {4, 8}, codes
    for _, sock in stalled:
        assert closed(sock)
        sock.close()
    assert await listed(server.address) == {cid}
    # the share came back: the same host writes now
    again = os.urandom(16)
    with tls_from("127.0.0.2", address) as sock:
        assert write_on(sock, 1, again, data, local_owner(again, NS))[:3] == (0, "", True)
    async with ChunkClient(server.address) as admin:
        assert (await admin.stat()).counters.rejected_requests == 3


async def test_writes_from_shared_memory_are_checked_and_the_connection_goes_on(chunkservers):
    server = chunkservers(extra=["--io-mode", "direct"])
    address = await data_address_of(server)
    size = 4 * MiB
    fd = sealed_memfd("test-writes", size)
    shm = mmap.mmap(fd, size)
    data = os.urandom(MiB + 7)
    shm[PAGE : PAGE + len(data)] = data
    good = os.urandom(16)
    sock = local_socket(address)
    try:
        def write_shm(rid, chunk_id, length, offset, owner, mapping=0, checksum=None):
            sock.sendall(wire.encode_write(rid, chunk_id, length, chunk_checksum(data) if checksum is None
                                           else checksum, owner, (mapping, offset)))
            return answer(sock)

        # before any mapping is registered
        assert write_shm(1, good, len(data), PAGE, local_owner(good, NS))[0] == 9
        assert register(sock, size, [fd]) == (0, "")
        cases = [  # (what, chunk id, length, offset, owner, code, the message says)
            ("another mapping", 1, len(data), PAGE, None, 9, "not registered"),
            ("past the mapping's end", 0, len(data), size - MiB, None, 3, "past the end"),
            ("no owner record", 0, len(data), PAGE, b"", 7, "owner record sealed"),
            ("other bytes than the checksum's", 0, len(data), 0, None, 15, "checksum mismatch"),
        ]
        for rid, (what, mapping, length, offset, owner, code, says) in enumerate(cases, 2):
            cid = os.urandom(16)
            got, message, created, receipt = write_shm(rid, cid, length, offset,
                                                       local_owner(cid, NS) if owner is None else owner, mapping)
            assert (got, created, receipt) == (code, False, b"") and says in message, (what, message)
        # the connection went on through all of them: the bytes at PAGE are stored, as they were
        got, message, created, receipt = write_shm(9, good, len(data), PAGE, local_owner(good, NS))
        assert (got, created) == (0, True) and receipt, message
    finally:
        sock.close()
        shm.close()
        os.close(fd)
    async with ChunkClient(server.address) as admin:
        assert await admin.read_chunk(good) == data
    assert await listed(server.address) == {good}  # none of the refused ones
    # over TCP nothing can be registered: a WRITE_SHM there names no mapping
    with data_connection(address) as tcp:
        cid = os.urandom(16)
        tcp.sendall(wire.encode_write(1, cid, 100, 0, local_owner(cid, NS), (0, 0)))
        assert answer(tcp)[0] == 9
