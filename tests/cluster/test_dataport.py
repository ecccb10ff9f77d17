"""The bulk data path: every transport against real chunkservers, corruption,
malformed frames, and clients that vanish mid-transfer."""

import os
import socket

import pytest

from kvfs import wire
from kvfs.checksum import chunk_checksum
from kvfs.client import ChunkClient, Client
from kvfs.client.transport import ServerInfo, is_local
from kvfs.errors import DataLoss
from kvfs.keys import Namespace
from kvfs.layout import BlockLayout
from kvfs.priority import thread_nice
from kvfs.proto import meta_pb2

from test_metrics import scrape

from helpers import (data_connection, flip_bytes, local_read_grant, recv_exactly, restore_all, thread_nices, tokens_for,
                     until, wait_until)

NS = Namespace("acme", "deepseek-v3")
MLA = BlockLayout.mla()
MiB = 1 << 20


async def restore(client: Client, tokens, layout=MLA, **kw):
    return await restore_all(client, await client.lookup(NS, tokens), layout, **kw)


@pytest.mark.parametrize("mode", ["direct", "buffered"])
async def test_every_transport_restores_byte_exact(local_cluster, mode):
    cluster = local_cluster(chunk_extra=["--io-mode", mode])
    tokens = tokens_for(8, seed=1)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address) as writer:
        await writer.write(NS, tokens, payload, MLA)
    for transport in ("grpc", "tcp", "shm", "auto"):
        async with Client(cluster.meta_address, transport=transport) as client:
            match = await client.lookup(NS, tokens)
            assert {client.transport_for(s).name for s in match.servers} == \
                {"shm" if transport == "auto" else transport}  # loopback: auto picks shared memory
            out, order, stats = await restore(client, tokens)
            assert bytes(out) == payload, transport
            assert order == list(range(MLA.layers))
            assert stats.retries == 0 and len(stats.per_server) == 3
            assert 0 < stats.first_layer <= stats.seconds  # layer 0 whole before (or as) the last is
            # a layer subset reads sub-ranges that do not start on a checksum block
            sub = bytearray(MLA.buffer_bytes(match.tokens))
            await client.read(match, sub, layers=[3, 20]).wait()
            stride = match.tokens * MLA.row_bytes
            for layer in (3, 20):
                assert sub[layer * stride : (layer + 1) * stride] == payload[layer * stride : (layer + 1) * stride]


def flip_byte_in_every_chunk_on(server_dir):
    for slot_file in server_dir.glob("slots/*/*.slots"):
        flip_bytes(slot_file, *range(1000, slot_file.stat().st_size, MiB))  # one byte in every 1 MiB slot


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_corrupt_replica_is_never_used_and_the_other_serves(local_cluster, transport):
    cluster = local_cluster(chunk_extra=["--io-mode", "buffered"])  # sendfile: only the client checks
    tokens = tokens_for(6, seed=2)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport=transport) as client:
        await client.write(NS, tokens, payload, MLA)
        flip_byte_in_every_chunk_on(cluster.root / "cs-0")
        print("injected: one flipped byte in every chunk on cs-0")
        out, order, stats = await restore(client, tokens)
        assert bytes(out) == payload
        assert stats.retries > 0 and cluster.chunkservers[0].address not in stats.per_server
        print(f"saw: {stats.retries} chunk reads from cs-0 failed their checksum and were read elsewhere")
        # with every replica of a chunk corrupt, the restore fails rather than hand over bytes
        flip_byte_in_every_chunk_on(cluster.root / "cs-1")
        flip_byte_in_every_chunk_on(cluster.root / "cs-2")
        match = await client.lookup(NS, tokens)
        r = client.read(match, bytearray(MLA.buffer_bytes(match.tokens)))
        with pytest.raises(DataLoss, match="every replica failed"):
            await r.wait()
        with pytest.raises(DataLoss):
            await r.layer_ready(MLA.layers - 1)


def raw_request(address: str, frame: bytes) -> tuple[wire.Header, bytes, socket.socket]:
    sock = data_connection(address)
    sock.sendall(frame)
    header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
    return header, recv_exactly(sock, header.body_len), sock


RAW_NS = os.urandom(16)  # the namespace the raw tests' chunks name in their owner records
RAW_OWNER = meta_pb2.ChunkOwner(namespace_digest=RAW_NS).SerializeToString()


