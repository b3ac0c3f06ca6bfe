"""Local-to-local transfers onto ext4 go through memory: each part is read into a
page-aligned buffer, hashed from it and written with O_DIRECT (storage/localio.py
``copies_through_memory`` says why), so the destination leaves no page cache behind and
nothing is read back. Onto other file systems the kernel copy stays
(tests/test_kernel_transfer.py). A cut-off copy resumes without sending a part twice."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import cached_bytes

from ckptctl.errors import CkptError, StorageError
from ckptctl.storage import multipart, open_store
from ckptctl.storage.hashing import digest_bytes
from ckptctl.storage.journal import Journal
from ckptctl.storage.localio import copies_through_memory
from ckptctl.storage.transfer import Transfer

MIB = 1 << 20


def _files(where: Path, n: int = 2, parts: int = 4) -> dict[str, bytes]:
    where.mkdir(parents=True)
    files = {f"f{i}.bin": os.urandom(parts * 5 * MIB - i * 4099) for i in range(n)}
    for rel, data in files.items():
        (where / rel).write_bytes(data)
    return files


def _copy(t: Transfer, files: dict[str, bytes]) -> dict:
    try:
        return {rel: t.copy(rel, len(data), digest_bytes(data)) for rel, data in files.items()}
    finally:
        t.close()


def test_onto_ext4_parts_go_through_memory_and_past_the_page_cache(tmp_path, small_ext4):
    mnt = small_ext4("64M")
    files = _files(tmp_path / "src")
    src, dst = open_store(str(tmp_path / "src")), open_store(str(mnt / "dst"))
    t = Transfer(src, dst, journal=Journal(None, {}), part_size=5 * MIB, workers=4)
    assert not t.kernel
    got = _copy(t, files)
    assert {r: (c.how, c.parts_sent) for r, c in got.items()} == {
        r: ("multipart", 4) for r in files}
    for rel, data in files.items():
        cached = cached_bytes(mnt / "dst" / rel)  # before reading it back
        if cached is not None:  # the aligned bulk went straight to the disk
            assert cached <= 2 * 4096, (rel, cached)
        assert dst.read(rel) == data
        assert got[rel].digest == digest_bytes(data)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_onto_tmpfs_parts_are_copied_in_the_kernel(tmp_path):
    shm = Path("/dev/shm") / f"ckptctl-test-{os.getpid()}-{tmp_path.name}"
    try:
        assert not copies_through_memory(str(shm / "dst"))
        files = _files(tmp_path / "src", n=1, parts=2)
        t = Transfer(open_store(str(tmp_path / "src")), open_store(str(shm / "dst")),
                     journal=Journal(None, {}), part_size=5 * MIB)
        assert t.kernel
        got = _copy(t, files)
        assert (shm / "dst" / "f0.bin").read_bytes() == files["f0.bin"]
        assert got["f0.bin"].how == "multipart"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_copy_cut_off_mid_file_resumes_without_sending_a_part_twice(tmp_path, small_ext4,
                                                                      monkeypatch):
    mnt = small_ext4("64M")
    files = _files(tmp_path / "src", n=1, parts=6)
    src, dst = open_store(str(tmp_path / "src")), open_store(str(mnt / "dst"))
    journal = Journal(None, {})
    real = multipart.upload_part
    sent: list[int] = []

    def failing(store, rel, upload_id, number, data):
        if number == 4:
            raise StorageError(store.display(rel), "write failed: no space left on device")
        sent.append(number)
        return real(store, rel, upload_id, number, data)

    monkeypatch.setattr(multipart, "upload_part", failing)
    with pytest.raises(CkptError, match="no space left on device"):
        _copy(Transfer(src, dst, journal=journal, part_size=5 * MIB, workers=1), files)
    assert "f0.bin" not in dst.list_files()  # nothing published under its name
    first = list(sent)
    assert 4 not in first and first
    sent.clear()
    monkeypatch.setattr(multipart, "upload_part",
                        lambda store, rel, uid, number, data: (sent.append(number),
                                                               real(store, rel, uid, number,
                                                                    data))[1])
    (c,) = _copy(Transfer(src, dst, journal=journal, part_size=5 * MIB, workers=1),
                 files).values()
    assert not set(sent) & set(first), "a part was sent twice"
    assert (c.parts_resumed, c.parts_sent) == (len(first), 6 - len(first))
    assert dst.read("f0.bin") == files["f0.bin"]
