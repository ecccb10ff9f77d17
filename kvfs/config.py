"""Configuration: frozen dataclasses read in one place.

Each value comes from, in order of precedence: a command-line flag, an
environment variable `KVFS_<SECTION>_<FIELD>` (e.g. KVFS_CHUNKSERVER_CAPACITY),
the `[section]` table of a TOML file (--config or KVFS_CONFIG), or the default.
Defaults run a one-machine cluster. Each part declares its own settings
dataclass (kvfs.metaserver.config, kvfs.chunkserver.config, kvfs.engine.config)
with the field helpers here; `render_toml` writes a default file from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import textwrap
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


def duration_field(default: float, help: str) -> Any:
    """A field read as a duration ('500ms', '10s', '3d') and written back the same way."""
    return dataclasses.field(default=default, metadata={"duration": True, "help": help})


def size_field(default: int, help: str) -> Any:
    """A field read as a size ('64MiB', '10GiB') and written back the same way."""
    return dataclasses.field(default=default, metadata={"size": True, "help": help})


def option(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """A plain field with its help text and, optionally, the values it may take."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def check_choices(cfg: Any) -> None:
    """Raises ValueError naming the first field whose value is not one of its choices."""
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, not {getattr(cfg, f.name)!r}")


def check_listen(name: str, value: str) -> None:
    """Raises ValueError unless `value` is empty (off) or host:port, the host given:
    a server binds only where it is told."""
    if not value:
        return
    host, _, port = value.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{name} must be host:port (e.g. 127.0.0.1:9100), not {value!r}")


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
        # argparse %-formats help texts: a literal % ("90% of capacity") must be doubled
        text = f"{f.metadata.get('help', '')} (default {f.default})".replace("%", "%%")
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


_SIZE_UNITS = (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_DURATION_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def _format(field: dataclasses.Field, value: Any) -> str:
    """A value as TOML, sizes and durations in the units people write."""
    if field.metadata.get("size"):
        unit = next((f"{value // n}{u}" for u, n in _SIZE_UNITS if value and value % n == 0), str(value))
        return f'"{unit}"'
    if field.metadata.get("duration"):
        if value and value < 1:
            return f'"{round(value * 1000)}ms"'
        unit = next((f"{int(value // n)}{u}" for u, n in _DURATION_UNITS if value % n == 0), f"{value}s")
        return f'"{unit}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def render_toml(sections: Mapping[str, type], header: str = "") -> str:
    """A TOML file holding every field of each settings class at its default, each
    under its help text: the shipped deploy/kvfs.toml is this output."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for section, cls in sections.items():
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            lines += textwrap.wrap(f.metadata.get("help", ""), 88, initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{f.name} = {_format(f, f.default)}")
    return "\n".join(lines).lstrip("\n") + "\n"
