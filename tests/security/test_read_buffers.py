"""The data port's read buffers are bounded over all connections (issue "Abuse
resistance": connections asking for large reads and never reading the replies held
a request's buffers each, and took a chunkserver from 53 MiB to 959 MiB). In direct
mode a request's buffers wait for room under `data_read_buffers`, and one client
host holds at most a quarter of it. From raw TLS connections on 127.0.0.2 that ask
for 16 MiB each and read nothing, against a real chunkserver: its resident memory
grows by one request's buffers, not eight; a client on another host reads meanwhile;
the requests that found no room are refused and logged."""

from __future__ import annotations

import os
import socket

from kvfs import wire
from kvfs.client import ChunkClient
from kvfs.proto import meta_pb2

from helpers import credentials, local_read_grant, recv_exactly, rss_bytes, wait_until

MiB = 1 << 20
NS = os.urandom(16)
OWNER = meta_pb2.ChunkOwner(namespace_digest=NS).SerializeToString()
CHUNK = 16 * MiB
ATTACKERS = 8


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
    before = rss_bytes(server.pid)
    held = []
    for _ in range(ATTACKERS):  # each asks for a whole 16 MiB chunk and never reads a byte of it
        s = tls_from("127.0.0.2", data_address)
        s.sendall(wire.encode_read(1, [wire.Range(b"big-0", 0, 0)], grant=grant))
        held.append(s)
    # another host reads a whole chunk meanwhile: there is room for it beside the attackers' one share
    legit = tls_from("127.0.0.1", data_address)
    legit.sendall(wire.encode_read(2, [wire.Range(b"big-1", 0, 0)], grant=grant))
    header = wire.parse_header(recv_exactly(legit, wire.HEADER.size), requests=False)
    (result,) = wire.parse_read_reply(header, recv_exactly(legit, header.body_len))
    assert result.code == 0, result.message
    assert recv_exactly(legit, result.data_len) == chunks[b"big-1"]
    # the attackers' other requests find no room within the request deadline and are refused
    wait_until(lambda: server.log_path.read_text().count("found no room among the read buffers") >= ATTACKERS - 1,
               30, "the requests past the host's share refused")
    grown = rss_bytes(server.pid) - before
    print(f"saw: {ATTACKERS} connections from one host asking for {CHUNK // MiB} MiB each and reading nothing "
          f"grew the server by {grown / MiB:.0f} MiB; another host read {CHUNK // MiB} MiB meanwhile")
    assert grown < 3 * CHUNK, f"resident memory grew {grown / MiB:.0f} MiB: more than a share of the buffers"
    for s in (*held, legit):
        s.close()
