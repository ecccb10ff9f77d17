"""Shared fixtures: real server processes, started with the users' launcher and
stopped at teardown whatever the test did.

Security is on in every suite, as for users. One CA serves the whole session
($KVFS_LOCAL_CA, where the launcher issues each server's certificate), and the
tests' own clients connect as one identity, a worker of any tenant that is also
an admin ($KVFS_CLIENT_TLS_*, which the SDK reads), since functional tests both
write blocks and inspect chunkservers. tests/security checks the access rules with
single-role certificates.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from kvfs.tls import ADMIN, ANY_TENANT, WORKER, LocalCA

_SESSION_TLS: list[str] = []


def pytest_configure(config):
    folder = tempfile.mkdtemp(prefix="kvfs-tests-ca-")
    _SESSION_TLS.append(folder)
    ca, cert, key = LocalCA(folder).issue_files("tests", [WORKER, ADMIN], tenants=[ANY_TENANT])
    os.environ.update({"KVFS_LOCAL_CA": folder, "KVFS_CLIENT_TLS_CA": str(ca), "KVFS_CLIENT_TLS_CERT": str(cert),
                       "KVFS_CLIENT_TLS_KEY": str(key)})


def pytest_unconfigure(config):
    for folder in _SESSION_TLS:
        shutil.rmtree(folder, ignore_errors=True)

from kvfs.cli.launcher import ServerProcess, start_chunkserver


@pytest.fixture
def chunkservers(tmp_path):
    """Factory: chunkservers(n=1, **kwargs) starts chunkserver processes."""
    started: list[ServerProcess] = []

    def start(server_id: str = "cs-1", data_dir=None, **kwargs) -> ServerProcess:
        server = start_chunkserver(data_dir or tmp_path / server_id, server_id=server_id,
                                   run_dir=tmp_path / "run", **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def pytest_report_header(config):
    return f"kvfs tests, pid {os.getpid()}"


FAST_META = ["--heartbeat-interval", "200ms", "--heartbeat-timeout", "3s", "--lifecycle-interval", "1h"]


@pytest.fixture
def local_cluster(tmp_path):
    """Factory: local_cluster(chunkservers=3, replicas=2, meta_extra=[...]) starts a
    LocalCluster (the launcher `kvfs cluster up` uses); all of it stops at teardown."""
    from kvfs.cli.launcher import LocalCluster

    clusters = []

    def start(chunkservers: int = 3, replicas: int = 2, meta_extra=(), **kw) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster-{len(clusters)}", chunkservers=chunkservers, replicas=replicas,
                               capacity=kw.pop("capacity", "2GiB"), meta_extra=FAST_META + list(meta_extra), **kw)
        clusters.append(cluster)
        return cluster.start()

    yield start
    for cluster in clusters:
        cluster.stop()
