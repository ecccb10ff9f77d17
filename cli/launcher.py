"""Starts kvfs servers as separate processes and waits until they are healthy.

The same code serves `kvfs demo`, `kvfs-bench` and the tests, so what the tests
exercise is what users run.

Security is on unless a server is started with --insecure: the launcher keeps a
local CA in the run folder's `tls/` (or in $KVFS_LOCAL_CA, shared by several
clusters), issues each server a certificate naming its id and its hosts, and talks
to the servers with an `admin` certificate from the same CA. Workers of a local
cluster use `LocalCluster.worker` (any tenant) or a certificate `credentials()` issues.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfs import tls
from kvfs.tls import ADMIN, ANY_TENANT, SERVER, WORKER, Credentials, LocalCA


if TYPE_CHECKING:
    from .hosts import Hosts


class LaunchError(RuntimeError):
    pass


@dataclass
class ServerProcess:
    """A running server: its process, bound address and log file."""

    name: str
    proc: subprocess.Popen
    address: str
    log_path: pathlib.Path
    args: list[str] = field(default_factory=list)
    credentials: Credentials | None = None  # what the launcher talks to it with (None: --insecure)
    metrics_address: str = ""  # host:port of its Prometheus metrics ("": it serves none)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """Asks it to stop (SIGTERM) without waiting."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        if self.alive():
            self.proc.kill()
        return self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def local_ca(run_dir: str | os.PathLike) -> LocalCA:
    """The launcher's CA: $KVFS_LOCAL_CA if set, else `<run_dir>/tls`; made on first use."""
    return LocalCA(os.environ.get("KVFS_LOCAL_CA") or pathlib.Path(run_dir) / "tls")


def admin_credentials(ca: LocalCA) -> Credentials:
    return ca.credentials("admin", [ADMIN])


def _secure(name: str, args: list[str], listen: str, ca: LocalCA | None,
            run_dir: pathlib.Path) -> tuple[list[str], Credentials | None]:
    """`args` with the TLS flags of a fresh certificate for server `name` from the
    local CA, and the admin credentials to reach it; as given with --insecure."""
    if "--insecure" in args:
        return args, None
    ca = ca or local_ca(run_dir)
    hosts = [*tls.LOCAL_HOSTS, listen.rsplit(":", 1)[0].strip("[]")]
    if "--advertise" in args:
        hosts.append(args[args.index("--advertise") + 1].rsplit(":", 1)[0].strip("[]"))
    paths = ca.issue_files(name, [SERVER], hosts=[h for h in hosts if h not in ("", "0.0.0.0", "::")])
    return [*args, *(x for flag, path in zip(("--tls-ca", "--tls-cert", "--tls-key"), paths)
                     for x in (flag, str(path))), "--cluster-key", str(ca.key_path)], admin_credentials(ca)


def health(address: str, credentials: Credentials | None = None, timeout: float = 5) -> str:
    """What the gRPC health service at `address` answers for the whole server:
    SERVING or NOT_SERVING (a chunkserver before it registered, or while full)."""
    with tls.channel(address, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_healthy(address: str, timeout: float = 30, credentials: Credentials | None = None) -> None:
    """Waits until the gRPC health service at `address` answers SERVING (a
    chunkserver: once it has registered with its metaserver)."""
    deadline = time.monotonic() + timeout
    with tls.channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"{address} not healthy after {timeout}s (health: {status})")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(left, 2), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                status = err.code().name
            time.sleep(0.05)


