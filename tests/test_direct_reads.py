"""Large aligned reads of a cold local file come straight from the disk
(storage/localio.read_at, O_DIRECT), warm ones from the page cache; every byte is the
file's, whatever the alignment, the tail or the file system."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import cached_bytes

from ckptctl.storage import localio, open_store
from ckptctl.storage.localio import DIRECT_ALIGN, aligned_buffer, read_at

MiB = 1 << 20


def _evicted(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def big(tmp_path):
    data = os.urandom(8 * MiB + 1234)
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    return f, data


def _read(f: Path, n: int, offset: int, *, aligned: bool = True) -> bytes:
    skip = 0 if aligned else 1  # one byte in: an address O_DIRECT cannot take
    buf = memoryview(aligned_buffer(n + 1))[skip:skip + n]
    fd = os.open(f, os.O_RDONLY)
    try:
        got = read_at(fd, buf, offset)
    finally:
        os.close(fd)
    return bytes(buf[:got])


@pytest.mark.parametrize("n, offset, aligned", [
    (4 * MiB, 0, True), (4 * MiB, 4 * MiB, True), (8 * MiB, 4 * MiB, True),  # past the end
    (4 * MiB + 7, 0, True), (4 * MiB, 100, True), (4 * MiB, 0, False), (1000, 0, True)],
    ids=["aligned", "second", "past-end", "tail", "unaligned-offset", "unaligned-buffer",
         "small"])
@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_every_byte_is_the_files(big, n, offset, aligned, cold):
    f, data = big
    if cold:
        _evicted(f)
    assert _read(f, n, offset, aligned=aligned) == data[offset:offset + n]


def test_a_cold_range_skips_the_page_cache_and_a_warm_one_uses_it(big):
    f, data = big
    _evicted(f)
    if cached_bytes(f) is None:
        pytest.skip("fincore not available")
    assert _read(f, 8 * MiB, 0) == data[:8 * MiB]
    assert cached_bytes(f) <= 2 * DIRECT_ALIGN  # from the disk, straight into the buffer
    f.read_bytes()  # now warm: read from the page cache, which stays
    assert _read(f, 8 * MiB, 0) == data[:8 * MiB]
    assert cached_bytes(f) >= 8 * MiB


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_file_system_without_o_direct_gets_plain_reads(monkeypatch):
    monkeypatch.setattr(localio, "_no_direct", set())
    d = Path("/dev/shm") / f"ckptctl-read-{os.getpid()}"
    d.mkdir()
    try:
        data = os.urandom(4 * MiB)
        (d / "x").write_bytes(data)
        s = open_store(str(d))
        buf = memoryview(aligned_buffer(4 * MiB))
        assert s.read_into("x", 0, buf) == 4 * MiB and bytes(buf) == data
    finally:
        shutil.rmtree(d)


def test_a_store_read_into_a_transfer_buffer_is_exact_cold(big):
    f, data = big
    _evicted(f)
    s = open_store(str(f.parent))
    buf = memoryview(aligned_buffer(8 * MiB))
    assert s.read_into(f.name, 0, buf) == 8 * MiB and bytes(buf) == data[:8 * MiB]
    assert s.read_into(f.name, 8 * MiB, buf) == 1234 and bytes(buf[:1234]) == data[8 * MiB:]


def test_a_cold_read_is_of_the_open_file_even_once_its_name_is_taken(big):
    """The O_DIRECT read reopens the descriptor's own inode, not the path."""
    f, data = big
    _evicted(f)
    fd = os.open(f, os.O_RDONLY)
    try:
        other = f.with_name("other.bin")
        other.write_bytes(os.urandom(len(data)))
        os.replace(other, f)  # the name now leads to another file
        buf = memoryview(aligned_buffer(8 * MiB))
        assert read_at(fd, buf, 0) == 8 * MiB and bytes(buf) == data[:8 * MiB]
    finally:
        os.close(fd)
