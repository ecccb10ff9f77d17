"""Configuration: frozen dataclasses read in one place.

Each value comes from, in order of precedence: a command-line flag, an
environment variable `KVFS_<SECTION>_<FIELD>` (e.g. KVFS_CHUNKSERVER_CAPACITY),
the `[section]` table of a TOML file (--config or KVFS_CONFIG), or the default.
Defaults run a one-machine cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'10GiB' -> 10737418240; '1.5MB' -> 1500000; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512MiB, 10GiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size(default: int, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"size": True, "help": help})


def _opt(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkserverConfig:
    data_dir: str = _opt("kvfs-data/chunkserver", "folder for slot files and the chunk index")
    listen: str = _opt("127.0.0.1:7100", "host:port for gRPC (port 0 picks a free one)")
    id: str = _opt("cs-1", "this server's id, unique in the cluster")
    failure_domain: str = _opt("default", "replicas of a chunk go to distinct failure domains")
    capacity: int = _size(10 * GiB, "most bytes of slot files this server may allocate")
    reserve: int = _size(64 * MiB, "free space kept on the filesystem for the index")
    io_engine: str = _opt("auto", "disk reads: io_uring, preadv (thread pool), or auto "
                          "(io_uring, falling back to preadv if the kernel refuses)",
                          ("auto", "io_uring", "preadv"))
    io_mode: str = _opt("auto", "direct (O_DIRECT), buffered, or auto (direct where the "
                        "filesystem allows it)", ("auto", "direct", "buffered"))
    uring_entries: int = _opt(256, "io_uring submission queue size")
    max_chunk_size: int = _size(64 * MiB, "largest chunk accepted")
    max_read_bytes: int = _size(256 * MiB, "most bytes one ReadChunks call may ask for")
    max_ranges: int = _opt(4096, "most ranges one ReadChunks call may ask for")
    ready_file: str = _opt("", "once serving, write the bound address here (for launchers)")
    log_level: str = _opt("INFO", "logging level")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, "
                                 f"not {getattr(self, f.name)!r}")
        if not 64 * KiB <= self.max_chunk_size <= 64 * MiB:
            raise ValueError("max_chunk_size must be between 64KiB and 64MiB")
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")


C = TypeVar("C")
# Field annotations are strings under `from __future__ import annotations`.
_TYPES: dict[str, type] = {"int": int, "str": str, "bool": bool, "float": float}


def _convert(field: dataclasses.Field, value: Any) -> Any:
    if field.metadata.get("size"):
        return parse_size(value)
    kind = _TYPES[field.type]
    if kind is bool and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one --flag per field of `cls` (default None: unset flags don't override)."""
    parser.add_argument("--config", help="TOML file with a table per part (env KVFS_CONFIG)")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, default=None, choices=f.metadata.get("choices"),
                            help=f"{f.metadata.get('help', '')} (default {f.default})")


def load(cls: type[C], section: str, flags: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> C:
    """Builds `cls` from flags > KVFS_<SECTION>_<FIELD> > TOML [section] > defaults."""
    flags = dict(flags or {})
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = flags.pop("config", None) or env.get("KVFS_CONFIG")
    if path:
        with open(path, "rb") as fh:
            table = tomllib.load(fh).get(section, {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys in [{section}]: {', '.join(sorted(unknown))}")
        values.update(table)
    prefix = f"KVFS_{section.upper()}_"
    for f in dataclasses.fields(cls):
        if prefix + f.name.upper() in env:
            values[f.name] = env[prefix + f.name.upper()]
        if flags.get(f.name) is not None:
            values[f.name] = flags[f.name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return cls(**{k: _convert(fields[k], v) for k, v in values.items()})
