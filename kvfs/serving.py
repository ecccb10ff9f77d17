"""Small pieces every kvfs server's main() shares."""

from __future__ import annotations

import os


def bound_address(listen: str, port: int) -> str:
    """host:port actually bound (port 0 in `listen` means the kernel chose)."""
    if port == 0:
        raise SystemExit(f"cannot listen on {listen}")
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def write_ready_file(path: str, address: str) -> None:
    """Atomically writes the bound address where a launcher waits for it."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(address)
    os.replace(tmp, path)
