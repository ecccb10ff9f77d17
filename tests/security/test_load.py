"""A bounded load of every kind of hostile input at once, against a real secure
cluster (issue "Abuse resistance": "a bounded load test (connections, malformed
frames, oversized requests) ends with the servers healthy").

For a few seconds, from raw sockets and raw gRPC channels: every chunkserver's
data port gets half-sent TLS handshakes, plaintext garbage where a handshake
belongs, and TLS connections (with a worker's certificate) that send malformed
frames; the metaserver gets requests past its byte limit and hostile bodies for
every method. A worker looks its prompt up throughout. At the end every server
answers its health check SERVING, its threads and descriptors are back where they
were, its resident memory grew by a bounded amount, and the worker writes and
restores exactly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import ssl

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfs import tls
from kvfs.client import ChunkClient
from kvfs.proto import meta_pb2

from helpers import Watch, credentials, settled
from test_attacks import NS_A, NS_A_MSG, write_and_restore
from test_dataport_slots import client_hello, connect_from
from test_oversized import Lookups
from test_rpc_fuzz import mangled, templates

MiB = 1 << 20
HALF_SENT, GARBAGE, MALFORMED = 24, 8, 8  # connections per data port, each from a host of its own
HOSTILE_BODIES = 60
# growth allowed over the start: the metaserver reads two requests past its 64 MiB limit (refused
# unread, what gRPC buffers of them), a chunkserver a few dozen connections' buffers
META_RSS, CHUNK_RSS = 160 * MiB, 64 * MiB
SPARE = 8  # threads and descriptors: pools started lazily, the test's own channels


def data_port_load(data_address: str) -> tuple[int, int]:
    """Hostile connections to one data port, all open at once, then closed. Returns
    (connections the server closed on its own while they were open, connections made)."""
    ip = data_address.rsplit(":", 1)[0]
    held: list[socket.socket] = []
    hello = client_hello(ip)
    for _ in range(HALF_SENT):
        s = connect_from("127.0.0.2", data_address)
        s.sendall(hello[: len(hello) // 2])
        held.append(s)
    for _ in range(GARBAGE):  # plaintext where a TLS handshake belongs
        s = connect_from("127.0.0.3", data_address)
        s.sendall(os.urandom(512))
        held.append(s)
    rng = random.Random(7)
    for _ in range(MALFORMED):  # a real TLS session, then frames that are not frames
        s = credentials().ssl_context(server=False).wrap_socket(connect_from("127.0.0.4", data_address),
                                                               server_hostname=ip)
        s.settimeout(10)
        s.sendall(rng.randbytes(rng.randint(1, 2048)))
        held.append(s)
    closed = 0
    for s in held:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        except (ConnectionResetError, ssl.SSLError):
            closed += 1
        s.close()
    return closed, len(held)


async def metaserver_load(cluster, who) -> dict[grpc.StatusCode, int]:
    """Requests past the byte limit, then hostile bodies for every method; the codes they got."""
    codes: dict[grpc.StatusCode, int] = {}
    too_big = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[os.urandom(16)] * 3_800_000)  # 68 MB
    rng = random.Random(11)
    cases = list(templates(cluster.chunkservers[0].address).items())
    async with tls.aio_channel(cluster.meta_address, who.worker_a) as ch:
        calls = [ch.unary_unary("/kvfs.meta.MetaService/MatchPrefix")(too_big.SerializeToString(), timeout=60)
                 for _ in range(2)]
        for _ in range(HOSTILE_BODIES):
            path, (role, request, _) = rng.choice(cases)
            if "/kvfs.meta." not in path or path.endswith("RunLifecycle"):
                continue
            calls.append(ch.unary_unary(path)(mangled(request.SerializeToString(), rng), timeout=30))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            code = outcome.code() if isinstance(outcome, grpc.aio.AioRpcError) else grpc.StatusCode.OK
            codes[code] = codes.get(code, 0) + 1
    return codes


async def serving(address: str, creds) -> bool:
    async with tls.aio_channel(address, creds) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_mixed_hostile_load_ends_with_every_server_healthy_and_the_worker_served(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS_A, seed=71)
    data_ports = []
    for cs in cluster.chunkservers:
        async with ChunkClient(cs.address, credentials=credentials()) as c:
            data_ports.append((await c.stat()).data_address)
    servers = [cluster.meta, *cluster.chunkservers]
    with contextlib.ExitStack() as stack:
        watches = [stack.enter_context(Watch(s.pid)) for s in servers]
        async with Lookups(cluster, who.worker_a, NS_A, tokens, 3) as lookups:
            ports, codes = await asyncio.gather(
                asyncio.gather(*(asyncio.to_thread(data_port_load, a) for a in data_ports)),
                metaserver_load(cluster, who))
    after = [settled(s.pid, w.before, spare=SPARE) for s, w in zip(servers, watches)]
    healthy = [await serving(s.address, who.worker_a) for s in servers]
    print(f"saw: data ports closed {[c for c, _ in ports]} of {[n for _, n in ports]} hostile connections "
          f"while open; the metaserver's answers {dict((c.name, n) for c, n in codes.items())}; the worker looked "
          f"up {lookups.served} times (slowest {lookups.slowest * 1000:.0f} ms); "
          + "; ".join(f"{s.name}: {w.grew()}" for s, w in zip(servers, watches)))
    assert all(healthy), healthy
    assert lookups.served > 0
    assert codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) >= 2  # the two past the limit, refused unread
    assert grpc.StatusCode.UNKNOWN not in codes and grpc.StatusCode.INTERNAL not in codes, codes
    for s, w, now in zip(servers, watches, after):
        bound = META_RSS if s is cluster.meta else CHUNK_RSS
        assert w.peak.rss - w.before.rss < bound, (s.name, w)
        assert now.threads <= w.before.threads + SPARE and now.fds <= w.before.fds + SPARE, (s.name, w)
    await write_and_restore(cluster, who.worker_a, NS_A, seed=72)
