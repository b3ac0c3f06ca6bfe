"""Many small files: a local destination makes them durable in batches (one ``syncfs``,
then renames), not with two fsyncs each; a failed batch leaves nothing under a file's name
and a rerun sends it again; the journal fsyncs only what a re-send cannot repair."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from ckptctl.errors import CkptError
from ckptctl.tiering.promote import promote
from ckptctl.integrity.seal import seal
from ckptctl.storage import local_store as store_mod
from ckptctl.storage import transfer as transfer_mod
from ckptctl.storage.journal import Journal


def _folder(d: Path, n: int) -> dict[str, bytes]:
    """A Hugging Face folder of ``n`` small safetensors shards and its index, sealed."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({f"layers.{i}.weight": rng.standard_normal(16 + i, dtype=np.float32)},
                  str(d / name))
        weight_map[f"layers.{i}.weight"] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    seal(str(d))
    return {p.name: p.read_bytes() for p in d.iterdir() if p.name != "ckptctl.manifest.json"}


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _count_fsyncs(monkeypatch) -> list:
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


def test_small_files_are_made_durable_in_batches(tmp_path, monkeypatch):
    """600 shards (more than one batch): every byte lands, sealed, no temp file left, and
    the fsyncs are a handful per batch and folder, not two per file."""
    src = tmp_path / "src" / "step-1"
    want = _folder(src, 600)
    monkeypatch.setattr(transfer_mod, "STAGE_FILES", 256)  # three batches
    syncfs = []
    real_sync_files = store_mod.sync_files
    monkeypatch.setattr(store_mod, "sync_files",
                        lambda paths: (syncfs.append(len(paths)), real_sync_files(paths)))
    fsyncs = _count_fsyncs(monkeypatch)
    r = promote(str(src), str(tmp_path / "dst" / "step-1"))
    assert r.files_sent == 601 and r.action == "promoted"
    got = _tree(tmp_path / "dst" / "step-1")
    assert {k: v for k, v in got.items() if k in want} == want
    assert set(got) == set(want) | {"ckptctl.manifest.json"}  # no temp file, no marker
    assert sum(syncfs) == 601 and len(syncfs) >= 3, syncfs
    assert len(fsyncs) < 30, len(fsyncs)  # was 2 per file: 1,202


def test_a_failed_batch_publishes_nothing_and_a_rerun_sends_it(tmp_path, monkeypatch):
    src = tmp_path / "src" / "step-1"
    want = _folder(src, 40)
    dst = tmp_path / "dst" / "step-1"
    real = store_mod.sync_files

    def fail(paths):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store_mod, "sync_files", fail)
    with pytest.raises(CkptError, match="I/O error"):
        promote(str(src), str(dst))
    left = {k: v for work in (tmp_path / "dst").glob(".step-1.*") for k, v in _tree(work).items()}
    assert not any(k in want for k in left), sorted(left)  # nothing under a file's name
    assert not any(k.endswith(".tmp") for k in left), sorted(left)  # temps removed
    monkeypatch.setattr(store_mod, "sync_files", real)
    r = promote(str(src), str(dst))
    assert r.action == "promoted" and r.files_sent == 41
    assert {k: v for k, v in _tree(dst).items() if k in want} == want


def test_journal_fsyncs_only_the_header_and_started_uploads(tmp_path, monkeypatch):
    fsyncs = _count_fsyncs(monkeypatch)
    j = Journal(str(tmp_path / "j.jsonl"), {"source": "x"})
    assert len(fsyncs) == 1  # the header
    j.upload_started("big", "U1", 8 << 20)
    assert len(fsyncs) == 2  # an upload nobody knows of would be left on the server
    for i in range(50):
        j.part_done("big", i + 1, f"e{i}", 8 << 20, "h")
        j.file_done(f"f{i}", "d", 1)
    assert len(fsyncs) == 2  # a lost line costs a re-send, nothing else
    j.close()
    again = Journal(str(tmp_path / "j.jsonl"), {"source": "x"})
    assert len(again.files) == 50 and len(again.uploads["big"].parts) == 50


def test_temp_files_from_many_threads_keep_the_umask(tmp_path):
    """Reading the umask means setting it: two threads doing that at once could leave
    the process at 0. Temp files get the mode open() would give, the umask stays."""
    before = os.umask(0o022)
    try:
        out = []

        def make(i):
            fd, tmp = store_mod.local_temp(str(tmp_path / f"d{i % 3}" / f"f{i}"))
            os.close(fd)
            out.append(tmp)

        threads = [threading.Thread(target=make, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        now = os.umask(0o022)
        assert now == 0o022
        assert {stat.S_IMODE(os.stat(p).st_mode) for p in out} == {0o644}
    finally:
        os.umask(before)
