"""etcd holds the shard map and the metaservers' leases: whoever can write it can move
every hash slot, or stop every metaserver answering. A local cluster's etcd speaks
mutual TLS only, with certificates from the cluster's CA, and a secure metaserver
speaks only TLS to etcd. Attacks from raw etcd clients."""

from __future__ import annotations

import aetcd
import grpc
import pytest

from kvfs.cli.launcher import LaunchError, start_etcd, start_metaserver
from kvfs.metaserver.coordination import EtcdClient
from kvfs.tls import ADMIN, Authority, LocalCA


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    root = tmp_path_factory.mktemp("etcd-tls")
    ca = LocalCA(root / "ca")
    etcd = start_etcd(root / "etcd", run_dir=root, ca=ca)
    yield ca, etcd
    etcd.stop()


async def reads(endpoint: str, credentials=None) -> bool:
    client = EtcdClient([endpoint], credentials=credentials, timeout=3)
    try:
        await client.put(b"/kvfs/probe", b"x")
        return (await client.get(b"/kvfs/probe")).value == b"x"
    finally:
        await client.close()


async def test_the_local_clusters_etcd_serves_its_cas_certificates_only(tls_etcd):
    ca, etcd = tls_etcd
    ours = ca.credentials("ops", [ADMIN])
    assert await reads(etcd.address, ours.channel())
    foreign = Authority.create("someone else's CA").issue("ops", [ADMIN])
    attackers = [None,  # plaintext
                 grpc.ssl_channel_credentials(root_certificates=ours.ca),  # TLS, no client certificate
                 # TLS, trusting etcd, with a certificate the cluster's CA did not sign
                 grpc.ssl_channel_credentials(root_certificates=ours.ca, private_key=foreign.key,
                                              certificate_chain=foreign.cert)]
    for creds in attackers:
        with pytest.raises(aetcd.ClientError):
            await reads(etcd.address, creds)
    assert await reads(etcd.address, ours.channel())  # still serving


def test_a_secure_metaserver_without_its_etcd_certificate_does_not_start(tls_etcd, tmp_path):
    ca, etcd = tls_etcd
    with pytest.raises(LaunchError, match="etcd: TLS files missing: certificate"):
        start_metaserver(tmp_path / "data", run_dir=tmp_path, ca=ca, timeout=30,
                         extra=["--etcd", etcd.address, "--etcd-cert", str(tmp_path / "absent.pem")])
