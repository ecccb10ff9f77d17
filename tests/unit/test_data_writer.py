"""DataWriter, the SDK's chunk writes on the data port, against fake data ports on
raw sockets: what a server's answers become for the caller (a receipt, the
server's own refusal, or Unavailable, which sends the write to gRPC)."""

import asyncio
import socket
import threading

import pytest

from kvfs import wire
from kvfs.client.transport import DataWriter
from kvfs.errors import PermissionDenied, Unavailable

from helpers import recv_exactly


class FakePort:
    """A data port that reads one WRITE (and its bytes when `read_bytes`) per
    connection and answers it with `answer(request_id) -> frame`, then closes."""

    def __init__(self, answer, read_bytes: bool = True):
        self.answer, self.read_bytes = answer, read_bytes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[wire.WriteRequest] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                header = wire.parse_header(recv_exactly(conn, wire.HEADER.size))
                req = wire.parse_write(header, recv_exactly(conn, header.body_len))
                if self.read_bytes:
                    recv_exactly(conn, req.length)
                self.received.append(req)
                conn.sendall(self.answer(header.request_id))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("answer,expect", [
    (lambda rid: wire.encode_write_reply(rid, 0, "", True, b"receipt"), (True, b"receipt")),
    # a server that predates WRITE: the caller goes to gRPC
    (lambda rid: wire.encode_status(rid, 3, "unknown request kind 4"), Unavailable),
    # the server's own refusal of what the write carries: the caller hears it as it is
    (lambda rid: wire.encode_status(rid, 7, "no owner record sealed by the metaserver"), PermissionDenied),
])
async def test_what_a_data_port_answers_is_what_the_writer_gets(answer, expect):
    port = FakePort(answer, read_bytes=expect != PermissionDenied)
    writer = DataWriter(connections=1, local=False)
    data = bytes(range(256)) * 40
    try:
        if isinstance(expect, tuple):
            assert await writer.write(port.address, b"chunk-1", data, 1234, b"owner") == expect
        else:
            with pytest.raises(expect):
                await asyncio.wait_for(writer.write(port.address, b"chunk-1", data, 1234, b"owner"), 30)
        assert port.received == [wire.WriteRequest(b"chunk-1", len(data), 1234, b"owner")]
    finally:
        await writer.close()
        port.close()


@pytest.mark.asyncio
async def test_a_port_that_cannot_be_reached_is_unavailable():
    free = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()  # nothing listens there now
    writer = DataWriter(connections=1, local=False)
    try:
        with pytest.raises(Unavailable):
            await writer.write(address, b"chunk-1", b"x" * 100, 1, b"")
    finally:
        await writer.close()
