"""Downloads write their parts past the page cache (storage/localio.write_at, O_DIRECT):
the aligned bulk of a part goes straight from its page-aligned buffer to the disk, the
rest through the page cache, and a file system that refuses O_DIRECT (tmpfs) gets plain
writes. Every byte is checked; where ``fincore`` exists, so is where the bytes went."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import cached_bytes

from ckptctl.storage import localio
from ckptctl.storage.localio import DIRECT_ALIGN, aligned_buffer, write_at

MiB = 1 << 20


def _pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(256)) * (n // 256) + bytes(n % 256)


def _filled(data: bytes):
    buf = aligned_buffer(len(data))
    memoryview(buf)[:len(data)] = data
    return memoryview(buf)[:len(data)]


@pytest.mark.parametrize("n, offset", [(8 * MiB, 0), (8 * MiB + 3, 8 * MiB), (4095, 0),
                                       (3 * DIRECT_ALIGN, 100), (0, 0)],
                         ids=["aligned", "tail", "short", "unaligned-offset", "empty"])
def test_every_byte_lands_where_it_belongs(tmp_path, n, offset):
    f = tmp_path / "part.upload"
    f.write_bytes(b"")
    data = _pattern(n)
    write_at(str(f), _filled(data), offset)
    raw = f.read_bytes()
    assert len(raw) == offset + n
    assert raw[offset:] == data and raw[:offset] == bytes(offset)


def test_parts_out_of_order_make_the_file(tmp_path):
    f = tmp_path / "big.upload"
    f.write_bytes(b"")
    parts = [_pattern(4 * MiB, i) for i in range(3)] + [_pattern(MiB + 17, 9)]
    for i in (2, 0, 3, 1):
        write_at(str(f), _filled(parts[i]), i * 4 * MiB)
    assert f.read_bytes() == b"".join(parts)


def test_the_aligned_bulk_skips_the_page_cache(tmp_path):
    f = tmp_path / "d.upload"
    f.write_bytes(b"")
    write_at(str(f), _filled(_pattern(16 * MiB + 5)), 0)
    cached = cached_bytes(f)
    if cached is None:
        pytest.skip("fincore not available")
    assert cached <= 2 * DIRECT_ALIGN, cached  # the 5-byte tail's page, not 16 MiB
    g = tmp_path / "b.upload"
    g.write_bytes(b"")
    write_at(str(g), _pattern(16 * MiB), 0)  # bytes: not an aligned buffer, page cache
    assert cached_bytes(g) >= 16 * MiB - DIRECT_ALIGN


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_file_system_without_o_direct_gets_plain_writes(monkeypatch):
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        f = Path(d) / "t.upload"
        f.write_bytes(b"")
        data = _pattern(2 * MiB + 1)
        write_at(str(f), _filled(data), 0)
        assert f.read_bytes() == data
    finally:
        shutil.rmtree(d)


def test_a_device_refusing_the_alignment_falls_back(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT but refuses the write (EINVAL: a larger
    block size) is written through the page cache, then and from then on."""
    f = tmp_path / "e.upload"
    f.write_bytes(b"")
    real = os.pwrite
    calls = []

    def pwrite(fd, buf, off):
        if _flags(fd) & os.O_DIRECT:
            calls.append(off)
            raise OSError(22, "Invalid argument")
        return real(fd, buf, off)

    monkeypatch.setattr(localio.os, "pwrite", pwrite)
    monkeypatch.setattr(localio, "_no_direct", set())
    data = _pattern(4 * MiB)
    write_at(str(f), _filled(data), 0)
    write_at(str(f), _filled(data), 4 * MiB)
    assert f.read_bytes() == data * 2
    assert len(calls) == 1  # the second write did not try again
    assert os.stat(f).st_dev in localio._no_direct


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _s3_checkpoint(bucket, tmp_path, mib: int) -> Path:
    """A sealed safetensors checkpoint of ``mib`` MiB (plus a byte, so the last part has
    an unaligned tail), uploaded to ``bucket`` as ``ck``; returns the local original."""
    import numpy as np
    from safetensors.numpy import save_file

    from ckptctl.tiering.promote import promote
    from ckptctl.integrity.seal import seal

    src = tmp_path / "src" / "ck"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({"w": rng.integers(0, 255, (mib << 20) + 1, dtype=np.uint8)},
              str(src / "model.safetensors"))
    seal(str(src))
    promote(str(src), bucket.url("ck"), None, bucket.storage_options)
    return src


def _cli(bucket, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= bucket.server.env
    return subprocess.run([str(Path(__import__("sys").executable).parent / "ckptctl"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_restore_onto_a_block_device_is_exact_and_skips_the_page_cache(s3_bucket, tmp_path,
                                                                         small_ext4):
    src = _s3_checkpoint(s3_bucket, tmp_path, 20)
    mnt = small_ext4("64M")
    p = _cli(s3_bucket, "promote", "--quiet", "--part-size", "5MiB", s3_bucket.url("ck"),
             str(mnt / "ck"))
    assert p.returncode == 0, p.stderr
    cached = cached_bytes(mnt / "ck" / "model.safetensors")  # before reading it back
    if cached is not None:  # the parts' aligned bulk went past the page cache
        assert cached < 2 * MiB, cached
    for f in src.iterdir():
        assert (mnt / "ck" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_restore_that_fills_the_disk_commits_nothing(s3_bucket, tmp_path, small_ext4):
    """ENOSPC in an O_DIRECT write: one line naming the cause, exit 3, nothing at the
    destination's name."""
    _s3_checkpoint(s3_bucket, tmp_path, 24)
    mnt = small_ext4("16M")
    p = _cli(s3_bucket, "promote", "--part-size", "5MiB", "--workers", "1",
             s3_bucket.url("ck"), str(mnt / "ck"))
    assert p.returncode == 3, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "no space left on device" in p.stderr.lower(), p.stderr
    assert not (mnt / "ck").exists()
    assert not any(f.name == "ckptctl.manifest.json" for f in mnt.rglob("*"))
