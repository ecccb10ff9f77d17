"""Every gRPC method of both servers against hostile bytes, from raw channels that
send whatever they are given (issue "Abuse resistance": the RPC fuzzer covers the
new messages, Usage, TenantKey and ShardMap among them). For each method: random byte strings, and a
valid request mangled (bytes flipped, cut short, spliced, lengths inflated). Each
call gets an answer: a result, or a status that says what was wrong, never
UNKNOWN (an unhandled error in a handler) and never a dead server; afterwards
both servers are healthy and a worker writes and restores beside them.

Health and reflection are fuzzed on both servers. Rebuild is left out: it is an admin's recovery command whose every run rebuilds
the whole metadata (a hostile body would only be one more rebuild)."""

from __future__ import annotations

import os
import random

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvfs import auth, tls
from kvfs.proto import chunk_pb2, meta_pb2

from helpers import credentials
from test_attacks import NS_A, NS_A_MSG, write_and_restore

CASES = 60  # per method: a third random bytes, the rest mangled valid requests
LAYOUT_MSG = meta_pb2.BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
# what a hostile body may earn: a status that says what was wrong (a body that does not
# parse: INVALID_ARGUMENT, kvfs.rpc.ParsesRequests)
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.ALREADY_EXISTS}

# grpcio-health-checking's servicer does not implement List (its base class answers UNIMPLEMENTED)
ALSO = {"/grpc.health.v1.Health/List": {grpc.StatusCode.UNIMPLEMENTED}}


def templates(server_address: str) -> dict[str, tuple[str, bytes, str]]:
    """method path -> (who calls it, a valid request, the call's shape: unary, stream
    (replies until the server ends), watch (replies until the caller leaves), upload
    (a stream of requests, here of one), bidi)."""
    keys = [os.urandom(16) for _ in range(3)]
    commit = meta_pb2.CommitBlocksRequest(namespace=NS_A_MSG, allocation_id=os.urandom(16), ttl_class="chat")
    commit.blocks.add(key=keys[0], chunk_checksums=[1, 2], receipts=[os.urandom(16)])
    meta, chunk = "/kvfs.meta.MetaService/", "/kvfs.chunk.ChunkService/"
    health, reflection = "/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/"
    ids = [os.urandom(16) for _ in range(2)]
    return {
        meta + "MatchPrefix": ("worker", meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=keys), "unary"),
        meta + "AllocateBlocks": ("worker", meta_pb2.AllocateBlocksRequest(namespace=NS_A_MSG, keys=keys,
                                                                           layout=LAYOUT_MSG), "unary"),
        meta + "CommitBlocks": ("worker", commit, "unary"),
        meta + "Status": ("worker", meta_pb2.StatusRequest(), "unary"),
        meta + "Usage": ("worker", meta_pb2.UsageRequest(tenants=["tenant-a", "tenant-b"]), "unary"),
        meta + "TenantKey": ("worker", meta_pb2.TenantKeyRequest(tenant="tenant-a"), "unary"),
        meta + "ShardMap": ("worker", meta_pb2.ShardMapRequest(), "unary"),
        meta + "RunLifecycle": ("worker", meta_pb2.RunLifecycleRequest(), "unary"),
        meta + "Register": ("server", meta_pb2.RegisterRequest(server_id="rogue", address="127.0.0.1:1",
                                                               failure_domain="x", capacity_bytes=1 << 30), "unary"),
        meta + "Heartbeat": ("server", meta_pb2.HeartbeatRequest(server_id="rogue", used_bytes=1), "unary"),
        chunk + "ReadChunks": ("worker", chunk_pb2.ReadChunksRequest(
            ranges=[chunk_pb2.ReadRange(chunk_id=i, length=100) for i in ids], read_grant=os.urandom(48)), "stream"),
        chunk + "WriteChunk": ("worker", chunk_pb2.WriteChunkRequest(header=chunk_pb2.ChunkHeader(
            chunk_id=ids[0], length=5, checksum=1), data=b"bytes"), "upload"),
        chunk + "DeleteChunks": ("worker", chunk_pb2.DeleteChunksRequest(chunk_ids=ids), "unary"),
        chunk + "ListChunks": ("worker", chunk_pb2.ListChunksRequest(start_after=ids[0], limit=10), "unary"),
        chunk + "Stat": ("worker", chunk_pb2.StatRequest(), "unary"),
        chunk + "CopyChunk": ("worker", chunk_pb2.CopyChunkRequest(chunk_id=ids[0], source=server_address, length=10,
                                                                   checksum=1), "unary"),
        # served by both servers
        health + "Check": ("worker", health_pb2.HealthCheckRequest(service=""), "unary"),
        health + "Watch": ("worker", health_pb2.HealthCheckRequest(service="kvfs.chunk.ChunkService"), "watch"),
        health + "List": ("worker", health_pb2.HealthListRequest(), "unary"),
        reflection + "ServerReflectionInfo": ("worker", reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="kvfs.meta.MetaService"), "bidi"),
    }


