"""Regenerates the checked-in gRPC stubs from ../../proto/*.proto.

Run `python -m kvfs.proto.generate` from the repository root after editing a
.proto file; tests/unit/test_proto_stubs.py fails while the stubs are stale.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto"
PROTOS = ("chunk.proto", "meta.proto")


def _fix_imports(text: str) -> str:
    # protoc emits `import chunk_pb2`; inside the package it must be relative.
    return re.sub(r"^import (\w+_pb2) as ", r"from . import \1 as ", text, flags=re.M)


def render() -> dict[str, str]:
    """Runs protoc and returns {file name: contents} of the generated stubs."""
    from grpc_tools import protoc  # only needed to regenerate, not to run

    include = pathlib.Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *(str(PROTO_DIR / p) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        return {p.name: _fix_imports(p.read_text()) for p in sorted(pathlib.Path(out).iterdir())}


def main() -> int:
    for name, text in render().items():
        (HERE / name).write_text(text)
        print(f"wrote kvfs/proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