def start_server(name: str, module: str, args: list[str], run_dir: pathlib.Path,
                 timeout: float = 30, env: dict[str, str] | None = None, netns: str | None = None,
                 credentials: Credentials | None = None, healthy: bool = True) -> ServerProcess:
    """Runs `python -m module args --ready-file ...` (inside network namespace
    `netns` when given: `ip netns exec`, as root) and waits for it to serve,
    checking its health with `credentials` (None: plaintext); with `healthy` off,
    only until it listens (its health may still say NOT_SERVING)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ready = run_dir / f"{name}.addr"
    ready.unlink(missing_ok=True)
    log_path = run_dir / f"{name}.log"
    cmd = [sys.executable, "-m", module, *args, "--ready-file", str(ready)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]  # execs: the pid is the server's
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    server = ServerProcess(name, proc, "", log_path, args, credentials)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not server.alive():
            raise LaunchError(f"{name} exited with {proc.returncode} before serving:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            server.kill()
            raise LaunchError(f"{name} did not start within {timeout}s:\n{server.log_tail()}")
        time.sleep(0.02)
    address, *others = ready.read_text().splitlines()
    server.address = address.strip()
    server.metrics_address = dict(line.split(" ", 1) for line in others).get("metrics", "")
    try:
        if healthy:
            wait_healthy(server.address, max(1.0, deadline - time.monotonic()), credentials)
    except LaunchError as err:
        server.kill()
        raise LaunchError(f"{name}: {err}:\n{server.log_tail()}") from None
    return server


def start_chunkserver(data_dir: str | os.PathLike, *, server_id: str = "cs-1",
                      failure_domain: str | None = None, capacity: str | None = None,
                      listen: str = "127.0.0.1:0", extra: list[str] | None = None,
                      run_dir: str | os.PathLike | None = None, timeout: float = 30,
                      env: dict[str, str] | None = None, netns: str | None = None,
                      ca: LocalCA | None = None, healthy: bool = True) -> ServerProcess:
    """Starts `kvfs-chunkserver` in its own process; returns once it serves (its
    health SERVING: registered, when it has a metaserver; with `healthy` off, once
    it listens).

    Options left None come from the server's own config (environment, TOML, defaults).
    Unless `extra` holds --insecure, it gets a certificate for `server_id` from `ca`
    (default: local_ca(run_dir)).
    """
    data_dir = pathlib.Path(data_dir)
    run_dir = pathlib.Path(run_dir) if run_dir else data_dir.parent
    args = ["--data-dir", str(data_dir), "--listen", listen, "--id", server_id]
    for flag, value in (("--failure-domain", failure_domain), ("--capacity", capacity)):
        if value is not None:
            args += [flag, value]
    args, creds = _secure(server_id, args + (extra or []), listen, ca, run_dir)
    return start_server(server_id, "kvfs.chunkserver", args, run_dir, timeout, env, netns, creds, healthy)


def start_metaserver(data_dir: str | os.PathLike, *, listen: str = "127.0.0.1:0", replicas: int | None = None,
                     extra: list[str] | None = None, run_dir: str | os.PathLike | None = None,
                     timeout: float = 30, env: dict[str, str] | None = None,
                     netns: str | None = None, ca: LocalCA | None = None, name: str = "metaserver") -> ServerProcess:
    """Starts `kvfs-metaserver` in its own process; returns once it serves (TLS as
    start_chunkserver's). `name` names its log and ready file (several in one run folder)."""
    data_dir = pathlib.Path(data_dir)
    run_dir = pathlib.Path(run_dir) if run_dir else data_dir.parent
    args = ["--data-dir", str(data_dir), "--listen", listen]
    if replicas is not None:
        args += ["--replicas", str(replicas)]
    args, creds = _secure(name, args + (extra or []), listen, ca, run_dir)
    return start_server(name, "kvfs.metaserver", args, run_dir, timeout, env, netns, creds)


def free_loopback_ports(n: int) -> list[int]:
    """`n` distinct loopback TCP ports nobody holds right now (all held while choosing)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def etcd_healthy(endpoint: str, tls_opener: urllib.request.OpenerDirector | None = None) -> bool:
    """Whether the etcd member at `endpoint` (host:port) says it is healthy (has a
    leader); over https with `tls_opener` (etcd_opener)."""
    try:
        url = f"https://{endpoint}/health" if tls_opener else f"http://{endpoint}/health"
        with (tls_opener or _NO_PROXY).open(url, timeout=1) as reply:
            return b'"true"' in reply.read()
    except OSError:
        return False


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback and test bridges only


def etcd_opener(credentials: Credentials) -> urllib.request.OpenerDirector:
    """An opener speaking mutual TLS as `credentials` (for etcd_healthy)."""
    https = urllib.request.HTTPSHandler(context=credentials.ssl_context(server=False))
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), https)


def start_etcd(data_dir: str | os.PathLike, *, run_dir: str | os.PathLike, timeout: float = 30,
               ca: LocalCA | None = None) -> ServerProcess:
    """One etcd member on loopback (Debian's etcd-server), for a local cluster of
    several metaservers; returns once it is healthy. A real cluster runs three or
    five members on hosts of their own. With `ca`, clients speak mutual TLS to it
    (a server certificate from that CA; a client certificate from it demanded);
    without, plaintext."""
    if shutil.which("etcd") is None:
        raise LaunchError("several metaservers need etcd, which is not installed (Debian: apt-get install "
                          "etcd-server)")
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    scheme = "https" if ca is not None else "http"
    client_port, peer_port = free_loopback_ports(2)
    client, peer = f"{scheme}://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"  # one member: no peers
    tls_flags, probe = [], None
    if ca is not None:
        ca_file, cert, key = ca.issue_files("etcd", [SERVER], hosts=tls.LOCAL_HOSTS)
        tls_flags = ["--cert-file", str(cert), "--key-file", str(key), "--client-cert-auth",
                     "--trusted-ca-file", str(ca_file)]
        probe = etcd_opener(ca.credentials("etcd-probe", [ADMIN]))  # made once: a context writes key files
    log_path = run_dir / "etcd.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            ["etcd", "--name", "local", "--data-dir", str(data_dir), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"local={peer}", "--force-new-cluster", *tls_flags],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = ServerProcess("etcd", proc, client.split("://", 1)[1], log_path)
    deadline = time.monotonic() + timeout
    while True:
        if not server.alive():
            raise LaunchError(f"etcd exited with {proc.returncode} before serving:\n{server.log_tail()}")
        if etcd_healthy(server.address, probe):
            return server
        if time.monotonic() > deadline:
            server.kill()
            raise LaunchError(f"etcd did not become healthy within {timeout}s:\n{server.log_tail()}")
        time.sleep(0.05)


def meta_status(address: str, timeout: float = 5, credentials: Credentials | None = None):
    """The metaserver's Status, asked with `credentials` (None: plaintext)."""
    from kvfs.proto import meta_pb2, meta_pb2_grpc

    with tls.channel(address, credentials) as channel:
        return meta_pb2_grpc.MetaServiceStub(channel).Status(meta_pb2.StatusRequest(), timeout=timeout)


class LocalCluster:
    """A metaserver and N chunkservers as separate local processes, each
    chunkserver in its own failure domain (host-0, host-1, ...).

    >>> with LocalCluster("/tmp/kvfs", chunkservers=3, replicas=2) as cluster:
    ...     client = Client(cluster.meta_address, credentials=cluster.worker)

    Mutual TLS from a local CA (see the module's docstring) unless `insecure`. Every
    server serves Prometheus metrics on a free loopback port (`metrics_address`)
    unless `metrics` is off. With `hosts` (hosts.Hosts, created, of at least
    chunkservers + 1), each server runs in a network namespace of its own, the
    metaserver on host 0 and chunkserver i on host i + 1, behind its links.

    With `metaservers` over 1, a local etcd member (start_etcd) holds their shard map
    and leases; they split the hash slots, and every chunkserver registers with all
    of them. `meta_address` is the first one's; `meta_addresses` all of them, as the
    SDK takes them.
    """

    def __init__(self, root: str | os.PathLike, *, chunkservers: int = 3, replicas: int = 2,
                 capacity: str = "4GiB", meta_extra: list[str] | None = None,
                 chunk_extra: list[str] | None = None, env: dict[str, str] | None = None,
                 insecure: bool = False, metrics: bool = True, hosts: Hosts | None = None, metaservers: int = 1):
        if hosts is not None and len(hosts.names) <= chunkservers:
            raise ValueError(f"{chunkservers} chunkservers and a metaserver need {chunkservers + 1} hosts, "
                             f"not {len(hosts.names)}")
        if metaservers < 1 or (hosts is not None and metaservers > 1):
            raise ValueError(f"a local cluster has 1 or more metaservers (one only on hosts), not {metaservers}")
        self.hosts = hosts
        self.root = pathlib.Path(root)
        self.metrics = metrics
        self.insecure = insecure
        self.ca = None if insecure else local_ca(self.root)
        # etcd's clients (the metaservers) hold certificates from a CA of their own: etcd
        # checks the CA, not kvfs's roles, and no worker may write the shard map
        self.etcd_ca = None if insecure or metaservers == 1 else LocalCA(self.root / "etcd-ca")
        self.n = chunkservers
        self.replicas = replicas
        self.capacity = capacity
        self.meta_extra = list(meta_extra or []) + (["--insecure"] if insecure else [])
        self.chunk_extra = list(chunk_extra or []) + (["--insecure"] if insecure else [])
        self.env = env
        self.metas: list[ServerProcess | None] = [None] * metaservers
        self.etcd: ServerProcess | None = None
        self.chunkservers: list[ServerProcess | None] = [None] * chunkservers

    @property
    def meta(self) -> ServerProcess | None:
        """The (first) metaserver."""
        return self.metas[0]

    @meta.setter
    def meta(self, server: ServerProcess | None) -> None:
        self.metas[0] = server

    @property
    def meta_address(self) -> str:
        assert self.meta is not None, "cluster not started"
        return self.meta.address

    @property
    def meta_addresses(self) -> str:
        """Every metaserver's address, comma-separated (what the SDK and chunkservers take)."""
        assert all(self.metas), "cluster not started"
        return ",".join(m.address for m in self.metas)

    @functools.cached_property
    def admin(self) -> Credentials | None:
        """An admin's credentials (what `kvfs status` uses); None when insecure."""
        return None if self.ca is None else admin_credentials(self.ca)

    @functools.cached_property
    def worker(self) -> Credentials | None:
        """A worker's credentials for any tenant (a local, single-user cluster); None when insecure."""
        return None if self.ca is None else self.ca.credentials("worker", [WORKER], tenants=[ANY_TENANT])

    def credentials(self, name: str, roles, tenants=(), hosts=()) -> Credentials | None:
        """A fresh certificate from this cluster's CA (None when insecure)."""
        return None if self.ca is None else self.ca.authority.issue(name, roles, tenants=tenants, hosts=hosts)

    @contextlib.contextmanager
    def worker_env(self):
        """Inside, SDK clients made without credentials in this process connect as
        this cluster's worker (the KVFS_CLIENT_* variables, restored on the way out)."""
        if self.ca is None:
            values = {"KVFS_CLIENT_INSECURE": "true"}
        else:
            self.worker  # noqa: B018 (issued on first use)
            folder = self.ca.folder
            values = {"KVFS_CLIENT_TLS_CA": f"{folder}/ca.pem", "KVFS_CLIENT_TLS_CERT": f"{folder}/worker.pem",
                      "KVFS_CLIENT_TLS_KEY": f"{folder}/worker.key", "KVFS_CLIENT_INSECURE": "false"}
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def start(self, timeout: float = 60) -> LocalCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            if len(self.metas) == 1:
                self.start_metaserver(timeout=timeout)
            else:  # together: each waits for the others before the first shard map is written
                self.etcd = start_etcd(self.root / "etcd", run_dir=self.root, timeout=timeout, ca=self.etcd_ca)
                self.admin  # noqa: B018 - issued here, once: each start below would write its files at once
                with ThreadPoolExecutor(len(self.metas)) as pool:
                    for f in [pool.submit(self.start_metaserver, timeout, i) for i in range(len(self.metas))]:
                        f.result()
            for i in range(self.n):
                self.start_chunkserver(i, wait=False, timeout=timeout)
            self.wait_live(self.n, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _host(self, i: int) -> tuple[str, str | None]:
        """Host i's address and network namespace (loopback and none without hosts)."""
        return ("127.0.0.1", None) if self.hosts is None else (self.hosts.address(i), self.hosts.names[i])

    def start_metaserver(self, timeout: float = 30, i: int = 0) -> ServerProcess:
        """(Re)starts metaserver i, on the same addresses as before if it had them."""
        address, netns = self._host(0)
        old = self.metas[i]
        listen = old.address if old else f"{address}:0"
        extra = self.meta_extra
        if self.metrics:
            extra = [*extra, "--metrics-listen", old.metrics_address if old else f"{address}:0"]
        name = "metaserver" if i == 0 else f"metaserver-{i}"
        if len(self.metas) > 1:
            extra = [*extra, "--etcd", self.etcd.address, "--cluster-name", "local", "--metaserver-id", name,
                     "--expect-metaservers", str(len(self.metas))]
            if self.etcd_ca is not None:
                ca, cert, key = self.etcd_ca.issue_files(name, [ADMIN])  # a client of etcd's CA, nothing else
                extra += ["--etcd-ca", str(ca), "--etcd-cert", str(cert), "--etcd-key", str(key)]
        self.metas[i] = start_metaserver(self.root / name, listen=listen, replicas=self.replicas, extra=extra,
                                         run_dir=self.root, timeout=timeout, env=self.env, netns=netns, ca=self.ca,
                                         name=name)
        return self.metas[i]

    def add_metaserver(self, timeout: float = 30) -> ServerProcess:
        """Starts one more metaserver in a running cluster of several: it joins on etcd,
        the chunkservers register with it once another names it in their heartbeats'
        replies, and the map gives it a share of the slots once it hears from them all."""
        if self.etcd is None:
            raise ValueError("a metaserver is added to a cluster of several (on etcd), not to one alone")
        self.metas.append(None)
        try:
            return self.start_metaserver(timeout, len(self.metas) - 1)
        except BaseException:
            self.metas.pop()
            raise

    def start_chunkserver(self, i: int, wait: bool = True, timeout: float = 30) -> ServerProcess:
        """(Re)starts chunkserver i on its data folder (on the same addresses as
        before if it had them) and, by default, waits until the metaserver sees it live."""
        old = self.chunkservers[i]
        address, netns = self._host(i + 1)
        listen = old.address if old else f"{address}:0"
        extra = ["--meta", self.meta_addresses, *self.chunk_extra]
        if self.metrics:
            extra += ["--metrics-listen", old.metrics_address if old else f"{address}:0"]
        cs = start_chunkserver(self.root / f"cs-{i}", server_id=f"cs-{i}", failure_domain=f"host-{i}",
                               capacity=self.capacity, listen=listen, run_dir=self.root, timeout=timeout,
                               extra=extra, env=self.env, netns=netns, ca=self.ca)
        self.chunkservers[i] = cs
        if wait:
            self.wait_until(lambda st: any(s.id == f"cs-{i}" and s.live and s.heartbeat_age_s < 1
                                           for s in st.servers), timeout, f"cs-{i} live")
        return cs

    def wait_until(self, condition, timeout: float = 30, what: str = "cluster condition", address: str = ""):
        """Polls Status of the (first, or at `address`) metaserver until `condition` holds; that Status."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = meta_status(address or self.meta_address, credentials=self.admin)
                if condition(status):
                    return status
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)

    def wait_live(self, n: int, timeout: float = 30):
        """Until every metaserver sees `n` live chunkservers; the first one's Status."""
        statuses = [self.wait_until(lambda st: sum(s.live for s in st.servers) >= n and st.chains > 0, timeout,
                                    f"{n} live chunkservers at {m.name}", m.address) for m in self.metas]
        return statuses[0]

    def processes(self) -> list[ServerProcess]:
        return [p for p in [*self.metas, *self.chunkservers, self.etcd] if p is not None]

    def stop(self) -> None:
        """Stops every process, all at once; etcd last (metaservers give up their leases there)."""
        processes = [p for p in self.processes() if p is not self.etcd]
        for p in processes:
            p.terminate()
        for p in processes:
            p.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
