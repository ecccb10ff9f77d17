"""Oversized requests against a real secure metaserver, from raw gRPC stubs: gRPC
refuses them before reading them (the metaserver's max_request_bytes, not the
320 MiB chunk data needs), the metaserver's memory does not grow with them, and
it keeps answering beside them; its threads and descriptors stay where they were.

A 6M-key MatchPrefix (108 MB) is refused unread. The largest one the byte limit lets
through (3.7M keys, 66.6 MB) is refused too, unparsed: MatchPrefix and AllocateBlocks
take at most what max_keys keys need (1.9 MB); within that, a request past max_keys is
refused for its key count before a Python object is made for each key."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from kvfs import tls
from kvfs.client import Client
from kvfs.keys import Namespace
from kvfs.proto import meta_pb2, meta_pb2_grpc
from kvfs.rpc import CHANNEL_OPTIONS
from kvfs.tls import WORKER

from helpers import Watch, settled, tokens_for
from test_attacks import LAYOUT, NS_A_MSG, refused, write_and_restore
from test_attacks import NS_A as NS

MiB = 1 << 20
DEFAULT_LIMIT = 64 * MiB  # MetaserverConfig.max_request_bytes
MAX_KEYS = 100_000  # MetaserverConfig.max_keys
SPARE = 8  # the metaserver's threads and descriptors: a test's few channels, gRPC's pollers
LAYOUT_MSG = meta_pb2.BlockLayout(layers=LAYOUT.layers, block_tokens=LAYOUT.block_tokens, kv_dim=LAYOUT.kv_dim,
                                  dtype=LAYOUT.dtype)


class Lookups:
    """A worker looking its prompt up over and over while an attack runs: every
    lookup must find the whole prompt. `served` counts them, `slowest` the longest."""

    def __init__(self, cluster, creds, ns: Namespace, tokens: list[int], blocks: int):
        self.cluster, self.creds, self.ns, self.tokens, self.blocks = cluster, creds, ns, tokens, blocks
        self.served, self.slowest = 0, 0.0

    async def _run(self):
        async with Client(self.cluster.meta_address, credentials=self.creds) as client:
            while True:
                t = time.perf_counter()
                assert (await client.lookup(self.ns, self.tokens)).matched == self.blocks
                self.slowest = max(self.slowest, time.perf_counter() - t)
                self.served += 1
                await asyncio.sleep(0.02)

    async def __aenter__(self):
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        if self.task.done():
            self.task.result()  # a lookup that failed fails the test
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def test_a_request_over_the_metaservers_limit_is_refused_unread_while_others_are_served(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS, seed=51)
    pid = cluster.meta.pid
    async with tls.aio_channel(cluster.meta_address, who.worker_a, CHANNEL_OPTIONS) as ch:
        meta = meta_pb2_grpc.MetaServiceStub(ch)
        await meta.Status(meta_pb2.StatusRequest(), timeout=10)  # the channel connected before the baseline
        with Watch(pid) as seen:
            async with Lookups(cluster, who.worker_a, NS, tokens, 3) as lookups:
                # one key of 65 MiB: cheap to send, and over the limit whatever the keys would say
                huge = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[b"k" * (DEFAULT_LIMIT + MiB)])
                for _ in range(4):
                    err = await refused(meta.MatchPrefix(huge, timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED)
                    assert "larger than max" in err.details()
                grown = seen.sample().rss - seen.before.rss
                # just under the limit: read, then refused by the metaserver itself for what it says
                keys = [b"k" * 16] * (MAX_KEYS + 1)
                err = await refused(meta.MatchPrefix(meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=keys),
                                                     timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
                assert "at most 100000" in err.details()
        after = settled(pid, seen.before, spare=4)  # the lookups' channel closed
    # the legitimate path, throughout and after
    await write_and_restore(cluster, who.worker_a, NS, seed=52)
    before, peak = seen.before, seen.peak
    print(f"saw: four 65 MiB requests grew the metaserver {grown / MiB:.0f} MiB; a worker looked up "
          f"{lookups.served} times meanwhile (slowest {lookups.slowest * 1000:.0f} ms); {seen.grew()}; after: {after}")
    assert lookups.served > 0
    # four 65 MiB requests, none of them kept: less than one of them, beside what the lookups
    # meanwhile add (the block cache, gRPC's buffers): a full run saw +48.5 MiB, alone +20-40
    assert grown < 64 * MiB, seen
    # and 100,001 keys (1.8 MB) read, beside the lookups: what gRPC buffers of a refused request, no more
    assert peak.rss - before.rss < 96 * MiB, seen
    assert peak.threads <= before.threads + SPARE, seen
    assert peak.fds <= before.fds + SPARE, seen


async def test_the_largest_match_prefix_the_byte_limit_lets_through_costs_its_bytes_not_more(cluster, who):
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS, seed=53)
    pid = cluster.meta.pid
    key = os.urandom(16)
    six_million = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[key] * 6_000_000)  # 108 MB
    under = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[key] * ((DEFAULT_LIMIT - 1024) // 18))
    assert six_million.ByteSize() > DEFAULT_LIMIT > under.ByteSize() > DEFAULT_LIMIT - 2048
    async with tls.aio_channel(cluster.meta_address, who.worker_a, CHANNEL_OPTIONS) as ch:
        meta = meta_pb2_grpc.MetaServiceStub(ch)
        await meta.Status(meta_pb2.StatusRequest(), timeout=10)
        with Watch(pid) as seen:
            async with Lookups(cluster, who.worker_a, NS, tokens, 3) as lookups:
                err = await refused(meta.MatchPrefix(six_million, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED)
                assert "larger than max" in err.details()
                unread = seen.sample().rss - seen.before.rss
                t = time.perf_counter()
                err = await refused(meta.MatchPrefix(under, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED)
                took = time.perf_counter() - t
                assert "max_keys keys needs; unread" in err.details(), err.details()
                # one just past what max_keys keys take is refused unparsed too; one at the bound is read
                limit = MAX_KEYS * 18 + 64 * 1024
                past = meta_pb2.MatchPrefixRequest(namespace=NS_A_MSG, keys=[key] * (MAX_KEYS + 4000))
                assert past.ByteSize() > limit
                await refused(meta.MatchPrefix(past, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED)
                err = await refused(meta.MatchPrefix(meta_pb2.MatchPrefixRequest(
                    namespace=NS_A_MSG, keys=[key] * (MAX_KEYS + 1)), timeout=60), grpc.StatusCode.INVALID_ARGUMENT)
                assert f"at most {MAX_KEYS}" in err.details()
        after = settled(pid, seen.before, spare=4)
    before, peak = seen.before, seen.peak
    grown = peak.rss - before.rss
    print(f"saw: a 6M-key MatchPrefix grew the metaserver {unread / MiB:.0f} MiB; one of {len(under.keys):,} keys "
          f"({under.ByteSize() / 1e6:.1f} MB) was refused in {took:.2f} s and grew it {grown / MiB:.0f} MiB at "
          f"most; a worker looked up {lookups.served} times meanwhile (slowest {lookups.slowest * 1000:.0f} ms); "
          f"{seen.grew()}; after: {after}")
    assert lookups.served > 0
    assert unread < 48 * MiB, seen
    assert peak.threads <= before.threads + SPARE, seen
    assert peak.fds <= before.fds + SPARE, seen
    # what max_request_bytes is meant to bound: the request held three times over at once (gRPC core's
    # byte buffer, the slices grpcio copies out of it as bytes, their join into the one bytes the
    # deserializer gets; the core's buffer is freed after the join), and slack for the transport's
    # buffers, the lookups beside it and the allocator. Parsed, it took +549 to +598 MiB.
    assert grown < 3 * DEFAULT_LIMIT + 64 * MiB, f"a MatchPrefix of {DEFAULT_LIMIT // MiB} MiB grew the " \
                                                 f"metaserver {grown / MiB:.0f} MiB"


async def test_malformed_or_oversized_joined_keys_are_refused_while_lookups_are_served(cluster, who):
    """MatchPrefixRequest.joined_keys, the keys as one field: bounded and checked like
    the repeated keys, the tenant checked as ever, each refusal a log line."""
    tokens, _ = await write_and_restore(cluster, who.worker_a, NS, seed=54)
    async with Client(cluster.meta_address, credentials=who.worker_a) as client:
        joined = b"".join((await client.lookup(NS, tokens)).keys)
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def lookup(**fields) -> meta_pb2.MatchPrefixRequest:  # in the namespace the SDK wrote
        return meta_pb2.MatchPrefixRequest(namespace=meta_pb2.Namespace(
            tenant=NS.tenant, model=NS.model, cache_format=NS.cache_format), **fields)

    async with tls.aio_channel(cluster.meta_address, who.worker_a, CHANNEL_OPTIONS) as ch, \
            tls.aio_channel(cluster.meta_address, who.worker_b, CHANNEL_OPTIONS) as other:
        meta, meta_b = meta_pb2_grpc.MetaServiceStub(ch), meta_pb2_grpc.MetaServiceStub(other)
        async with Lookups(cluster, who.worker_a, NS, tokens, 3) as lookups:
            for body, message in ((joined + b"x", "not a whole number of 16-byte keys"),
                                  (joined + bytes(16), "16 zero bytes is not a block key"),
                                  (b"\x01" * 16 * (MAX_KEYS + 1), f"at most {MAX_KEYS}")):
                err = await refused(meta.MatchPrefix(lookup(joined_keys=body), timeout=30), invalid)
                assert message in err.details(), err.details()
            err = await refused(meta.MatchPrefix(lookup(keys=[joined[:16]], joined_keys=joined), timeout=30), invalid)
            assert "one of the two" in err.details()
            # past what max_keys keys take: refused unparsed, as the repeated form is
            err = await refused(meta.MatchPrefix(lookup(joined_keys=b"\x01" * (MAX_KEYS * 18 + 65 * 1024)),
                                                 timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "max_keys keys needs; unread" in err.details()
            # tenant B's worker naming tenant A's namespace, its keys joined
            err = await refused(meta_b.MatchPrefix(lookup(joined_keys=joined), timeout=30),
                                grpc.StatusCode.PERMISSION_DENIED)
            assert "tenant 'tenant-a'" in err.details()
            assert (await meta.MatchPrefix(lookup(joined_keys=joined), timeout=30)).matched == 3
    assert lookups.served > 0
    log = cluster.meta.log_path.read_text()
    assert "not a whole number of 16-byte keys" in log and "one of the two" in log