async def test_malformed_frames_get_a_status_and_the_server_serves_on(chunkservers):
    server = chunkservers()
    grant = local_read_grant(RAW_NS)
    async with ChunkClient(server.address) as c:
        await c.write(b"known", os.urandom(3 * MiB), owner=RAW_OWNER)
        data_address = (await c.stat()).data_address
    assert data_address
    cases = [
        (b"GET / HTTP/1.1\r\n\r\n" + bytes(10), 3, "magic"),
        (wire.encode_header(wire.READ, 5, wire.MAX_RANGES + 1, 0), 3, "ranges"),
        (wire.encode_header(wire.READ, 6, 2, 9) + b"\x00" * 9, 3, "chunk id length"),
        (wire.encode_read(7, [wire.Range(b"known", 0, 10, 0, ((0, 10),))], shm=True, grant=grant), 9, "SHM_REGISTER"),
        (wire.encode_shm_register(8, 100), 9, "local socket only"),  # shared memory never over TCP
    ]
    for frame, code, text in cases:
        header, body, sock = raw_request(data_address, frame)
        assert header.kind == wire.STATUS
        got_code, message = wire.parse_status(header, body)
        assert (got_code, text in message) == (code, True), message
        assert sock.recv(1) == b""  # the server closed the connection after a malformed frame
        sock.close()
    # per-range errors keep the connection: unknown chunk, out of range; then a good read
    header, body, sock = raw_request(data_address, wire.encode_read(9, [
        wire.Range(b"unknown", 0, 0), wire.Range(b"known", 3 * MiB, 5), wire.Range(b"known", 10, 20)], grant=grant))
    results = wire.parse_read_reply(header, body)
    assert [r.code for r in results] == [5, 11, 0]
    assert len(recv_exactly(sock, results[2].data_len)) == 65536  # widened to its checksum block
    # a read over the server's limit is refused as a whole, on a connection that stays open
    sock.sendall(wire.encode_read(10, [wire.Range(b"known", 0, 0)] * 200, grant=grant))
    header = wire.parse_header(recv_exactly(sock, 24), requests=False)
    code, message = wire.parse_status(header, recv_exactly(sock, header.body_len))
    assert code == 3 and "at most" in message
    sock.close()
    async with ChunkClient(server.address) as c:
        assert (await c.stat()).counters.rejected_requests >= 4
    assert "malformed request" in server.log_path.read_text()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_clients_vanishing_mid_transfer_leave_the_server_serving(chunkservers):
    server = chunkservers(extra=["--io-mode", "buffered"])
    chunks = {b"c%d" % i: os.urandom(4 * MiB) for i in range(8)}
    grant = local_read_grant(RAW_NS)
    async with ChunkClient(server.address) as c:
        for cid, data in chunks.items():
            await c.write(cid, data, owner=RAW_OWNER)
        data_address = (await c.stat()).data_address
    baseline = open_fds(server.pid)
    for _ in range(20):  # ask for 32 MiB, read a little, vanish
        sock = data_connection(data_address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        sock.sendall(wire.encode_read(1, [wire.Range(cid, 0, 0) for cid in chunks], grant=grant))
        sock.recv(1000)
        sock.close()
    wait_until(lambda: open_fds(server.pid) <= baseline, 20, "the server to drop vanished connections")
    info = ServerInfo("cs-1", server.address, data_address)
    async with Client("127.0.0.1:1", transport="tcp") as client:  # no metaserver needed for raw reads
        from kvfs.client.transport import ReadSpec

        out = bytearray(4 * MiB)
        spec = ReadSpec(b"c3", 0, 4 * MiB, 4 * MiB, chunk_checksum(chunks[b"c3"]), [(0, 0, 4 * MiB)], grant=grant)
        errors = await client._transports["tcp"].read(info, [spec], memoryview(out))
        assert errors == [None] and bytes(out) == chunks[b"c3"]


async def test_dead_data_port_is_retried_on_other_replicas(local_cluster):
    cluster = local_cluster()
    tokens = tokens_for(6, seed=3)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="tcp") as client:
        await client.write(NS, tokens, payload, MLA)
        out, _, _ = await restore(client, tokens)  # connections open to every server
        cluster.chunkservers[2].kill()
        out, order, stats = await restore(client, tokens)
        assert bytes(out) == payload and order == list(range(MLA.layers))
        assert cluster.chunkservers[2].address not in stats.per_server


