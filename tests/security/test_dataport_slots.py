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

import pytest

from kvfs import wire
from kvfs.chunkserver import dataport
from kvfs.client import ChunkClient, Client
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.proto import meta_pb2

from helpers import (Watch, credentials, local_read_grant, recv_exactly, restore_all, settled,
                     tokens_for, until)

NS = Namespace("tenant-a", "m")
LAYOUT = BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
PEER_CAP = 8
MiB = 1 << 20
SPARE = 8  # threads and descriptors besides one per connection: the legitimate client's, pools started lazily


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
        holder = match.servers[match.blocks[0].chunks[0].replicas[0]]
        data_address = holder.data_address
        server = next(cs for cs in cluster.chunkservers if cs.address == holder.address)
        ip = data_address.rsplit(":", 1)[0]
        hello = client_hello(ip)
        out, _, _ = await restore_all(client, match, LAYOUT)  # the client's own connections, before the attack
        with Watch(server.pid) as watch:
            held = [connect_from("127.0.0.2", data_address) for _ in range(PEER_CAP)]
            for s in held:
                s.sendall(hello[:5])  # the first bytes of a TLS handshake, and then nothing
            extra = connect_from("127.0.0.2", data_address)  # one more from the same host: refused at once
            await until(lambda: closed_by_server(extra), 5, "the connection over the per-host cap closed")
            # the legitimate client, from another host, is served while those are held
            out, _, _ = await restore_all(client, await client.lookup(NS, tokens), LAYOUT)
            assert bytes(out) == payload
            held_at = watch.sample()
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
        after = settled(server.pid, watch.before)  # the attacker's connections all gone, the client's kept
    before, peak = watch.before, watch.peak
    print(f"saw: {PEER_CAP} half-sent handshakes held from one host: {held_at}; {watch.grew()}; after: {after}")
    assert peak.threads <= before.threads + PEER_CAP + SPARE, watch  # a thread per held connection
    assert peak.fds <= before.fds + PEER_CAP + SPARE, watch  # a socket per held connection
    assert peak.rss - before.rss < 32 * MiB, watch  # a TLS connection without a request holds a few KiB


def tls_from(host: str, address: str):
    ip = address.rsplit(":", 1)[0]
    sock = credentials().ssl_context(server=False).wrap_socket(connect_from(host, address), server_hostname=ip)
    sock.settimeout(10)
    return sock


def cut_off(sock) -> bool:
    """Whether the server closed this TLS connection (without waiting for it to)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except ssl.SSLWantReadError:
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True
    finally:
        sock.settimeout(10)


async def test_headers_announcing_large_bodies_hold_one_body_each_until_the_deadline(chunkservers):
    server = chunkservers(extra=["--data-request-timeout", "3s", "--data-peer-connections", str(PEER_CAP)])
    digest = os.urandom(16)
    grant = local_read_grant(digest)
    data = os.urandom(MiB)
    async with ChunkClient(server.address) as c:
        await c.write(b"legit", data, owner=meta_pb2.ChunkOwner(namespace_digest=digest).SerializeToString())
        data_address = (await c.stat()).data_address
    body = wire.MAX_BODY
    with Watch(server.pid) as watch:
        held = []
        for _ in range(PEER_CAP):  # a READ header announcing the largest body, and all of it but its last byte
            s = tls_from("127.0.0.2", data_address)
            s.sendall(wire.encode_header(wire.READ, 1, 1, body) + bytes(body - 1))
            held.append(s)
        # a body over the limit is refused at once, from its header
        over = tls_from("127.0.0.3", data_address)
        over.sendall(wire.encode_header(wire.READ, 2, 1, body + 1))
        header = wire.parse_header(recv_exactly(over, wire.HEADER.size), requests=False)
        code, message = wire.parse_status(header, recv_exactly(over, header.body_len))
        assert code == 3 and f"at most {body}" in message, message
        # another host reads meanwhile
        legit = tls_from("127.0.0.1", data_address)
        legit.sendall(wire.encode_read(3, [wire.Range(b"legit", 0, 0)], grant=grant))
        header = wire.parse_header(recv_exactly(legit, wire.HEADER.size), requests=False)
        (result,) = wire.parse_read_reply(header, recv_exactly(legit, header.body_len))
        assert result.code == 0 and recv_exactly(legit, result.data_len) == data
        held_at = watch.sample()
        # cut off at the request deadline, the bodies never finished
        await until(lambda: all(cut_off(s) for s in held), 30, "the unfinished requests closed")
        for s in (*held, over, legit):
            s.close()
        after = settled(server.pid, watch.before)
    before, peak = watch.before, watch.peak
    print(f"saw: {PEER_CAP} requests each {body // MiB} MiB but a byte, held from one host: {held_at}; "
          f"{watch.grew()}; after: {after}")
    assert "sent part of a request and nothing more" in server.log_path.read_text()
    # one body per connection (wire.MAX_BODY), no more
    assert peak.rss - before.rss < PEER_CAP * body + 24 * MiB, watch
    assert peak.threads <= before.threads + PEER_CAP + SPARE, watch
    assert peak.fds <= before.fds + PEER_CAP + SPARE, watch


async def test_a_few_hosts_together_never_hold_every_slot(chunkservers):
    server = chunkservers(extra=["--data-request-timeout", "5s"])  # data_peer_connections: its default, 64
    async with ChunkClient(server.address) as c:
        data_address = (await c.stat()).data_address
    hello = client_hello(data_address.rsplit(":", 1)[0])
    hosts, per_host = [f"127.0.0.{i}" for i in range(2, 6)], 64
    with Watch(server.pid) as watch:
        held = []
        for host in hosts:
            for _ in range(per_host):
                s = connect_from(host, data_address)
                s.sendall(hello[:5])
                held.append(s)
        # three hosts take 64 each; past 192 slots a host holding 8 gets no more (the rest are for newcomers)
        admitted = 3 * per_host + dataport.NEWCOMER_CONNECTIONS
        await until(lambda: watch.sample().threads >= watch.before.threads + admitted - 4, 10,
                    "the held connections served")
        held_at = watch.sample()
        try:  # another host, meanwhile: a whole request
            legit = tls_from("127.0.0.1", data_address)
            legit.sendall(wire.encode_read(7, [wire.Range(b"no-such-chunk", 0, 1)]))
            served = wire.parse_header(recv_exactly(legit, wire.HEADER.size), requests=False).request_id == 7
            legit.close()
        except (OSError, ConnectionError):
            served = False
        for s in held:
            s.close()
        after = settled(server.pid, watch.before)
    before, peak = watch.before, watch.peak
    print(f"saw: {len(hosts)} hosts x {per_host} half-sent handshakes: {held_at}; another host served: {served}; "
          f"{watch.grew()}; after: {after}")
    assert served, f"{len(hosts)} hosts holding {per_host} connections each left no slot for another host"
    assert peak.threads <= before.threads + admitted + 1 + SPARE, watch  # a handler thread per admitted one
    assert peak.fds <= before.fds + admitted + 1 + SPARE, watch
    assert peak.rss - before.rss < 64 * MiB, watch
