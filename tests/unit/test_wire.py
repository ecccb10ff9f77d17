"""The data-port frame codec, including fuzzing of what a server parses."""

import os
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs import wire

ids = st.binary(min_size=1, max_size=wire.MAX_ID)
ranges = st.lists(st.builds(wire.Range, ids, st.integers(0, 2**63), st.integers(0, 2**63)), max_size=50)
pieces = st.lists(st.tuples(st.integers(0, 2**63), st.integers(1, 2**32 - 1)), min_size=1, max_size=20)
shm_ranges = st.lists(st.builds(lambda cid, off, mapping, ps: wire.Range(cid, off, sum(n for _, n in ps), mapping,
                                                                         tuple(ps)),
                                ids, st.integers(0, 2**63), st.integers(0, wire.MAX_MAPPINGS - 1), pieces),
                      max_size=30)


def split(frame: bytes):
    header = wire.parse_header(frame[: wire.HEADER.size])
    return header, frame[wire.HEADER.size :]


@given(ranges, st.integers(0, 2**64 - 1))
def test_read_requests_round_trip(rs, rid):
    header, body = split(wire.encode_read(rid, rs))
    assert (header.kind, header.request_id, header.count) == (wire.READ, rid, len(rs))
    assert wire.parse_ranges(header, body) == rs


@given(shm_ranges, st.binary(max_size=wire.MAX_GRANT))
def test_shm_read_requests_round_trip_with_their_grant(rs, grant):
    header, body = split(wire.encode_read(3, rs, shm=True, grant=grant))
    assert header.kind == wire.READ_SHM and wire.parse_read(header, body) == (grant, rs)


def test_a_read_grant_longer_than_the_bound_or_past_the_body_is_malformed():
    rs = [wire.Range(b"c", 0, 10)]
    header, body = split(wire.encode_read(1, rs, grant=b"g" * (wire.MAX_GRANT + 1)))
    with pytest.raises(wire.WireError, match="read grant of at most"):
        wire.parse_read(header, body)
    with pytest.raises(wire.WireError, match="read grant of at most"):
        wire.parse_read(wire.Header(wire.READ, 0, 1, 0, 3), b"\x09ab")


def test_shm_pieces_must_add_up_to_the_range():
    bad = wire.Range(b"c", 0, 100, 0, ((0, 60), (4096, 30)))
    header, body = split(wire.encode_read(1, [bad], shm=True))
    with pytest.raises(wire.WireError, match="pieces hold 90 bytes"):
        wire.parse_ranges(header, body)
    header, body = split(wire.encode_read(1, [wire.Range(b"c", 0, 10, 5, ((0, 10),))], shm=True))
    with pytest.raises(wire.WireError, match="mapping 5"):
        wire.parse_ranges(header, body)


@given(ids, st.integers(1, wire.MAX_CHUNK), st.integers(0, 2**64 - 1), st.binary(max_size=wire.MAX_OWNER))
def test_write_requests_round_trip(cid, length, checksum, owner):
    header, body = split(wire.encode_write(7, cid, length, checksum, owner))
    assert (header.kind, header.request_id, header.count) == (wire.WRITE, 7, 1)
    assert wire.parse_write(header, body) == wire.WriteRequest(cid, length, checksum, owner)


@given(st.integers(0, 2**16 - 1), st.text(max_size=200), st.booleans(), st.binary(max_size=255))
def test_write_replies_round_trip(code, message, created, receipt):
    frame = wire.encode_write_reply(9, code, message, created, receipt)
    header = wire.parse_header(frame[: wire.HEADER.size], requests=False)
    assert header.kind == wire.WRITE_REPLY
    assert wire.parse_write_reply(header, frame[wire.HEADER.size :]) == (code, message, created, receipt)


def test_replies_and_statuses_round_trip():
    # a range's data covers blocks 1-2 of a 3-block chunk; the reply carries all 3 checksums
    results = [wire.RangeResult(0, "", 65536, 100_000, 165_536, (1, 2, 3)), wire.RangeResult(5, "not found on cs-1")]
    frame = wire.encode_read_reply(9, results)
    header = wire.parse_header(frame[:24], requests=False)
    assert wire.parse_read_reply(header, frame[24:]) == results
    assert results[0].covering() == (2, 3)
    for short in ((1, 2), (1, 2, 3, 4)):  # not every block of the chunk: refused
        frame = wire.encode_read_reply(9, [wire.RangeResult(0, "", 65536, 100_000, 165_536, short)])
        with pytest.raises(wire.WireError, match="do not fit"):
            wire.parse_read_reply(wire.parse_header(frame[:24], requests=False), frame[24:])
    frame = wire.encode_status(4, 3, "bad")
    header = wire.parse_header(frame[:24], requests=False)
    assert wire.parse_status(header, frame[24:]) == (3, "bad")
    frame = wire.encode_shm_register(1, 1 << 20, mapping=1)
    header, body = split(frame)
    assert wire.parse_shm_register(header, body) == 1 << 20 and header.flags == 1
    with pytest.raises(wire.WireError, match="malformed"):  # the old body, naming a path: no longer taken
        wire.parse_shm_register(wire.Header(wire.SHM_REGISTER, 0, 1, 0, 25), b"\x0f\x00/dev/shm/kvfs-x" + bytes(8))


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_fuzzed_headers_parse_or_raise_wire_error(raw):
    try:
        header = wire.parse_header(raw)
    except wire.WireError:
        return
    # whatever passes is within the limits a server allocates for
    assert header.count <= wire.MAX_RANGES and header.body_len <= wire.MAX_BODY


