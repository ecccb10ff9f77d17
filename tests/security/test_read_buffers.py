"""The data port's read buffers are bounded over all connections (issue "Abuse
resistance": connections asking for large reads and never reading the replies held
a request's buffers each, and took a chunkserver from 53 MiB to 959 MiB). In direct
mode a request's buffers wait for room under `data_read_buffers`, and one client
host holds at most a quarter of it. From raw TLS connections on 127.0.0.2 that ask
for 16 MiB each and read nothing, against a real chunkserver: its resident memory
grows by one request's buffers, not eight; a client on another host reads meanwhile;
the requests that found no room are refused and logged; its threads and descriptors
grow by one per connection while they are open and go back once they close.

Clients asking for thousands of ranges (wire.MAX_RANGES) of 2 bytes each, every one
straddling two 64 KiB blocks, and reading nothing: a read costs what its ranges are
widened to (the whole 64 KiB blocks read and sent), so one such request of 8 KiB
asked for costs 512 MiB, past max_read_bytes, and is refused whole before a buffer
is taken (before that it held 512 MiB of read buffers in direct mode and starved
every other host)."""

from __future__ import annotations

import os
import socket

import pytest

from kvfs import wire
from kvfs.client import ChunkClient
from kvfs.proto import meta_pb2

from helpers import Watch, credentials, local_read_grant, recv_exactly, settled, wait_until

MiB = 1 << 20
NS = os.urandom(16)
OWNER = meta_pb2.ChunkOwner(namespace_digest=NS).SerializeToString()
CHUNK = 16 * MiB
ATTACKERS = 8
# besides a handler thread per connection: the preadv pool (8, started lazily where the
# kernel refuses io_uring), io_uring's kernel workers; seen: none
SPARE_THREADS = 16
SPARE_FDS = 8  # besides a socket per connection: slot files opened on first read; seen: none
TLS_READ = 1 << 20  # chunkserver/dataport.py: a buffered read's piece through TLS


def read_whole(sock, request_id: int, chunk_id: bytes, grant: bytes) -> tuple[int, bytes]:
    """One READ of a whole chunk on a raw connection: (range code, the data)."""
    sock.sendall(wire.encode_read(request_id, [wire.Range(chunk_id, 0, 0)], grant=grant))
    header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
    if header.kind == wire.STATUS:
        return wire.parse_status(header, recv_exactly(sock, header.body_len))[0], b""
    (result,) = wire.parse_read_reply(header, recv_exactly(sock, header.body_len))
    return result.code, recv_exactly(sock, result.data_len) if result.code == 0 else b""


def tls_from(host: str, address: str):
    ip, port = address.rsplit(":", 1)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # a reader that reads nothing holds little
    raw.bind((host, 0))
    raw.connect((ip, int(port)))
    sock = credentials().ssl_context(server=False).wrap_socket(raw, server_hostname=ip)
    sock.settimeout(30)
    return sock


async def test_clients_that_never_read_hold_one_share_of_the_read_buffers(chunkservers):
    server = chunkservers(extra=["--io-mode", "direct", "--data-read-buffers", "32MiB",
                                 "--data-request-timeout", "2s"])
    grant = local_read_grant(NS)
    async with ChunkClient(server.address) as c:
        chunks = {f"big-{i}".encode(): os.urandom(CHUNK) for i in range(2)}
        for cid, data in chunks.items():
            await c.write(cid, data, owner=OWNER)
        data_address = (await c.stat()).data_address
    with Watch(server.pid) as seen:
        held = []
        for _ in range(ATTACKERS):  # each asks for a whole 16 MiB chunk and never reads a byte of it
            s = tls_from("127.0.0.2", data_address)
            s.sendall(wire.encode_read(1, [wire.Range(b"big-0", 0, 0)], grant=grant))
            held.append(s)
        # another host reads a whole chunk meanwhile: there is room for it beside the attackers' one share
        legit = tls_from("127.0.0.1", data_address)
        assert read_whole(legit, 2, b"big-1", grant) == (0, chunks[b"big-1"])
        # the attackers' other requests find no room within the request deadline and are refused
        wait_until(lambda: server.log_path.read_text().count("found no room among the read buffers") >= ATTACKERS - 1,
                   30, "the requests past the host's share refused")
        during = seen.sample()
    after, before, peak, grown = closed(server, seen, (*held, legit))
    print(f"saw: {ATTACKERS} connections from one host asking for {CHUNK // MiB} MiB each and reading nothing "
          f"grew the server by {grown / MiB:.0f} MiB at most; another host read {CHUNK // MiB} MiB meanwhile; "
          f"{seen.grew()}; while held {during}; closed: {after}")
    # data_read_buffers (32 MiB), of which the attackers' host holds a quarter, and the legitimate read's 16 MiB
    assert grown < 3 * CHUNK, f"resident memory grew {grown / MiB:.0f} MiB: more than a share of the buffers"
    assert peak.threads <= before.threads + ATTACKERS + 1 + SPARE_THREADS, seen
    assert peak.fds <= before.fds + ATTACKERS + 1 + SPARE_FDS, seen


