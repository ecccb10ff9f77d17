"""Grants (kvfs/grants.py): what the metaserver seals and chunkservers check."""

import os

from kvfs.grants import READ_GRANT_BYTES, ReadGrant, granted, owner_namespace, owner_record, read_grant, tenant_id
from kvfs.proto import meta_pb2

KEY = os.urandom(32)
NS = os.urandom(16)


def test_a_read_grant_names_its_namespace_and_tenant_until_it_expires_and_only_under_its_key():
    grant = read_grant(KEY, NS, "acme", 1000.0)
    assert len(grant) == READ_GRANT_BYTES
    assert granted(KEY, grant, 999.0) == ReadGrant(NS, tenant_id("acme"))
    assert granted(KEY, grant, 1000.0) == ReadGrant(NS, tenant_id("acme"))
    assert granted(KEY, grant, 1001.0) is None  # expired
    assert granted(os.urandom(32), grant, 999.0) is None  # another cluster's key
    other = os.urandom(16)
    assert granted(KEY, other + grant[16:], 999.0) is None  # another namespace, same seal
    assert granted(KEY, grant[:16] + tenant_id("other") + grant[24:], 999.0) is None  # another tenant's pace
    later = read_grant(KEY, NS, "acme", 5000.0)
    assert granted(KEY, grant[:24] + later[24:32] + grant[32:], 2000.0) is None  # expiry moved
    assert granted(KEY, grant[:-1], 999.0) is None and granted(KEY, b"", 999.0) is None


def test_owner_namespace_reads_the_digest_a_stored_owner_record_names():
    layout = meta_pb2.BlockLayout(layers=2, block_tokens=64, kv_dim=64, dtype="bfloat16")
    raw = owner_record(NS, b"k" * 16, 0, 1, layout, 1 << 20, b"s" * 16, 7, "chat")
    assert owner_namespace(raw) == NS
    no_namespace = meta_pb2.ChunkOwner(block_key=b"k" * 16).SerializeToString()
    assert owner_namespace(no_namespace) == b"" and owner_namespace(b"") == b""
    assert owner_namespace(b"\xff\xff garbage") == b""


def test_a_lookup_carries_a_read_grant_for_its_namespace(make_state):
    from helpers import Clock

    clock = Clock()
    state = make_state(clock, read_grant_ttl=60)
    reply = state.match(NS, [b"k" * 16])
    assert reply.read_grant == b""  # an --insecure metaserver grants nothing (and nobody checks)
    state.key = state.allocations.key = KEY
    reply = state.match(NS, [b"k" * 16])
    assert granted(KEY, reply.read_grant, clock.now + 60).namespace == NS
    assert granted(KEY, reply.read_grant, clock.now + 61) is None
