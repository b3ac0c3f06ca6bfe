"""Local-to-local transfers onto file systems other than ext4 (XFS, btrfs, NFS, tmpfs)
copy parts in the kernel, one part of a file at a time (ext4 serializes the writers of
one inode), files in parallel; a failing part stops the file's later parts and nothing
waits forever. (Onto ext4 the parts go through memory: tests/test_memory_transfer.py.)"""
from __future__ import annotations

import os
import threading
from collections import Counter

import pytest

from ckptctl.errors import CkptError, StorageError
from ckptctl.storage import multipart, open_store
from ckptctl.storage.hashing import digest_bytes
from ckptctl.storage.journal import Journal
from ckptctl.storage.transfer import KERNEL_LANES, Transfer

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _kernel_path(monkeypatch):
    """tmp_path may be on ext4, where parts go through memory: test the kernel path."""
    from ckptctl.storage import transfer

    monkeypatch.setattr(transfer, "copies_through_memory", lambda path: False)


def _files(tmp_path, n=3, parts=6):
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}.bin": os.urandom(parts * 5 * MIB - i) for i in range(n)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    return open_store(str(src)), open_store(str(tmp_path / "dst")), files


def _copy_all(t: Transfer, files: dict[str, bytes]) -> dict:
    results, errors = {}, {}

    def one(rel):
        try:
            results[rel] = t.copy(rel, len(files[rel]), digest_bytes(files[rel]))
        except BaseException as e:  # noqa: BLE001 - asserted by the caller
            errors[rel] = e

    threads = [threading.Thread(target=one, args=(rel,)) for rel in files]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a copy is stuck"
    return {"results": results, "errors": errors}


def test_parts_of_one_file_are_copied_one_at_a_time(tmp_path, monkeypatch):
    src, dst, files = _files(tmp_path)
    running, most = Counter(), Counter()
    lock = threading.Lock()
    real = multipart.copy_part

    def counted(s, src_rel, d, rel, *a, **kw):
        with lock:
            running[rel] += 1
            most[rel] = max(most[rel], running[rel])
        try:
            return real(s, src_rel, d, rel, *a, **kw)
        finally:
            with lock:
                running[rel] -= 1

    monkeypatch.setattr(multipart, "copy_part", counted)
    t = Transfer(src, dst, journal=Journal(None, {}), part_size=5 * MIB, workers=4)
    try:
        got = _copy_all(t, files)
    finally:
        t.close()
    assert not got["errors"]
    assert {r: c.how for r, c in got["results"].items()} == {r: "multipart" for r in files}
    assert {r: c.parts_sent for r, c in got["results"].items()} == {r: 6 for r in files}
    assert dict(most) == {r: KERNEL_LANES for r in files} and KERNEL_LANES == 1
    for rel, data in files.items():
        assert dst.read(rel) == data


def test_a_failing_part_stops_the_later_parts_of_its_file(tmp_path, monkeypatch):
    src, dst, files = _files(tmp_path, n=1)
    sent = []
    real = multipart.copy_part

    def failing(s, src_rel, d, rel, upload_id, number, *a, **kw):
        if number == 3:
            raise StorageError(d.display(rel), "write failed: no space left on device")
        sent.append(number)
        return real(s, src_rel, d, rel, upload_id, number, *a, **kw)

    monkeypatch.setattr(multipart, "copy_part", failing)
    t = Transfer(src, dst, journal=Journal(None, {}), part_size=5 * MIB, workers=4)
    try:
        got = _copy_all(t, files)
    finally:
        t.close()
    (err,) = got["errors"].values()
    assert isinstance(err, CkptError) and "no space left on device" in str(err)
    assert sent == [1, 2], "parts after the failed one were copied"
    assert "f0.bin" not in dst.list_files()  # nothing published under its name


@pytest.mark.parametrize("cancel_at", [1, 4])
def test_cancelling_mid_file_ends_the_copy(tmp_path, monkeypatch, cancel_at):
    """A SIGTERM sets the transfer's cancel event: the lane stops at its next part and
    the file's copy raises instead of waiting for parts nobody will copy."""
    src, dst, files = _files(tmp_path, n=1)
    real = multipart.copy_part
    t = Transfer(src, dst, journal=Journal(None, {}), part_size=5 * MIB, workers=2)

    def cancelling(s, src_rel, d, rel, upload_id, number, *a, **kw):
        part = real(s, src_rel, d, rel, upload_id, number, *a, **kw)
        if number == cancel_at:
            t.cancel.set()
        return part

    monkeypatch.setattr(multipart, "copy_part", cancelling)
    try:
        got = _copy_all(t, files)
    finally:
        t.close()
    assert list(got["errors"]) == ["f0.bin"] and not got["results"]
    assert "f0.bin" not in dst.list_files()
