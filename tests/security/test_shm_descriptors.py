"""Shared memory by descriptor, from raw frames on the data port's local socket
(issue "Abuse resistance": a client registered a /dev/shm file, truncated it and
sent READ_SHM, and the chunkserver died of SIGBUS; SHM_REGISTER took a path, so
the chunkserver, running as root, wrote into files the client itself could not
open). Now a client passes the descriptor of a memory file sealed against
shrinking, over the local socket only; anything else is refused with a status,
descriptors sent with other requests are closed, and the server serves on."""

from __future__ import annotations

import os
import socket

from kvfs import wire
from kvfs.buffers import sealed_memfd
from kvfs.client import ChunkClient
from kvfs.proto import meta_pb2

from helpers import local_read_grant, recv_exactly

MiB = 1 << 20
RAW_NS = os.urandom(16)
RAW_OWNER = meta_pb2.ChunkOwner(namespace_digest=RAW_NS).SerializeToString()


def local_socket(data_address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(wire.local_socket_name(data_address))
    return s


def answer(sock: socket.socket) -> tuple[wire.Header, bytes]:
    header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
    return header, recv_exactly(sock, header.body_len)


def register(sock: socket.socket, size: int, fds: list[int], mapping: int = 0) -> tuple[int, str]:
    socket.send_fds(sock, [wire.encode_shm_register(1, size, mapping)], fds)
    return wire.parse_status(*answer(sock))


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_only_a_sealed_memory_file_passed_by_descriptor_is_mapped(chunkservers, tmp_path):
    server = chunkservers()
    payload = os.urandom(3 * MiB)
    async with ChunkClient(server.address) as c:
        await c.write(b"known", payload, owner=RAW_OWNER)
        data_address = (await c.stat()).data_address
    grant = local_read_grant(RAW_NS)

    # Refused, the connection closed: no descriptor at all, or more than one
    for fds in ([], [sealed_memfd("a", MiB), sealed_memfd("b", MiB)]):
        s = local_socket(data_address)
        code, message = register(s, MiB, fds)
        assert code == 3 and "exactly one" in message, message
        assert closed(s)
        s.close()
        for fd in fds:
            os.close(fd)

    # Refused with a status, the connection kept: files that could shrink under the
    # mapping, or that it may not write, or asked for past their end
    s = local_socket(data_address)
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, MiB)
    on_disk = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(on_disk, MiB)
    sealed = sealed_memfd("sealed", MiB)
    read_only = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)
    for fd, size, why in ((unsealed, MiB, "not sealed against shrinking"), (on_disk, MiB, "cannot be sealed"),
                          (sealed, 2 * MiB, "bytes asked for"), (read_only, MiB, "cannot map it")):
        code, message = register(s, size, [fd])
        assert code == 9 and why in message, (why, message)
    for fd in (unsealed, on_disk, read_only):
        os.close(fd)

    # The one accepted: the attack that used to kill the server cannot even start
    # (the file cannot shrink), and READ_SHM lands in it
    assert register(s, MiB, [sealed]) == (0, "")
    try:
        os.ftruncate(sealed, 0)
        raise AssertionError("a sealed memory file was truncated")
    except PermissionError:
        pass
    s.sendall(wire.encode_read(2, [wire.Range(b"known", 4096, 65536, 0, ((0, 65536),))], shm=True, grant=grant))
    header, body = answer(s)
    (result,) = wire.parse_read_reply(header, body)
    assert result.code == 0, result.message
    with open(f"/proc/self/fd/{sealed}", "rb") as f:
        assert f.read(65536) == payload[4096 : 4096 + 65536]

    # Descriptors sent with anything else are closed, not collected
    before = open_fds(server.pid)
    for i in range(100):
        fd = sealed_memfd("spare", 4096)
        socket.send_fds(s, [wire.encode_read(10 + i, [wire.Range(b"known", 0, 10)], grant=grant)], [fd])
        os.close(fd)
        header, body = answer(s)
        (result,) = wire.parse_read_reply(header, body)
        assert result.code == 0
        recv_exactly(s, result.data_len)
    assert open_fds(server.pid) < before + 10
    s.close()
    os.close(sealed)

    # and the server serves on, over TCP too
    assert server.alive()
    async with ChunkClient(server.address) as c:
        assert (await c.stat()).counters.rejected_requests >= 6
    assert "not sealed against shrinking" in server.log_path.read_text()
