"""gRPC settings and servicer plumbing every kvfs server shares."""

from __future__ import annotations

import functools
import logging

import grpc

from kvfs.config import MiB
from kvfs.errors import KvfsError

# Chunks are up to 64 MiB and a ReadChunks reply up to 256 MiB; gRPC's default
# receive limit is 4 MiB.
MAX_MESSAGE = 320 * MiB

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]

log = logging.getLogger("kvfs.rpc")


async def abort(context: grpc.aio.ServicerContext, rpc: str, err: KvfsError) -> None:
    """Ends the call with the error's status and message, after a log line."""
    level = logging.ERROR if err.code == grpc.StatusCode.INTERNAL else logging.WARNING
    log.log(level, "%s from %s: %s %s", rpc, context.peer(), err.code.name, err.message)
    await context.abort(err.code, err.message)


def handles_errors(method):
    """Servicer method decorator: a KvfsError becomes its gRPC status (and a log
    line), and the servicer's optional `on_error(err)` hook sees it; the server
    serves on."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except KvfsError as err:
            if hasattr(self, "on_error"):
                self.on_error(err)
            await abort(context, method.__name__, err)

    return wrapper