def closed(server, seen: Watch, sockets) -> tuple:
    """Closes an attack's sockets; (the server's footprint once settled, before, peak, RSS growth)."""
    for s in sockets:
        s.close()
    return settled(server.pid, seen.before), seen.before, seen.peak, seen.peak.rss - seen.before.rss


@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
async def test_clients_asking_for_thousands_of_ranges_and_reading_nothing_hold_bounded_memory(chunkservers, io_mode):
    budget = 32 * MiB
    server = chunkservers(extra=["--io-mode", io_mode, "--data-read-buffers", "32MiB", "--data-request-timeout", "2s"])
    grant = local_read_grant(NS)
    chunk = 4 * MiB  # 64 blocks: 64 checksums in every range's reply
    async with ChunkClient(server.address) as c:
        await c.write(b"many", os.urandom(chunk), owner=OWNER)
        legit_data = os.urandom(MiB)
        await c.write(b"legit", legit_data, owner=OWNER)
        data_address = (await c.stat()).data_address
    # 4096 ranges of 2 bytes, each across a block boundary: 8 KiB asked for
    ranges = [wire.Range(b"many", wire.BLOCK * (1 + i % 63) - 1, 2) for i in range(wire.MAX_RANGES)]
    request = wire.encode_read(1, ranges, grant=grant)
    reply_bytes = wire.MAX_RANGES * (64 + 8 * (chunk // wire.BLOCK))  # a range's result and checksums, encoded
    with Watch(server.pid) as seen:
        held = []
        for _ in range(ATTACKERS):
            s = tls_from("127.0.0.2", data_address)
            s.sendall(request)
            held.append(s)
        wait_until(lambda: seen.sample().threads >= seen.before.threads + ATTACKERS, 10, "the attackers served")
        legit = tls_from("127.0.0.1", data_address)  # another host reads 1 MiB meanwhile
        served = read_whole(legit, 2, b"legit", grant)
        # each request costs 512 MiB widened (max_read_bytes 256 MiB): refused whole, before a buffer is taken
        wait_until(lambda: server.log_path.read_text().count("checksum blocks); at most") >= ATTACKERS, 30,
                   "the requests refused for what their ranges cost widened")
        during = seen.sample()
    after, before, peak, grown = closed(server, seen, (*held, legit))
    # what the limits imply: the read buffers (direct mode), and per connection one request body, its reply
    # (encoded) and, over TLS in buffered mode, one piece read from the page cache
    per_connection = wire.MAX_BODY + reply_bytes + (TLS_READ if io_mode == "buffered" else 0)
    bound = (budget if io_mode == "direct" else 0) + ATTACKERS * per_connection + 32 * MiB
    print(f"saw ({io_mode}): {ATTACKERS} connections from one host asking for {wire.MAX_RANGES} ranges of 2 bytes "
          f"each and reading nothing grew the server by {grown / MiB:.0f} MiB at most (bound {bound / MiB:.0f} MiB); "
          f"another host's 1 MiB read got code {served[0]}; {seen.grew()}; while held {during}; "
          f"closed: {after}")
    assert peak.threads <= before.threads + ATTACKERS + 1 + SPARE_THREADS, seen
    assert peak.fds <= before.fds + ATTACKERS + 1 + SPARE_FDS, seen
    assert served == (0, legit_data), f"another host's read was refused (code {served[0]}) while one host's " \
                                      f"requests of 2-byte ranges were answered"
    assert grown < bound, f"resident memory grew {grown / MiB:.0f} MiB, past {bound / MiB:.0f} MiB"
