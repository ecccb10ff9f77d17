"""The data port's time and slot limits against raw sockets (issue "Abuse
resistance": 300 half-sent headers held every data-port slot for the 600 s idle
timeout). The port speaks TLS, so the attack now sends half a TLS handshake: the
handshake, like a request, must arrive whole within `data_request_timeout` of its
start, however slowly it trickles in, and one client host holds at most
`data_peer_connections` slots. The attacker connects from 127.0.0.2, another host
to the server; the legitimate client, from 127.0.0.1, restores throughout."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

from kvfs import wire
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout

from helpers import credentials, recv_exactly, restore_all, tokens_for, until

NS = Namespace("tenant-a", "m")
LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
PEER_CAP = 8


def client_hello(host: str) -> bytes:
    """The first flight of a TLS handshake, as the suite's client would send it."""
    hello = ssl.MemoryBIO()
    tls = credentials().ssl_context(server=False).wrap_bio(ssl.MemoryBIO(), hello, server_hostname=host)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return hello.read()


def connect_from(host: str, address: str) -> socket.socket:
    ip, port = address.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.connect((ip, int(port)))
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed this connection (without waiting for it to)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def test_half_sent_requests_hold_slots_for_seconds_and_one_host_never_holds_them_all(local_cluster):
    cluster = local_cluster(chunk_extra=["--data-request-timeout", "2s", "--data-peer-connections", str(PEER_CAP)])
    tokens = tokens_for(3, seed=61)
    payload = os.urandom(LAYOUT.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="tcp") as client:
        await client.write(NS, tokens, payload, LAYOUT)
        match = await client.lookup(NS, tokens)
        data_address = match.servers[match.blocks[0].chunks[0].replicas[0]].data_address
        ip = data_address.rsplit(":", 1)[0]
        hello = client_hello(ip)
        held = [connect_from("127.0.0.2", data_address) for _ in range(PEER_CAP)]
        for s in held:
            s.sendall(hello[:5])  # the first bytes of a TLS handshake, and then nothing
        extra = connect_from("127.0.0.2", data_address)  # one more from the same host: refused at once
        await until(lambda: closed_by_server(extra), 5, "the connection over the per-host cap closed")
        # the legitimate client, from another host, is served while those are held
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens), LAYOUT)
        assert bytes(out) == payload
        # the half-sent requests are cut off after the request deadline, not the 600 s idle timeout
        await until(lambda: all(closed_by_server(s) for s in held), 30, "half-sent requests closed")
        # and their host is served again: a whole request gets its answer
        again = credentials().ssl_context(server=False).wrap_socket(connect_from("127.0.0.2", data_address),
                                                                     server_hostname=ip)
        again.settimeout(10)
        again.sendall(wire.encode_read(7, [wire.Range(b"no-such-chunk", 0, 1)]))
        reply = wire.parse_header(recv_exactly(again, wire.HEADER.size), requests=False)
        assert reply.request_id == 7
        # a handshake trickled in a byte at a time never outlasts the deadline either
        drip, sent = connect_from("127.0.0.3", data_address), 0
        frame = hello
        while sent < len(frame) and not closed_by_server(drip):
            drip.setblocking(True)
            try:
                drip.sendall(frame[sent : sent + 1])
            except OSError:
                break
            sent += 1
            await asyncio.sleep(0.5)  # the attacker's pace: its hello would take minutes
        assert sent < 10 < len(frame)  # cut off after the 2 s request deadline, in the middle of the hello
        for s in (*held, extra, again, drip):
            s.close()
        out, _, _ = await restore_all(client, await client.lookup(NS, tokens), LAYOUT)
        assert bytes(out) == payload
