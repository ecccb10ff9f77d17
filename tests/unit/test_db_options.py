"""RocksDB settings both servers rely on, read back from the OPTIONS file RocksDB
writes when it opens a database (what it applied, not what was asked)."""

import pathlib

from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.chunkserver.store import ChunkStore
from kvfs.metaserver.db import MetaDB


def applied(db_dir: pathlib.Path) -> dict[str, str]:
    latest = max(db_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
    pairs = (line.strip().split("=", 1) for line in latest.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}


def test_no_server_thread_deletes_obsolete_files_itself(tmp_path):
    """Obsolete files go in RocksDB's background threads: an unlink on a filesystem
    mounted with `discard` held the metaserver's event loop 32 ms (db.py)."""
    meta = MetaDB(str(tmp_path / "meta"), 1 << 20)
    try:
        assert applied(tmp_path / "meta" / "meta")["avoid_unnecessary_blocking_io"] == "true"
    finally:
        meta.close()
    store = ChunkStore(ChunkserverConfig(data_dir=str(tmp_path / "cs"), capacity=1 << 30))
    try:
        assert applied(tmp_path / "cs" / "index")["avoid_unnecessary_blocking_io"] == "true"
    finally:
        store.close()
