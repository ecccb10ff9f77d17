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


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|)\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float) -> float:
    """'3d' -> 259200.0; '500ms' -> 0.5; plain numbers are seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 500ms, 10s, 5m, 3d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_ttl_classes(text: str) -> dict[str, float]:
    """'agent=3d,chat=7d' -> {'agent': 259200.0, 'chat': 604800.0}."""
    classes = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"bad TTL class {item!r}: expected name=duration, e.g. chat=7d")
        classes[name.strip()] = parse_duration(value)
    if not classes:
        raise ValueError("at least one TTL class is needed")
    return classes


def _duration(default: float, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"duration": True, "help": help})


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
    scrub_rate: int = _size(64 * MiB, "background checksum verification of every stored chunk reads at "
                            "most this many bytes/s (0: no background passes)")
    scrub_interval: float = _duration(3600.0, "pause between two full scrub passes")
    data_listen: str = _opt("", "host:port of the bulk data port (default: the gRPC host and a free "
                            "port; 'off' serves reads over gRPC only)")
    meta: str = _opt("", "metaserver host:port to register with (empty: standalone)")
    advertise: str = _opt("", "address clients use to reach this server (default: the bound one)")
    ready_file: str = _opt("", "once serving, write the bound address here (for launchers)")
    log_level: str = _opt("INFO", "logging level")

    def __post_init__(self) -> None:
        _check_choices(self)
        if not 64 * KiB <= self.max_chunk_size <= 64 * MiB:
            raise ValueError("max_chunk_size must be between 64KiB and 64MiB")
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")


@dataclasses.dataclass(frozen=True, slots=True)
class MetaserverConfig:
    data_dir: str = _opt("kvfs-data/metaserver", "folder for the metadata RocksDB")
    listen: str = _opt("127.0.0.1:7000", "host:port for gRPC (port 0 picks a free one)")
    replicas: int = _opt(2, "copies of every chunk, on servers in distinct failure domains")
    chunk_size: int = _size(1 * MiB, "blocks are cut into chunks of at most this size")
    ttl_classes: str = _opt("agent=3d,chat=7d", "TTL classes, name=duration; refreshed on every hit")
    default_ttl_class: str = _opt("chat", "class of blocks committed without one")
    heartbeat_interval: float = _duration(2.0, "how often chunkservers heartbeat")
    heartbeat_timeout: float = _duration(10.0, "a server silent this long is not live")
    allocation_timeout: float = _duration(60.0, "an allocation not committed by then is garbage")
    lifecycle_interval: float = _duration(30.0, "how often expiry and orphan GC run")
    gc_grace: float = _duration(600.0, "an unreferenced chunk younger than this is left alone")
    repair_interval: float = _duration(2.0, "how often servers back from silence are reconciled and "
                                       "chunks short of copies re-replicated")
    repair_rate: int = _size(256 * MiB, "re-replication copies at most this many bytes per second")
    max_keys: int = _opt(100_000, "most keys in one MatchPrefix or AllocateBlocks")
    # choices are metaserver/eviction.py's POLICIES (kvfs/ imports no server; a unit test checks they agree)
    eviction_policy: str = _opt("lfuda", "which cached blocks capacity eviction drops first, leaves before "
                                "their parents: lfuda (least frequently used, aged) or lru", ("lfuda", "lru"))
    evict_high: float = _opt(0.90, "capacity eviction starts when cached blocks would pass this share of "
                             "the live servers' capacity divided by replicas")
    evict_low: float = _opt(0.80, "and evicts until cached blocks take this share of it")
    rebuild: bool = _opt(False, "rebuild block metadata from chunkserver inventories after "
                         "servers register (see rebuild_after)")
    rebuild_after: float = _duration(5.0, "with rebuild: wait this long for servers to register")
    ready_file: str = _opt("", "once serving, write the bound address here (for launchers)")
    log_level: str = _opt("INFO", "logging level")

    def __post_init__(self) -> None:
        _check_choices(self)
        classes = parse_ttl_classes(self.ttl_classes)
        if self.default_ttl_class not in classes:
            raise ValueError(f"default_ttl_class {self.default_ttl_class!r} is not one of "
                             f"{', '.join(classes)}")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if not 64 * KiB <= self.chunk_size <= 64 * MiB:
            raise ValueError("chunk_size must be between 64KiB and 64MiB")
        if not 0.0 < self.evict_low <= self.evict_high <= 1.0:
            raise ValueError(f"watermarks need 0 < evict_low <= evict_high <= 1, got evict_low={self.evict_low} "
                             f"evict_high={self.evict_high}")

    @property
    def ttls(self) -> dict[str, float]:
        return parse_ttl_classes(self.ttl_classes)


def _check_choices(cfg: Any) -> None:
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, not {getattr(cfg, f.name)!r}")


C = TypeVar("C")
# Field annotations are strings under `from __future__ import annotations`.
_TYPES: dict[str, type] = {"int": int, "str": str, "bool": bool, "float": float}


def _convert(field: dataclasses.Field, value: Any) -> Any:
    if field.metadata.get("size"):
        return parse_size(value)
    if field.metadata.get("duration"):
        return parse_duration(value)
    kind = _TYPES[field.type]
    if kind is bool and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one --flag per field of `cls` (default None: unset flags don't override)."""
    parser.add_argument("--config", help="TOML file with a table per part (env KVFS_CONFIG)")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        text = f"{f.metadata.get('help', '')} (default {f.default})"
        if f.type == "bool":
            parser.add_argument(flag, action="store_const", const="true", default=None, help=text)
        else:
            parser.add_argument(flag, default=None, choices=f.metadata.get("choices"), help=text)


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