@settings(max_examples=500)
@given(st.sampled_from(wire.REQUEST_KINDS), st.integers(0, 40), st.binary(max_size=600))
def test_fuzzed_bodies_parse_or_raise_wire_error(kind, count, body):
    header = wire.Header(kind, 0, 1, count, len(body))
    try:
        if kind == wire.SHM_REGISTER:
            wire.parse_shm_register(header, body)
        elif kind == wire.WRITE:
            req = wire.parse_write(header, body)
            assert 0 < req.length <= wire.MAX_CHUNK and len(req.owner) <= wire.MAX_OWNER
        else:
            parsed = wire.parse_ranges(header, body)
            assert len(parsed) == count
    except wire.WireError:
        pass


@given(ranges.filter(bool), st.data())
def test_truncated_frames_are_refused(rs, data):
    frame = wire.encode_read(1, rs)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(wire.WireError):
        header = wire.parse_header(frame[: min(cut, 24)])
        wire.parse_ranges(header, frame[24:cut])


@pytest.mark.parametrize("raw,match", [
    (b"HTTP" + bytes(20), "magic"),
    (struct.pack("<4sBBHQII", b"KVFS", 9, 1, 0, 0, 0, 0), "version"),
    (struct.pack("<4sBBHQII", b"KVFS", 1, 1, 0, 0, 0, 0), "version 1"),  # replies without every block checksum
    (struct.pack("<4sBBHQII", b"KVFS", wire.VERSION, 77, 0, 0, 0, 0), "kind"),
    (struct.pack("<4sBBHQII", b"KVFS", wire.VERSION, 1, 0, 0, wire.MAX_RANGES + 1, 0), "ranges"),
    (struct.pack("<4sBBHQII", b"KVFS", wire.VERSION, 1, 0, 0, 1, wire.MAX_BODY + 1), "body"),
])
def test_bad_headers_say_what_is_wrong(raw, match):
    with pytest.raises(wire.WireError, match=match):
        wire.parse_header(raw)


@pytest.mark.parametrize("offset,length,chunk,expect", [
    (0, 100, 100, (0, 100)), (70_000, 10, 1 << 20, (65536, 65536)), (65535, 2, 1 << 20, (0, 131072)),
    (1_000_000, 48_576, 1 << 20, (983_040, 65_536)), (0, 1_032_192, 1_032_192, (0, 1_032_192)), (73_728, 73_728, 1_032_192, (65_536, 131_072)),
])
def test_widen_to_whole_checksum_blocks(offset, length, chunk, expect):
    assert wire.widen(offset, length, chunk) == expect


@settings(deadline=None)  # up to 300 KB hashed in pieces: on a loaded machine an example can take 200 ms
@given(st.integers(1, 300_000), st.lists(st.integers(1, 70_000), min_size=1, max_size=20))
def test_verifier_accepts_exact_bytes_in_any_pieces(n, cuts):
    data = os.urandom(n)
    sums = tuple(xxhash.xxh3_64_intdigest(data[i : i + wire.BLOCK]) for i in range(0, n, wire.BLOCK))
    v = wire.BlockVerifier(sums)
    pos = 0
    for c in cuts * (n // sum(cuts) + 1):
        v.feed(memoryview(data)[pos : pos + c])
        pos += c
        if pos >= n:
            break
    assert v.finish()


def test_verifier_rejects_a_flipped_byte_and_missing_bytes():
    data = bytearray(os.urandom(200_000))
    sums = tuple(xxhash.xxh3_64_intdigest(data[i : i + wire.BLOCK]) for i in range(0, len(data), wire.BLOCK))
    short = wire.BlockVerifier(sums)
    short.feed(memoryview(data)[:-1])
    assert not short.finish()
    data[150_000] ^= 1
    bad = wire.BlockVerifier(sums)
    bad.feed(memoryview(data))
    assert not bad.finish()


@pytest.mark.parametrize("backlog, flags", [(0, 0), ((1 << 20) - 1, 0), (5 << 20, 5), ((5 << 20) + 7, 5),
                                            (1 << 40, wire.MAX_BACKLOG_MIB), (-3, 0)])
def test_a_read_reply_carries_the_server_backlog_in_whole_mib(backlog, flags):
    frame = wire.encode_read_reply(4, [wire.RangeResult(5, "gone")], backlog)
    header = wire.parse_header(frame[: wire.HEADER.size], requests=False)
    assert header.flags == flags
    assert wire.parse_read_reply(header, frame[wire.HEADER.size :])[0].code == 5
    assert wire.parse_header(wire.encode_read_reply(4, [])[: wire.HEADER.size], requests=False).flags == 0