async def test_a_restarted_servers_old_data_connections_are_closed(local_cluster):
    """A restarted chunkserver comes back on a new data port: the client's dead
    connections to its old one, for reads and for writes, are closed and forgotten
    once it opens the new ones, not kept for the client's lifetime."""
    def fd(conn) -> int:  # -1 once closed (a TLS connection wraps the socket)
        return getattr(conn.sock, "sock", conn.sock).fileno()

    cluster = local_cluster()
    tokens = tokens_for(6, seed=4)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="tcp") as client:
        reads, writes = client._transports["tcp"], client._writer
        await client.write(NS, tokens, payload, MLA)
        await restore(client, tokens)
        cs = cluster.chunkservers[2]
        old = (await client.lookup(NS, tokens)).servers
        old_address = next(s.data_address for s in old if s.address == cs.address)
        held = [c for t in (reads, writes) for c in t._conns.get(old_address, [])]
        assert held and all(fd(c) >= 0 for c in held)
        cs.kill()
        cluster.start_chunkserver(2)
        await until(lambda: all(c.dead is not None for c in held), what="the old connections seen dead")
        for seed in range(20, 26):  # writes placed on every server, the restarted one among them
            await client.write(NS, tokens_for(6, seed=seed), payload, MLA)
            out, _, _ = await restore(client, tokens_for(6, seed=seed))
            assert bytes(out) == payload
        new_address = next(s.data_address for s in (await client.lookup(NS, tokens_for(6, seed=25))).servers
                           if s.address == cs.address)
        assert new_address != old_address
        assert new_address in reads._conns and new_address in writes._conns
        assert old_address not in reads._conns and old_address not in writes._conns
        assert all(fd(c) == -1 for c in held)  # closed, not merely forgotten


def test_same_host_detection():
    assert is_local("127.0.0.1:7000") and is_local("localhost:1") and is_local("[::1]:5")
    assert not is_local("192.0.2.1:7000")  # TEST-NET-1: never this host


