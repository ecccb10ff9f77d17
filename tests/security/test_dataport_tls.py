"""The data port over TCP speaks mutual TLS, as gRPC does: from raw sockets against a
real secure cluster, a caller without a certificate of the cluster's CA gets no
byte of a chunk even with a valid read grant (plaintext frames, TLS without a
certificate, a certificate from another CA), and an eavesdropper between a worker
and a chunkserver sees none of the chunk's bytes the worker reads."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from kvfs import wire
from kvfs.client import Client

from helpers import data_connection, recv_exactly
from test_attacks import NS_A, write_and_restore


async def a_chunk_of_a(cluster, who, seed: int):
    """One of tenant A's chunks, of a prompt of its own: (data port holding it, chunk id, A's read grant)."""
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS_A, seed=seed)
    async with Client(cluster.meta_address, credentials=who.worker_a, transport="grpc") as client:
        match = await client.lookup(NS_A, tokens)
    chunk = match.blocks[0].chunks[0]
    return match.servers[chunk.replicas[0]].data_address, chunk.chunk_id, match.read_grant


def read_frame(chunk_id: bytes, grant: bytes) -> bytes:
    return wire.encode_read(1, [wire.Range(chunk_id, 0, 0)], grant=grant)


def refused(sock) -> bool:
    """True when the server answered a request with nothing but a closed connection or a TLS alert."""
    try:
        return sock.recv(1) == b""
    except (ssl.SSLError, ConnectionError):
        return True


def served_on(address: str, chunk_id: bytes, grant: bytes, creds) -> bytes:
    """The chunk's bytes, read with a certificate of the cluster (the port still serves)."""
    with data_connection(address, creds) as sock:
        sock.sendall(read_frame(chunk_id, grant))
        header = wire.parse_header(recv_exactly(sock, wire.HEADER.size), requests=False)
        (result,) = wire.parse_read_reply(header, recv_exactly(sock, header.body_len))
        assert result.code == 0, result.message
        return recv_exactly(sock, result.data_len)


async def test_no_chunk_byte_without_a_certificate_of_the_cluster_even_with_a_grant(cluster, who):
    address, chunk_id, grant = await a_chunk_of_a(cluster, who, seed=91)
    host, port = address.rsplit(":", 1)
    # plaintext, as an --insecure client would speak: the handshake fails, nothing is served
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        plain.sendall(read_frame(chunk_id, grant))
        plain.settimeout(10)
        try:
            answer = plain.recv(1 << 16)
        except ConnectionError:
            answer = b""
        assert not answer.startswith(wire.MAGIC), "a plaintext READ was answered with a data-port frame"
    # TLS that checks the server but shows no certificate of its own: refused at the handshake
    anonymous = ssl.create_default_context(cadata=who.worker_a.ca.decode())
    with anonymous.wrap_socket(socket.create_connection((host, int(port)), timeout=10), server_hostname=host) as s:
        try:
            s.sendall(read_frame(chunk_id, grant))
        except (ssl.SSLError, ConnectionError):
            pass
        assert refused(s)
    # a certificate from a CA the cluster does not trust, for the same name and tenant
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with data_connection(address, foreign_with_our_ca(who)) as s:
            s.sendall(read_frame(chunk_id, grant))
            if refused(s):
                raise ConnectionError("refused after the handshake")
    # and the port serves on: A's worker reads the chunk
    assert len(served_on(address, chunk_id, grant, who.worker_a)) > 0
    assert "TLS handshake" in "".join(cs.log_path.read_text() for cs in cluster.chunkservers)


def foreign_with_our_ca(who):
    """The foreign certificate, trusting our CA (so it accepts our server): only the cluster can refuse it."""
    import dataclasses

    return dataclasses.replace(who.foreign, ca=who.worker_a.ca)


class Tap:
    """A TCP relay between a client and a data port that keeps every byte it relays."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream)
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        self._pump(server, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


async def test_an_eavesdropper_on_the_link_sees_none_of_the_bytes_a_worker_reads(cluster, who):
    address, chunk_id, grant = await a_chunk_of_a(cluster, who, seed=92)
    tap = Tap(address)
    try:
        data = served_on(tap.address, chunk_id, grant, who.worker_a)
    finally:
        tap.close()
    with tap.lock:
        seen = bytes(tap.seen)
    assert len(data) >= 1 << 14 and len(seen) > len(data)  # the whole chunk (16 KiB) went through the tap
    windows = [data[i : i + 32] for i in range(0, len(data) - 32, max(1, len(data) // 64))]
    leaked = [w for w in windows if w in seen]
    assert not leaked, f"{len(leaked)} of {len(windows)} 32-byte pieces of the chunk crossed the wire in the clear"
