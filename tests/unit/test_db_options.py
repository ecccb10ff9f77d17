"""RocksDB settings both servers rely on, read back from the OPTIONS file RocksDB
writes when it opens a database (what it applied, not what was asked)."""

import os
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


def test_the_metaservers_bloom_filters_survive_a_reopen(tmp_path):
    """Reopened without its column family's options, rocksdict gave the database the
    options saved in it, less the filter policy: a restarted metaserver read every
    absent key's data blocks (db.py). Checked in the OPTIONS file of each open, and by
    what reads of absent keys within the stored range bring into the block cache."""
    path = tmp_path / "meta"
    prefix = b"b" + bytes(15)  # stored keys and the absent ones share it: every file's range holds them
    for n in range(2):
        meta = MetaDB(str(path), 64 << 20)
        try:
            assert applied(path / "meta")["filter_policy"] == "bloomfilter", f"open {n + 1}"
            if n == 0:
                for i in range(20_000):
                    meta.db.put(prefix + os.urandom(16), os.urandom(40))
                meta.db.flush()
                continue
            before = int(meta.db.property_value("rocksdb.block-cache-usage"))
            absent = [prefix + os.urandom(16) for _ in range(2_000)]
            assert meta.db.get(absent) == [None] * len(absent)
            loaded = int(meta.db.property_value("rocksdb.block-cache-usage")) - before
            # a filter lets about 1% through to a 4 KiB data block; without one, each read loads one
            assert loaded < 2_000 * 4096 // 10, loaded
        finally:
            meta.close()


def test_a_write_that_holds_the_thread_is_counted_and_reported_with_its_size(tmp_path, caplog):
    """rocksdict keeps the GIL through a write, so a long one stops the whole process
    and the loop's stall sampler cannot name it: MetaDB counts and logs it itself."""
    from kvfs.metaserver.db import SLOW_WRITE, Batch

    meta = MetaDB(str(tmp_path / "meta"), 1 << 20)
    try:
        small = Batch()
        small.put(b"k", b"v")
        meta.write(small)
        assert meta.slow_writes == 0
        big = Batch()
        for i in range(400_000):  # about 40 MB into the memtable in one call: well over SLOW_WRITE
            big.put(i.to_bytes(8, "big") + bytes(8), bytes(80))
        meta.write(big)
    finally:
        meta.close()
    assert meta.slow_writes == 1
    (line,) = [r for r in caplog.records if "RocksDB write took" in r.getMessage()]
    took_ms, changes, staging_ms, count, since = (line.args[0], line.args[1], line.args[3], line.args[4],
                                                  line.args[6])
    assert took_ms > 1e3 * SLOW_WRITE and changes == 400_000 and count == 1, line.getMessage()
    assert staging_ms < took_ms / 2, line.getMessage()  # no rows: nearly all of it the write
    assert since < 60, line.getMessage()  # counted from the database's opening
