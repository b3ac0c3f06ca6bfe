"""``pack`` and ``promote`` of an unsealed checkpoint that cannot be written to (issue 17,
item 9): a read-only bind mount, and a read-only S3 server (``rclone serve s3
--read-only`` over the test server's data, like a bucket behind read-only keys).

The source is hashed while it is read and stays byte for byte as it was, unsealed; the
destination gets the manifest sealing would have written and passes ``verify --level
full``. ``--seal-source`` (seal it, or fail) fails with exit 3 and changes nothing;
``--no-seal-source`` leaves even a writable source as it is.
"""
from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

from ckptctl.formats.manifest import MANIFEST, Manifest


def _unsealed(path: Path, step: int = 5) -> Path:
    """A complete, unsealed safetensors checkpoint (and a config beside it)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    g = np.random.default_rng(step)
    save_file({"w": g.standard_normal((64, 64)).astype(np.float32),
               "b": np.arange(64, dtype=np.int64)}, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"hidden": 64}\n')
    return path


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _sealing_id(folder: Path, tmp_path: Path) -> str:
    """The id a seal of a copy of ``folder`` gives (what the destination must carry)."""
    import shutil

    copy = tmp_path / f"copy-{uuid.uuid4().hex[:8]}"
    shutil.copytree(folder, copy)
    code, out, err = run_cli("seal", str(copy), "--json")
    assert code == 0, err
    return json.loads(out)["manifest_id"]


@pytest.fixture
def readonly_mount(tmp_path):
    """(writable folder, the same folder bind-mounted read-only). As root, permissions
    do not stop writes; a read-only mount does. Skipped (with the reason) where this
    process may not mount."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")
        try:
            (ro / "probe").write_bytes(b"x")
        except OSError:
            pass
        else:
            pytest.skip("the read-only mount took a write")
        yield src, ro
    finally:
        import gc

        gc.collect()  # stores of the in-process CLI runs keep read descriptors open
        if subprocess.run(["umount", str(ro)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)  # still busy


def test_promote_from_a_read_only_mount(readonly_mount, tmp_path):
    src, ro = readonly_mount
    _unsealed(src / "step-5")
    before = _tree(src / "step-5")
    want = _sealing_id(src / "step-5", tmp_path)
    dst = tmp_path / "warm" / "step-5"
    code, out, err = run_cli("promote", str(ro / "step-5"), str(dst), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["action"] == "promoted" and not doc["sealed_source"] and doc["source_unsealed"]
    assert doc["manifest_id"] == want
    assert _tree(src / "step-5") == before and MANIFEST not in before
    code, out, err = run_cli("verify", "--level", "full", str(dst))
    assert code == 0, out
    assert {k: v for k, v in _tree(dst).items() if k != MANIFEST} == before
    assert Manifest.parse((dst / MANIFEST).read_bytes(), "m").id == want
    code, out, err = run_cli("ls", str(ro), "--json")  # the source: still complete, unsealed
    assert [c["state"] for c in json.loads(out)["checkpoints"]] == ["complete"], out


def test_pack_and_promote_pack_from_a_read_only_mount(readonly_mount, tmp_path):
    src, ro = readonly_mount
    _unsealed(src / "step-5")
    before = _tree(src / "step-5")
    want = _sealing_id(src / "step-5", tmp_path)
    for args, dst in ((("pack", str(ro / "step-5")), tmp_path / "packs" / "step-5"),
                      (("promote", str(ro / "step-5")), tmp_path / "cold" / "step-5")):
        extra = ("--pack",) if args[0] == "promote" else ()
        code, out, err = run_cli(*args, str(dst), *extra)
        assert code == 0, err
        assert _tree(src / "step-5") == before
        code, out, err = run_cli("verify", "--level", "full", str(dst))
        assert code == 0, out
        back = tmp_path / "back" / dst.parent.name
        code, out, err = run_cli("unpack", str(dst), str(back), "--json")
        assert code == 0 and json.loads(out)["manifest_id"] == want, (out, err)
        assert {k: v for k, v in _tree(back).items() if k != MANIFEST} == before


def test_seal_source_on_a_read_only_mount_fails_and_changes_nothing(readonly_mount, tmp_path):
    src, ro = readonly_mount
    _unsealed(src / "step-5")
    before = _tree(src / "step-5")
    code, out, err = run_cli("promote", str(ro / "step-5"), str(tmp_path / "dst"),
                             "--seal-source")
    assert code == 3 and "read-only" in err, (out, err)
    assert len(err.strip().splitlines()) == 1  # one line naming the file, no traceback
    assert _tree(src / "step-5") == before and not (tmp_path / "dst").exists()


def test_no_seal_source_leaves_a_writable_source_as_it_is(tmp_path):
    src = _unsealed(tmp_path / "hot" / "step-5")
    before = _tree(src)
    code, out, err = run_cli("promote", str(src), str(tmp_path / "warm" / "step-5"),
                             "--no-seal-source")
    assert code == 0 and "left unsealed" in out, err
    code, out, err = run_cli("pack", str(src), str(tmp_path / "p" / "step-5"),
                             "--no-seal-source")
    assert code == 0 and "not sealed" in out, err
    assert _tree(src) == before
    # the default still seals a source that takes the write
    code, out, err = run_cli("promote", str(src), str(tmp_path / "warm2" / "step-5"))
    assert code == 0 and "sealed SRC first" in out, err
    assert (src / MANIFEST).exists()


def test_promote_and_pack_from_a_read_only_s3_server(s3_bucket, rclone_s3_readonly, tmp_path):
    local = _unsealed(tmp_path / "step-5")
    before = _tree(local)
    want = _sealing_id(local, tmp_path)
    s3_bucket.upload(local, "archive/step-5")
    ro = rclone_s3_readonly
    src = s3_bucket.url("archive/step-5")
    opts = [f"endpoint_url={ro.endpoint_url}", f"key={ro.key}", f"secret={ro.secret}"]
    src_flags = [x for o in opts for x in ("--src-option", o)]
    dst = tmp_path / "restored" / "step-5"
    code, out, err = run_cli("promote", src, str(dst), *src_flags, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["source_unsealed"] and doc["manifest_id"] == want, doc
    code, out, err = run_cli("verify", "--level", "full", str(dst))
    assert code == 0, out
    code, out, err = run_cli("pack", src, str(tmp_path / "p" / "step-5"), *src_flags,
                             "--json")
    assert code == 0 and json.loads(out)["manifest_id"] == want, err
    code, out, err = run_cli("verify", "--level", "full", str(tmp_path / "p" / "step-5"))
    assert code == 0, out
    # the bucket holds what was uploaded, nothing more, byte for byte
    fs = s3_bucket.fs()
    root = s3_bucket.path("archive/step-5")
    assert {k[len(root) + 1:]: fs.cat_file(k) for k in fs.find(root)} == before
    # asked to seal it, the read-only server refuses: exit 3, nothing written
    code, out, err = run_cli("promote", src, str(tmp_path / "x"), *src_flags, "--seal-source")
    assert code == 3, (out, err)
    assert sorted(fs.find(root)) == sorted(f"{root}/{k}" for k in before)
