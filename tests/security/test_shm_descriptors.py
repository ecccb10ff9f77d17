"""Shared memory by descriptor, from raw frames on the data port's local socket
(issue "Abuse resistance": a client registered a /dev/shm file, truncated it and
sent READ_SHM, and the chunkserver died of SIGBUS; SHM_REGISTER took a path, so
the chunkserver, running as root, wrote into files the client itself could not
open). Now a client passes the descriptor of a memory file sealed against
shrinking, over the local socket only; anything else is refused with a status,
descriptors sent with other requests are closed, and the server serves on: a
legitimate local client reads into its own mapping between every step of the attack,
and the server's memory, threads and descriptors stay bounded throughout.

The confused deputy: whatever an attacker writes into a frame (the path of another
process's /dev/shm file, in the old SHM_REGISTER's layout or the new one's), the
server opens no file by name; a /dev/shm file passed by descriptor is refused (it
cannot be sealed), and the file named is never written."""

from __future__ import annotations

import os
import pathlib
import socket
import struct

from kvfs import wire
from kvfs.buffers import sealed_memfd
from kvfs.client import ChunkClient
from kvfs.proto import meta_pb2

from helpers import Watch, data_connection, local_read_grant, recv_exactly, settled

MiB = 1 << 20
RAW_NS = os.urandom(16)
RAW_OWNER = meta_pb2.ChunkOwner(namespace_digest=RAW_NS).SerializeToString()
POOL = 16  # the data port's shm-read threads (chunkserver/dataport.py), started as READ_SHMs need them
SPARE = 8  # threads and descriptors besides the test's connections and that pool


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


class LocalReader:
    """A legitimate local client: its own sealed memory file, registered, and READ_SHMs
    of a chunk into it, checked against the bytes written."""

    def __init__(self, data_address: str, grant: bytes, chunk_id: bytes, payload: bytes):
        self.sock = local_socket(data_address)
        self.fd = sealed_memfd("reader", MiB)
        self.grant, self.chunk_id, self.payload, self.reads = grant, chunk_id, payload, 0
        assert register(self.sock, MiB, [self.fd]) == (0, "")

    def read(self) -> None:
        self.reads += 1
        offset = 4096 * self.reads % (len(self.payload) - 65536)
        self.sock.sendall(wire.encode_read(1000 + self.reads, [wire.Range(self.chunk_id, offset, 65536, 0,
                                                                          ((0, 65536),))], shm=True, grant=self.grant))
        (result,) = wire.parse_read_reply(*answer(self.sock))
        assert result.code == 0, result.message
        with open(f"/proc/self/fd/{self.fd}", "rb") as f:
            assert f.read(65536) == self.payload[offset : offset + 65536]

    def close(self) -> None:
        self.sock.close()
        os.close(self.fd)


async def test_only_a_sealed_memory_file_passed_by_descriptor_is_mapped(chunkservers, tmp_path):
    server = chunkservers()
    payload = os.urandom(3 * MiB)
    async with ChunkClient(server.address) as c:
        await c.write(b"known", payload, owner=RAW_OWNER)
        data_address = (await c.stat()).data_address
    grant = local_read_grant(RAW_NS)
    reader = LocalReader(data_address, grant, b"known", payload)
    reader.read()  # the legitimate client is served before, between every step, and after

    with Watch(server.pid) as seen:
        # Refused, the connection closed: no descriptor at all, or more than one
        for fds in ([], [sealed_memfd("a", MiB), sealed_memfd("b", MiB)]):
            s = local_socket(data_address)
            code, message = register(s, MiB, fds)
            assert code == 3 and "exactly one" in message, message
            assert closed(s)
            s.close()
            for fd in fds:
                os.close(fd)
        reader.read()

        # The attack that killed the server, replayed: a memory file registered, truncated, READ_SHM into it.
        # Unsealed, it is refused at registration, so the READ_SHM has no mapping to land in
        s = local_socket(data_address)
        victim = os.memfd_create("truncated")
        os.ftruncate(victim, MiB)
        code, message = register(s, MiB, [victim])
        assert code == 9 and "not sealed against shrinking" in message, message
        os.ftruncate(victim, 0)
        s.sendall(wire.encode_read(2, [wire.Range(b"known", 0, 65536, 0, ((0, 65536),))], shm=True, grant=grant))
        code, message = wire.parse_status(*answer(s))
        assert code == 9 and "not registered" in message, message
        assert closed(s)
        s.close()
        os.close(victim)
        assert server.alive()
        reader.read()

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
        reader.read()

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
        reader.read()

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
        reader.read()
        s.close()
        os.close(sealed)
        reader.close()
        after = settled(server.pid, seen.before, threads=POOL)  # the reader's connection, and its mapping, gone too

    # and the server serves on, over TCP too
    assert server.alive()
    async with ChunkClient(server.address) as c:
        assert (await c.stat()).counters.rejected_requests >= 8
    assert "not sealed against shrinking" in server.log_path.read_text()
    before, peak = seen.before, seen.peak
    print(f"saw: the refused registrations, the truncation replayed and 100 stray descriptors, a local reader "
          f"served {reader.reads} times between them: {seen.grew()}; after: {after}")
    assert peak.threads <= before.threads + 3 + POOL + SPARE, seen  # three connections at most at once
    assert peak.fds <= before.fds + 3 + 2 + SPARE, seen  # and two descriptors held while a request is read
    assert peak.rss - before.rss < 32 * MiB, seen  # mappings of 1 MiB files, 64 KiB read into them


