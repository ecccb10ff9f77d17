"""gRPC settings and servicer plumbing every kvfs server shares."""

from __future__ import annotations

import functools
import inspect
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
    trailers = err.trailers() if hasattr(err, "trailers") else ()
    await context.abort(err.code, err.message, trailers)


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


class ParsesRequests(grpc.aio.ServerInterceptor):
    """Parses each request in its handler instead of in gRPC: a body that is not the
    method's message is INVALID_ARGUMENT saying so, with a log line, where gRPC's own
    failed parse would answer UNKNOWN ("Unexpected DecodeError"). After the access
    check (kvfs.auth.Authorizer comes first), so a refused caller's bytes are never parsed."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _parsing(handler, details.method)


def _parsing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` taking raw bytes and parsing them itself, for each of the four call shapes."""
    parse = handler.request_deserializer
    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
           ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)

    async def parsed(raw: bytes, context):
        try:
            return parse(raw)
        except Exception as err:  # DecodeError, or whatever else a parser makes of hostile bytes
            log.warning("%s from %s: INVALID_ARGUMENT, the request does not parse: %s", method, context.peer(), err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{method}: the request is not a well-formed message of its type: {err}")

    async def each(requests, context):
        async for raw in requests:
            yield await parsed(raw, context)

    async def request(raw_or_stream, context):
        return each(raw_or_stream, context) if handler.request_streaming else await parsed(raw_or_stream, context)

    if inspect.isasyncgenfunction(behavior):
        async def parsing(raw_or_stream, context):
            async for reply in behavior(await request(raw_or_stream, context), context):
                yield reply
    else:
        async def parsing(raw_or_stream, context):
            return await behavior(await request(raw_or_stream, context), context)

    return handler._replace(request_deserializer=None, **{kind: parsing})