@pytest.mark.parametrize("mode", ["direct", "buffered"])
async def test_shm_reads_straight_into_buffer_pool_memory(local_cluster, mode):
    from kvfs.client import BufferPool

    pool = BufferPool(arena_bytes=256 * MiB)  # before the client connects: connections register its arena
    cluster = local_cluster(chunk_extra=["--io-mode", mode])
    tokens = tokens_for(5, seed=7)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="shm") as client:
        await client.write(NS, tokens, payload, MLA)
        match = await client.lookup(NS, tokens)
        buf = pool.get(MLA.buffer_bytes(match.tokens))
        order = [layer async for layer in client.read(match, buf)]
        assert bytes(buf.numpy()) == payload and order == list(range(MLA.layers))
        counts = client._transports["shm"].ranges
        assert counts["zero_copy"] == 10 and counts["staged"] == 0  # 5 blocks x 2 chunks, no copies
        # sub-ranges that start inside a checksum block: the server keeps the widening to itself
        sub = pool.get(MLA.buffer_bytes(match.tokens))
        await client.read(match, sub, layers=[1, 15, 26]).wait()
        stride = match.tokens * MLA.row_bytes
        for layer in (1, 15, 26):
            assert bytes(sub.numpy()[layer * stride : (layer + 1) * stride]) == payload[layer * stride : (layer + 1) * stride]
        # a destination outside the arena is staged and copied
        plain = bytearray(len(payload))
        await client.read(match, plain).wait()
        assert bytes(plain) == payload and client._transports["shm"].ranges["staged"] == 10
        # a corrupt replica is caught by the server before the client uses the bytes
        flip_byte_in_every_chunk_on(cluster.root / "cs-0")
        again = pool.get(MLA.buffer_bytes(match.tokens))
        stats = await client.read(await client.lookup(NS, tokens), again).wait()
        assert bytes(again.numpy()) == payload and stats.retries > 0


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_write_back_opens_the_restores_connections_before_the_hit(local_cluster, transport):
    from kvfs.client import BufferPool

    pool = BufferPool(arena_bytes=64 * MiB)  # shared memory warms only once there is an arena to register
    cluster = local_cluster()
    tokens = tokens_for(6, seed=11)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport=transport, warm_reads=False) as cold:
        await cold.write(NS, tokens_for(6, seed=12), payload, MLA)
        assert not cold._transports[transport]._conns  # off: nothing opened for reads
    async with Client(cluster.meta_address, transport=transport) as client:
        reads = client._transports[transport]
        await client.write(NS, tokens, payload, MLA)
        conns = await until(lambda: not reads._warming and reads._conns and
                            {a: list(c) for a, c in reads._conns.items()}, what="the warmed connections")
        assert all(len(c) == reads.connections for c in conns.values())
        assert reads.warmed == sum(map(len, conns.values()))
        match = await client.lookup(NS, tokens)
        buf = pool.get(MLA.buffer_bytes(match.tokens))
        stats = await client.read(match, buf).wait()
        assert bytes(buf.numpy()) == payload and stats.retries == 0
        assert {s.data_address for s in match.servers} <= set(conns)
        # the restore used the connections the write-back opened; none was opened for it
        assert {a: list(c) for a, c in reads._conns.items()} == conns
        if transport == "shm":  # they registered the arena: read straight into the pool's buffer
            assert reads.ranges["staged"] == 0 and reads.ranges["zero_copy"] > 0


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_warm_up_opens_every_live_servers_connections_before_the_first_lookup(local_cluster, transport):
    from kvfs.client import BufferPool

    pool = BufferPool(arena_bytes=64 * MiB)
    cluster = local_cluster()
    tokens = tokens_for(6, seed=13)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport=transport, warm_reads=False) as writer:
        await writer.write(NS, tokens, payload, MLA)
        status = await writer.status()
    data_ports = {s.data_address for s in status.servers if s.live}
    assert len(data_ports) == len(status.servers) and all(data_ports)  # Status names each data port
    async with Client(cluster.meta_address, transport=transport) as client:
        reads = client._transports[transport]
        assert not reads._conns and not client._tenant_keys
        assert await client.warm_up([NS.tenant]) == len(data_ports)
        assert NS.tenant in client._tenant_keys  # the first lookup asks for no key
        conns = {a: list(c) for a, c in reads._conns.items()}
        assert set(conns) == data_ports and all(len(c) == reads.connections for c in conns.values())
        assert await client.warm_up() == 0  # all open already: nothing more
        match = await client.lookup(NS, tokens)
        buf = pool.get(MLA.buffer_bytes(match.tokens))
        stats = await client.read(match, buf).wait()
        assert bytes(buf.numpy()) == payload and stats.retries == 0
        assert {a: list(c) for a, c in reads._conns.items()} == conns  # the restore opened none
        pool.put(buf)


async def test_a_server_that_refuses_our_buffer_is_read_without_shared_memory(local_cluster, monkeypatch, caplog):
    from kvfs.client import transport

    def unsealed(self, size):  # a memory file the server must refuse: it could shrink under its mapping
        fd = os.memfd_create("kvfs-test-unsealed")
        try:
            os.ftruncate(fd, size)
            self._register(fd, size, 0)
        finally:
            os.close(fd)

    monkeypatch.setattr(transport._Connection, "_map_staging", unsealed)
    cluster = local_cluster()
    tokens = tokens_for(4, seed=11)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="shm") as client:
        await client.write(NS, tokens, payload, MLA)
        out, order, stats = await restore(client, tokens)
        assert bytes(out) == payload and stats.retries == 0
        assert client._transports["shm"].ranges == {"staged": 0, "zero_copy": 0}  # all came over the socket
    assert "not sealed against shrinking" in caplog.text and "without shared memory instead" in caplog.text


def test_a_data_port_that_closes_during_the_tls_handshake_fails_the_connection_at_once():
    """As one does for a host over its connection cap: the client's TLS layer gives up at
    once, saying why (before, the closed socket surfaced only as whatever a later send
    raised, here a broken pipe; a send that happened to succeed would have looped)."""
    import threading
    import time

    from kvfs.client.transport import TlsSocket

    from helpers import credentials

    listener = socket.create_server(("127.0.0.1", 0))

    def close_at_once():
        conn, _ = listener.accept()
        conn.close()

    threading.Thread(target=close_at_once, daemon=True).start()
    sock = socket.create_connection(listener.getsockname())
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="during the TLS handshake"):
        TlsSocket(sock, credentials().ssl_context(server=False), "127.0.0.1")
    assert time.monotonic() - t0 < 5
    sock.close()
    listener.close()


