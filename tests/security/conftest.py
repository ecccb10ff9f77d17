"""One secure local cluster for the attack tests of a module (real processes, the
launcher users run), and the identities an attacker might hold."""

from __future__ import annotations

import pytest

from kvfs.cli.launcher import LocalCluster
from kvfs.tls import ADMIN, SERVER, WORKER, Authority

FAST_META = ["--heartbeat-interval", "200ms", "--heartbeat-timeout", "3s", "--lifecycle-interval", "1h"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("secure"), chunkservers=3, replicas=2, capacity="2GiB",
                     meta_extra=FAST_META)
    c.start()
    yield c
    c.stop()


class Identities:
    """Certificates from the cluster's CA, one role each, and one from a CA it does not trust."""

    def __init__(self, cluster: LocalCluster):
        self.worker_a = cluster.credentials("worker-a", [WORKER], tenants=["tenant-a"])
        self.worker_b = cluster.credentials("worker-b", [WORKER], tenants=["tenant-b"])
        self.admin = cluster.credentials("ops", [ADMIN])
        self.rogue_server = cluster.credentials("rogue", [SERVER], hosts=["127.0.0.1"])
        self.foreign = Authority.create("someone else's CA").issue("worker-a", [WORKER], tenants=["tenant-a"])


@pytest.fixture(scope="module")
def who(cluster) -> Identities:
    return Identities(cluster)
