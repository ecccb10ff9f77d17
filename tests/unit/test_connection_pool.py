"""The SDK's pool of data connections (TcpTransport) against a real listening
socket: what it holds after a server was given up on while a connection to it
was being opened."""

import asyncio
import socket
import threading
from types import SimpleNamespace

from kvfs.client.transport import TcpTransport


async def test_a_connection_opened_while_its_server_is_aborted_stays_in_the_pool():
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nothing needs to answer
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    transport = TcpTransport(connections=1)
    entered, release = threading.Event(), threading.Event()
    real_open = transport._open

    def slow_open(addr, arena):
        entered.set()
        release.wait(10)
        return real_open(addr, arena)

    transport._open = slow_open
    try:
        opening = asyncio.create_task(transport._connection(address))
        assert await asyncio.to_thread(entered.wait, 10)
        transport.abort(SimpleNamespace(data_address=address))  # no answer in time: drop what it has
        release.set()
        conn = await asyncio.wait_for(opening, 10)
        # in the pool, where close() and the dead-connection sweep find it; not in a list no one holds
        assert transport._conns == {address: [conn]}
        await transport.close()
        assert conn.sock.fileno() == -1
    finally:
        release.set()
        await transport.close()
        listener.close()
