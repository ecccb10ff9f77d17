"""The metaserver's prefix filters (db.FILTERED_PREFIX): a block's children are found
by a prefix-mode seek, and every other scan still sees keys in order across prefixes.
Keys are spread over the memtable and SST files at two levels, so that a seek crosses
files whose filters hold the prefix and files whose filters do not."""

import os

from kvfs.metaserver.blocks import Reader
from kvfs.metaserver.db import MetaDB, seek_options
from kvfs.metaserver.records import CHILD, FULL, VICTIM, child_key


def _full(i: int) -> bytes:
    return bytes(16) + i.to_bytes(FULL - 16, "big")  # neighbours: parent i and i + 1 differ in the last byte


def _spread(db: MetaDB, keys: list[bytes]) -> None:
    """A third of the keys compacted to the bottom, a third in level 0, a third in the memtable."""
    third = len(keys) // 3
    for part in (keys[:third], keys[third : 2 * third], keys[2 * third :]):
        for k in part:
            db.put(k, b"")
        if part is keys[:third]:
            db.db.flush()
            db.db.compact_range(None, None)
        elif part is keys[third : 2 * third]:
            db.db.flush()


def test_children_found_by_prefix_and_other_scans_in_order(tmp_path):
    db = MetaDB(str(tmp_path / "meta"), 1 << 20)
    try:
        # parents 0..299: even ones have children (1 to 3), odd ones none; children keys sort
        # right next to the next parent's, so a seek that runs past its prefix would find them
        children = {p: [child_key(_full(p), _full(1000 + 10 * p + c)) for c in range(1 + p % 3)] if p % 2 == 0
                     else [] for p in range(300)}
        victims = [VICTIM + os.urandom(8) + _full(p) for p in range(300)]  # long keys, another prefix each
        _spread(db, [k for ks in children.values() for k in ks] + victims)
        reader = Reader(db)
        for p, ks in children.items():
            prefix = CHILD + _full(p)
            assert db.has_prefix(prefix) == bool(ks), p
            assert [k for k, _ in db.scan(prefix)] == ks, p
            assert reader.has_children(_full(p), set(ks[1:])) == bool(ks), p  # the one not skipped
            assert not reader.has_children(_full(p), set(ks)), p  # all of them being deleted
        # scans that cross prefixes are in total order: every key, sorted
        assert [k for k, _ in db.scan(VICTIM)] == sorted(victims)
        assert [k for k, _ in db.scan(CHILD)] == sorted(k for ks in children.values() for k in ks)
        start = sorted(victims)[150]
        assert [k for k, _ in db.scan(VICTIM, start=start)] == sorted(victims)[150:]
    finally:
        db.close()


def test_seek_options_prefix_mode_only_within_one_prefix(tmp_path):
    """A prefix-mode iterator stops at its prefix; the options pick it only where the scan
    stays within one FILTERED_PREFIX-byte prefix."""
    db = MetaDB(str(tmp_path / "meta"), 1 << 20)
    try:
        keys = [CHILD + _full(p) + bytes([c]) * 16 for p in range(4) for c in range(2)]
        _spread(db, keys)
        prefix = CHILD + _full(1)

        def from_seek(opts, at: bytes) -> list[bytes]:
            it, out = db.db.iter(opts), []
            it.seek(at)
            while it.valid():
                out.append(it.key())
                it.next()
            return out

        # prefix mode: the two children of parent 1, nothing after
        assert from_seek(seek_options(prefix), prefix) == keys[2:4]
        # a start outside the prefix, or a shorter prefix: total order, on past parent 1's children
        # (to the end of the database, whose format record comes after them)
        assert [k for k in from_seek(seek_options(prefix, start=CHILD + _full(0)), prefix) if k < b"d"] == keys[2:]
        assert [k for k in from_seek(seek_options(CHILD), prefix) if k < b"d"] == keys[2:]
    finally:
        db.close()
