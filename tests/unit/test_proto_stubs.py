"""The checked-in stubs must be what generate.py makes from proto/ today."""

import pathlib

from kvfs.proto import generate


def test_checked_in_stubs_match_the_protos():
    rendered = generate.render()
    assert set(rendered) == {f"{p[:-6]}{s}" for p in generate.PROTOS
                             for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")}
    stale = [name for name, text in rendered.items()
             if (generate.HERE / name).read_text() != text]
    assert not stale, f"stale stubs {stale}: run `python -m kvfs.proto.generate`"


def test_stubs_import_relatively():
    grpc_stub = pathlib.Path(generate.HERE / "chunk_pb2_grpc.py").read_text()
    assert "from . import chunk_pb2" in grpc_stub
