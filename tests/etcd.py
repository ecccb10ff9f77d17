"""Real etcd members for tests: Debian's `etcd` (etcd-server), on loopback ports."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile

from kvfs.cli.launcher import etcd_healthy

from helpers import free_ports, wait_until

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: killed when the test process dies, even by SIGKILL
    (a killed pytest otherwise leaves its etcd members running)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class EtcdCluster:
    """`size` etcd processes forming one cluster; `stop` kills them all."""

    def __init__(self, root: pathlib.Path, size: int = 3, host: str = "127.0.0.1"):
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server; make test installs it)")
        self.root = root
        self.host = host  # where clients reach the members (also on 127.0.0.1); peers talk on 127.0.0.1
        root.mkdir(parents=True, exist_ok=True)  # its logs
        # etcd fsyncs every write: on a busy disk that alone can outlast a short lease (each
        # member preallocates a 64 MB log: memory only where there is room for it)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 1 << 30 else None
        self.data = pathlib.Path(tempfile.mkdtemp(prefix="kvfs-etcd-", dir=shm))
        self.names = [f"e{i}" for i in range(size)]
        ports = free_ports(2 * size)
        self.client_ports = dict(zip(self.names, ports[:size]))
        peer = dict(zip(self.names, ports[size:]))
        initial = ",".join(f"{n}=http://127.0.0.1:{peer[n]}" for n in self.names)
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self._start(initial, peer)
        except BaseException:
            self.stop()
            raise

    def _start(self, initial: str, peer: dict[str, int]) -> None:
        for n in self.names:
            client = f"http://{self.host}:{self.client_ports[n]}"
            local = f"http://127.0.0.1:{self.client_ports[n]}"
            log = open(self.root / f"etcd-{n}.log", "wb")
            self.procs[n] = subprocess.Popen(
                ["etcd", "--name", n, "--data-dir", str(self.data / n),
                 "--listen-client-urls", client if client == local else f"{local},{client}",
                 "--advertise-client-urls", client,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer[n]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[n]}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"kvfs-test-{os.getpid()}",
                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
            log.close()
        wait_until(lambda: all(self.healthy(n) for n in self.names), timeout=30, what="etcd members healthy")

    def endpoint(self, name: str) -> str:
        return f"{self.host}:{self.client_ports[name]}"

    def endpoints(self, *names: str) -> list[str]:
        return [self.endpoint(n) for n in (names or self.names)]

    def healthy(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise AssertionError(f"etcd {name} exited: {(self.root / f'etcd-{name}.log').read_text()[-2000:]}")
        return etcd_healthy(self.endpoint(name))

    def pause(self, name: str) -> None:
        """Freezes a member (SIGSTOP): its connections stay open and answer nothing."""
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in self.procs.values():
            p.wait(timeout=10)
        shutil.rmtree(self.data, ignore_errors=True)