def mangled(valid: bytes, rng: random.Random) -> bytes:
    """A hostile variation of a valid serialized request."""
    raw = bytearray(valid or b"\x0a\x00")
    how = rng.randrange(5)
    if how == 0:  # bytes flipped
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif how == 1:  # cut short
        del raw[rng.randrange(len(raw)) :]
    elif how == 2:  # a piece repeated (fields given twice, repeated fields grown)
        at, n = rng.randrange(len(raw)), rng.randint(1, 16)
        raw[at:at] = raw[at : at + n] * rng.randint(2, 50)
    elif how == 3:  # a length prefix inflated
        raw[rng.randrange(len(raw))] = rng.choice([0x7F, 0xFF])
    else:  # random bytes spliced in
        at = rng.randrange(len(raw) + 1)
        raw[at:at] = rng.randbytes(rng.randint(1, 64))
    return bytes(raw)


def test_the_templates_cover_every_method_the_servers_serve():
    # every served method has a rule (tests/unit/test_rules.py); Rebuild: see the docstring
    assert set(templates("127.0.0.1:1")) | {"/kvfs.meta.MetaService/Rebuild"} == set(auth.RULES)


def call_once(channel: grpc.Channel, path: str, shape: str, body: bytes) -> None:
    """Sends `body` to `path` as raw bytes and reads what the call's shape returns."""
    if shape == "unary":
        channel.unary_unary(path)(body, timeout=30)
    elif shape == "upload":
        channel.stream_unary(path)(iter([body]), timeout=30)
    elif shape == "bidi":
        list(channel.stream_stream(path)(iter([body]), timeout=30))
    else:
        replies = channel.unary_stream(path)(body, timeout=30)
        if shape == "stream":
            list(replies)
        else:  # a watch answers at once, then only on a change: its first reply, then leave
            next(replies, None)
            replies.cancel()


def test_hostile_bodies_get_a_status_and_both_servers_serve_on(cluster, who):
    import asyncio

    rng = random.Random(20261201)
    chunkserver = cluster.chunkservers[0].address
    unanswered = []
    parse_errors = 0
    for path, (role, request, shape) in templates(chunkserver).items():
        both = [cluster.meta_address, chunkserver]
        targets = both[:1] if "/kvfs.meta." in path else both[1:] if "/kvfs.chunk." in path else both
        creds = credentials() if role == "worker" else who.rogue_server  # a worker of any tenant, and an admin
        valid = request.SerializeToString()
        for target in targets:
            with tls.channel(target, creds) as channel:
                for i in range(CASES if not path.endswith("RunLifecycle") else 6):
                    body = rng.randbytes(rng.randint(0, 512)) if i % 3 == 0 else mangled(valid, rng)
                    try:
                        call_once(channel, path, shape, body)
                    except grpc.RpcError as err:
                        if err.code() not in ANSWERS | ALSO.get(path, set()):
                            unanswered.append((path, body.hex(), err.code(), err.details()))
                        elif err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            parse_errors += "not a well-formed message" in err.details()
    assert not unanswered, [(p, c, d) for p, _, c, d in unanswered[:5]]
    assert parse_errors > 0  # bodies that did not parse were told so
    assert cluster.meta.alive() and all(cs.alive() for cs in cluster.chunkservers)
    asyncio.run(write_and_restore(cluster, credentials(), NS_A, seed=97))
