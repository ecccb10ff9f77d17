"""Real etcd members for tests: Debian's `etcd` (etcd-server), on loopback ports."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import urllib.request

from helpers import free_port, wait_until


class EtcdCluster:
    """`size` etcd processes forming one cluster; `stop` kills them all."""

    def __init__(self, root: pathlib.Path, size: int = 3):
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server; .ci/run installs it)")
        self.root = root
        self.names = [f"e{i}" for i in range(size)]
        self.client_ports = {n: free_port() for n in self.names}
        peer = {n: free_port() for n in self.names}
        initial = ",".join(f"{n}=http://127.0.0.1:{peer[n]}" for n in self.names)
        self.procs: dict[str, subprocess.Popen] = {}
        for n in self.names:
            client = f"http://127.0.0.1:{self.client_ports[n]}"
            log = open(root / f"etcd-{n}.log", "wb")
            self.procs[n] = subprocess.Popen(
                ["etcd", "--name", n, "--data-dir", str(root / f"etcd-{n}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer[n]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[n]}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"kvfs-test-{os.getpid()}",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        wait_until(lambda: all(self.healthy(n) for n in self.names), timeout=30, what="etcd members healthy")

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.client_ports[name]}"

    def endpoints(self, *names: str) -> list[str]:
        return [self.endpoint(n) for n in (names or self.names)]

    def healthy(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise AssertionError(f"etcd {name} exited: {(self.root / f'etcd-{name}.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint(name)}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

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