async def test_writes_fall_back_to_grpc_when_a_data_port_turns_them_away(local_cluster, caplog):
    # every data-port connection is refused on accept (a port at its connection limit)
    cluster = local_cluster(chunk_extra=["--data-peer-connections", "0"])
    tokens = tokens_for(4, seed=61)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport="grpc") as reader:
        async with Client(cluster.meta_address) as writer:
            result = await writer.write(NS, tokens, payload, MLA)
            assert result.committed == 4
        out, _, _ = await restore(reader, tokens)
    assert bytes(out) == payload
    written = [scrape(cs.metrics_address) for cs in cluster.chunkservers]
    for transport, count in (("grpc", 2 * 4 * 2), ("local", 0), ("tcp", 0)):  # replicas x blocks x chunks
        assert sum(w[("kvfs_chunk_write_seconds_count", (("transport", transport),))] for w in written) == count
    assert "go over gRPC for 30 s: its data port failed a write" in caplog.text


async def test_a_read_reply_tells_the_backlog_other_clients_left_at_the_server(chunkservers):
    """READ_REPLY's flags: MiB of reads the server had taken ahead of this one and not
    yet sent, from any client. A client that asks for 24 MiB and reads none of it holds
    them there; another client's read is told so, and nothing once that one is gone."""
    server = chunkservers()
    grant = local_read_grant(RAW_NS)
    async with ChunkClient(server.address) as c:
        for i in range(24):
            await c.write(b"big%d" % i, os.urandom(MiB), owner=RAW_OWNER)
        await c.write(b"small", os.urandom(64 << 10), owner=RAW_OWNER)
        data_address = (await c.stat()).data_address

    def small_read() -> int:
        header, body, sock = raw_request(data_address, wire.encode_read(2, [wire.Range(b"small", 0, 0)], grant=grant))
        assert header.kind == wire.READ_REPLY
        recv_exactly(sock, wire.parse_read_reply(header, body)[0].data_len)
        sock.close()
        return header.flags

    assert small_read() == 0
    stalled = data_connection(data_address)
    stalled.sendall(wire.encode_read(1, [wire.Range(b"big%d" % i, 0, 0) for i in range(24)], grant=grant))
    header = wire.parse_header(recv_exactly(stalled, wire.HEADER.size), requests=False)
    assert (header.kind, header.flags) == (wire.READ_REPLY, 0)  # nothing was ahead of it
    assert small_read() == 24
    stalled.close()
    wait_until(lambda: small_read() == 0, 10, "the stalled client's backlog gone with it")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_write_work_runs_nicer_than_the_threads_that_serve_restores(local_cluster, transport):
    cluster = local_cluster(chunk_extra=["--write-nice", "6"])
    pids = [cs.pid for cs in cluster.chunkservers]
    base = {pid: thread_nices(pid)[pid] for pid in pids}  # each server's main thread: its loop

    def niced(pid):
        return sum(n == min(19, base[pid] + 6) for n in thread_nices(pid).values())

    tokens = tokens_for(8, seed=5)
    payload = os.urandom(MLA.buffer_bytes(len(tokens)))
    async with Client(cluster.meta_address, transport=transport, write_nice=5) as writer:
        await writer.write(NS, tokens, payload, MLA)
        mine = list(writer._write_threads._threads)  # this client's, not another's left over
        assert mine and {thread_nice(t.native_id) for t in mine} == {min(19, thread_nice() + 5)}
        while_open = {pid: niced(pid) for pid in pids}
        assert all(while_open.values()), while_open  # every server stored chunks on nicer threads
        assert {pid: thread_nices(pid)[pid] for pid in pids} == base
    # the writer's data connections closed: their threads on the servers were the nicer ones, and end
    wait_until(lambda: sum(map(niced, pids)) < sum(while_open.values()), what="write connection threads ended")
    async with Client(cluster.meta_address, transport=transport) as reader:
        out, _, _ = await restore(reader, tokens)
    assert bytes(out) == payload
