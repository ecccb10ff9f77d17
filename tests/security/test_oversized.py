"""Oversized requests against a real secure metaserver, from raw gRPC stubs: gRPC
refuses them before reading them (the metaserver's max_request_bytes, not the
320 MiB chunk data needs), the metaserver's memory does not grow with them, and
it keeps answering beside them."""

from __future__ import annotations

import grpc

from kvfs import tls
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS

from helpers import rss_bytes
from test_attacks import NS_A_MSG, refused, write_and_restore
from test_attacks import NS_A as NS

MiB = 1 << 20
DEFAULT_LIMIT = 64 * MiB  # MetaserverConfig.max_request_bytes


async def test_a_request_over_the_metaservers_limit_is_refused_unread_while_others_are_served(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS, seed=51)
    async with tls.aio_channel(cluster.meta_address, who.worker_a, CHANNEL_OPTIONS) as ch:
        meta = meta_pb2_grpc.MetaServiceStub(ch)
        pid = cluster.meta.pid
        before = rss_bytes(pid)
        # one key of 65 MiB: cheap to send, and over the limit whatever the keys would say
        huge = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[b"k" * (DEFAULT_LIMIT + MiB)])
        for _ in range(4):
            err = await refused(meta.MatchPrefix(huge, timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "larger than max" in err.details()
        assert rss_bytes(pid) - before < 48 * MiB  # four 65 MiB requests, none of them kept
        # just under the limit: read, then refused by the metaserver itself for what it says
        keys = [b"k" * 16] * 100_001
        err = await refused(meta.MatchPrefix(meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=keys), timeout=30),
                            grpc.StatusCode.INVALID_ARGUMENT)
        assert "at most 100000" in err.details()
    # the legitimate path, throughout and after
    await write_and_restore(cluster, who.worker_a, NS, seed=52)
