"""Starts kvfs servers as separate processes and waits until they are healthy.

The same code serves `kvfs demo`, `kvfs-bench` and the tests, so what the tests
exercise is what users run.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
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


def wait_healthy(address: str, timeout: float = 30) -> None:
    """Waits until the gRPC health service at `address` answers SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"{address} not healthy after {timeout}s")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(left, 2), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)


def start_server(name: str, module: str, args: list[str], run_dir: pathlib.Path,
                 timeout: float = 30, env: dict[str, str] | None = None) -> ServerProcess:
    """Runs `python -m module args --ready-file ...` and waits for it to serve."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ready = run_dir / f"{name}.addr"
    ready.unlink(missing_ok=True)
    log_path = run_dir / f"{name}.log"
    cmd = [sys.executable, "-m", module, *args, "--ready-file", str(ready)]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    server = ServerProcess(name, proc, "", log_path, args)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if not server.alive():
            raise LaunchError(f"{name} exited with {proc.returncode} before serving:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            server.kill()
            raise LaunchError(f"{name} did not start within {timeout}s:\n{server.log_tail()}")
        time.sleep(0.02)
    server.address = ready.read_text().strip()
    try:
        wait_healthy(server.address, max(1.0, deadline - time.monotonic()))
    except LaunchError:
        server.kill()
        raise
    return server


def start_chunkserver(data_dir: str | os.PathLike, *, server_id: str = "cs-1",
                      failure_domain: str | None = None, capacity: str | None = None,
                      listen: str = "127.0.0.1:0", extra: list[str] | None = None,
                      run_dir: str | os.PathLike | None = None, timeout: float = 30,
                      env: dict[str, str] | None = None) -> ServerProcess:
    """Starts `kvfs-chunkserver` in its own process; returns once it serves.

    Options left None come from the server's own config (environment, TOML, defaults).
    """
    data_dir = pathlib.Path(data_dir)
    args = ["--data-dir", str(data_dir), "--listen", listen, "--id", server_id]
    for flag, value in (("--failure-domain", failure_domain), ("--capacity", capacity)):
        if value is not None:
            args += [flag, value]
    args += extra or []
    return start_server(server_id, "kvfs.chunkserver", args,
                        pathlib.Path(run_dir) if run_dir else data_dir.parent, timeout, env)
