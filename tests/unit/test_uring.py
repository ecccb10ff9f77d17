"""Both disk readers against a real file: same bytes, same error convention."""

import errno
import logging
import os
import subprocess
import sys

import pytest

from kvfs.buffers import address_of, aligned_bytearray
from kvfs.chunkserver import uring
from kvfs.chunkserver.uring import PreadvReader, UringReader, open_reader

MiB = 1 << 20
# The readers that can run on this machine: where the liburing binding cannot (its binary
# needs instructions this CPU lacks), test_a_binding_that_cannot_run_here_is_refused_not_run
# checks that it is refused rather than run
READERS = ["io_uring", "preadv"] if uring.binding_refused() is None else ["preadv"]


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(8 * MiB)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture(params=READERS)
def reader(request):
    r = UringReader(64) if request.param == "io_uring" else PreadvReader()
    yield r
    r.close()


@pytest.fixture(params=READERS)
def small_reader(request):
    """One with fewer ring entries (or threads) than the reads it is given."""
    r = UringReader(4) if request.param == "io_uring" else PreadvReader(threads=2)
    yield r
    r.close()


@pytest.mark.parametrize("flags", [0, os.O_DIRECT], ids=["buffered", "direct"])
def test_batch_reads_return_the_file_bytes(reader, data_file, flags):
    path, data = data_file
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        bufs = [aligned_bytearray(MiB) for _ in range(8)]
        got = reader.read_batch([(fd, (7 - i) * MiB, b) for i, b in enumerate(bufs)]).result(10)
        assert got == [MiB] * 8
        assert b"".join(reversed(bufs)) == data
    finally:
        os.close(fd)


def test_more_reads_than_ring_entries_all_complete(small_reader, data_file):
    path, data = data_file
    reader = small_reader
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = [aligned_bytearray(64 * 1024) for _ in range(100)]
        futures = [reader.read_batch([(fd, i * 65536, b)]) for i, b in enumerate(bufs)]
        assert [f.result(10) for f in futures] == [[65536]] * 100
        assert b"".join(bufs) == data[: 100 * 65536]
    finally:
        os.close(fd)


def test_errors_come_back_as_negative_errno(reader, data_file):
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        misaligned = bytearray(8192 + 1)
        good = aligned_bytearray(8192)
        got = reader.read_batch([(fd, 0, misaligned), (fd, 0, good), (987654, 0, good)]).result(10)
        assert got == [-errno.EINVAL, 8192, -errno.EBADF]
    finally:
        os.close(fd)


def test_short_read_at_end_of_file(reader, data_file):
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = aligned_bytearray(MiB)
        assert reader.read_batch([(fd, 8 * MiB - 4096, buf)]).result(10) == [4096]
        assert bytes(buf[:4096]) == data[-4096:]
    finally:
        os.close(fd)


def test_auto_falls_back_to_preadv_when_the_kernel_refuses_a_ring(caplog):
    # 65536 entries is over the kernel's IORING_MAX_ENTRIES: io_uring_setup fails with EINVAL.
    with caplog.at_level(logging.WARNING):
        reader = open_reader("auto", 65536)
    try:
        assert reader.name == "preadv"
        assert "FALLING BACK to preadv" in caplog.text
    finally:
        reader.close()


def test_the_binding_probe_tells_the_truth(data_file, caplog):
    # a ring set up in a child process: killed by a signal means the binding cannot run here
    # (refused, and "auto" falls back, saying why); otherwise rings work in this process too
    child = subprocess.run([sys.executable, "-c", uring._PROBE], capture_output=True, timeout=60)
    why = uring.binding_refused()
    assert (why is not None) == (child.returncode < 0)
    if why is None:
        path, data = data_file
        reader = UringReader(8)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = aligned_bytearray(MiB)
            assert reader.read_batch([(fd, MiB, buf)]).result(10) == [MiB] and bytes(buf) == data[MiB : 2 * MiB]
        finally:
            os.close(fd)
            reader.close()
        return
    with pytest.raises(OSError, match="liburing binding"):
        UringReader(8)
    with caplog.at_level(logging.WARNING):
        fallback = open_reader("auto", 64)
    try:
        assert fallback.name == "preadv" and "FALLING BACK to preadv" in caplog.text and "liburing" in caplog.text
    finally:
        fallback.close()


def test_explicit_io_uring_does_not_fall_back():
    with pytest.raises(OSError):
        open_reader("io_uring", 65536)


def test_aligned_buffers_are_aligned():
    for n in (8192, 65536, MiB, 3 * MiB + 4096):
        buf = aligned_bytearray(n)
        assert len(buf) == n and address_of(buf) % 4096 == 0
    with pytest.raises(ValueError):
        aligned_bytearray(4096)