def test_a_shared_memory_file_is_never_opened_by_name(chunkservers):
    """The confused deputy: an attacker names a file it wants the server (root, in
    production) to write into; nothing it can send makes the server open it."""
    import asyncio

    server = chunkservers()
    payload = os.urandom(MiB)

    async def setup():
        async with ChunkClient(server.address) as c:
            await c.write(b"known", payload, owner=RAW_OWNER)
            return (await c.stat()).data_address

    data_address = asyncio.run(setup())
    grant = local_read_grant(RAW_NS)
    target = pathlib.Path("/dev/shm") / f"kvfs-victim-{os.getpid()}"  # another process's buffer, by its name
    target.write_bytes(b"\xaa" * MiB)
    os.chmod(target, 0o600)
    name = str(target).encode()
    reader = LocalReader(data_address, grant, b"known", payload)
    try:
        with Watch(server.pid) as seen:
            # the old SHM_REGISTER (wire version 3): path_len u16, path, size u64, no descriptor; under the old
            # version byte and under this one
            old_body = struct.pack("<H", len(name)) + name + struct.pack("<Q", MiB)
            for version in (wire.VERSION - 1, wire.VERSION):
                s = local_socket(data_address)
                header = bytearray(wire.encode_header(wire.SHM_REGISTER, 1, 0, len(old_body)))
                header[4] = version
                s.sendall(bytes(header) + old_body)
                code, message = wire.parse_status(*answer(s))
                assert code == 3, message
                assert closed(s)
                s.close()
            reader.read()
            # this version's layout with the name where the size goes, or after it: still no descriptor
            for body in (name[:8].ljust(8, b"/"), struct.pack("<Q", MiB) + name):
                s = local_socket(data_address)
                s.sendall(wire.encode_header(wire.SHM_REGISTER, 1, 0, len(body)) + body)
                code, message = wire.parse_status(*answer(s))
                assert code == 3 and ("exactly one" in message or "a size u64 and nothing else" in message), message
                assert closed(s)
                s.close()
            # the file itself, passed by descriptor: a /dev/shm file cannot be sealed against shrinking
            s = local_socket(data_address)
            fd = os.open(target, os.O_RDWR)
            code, message = register(s, MiB, [fd])
            os.close(fd)
            assert code == 9 and "not sealed against shrinking" in message, message
            # so a READ_SHM has nothing to land in
            s.sendall(wire.encode_read(2, [wire.Range(b"known", 0, 65536, 0, ((0, 65536),))], shm=True, grant=grant))
            code, message = wire.parse_status(*answer(s))
            assert code == 9 and "not registered" in message, message
            s.close()
            reader.read()
            # over TCP, SHM_REGISTER is refused whatever it carries
            tcp = data_connection(data_address)
            tcp.sendall(wire.encode_shm_register(3, MiB))
            code, message = wire.parse_status(*answer(tcp))
            assert code == 9 and "local socket only" in message, message
            tcp.close()
            reader.read()
            reader.close()
            after = settled(server.pid, seen.before, threads=POOL)
        assert target.read_bytes() == b"\xaa" * MiB  # never written
        assert server.alive()
        before, peak = seen.before, seen.peak
        print(f"saw: a /dev/shm file named in every frame and passed by descriptor, never opened; a local reader "
              f"served {reader.reads} times meanwhile: {seen.grew()}; after: {after}")
        assert peak.threads <= before.threads + 2 + POOL + SPARE, seen
        assert peak.fds <= before.fds + 2 + 2 + SPARE, seen
        assert peak.rss - before.rss < 32 * MiB, seen
    finally:
        target.unlink()
