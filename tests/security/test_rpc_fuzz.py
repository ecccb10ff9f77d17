"""Every gRPC method of both servers against hostile bytes, from raw channels that
send whatever they are given (issue "Abuse resistance": the RPC fuzzer covers the
new messages, Usage and TenantKey among them). For each method: random byte strings, and a
valid request mangled (bytes flipped, cut short, spliced, lengths inflated). Each
call gets an answer: a result, or a status that says what was wrong, never
UNKNOWN (an unhandled error in a handler) and never a dead server; afterwards
both servers are healthy and a worker writes and restores beside them.

Rebuild is left out: it is an admin's recovery command whose every run rebuilds
the whole metadata (a hostile body would only be one more rebuild)."""

from __future__ import annotations

import os
import random

import grpc

from kvfs import tls
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


def templates(server_address: str) -> dict[str, tuple[str, bytes, bool]]:
    """method path -> (who calls it, a valid request, whether the reply is a stream)."""
    keys = [os.urandom(16) for _ in range(3)]
    commit = meta_pb2.CommitBlocksRequest(namespace=NS_A_MSG, allocation_id=os.urandom(16), ttl_class="chat")
    commit.blocks.add(key=keys[0], chunk_checksums=[1, 2], receipts=[os.urandom(16)])
    meta, chunk = "/kvfs.meta.MetaService/", "/kvfs.chunk.ChunkService/"
    ids = [os.urandom(16) for _ in range(2)]
    return {
        meta + "MatchPrefix": ("worker", meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=keys), False),
        meta + "AllocateBlocks": ("worker", meta_pb2.AllocateBlocksRequest(namespace=NS_A_MSG, keys=keys,
                                                                           layout=LAYOUT_MSG), False),
        meta + "CommitBlocks": ("worker", commit, False),
        meta + "Status": ("worker", meta_pb2.StatusRequest(), False),
        meta + "Usage": ("worker", meta_pb2.UsageRequest(tenants=["tenant-a", "tenant-b"]), False),
        meta + "TenantKey": ("worker", meta_pb2.TenantKeyRequest(tenant="tenant-a"), False),
        meta + "RunLifecycle": ("worker", meta_pb2.RunLifecycleRequest(), False),
        meta + "Register": ("server", meta_pb2.RegisterRequest(server_id="rogue", address="127.0.0.1:1",
                                                               failure_domain="x", capacity_bytes=1 << 30), False),
        meta + "Heartbeat": ("server", meta_pb2.HeartbeatRequest(server_id="rogue", used_bytes=1), False),
        chunk + "ReadChunks": ("worker", chunk_pb2.ReadChunksRequest(
            ranges=[chunk_pb2.ReadRange(chunk_id=i, length=100) for i in ids], read_grant=os.urandom(48)), True),
        chunk + "DeleteChunks": ("worker", chunk_pb2.DeleteChunksRequest(chunk_ids=ids), False),
        chunk + "ListChunks": ("worker", chunk_pb2.ListChunksRequest(start_after=ids[0], limit=10), False),
        chunk + "Stat": ("worker", chunk_pb2.StatRequest(), False),
        chunk + "CopyChunk": ("worker", chunk_pb2.CopyChunkRequest(chunk_id=ids[0], source=server_address, length=10,
                                                                   checksum=1), False),
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


def test_hostile_bodies_get_a_status_and_both_servers_serve_on(cluster, who):
    import asyncio

    rng = random.Random(20261201)
    chunkserver = cluster.chunkservers[0].address
    unanswered = []
    parse_errors = 0
    for path, (role, request, streaming) in templates(chunkserver).items():
        target = cluster.meta_address if "/kvfs.meta." in path else chunkserver
        creds = credentials() if role == "worker" else who.rogue_server  # a worker of any tenant, and an admin
        valid = request.SerializeToString()
        with tls.channel(target, creds) as channel:
            call = (channel.unary_stream if streaming else channel.unary_unary)(path)  # bytes in, bytes out
            for i in range(CASES if not path.endswith("RunLifecycle") else 6):
                body = rng.randbytes(rng.randint(0, 512)) if i % 3 == 0 else mangled(valid, rng)
                try:
                    reply = call(body, timeout=30)
                    if streaming:
                        list(reply)
                except grpc.RpcError as err:
                    if err.code() not in ANSWERS:
                        unanswered.append((path, body.hex(), err.code(), err.details()))
                    elif err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        parse_errors += "not a well-formed message" in err.details()
    assert not unanswered, [(p, c, d) for p, _, c, d in unanswered[:5]]
    assert parse_errors > 0  # bodies that did not parse were told so
    assert cluster.meta.alive() and all(cs.alive() for cs in cluster.chunkservers)
    asyncio.run(write_and_restore(cluster, credentials(), NS_A, seed=97))
