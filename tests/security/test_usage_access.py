"""The Usage RPC (per-tenant metering, `kvfs usage`): what one tenant used is that
tenant's business. From raw stubs with single-role certificates against a real
secure cluster: a worker sees only the tenants its certificate names, is refused
another's by name, an admin sees every tenant, a server none; an oversized request
is refused; and the figures are the ones the calls made."""

from __future__ import annotations

import json

import grpc
import pytest

from kvfs import tls
from kvfs.cli.main import main as kvfs
from kvfs.keys import Namespace
from kvfs.proto import meta_pb2, meta_pb2_grpc

from test_attacks import LAYOUT, NS_A, refused, write_and_restore

NS_B = Namespace("tenant-b", "m")


def stub(cluster, creds) -> meta_pb2_grpc.MetaServiceStub:
    return meta_pb2_grpc.MetaServiceStub(tls.aio_channel(cluster.meta_address, creds))


async def usage(cluster, creds, *tenants: str) -> dict[str, meta_pb2.TenantUsage]:
    reply = await stub(cluster, creds).Usage(meta_pb2.UsageRequest(tenants=tenants), timeout=10)
    return {u.tenant: u for u in reply.tenants}


async def test_a_tenant_sees_its_own_usage_only_and_an_admin_sees_all(cluster, who, capsys):
    before = await usage(cluster, who.admin)
    await write_and_restore(cluster, who.worker_a, NS_A, seed=91)  # 3 blocks written, then a 3-block hit
    await write_and_restore(cluster, who.worker_b, NS_B, seed=92)
    await write_and_restore(cluster, who.worker_b, NS_B, seed=93)

    mine = await usage(cluster, who.worker_a)
    assert set(mine) == {"tenant-a"}  # not B's, not "(other)" or "(unknown)"
    a, a0 = mine["tenant-a"], before.get("tenant-a", meta_pb2.TenantUsage())
    # the write adds 3 blocks; the lookup after it finds all 3
    assert a.blocks_written - a0.blocks_written == 3 and a.tokens_written - a0.tokens_written == 3 * 64
    assert a.bytes_written - a0.bytes_written == 3 * LAYOUT.payload_bytes
    assert a.blocks_hit - a0.blocks_hit == 3 and a.tokens_hit - a0.tokens_hit == 3 * 64
    assert a.lookups - a0.lookups >= 1
    assert a.blocks_stored - a0.blocks_stored == 3 and a.bytes_stored - a0.bytes_stored == 3 * LAYOUT.payload_bytes
    assert a.byte_seconds > 0 and a.as_of >= a.since

    everyone = await usage(cluster, who.admin)
    assert {"tenant-a", "tenant-b"} <= set(everyone)
    b0 = before.get("tenant-b", meta_pb2.TenantUsage())
    assert everyone["tenant-b"].blocks_written - b0.blocks_written == 6

    # another tenant's figures, by name: refused; an oversized request: refused
    err = await refused(stub(cluster, who.worker_a).Usage(meta_pb2.UsageRequest(tenants=["tenant-b"]), timeout=10),
                        grpc.StatusCode.PERMISSION_DENIED)
    assert "tenant-b" in err.details()
    await refused(stub(cluster, who.worker_a).Usage(meta_pb2.UsageRequest(tenants=["tenant-a"] * 1001),
                                                    timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    await refused(stub(cluster, who.worker_a).Usage(meta_pb2.UsageRequest(tenants=["x" * 300]), timeout=10),
                  grpc.StatusCode.INVALID_ARGUMENT)
    # a server certificate has no business here, nor a certificate from another CA
    await refused(stub(cluster, who.rogue_server).Usage(meta_pb2.UsageRequest(), timeout=10),
                  grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub(cluster, who.foreign).Usage(meta_pb2.UsageRequest(), timeout=10)
    # and the tenant is still served
    assert set(await usage(cluster, who.worker_a, "tenant-a")) == {"tenant-a"}

    # `kvfs usage` as the operator: the same figures
    assert kvfs(["usage", "--json", "--meta", cluster.meta_address, "--tls-ca", str(cluster.ca.folder / "ca.pem"),
                 "--tls-cert", str(cluster.ca.folder / "admin.pem"), "--tls-key",
                 str(cluster.ca.folder / "admin.key"), "--tenant", "tenant-b"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(t["tenant"], int(t["blocks_written"])) for t in printed["tenants"]] == \
        [("tenant-b", everyone["tenant-b"].blocks_written)]
    # what B's restores read, from the chunkservers' counts per tenant: at least its two restores' payload
    # (the data port sends whole 64 KiB blocks)
    assert printed["restored"]["tenant-b"]["bytes"] >= 2 * LAYOUT.buffer_bytes(3 * 64)
    assert printed["restored"]["tenant-b"]["reads"] >= 2 and printed["restored"]["tenant-b"]["reads_paced"] == 0
