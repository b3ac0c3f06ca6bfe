"""What ckptctl calls good can be restored, what it deletes was its to delete (issue 17).

- The ordinary routes by which a delta pack used to lose its base and stay "sealed":
  ``rm`` of the base, ``pack --base`` in another root then ``gc`` of that root, a plain
  copy of a pack folder. Each ends with the root holding a restorable newest checkpoint,
  and ``ls``/``latest``/``verify`` agreeing with what ``unpack`` can do. Local and S3.
- ``--force`` replaces only what the command would have written: a destination holding a
  pinned checkpoint, several checkpoints or a user's file is refused and nothing is
  deleted, for every verb that takes ``--force``. Local and S3.
- gc and rm delete only files they own; a checkpoint without a step is never ranked.
- Every reading verb honours ``.ckptctl-writing``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ckptctl.formats.manifest import MANIFEST, NEEDED_BY_PREFIX, WRITING_MARKER
from ckptctl.tiering.gc import gc
from ckptctl.tiering.latest import latest
from ckptctl.catalog.ls import ls
from ckptctl.packs.pack import pack
from ckptctl.tiering.pins import pin
from ckptctl.tiering.policy import Policy
from ckptctl.integrity.seal import seal
from conftest import write_tiny_dcp


_W = np.random.default_rng(0).standard_normal(8192).astype(np.float32)


def _weights(step: int) -> dict:
    """Weights big enough to be delta-encoded (a pack against an earlier step then needs
    its base), differing a little by step."""
    w = _W.copy()
    w[:32] += step
    return {"w": w, "b": np.arange(8, dtype=np.int64) + step}


def _ckpt(path: Path, step: int, *, sealed: bool = True) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    save_file(_weights(step), str(path / "model.safetensors"))
    if sealed:
        seal(str(path))
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


class Place:
    """A root to test on: a local folder, or a prefix of a loopback S3 bucket (built
    locally, then uploaded)."""

    def __init__(self, tmp: Path, bucket=None):
        self.tmp, self.bucket = tmp, bucket
        self.local = tmp / "root"

    @property
    def s3(self) -> bool:
        return self.bucket is not None

    def url(self, rel: str = "") -> str:
        if self.s3:
            return self.bucket.url(f"root/{rel}".rstrip("/"))
        return str(self.local / rel) if rel else str(self.local)

    @property
    def opts(self) -> dict | None:
        return self.bucket.storage_options if self.s3 else None

    def args(self) -> list[str]:
        if not self.s3:
            return []
        o = self.opts
        return [f"--storage-option=endpoint_url={o['endpoint_url']}",
                f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]

    def publish(self) -> None:
        if self.s3:
            self.bucket.upload(self.local, "root")

    def files(self) -> dict[str, bytes]:
        """Every file under the root, by relative path, with its bytes."""
        if not self.s3:
            return _tree(self.local)
        fs = self.bucket.fs()
        base = self.bucket.path("root") + "/"
        return {p[len(base):]: fs.cat_file(p) for p in sorted(fs.find(base))}


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    if request.param == "s3":
        return Place(tmp_path, request.getfixturevalue("s3_bucket"))
    return Place(tmp_path)


# ------------------------------------------------------------------ item 1: pack routes

def test_rm_of_a_pack_base_names_the_pack_and_needs_a_flag(place, cli):
    src = place.tmp / "src"
    _ckpt(place.local / "step-100", 100)
    _ckpt(src / "step-200", 200)
    pack(str(src / "step-200"), str(place.local / "step-200"),
         base=str(place.local / "step-100"), workers=1)
    place.publish()
    before = place.files()
    code, out, err = cli("rm", place.url("step-100"), *place.args())
    assert code == 1 and "step-200" in err and "--orphan-dependants" in err, (code, err)
    assert len(err.strip().splitlines()) == 1 and place.files() == before
    # with the flag it goes; the pack is then incomplete and names its missing base
    code, out, err = cli("rm", place.url("step-100"), "--orphan-dependants", *place.args())
    assert code == 0, err
    rows = {r.name: r for r in ls(place.url(), place.opts).checkpoints}
    assert rows["step-200"].state == "incomplete"
    assert rows["step-200"].reason.startswith("MISSING_BASE") and "step-100" in rows[
        "step-200"].reason
    assert latest(place.url(), place.opts).url is None
    code, out, err = cli("verify", place.url("step-200"), "--level", "quick", *place.args())
    assert code == 1 and "MISSING_BASE" in out, (code, out, err)


def test_pack_against_another_root_keeps_its_base_there(place, cli):
    """The base lives in root A, the pack in root B: gc of A cannot list B's pack, but
    the reference the pack left in its base keeps it ('base of ...')."""
    warm, cold = place.local / "warm", place.local / "cold"
    for s in (100, 200, 300):
        _ckpt(warm / f"step-{s}", s)
    _ckpt(place.tmp / "src" / "step-400", 400)
    place.publish()
    pack(str(place.tmp / "src" / "step-400"), place.url("cold/step-400"),
         base=place.url("warm/step-100"), workers=1, dst_storage_options=place.opts,
         base_storage_options=place.opts)
    assert any(k.startswith(f"warm/step-100/{NEEDED_BY_PREFIX}") for k in place.files())
    d = gc(place.url("warm"), Policy(last=1), place.opts)
    assert d.decision.keep == {"step-300": ["last 1", "newest committed"],
                               "step-100": [f"base of {place.url('cold/step-400')}"]}
    assert d.decision.remove == ["step-200"]
    # the pack still restores; and its reference is no checkpoint content
    out = place.tmp / "restored"
    code, _, err = cli("unpack", place.url("cold/step-400"), str(out), *place.args())
    assert code == 0, err
    assert _tree(out)["model.safetensors"] == (
        place.tmp / "src" / "step-400" / "model.safetensors").read_bytes()
    code, _, err = cli("verify", place.url("warm/step-100"), "--level", "full", *place.args())
    assert code == 0, err
    # rm of the base names the pack elsewhere
    code, _, err = cli("rm", place.url("warm/step-100"), *place.args())
    assert code == 1 and "cold/step-400" in err, err
    # once the pack is gone, the reference is stale: the base is free to go
    code, _, err = cli("rm", place.url("cold/step-400"), *place.args())
    assert code == 0, err
    d = gc(place.url("warm"), Policy(last=1), place.opts)
    assert d.decision.remove == ["step-100"]


def test_a_plain_copy_of_a_pack_folder_is_not_sealed(place, cli):
    """cp -r of a delta pack without its base: incomplete (MISSING_BASE) for ls, latest
    and verify, as unpack says; gc keeps the restorable newest and the copy."""
    run = place.tmp / "run"
    _ckpt(run / "step-100", 100)
    _ckpt(place.tmp / "src" / "step-200", 200)
    pack(str(place.tmp / "src" / "step-200"), str(run / "step-200"),
         base=str(run / "step-100"), workers=1)
    _ckpt(place.local / "step-150", 150)
    shutil.copytree(run / "step-200", place.local / "step-200")  # the base stays behind
    place.publish()
    rows = {r.name: r for r in ls(place.url(), place.opts).checkpoints}
    assert rows["step-200"].state == "incomplete", rows["step-200"]
    assert rows["step-150"].state == "sealed"
    assert latest(place.url(), place.opts).name == "step-150"
    code, out, err = cli("unpack", place.url("step-200"), str(place.tmp / "o"), *place.args())
    assert code != 0 and "base" in err
    d = gc(place.url(), Policy(last=1), place.opts)
    assert "step-150" in d.decision.keep and "step-200" in d.decision.keep
    assert d.decision.remove == []


# ------------------------------------------------------------------ item 2: --force scope

def _force_cases(tmp: Path) -> dict[str, Path]:
    """Destinations --force must refuse: a folder of checkpoints, a pinned checkpoint,
    a checkpoint with a user's file, a folder of user files."""
    cases = {}
    d = tmp / "dests" / "parent"
    _ckpt(d / "step-1", 1)
    _ckpt(d / "step-2", 2, sealed=False)
    cases["parent"] = d
    d = _ckpt(tmp / "dests" / "pinned", 3)
    pin(str(d), "paper")
    cases["pinned"] = d
    d = _ckpt(tmp / "dests" / "notes", 4)
    (d / "eval").mkdir()
    (d / "eval" / "results.json").write_text("{}")
    cases["notes"] = d
    d = tmp / "dests" / "user"
    d.mkdir(parents=True)
    (d / "thesis.tex").write_text("x")
    cases["user"] = d
    return cases


def test_force_never_wipes_what_it_did_not_write(tmp_path, cli, s3_bucket):
    src = tmp_path / "src"
    write_tiny_dcp(src)
    packed = tmp_path / "packed"
    pack(str(src), str(packed), workers=1)
    cases = _force_cases(tmp_path)
    s3_bucket.upload(tmp_path / "dests", "dests")
    o = s3_bucket.storage_options
    s3_args = [f"--storage-option=endpoint_url={o['endpoint_url']}",
               f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]
    fs = s3_bucket.fs()
    verbs = {
        "reshard": ["reshard", str(src), "{dst}", "--world-size", "2"],
        "consolidate": ["consolidate", str(src), "{dst}", "--to", "safetensors", "--only",
                        "model"],
        "pack": ["pack", str(src), "{dst}"],
        "unpack": ["unpack", str(packed), "{dst}"],
    }
    local_before = _tree(tmp_path / "dests")
    s3_before = {p: fs.cat_file(p) for p in fs.find(s3_bucket.path("dests"))}
    for verb, argv in verbs.items():
        for name in cases:
            for dst, extra in ((str(cases[name]), []),
                               (s3_bucket.url(f"dests/{name}"), s3_args)):
                code, out, err = cli(*[a.format(dst=dst) for a in argv], "--force", *extra)
                assert code == 2, (verb, name, dst, code, out, err)
                assert "not empty and it holds" in err and len(err.strip().splitlines()) == 1, err
    assert _tree(tmp_path / "dests") == local_before
    fs = s3_bucket.fs()
    assert {p: fs.cat_file(p) for p in fs.find(s3_bucket.path("dests"))} == s3_before
    # what --force is for: one unpinned checkpoint of its own kind, replaced
    one = _ckpt(tmp_path / "one", 9)
    code, out, err = cli("consolidate", str(src), str(one), "--to", "safetensors", "--only",
                         "model", "--force")
    assert code == 0, err
    assert sorted(_tree(one)) == [MANIFEST, "model.safetensors"]


def test_force_replaces_an_unfinished_write(tmp_path, cli):
    src = tmp_path / "src"
    write_tiny_dcp(src)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / WRITING_MARKER).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    (dst / "__0_0.distcp").write_bytes(b"half")
    code, out, err = cli("reshard", str(src), str(dst), "--world-size", "2")
    assert code == 2 and "--force" in err
    code, out, err = cli("reshard", str(src), str(dst), "--world-size", "2", "--force")
    assert code == 0, err
    assert cli("verify", str(dst), "--level", "full")[0] == 0


# ------------------------------------------------------ item 4: ownership, stepless ones

def test_gc_and_rm_take_only_what_the_checkpoint_owns(place, cli):
    for s in (10, 20, 30):
        _ckpt(place.local / f"step-{s}", s, sealed=s != 20)
    (place.local / "step-10" / "NOTES.md").write_text("keep me")
    (place.local / "step-20" / "eval").mkdir()
    (place.local / "step-20" / "eval" / "results.json").write_text("{}")
    _ckpt(place.local / "hf-export", 30)  # no step: never ranked
    scratch = place.local / "scratch"
    scratch.mkdir()
    (scratch / "__0_0.distcp").write_bytes(b"user bytes")  # only a .distcp, no step
    place.publish()
    code, out, err = cli("gc", place.url(), "--keep-last", "1", "--json", *place.args())
    assert code == 1, (code, err)  # a finding: the policy asked for removals gc refused
    doc = json.loads(out)
    assert doc["remove"] == [] and {b["name"] for b in doc["blocked"]} == {"step-10", "step-20"}
    assert doc["keep"]["hf-export"] == ["no step"] and doc["keep"]["scratch"] == ["no step"]
    assert "NOTES.md" in err and "eval/results.json" in err
    files = place.files()
    assert files["step-10/NOTES.md"] == b"keep me" and "step-20/eval/results.json" in files
    code, out, err = cli("rm", place.url("step-10"), *place.args())
    assert code == 1 and "NOTES.md" in err and len(err.strip().splitlines()) == 1
    assert place.files() == files


def test_a_stepless_checkpoint_is_never_ranked(tmp_path):
    root = tmp_path / "run"
    for s in (100, 200):
        _ckpt(root / f"step-{s}", s)
    _ckpt(root / "final-export", 200)
    for p in (Policy(last=1), Policy(every=1000), Policy(last=1, every=100)):
        d = gc(str(root), p, dry_run=True)
        assert d.decision.keep["final-export"] == ["no step"], d.decision
        assert "newest committed" in d.decision.keep["step-200"]


# ----------------------------------------------------------- item 5: the writing marker

def test_every_reading_verb_honours_the_writing_marker(tmp_path, cli):
    src = tmp_path / "src"
    write_tiny_dcp(src)
    seal(str(src))
    (src / WRITING_MARKER).write_text(json.dumps({"pid": 1, "host": "elsewhere",
                                                 "command": "gc"}))
    for argv in (["inspect", str(src)], ["diff", str(src), str(src)],
                 ["reshard", str(src), str(tmp_path / "r"), "--world-size", "2"],
                 ["consolidate", str(src), str(tmp_path / "c"), "--to", "safetensors",
                  "--only", "model"],
                 ["pack", str(src), str(tmp_path / "p")],
                 ["promote", str(src), str(tmp_path / "w")],
                 ["verify", str(src)]):
        code, out, err = cli(*argv)
        assert code != 0 and ("NOT_COMMITTED" in out + err or WRITING_MARKER in err), \
            (argv, code, out, err)
        assert not (tmp_path / argv[0][0]).exists()
    code, out, err = cli("inspect", str(src), "--allow-incomplete")
    assert code == 0, err


# ------------------------------------------------------------------ item 10: the smaller

def test_a_marker_write_killed_midway_is_no_problem(tmp_path, cli):
    d = _ckpt(tmp_path / "step-1", 1)
    (d / f".{WRITING_MARKER}.k2j3x9.tmp").write_text("{")  # what a killed write leaves
    code, out, err = cli("verify", str(d))
    assert code == 0, (out, err)


def test_two_gc_at_once_do_not_trip_over_each_other(tmp_path):
    """The second gc lists the root before the first one deleted: what is gone since
    is no error (deletes of missing files are fine, a vanished file reads as changed)."""
    root = tmp_path / "run"
    for s in (1, 2, 3):
        _ckpt(root / f"step-{s}", s, sealed=False)
    import importlib

    gc_mod = importlib.import_module("ckptctl.tiering.gc")

    real = gc_mod.ls
    listed = real(str(root), manifests=True, check="auto")
    gc(str(root), Policy(last=1))  # the first gc removes step-1 and step-2
    gc_mod.ls = lambda *a, **k: listed  # the second one still works from its old listing
    try:
        d = gc(str(root), Policy(last=1))
    finally:
        gc_mod.ls = real
    assert d.decision.remove == ["step-2", "step-1"]
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]


def test_gc_with_no_grace_keeps_what_a_live_process_is_writing(tmp_path):
    """A promote's local staging folder (or any ckptctl write) whose marker names a
    process still running on this host is kept even with --incomplete-grace 0s; the same
    marker left by a dead process is garbage."""
    import os
    import socket

    root = tmp_path / "run"
    for s in (1, 2):
        _ckpt(root / f"step-{s}", s)
    for name, pid in ((".step-3.promote", os.getpid()), ("step-4", 2 ** 22 + 7)):
        d = root / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
        (d / WRITING_MARKER).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                    "command": "promote"}))
    d = gc(str(root), Policy(last=1), grace=0)
    assert d.decision.keep[".step-3.promote"] == [
        f"being written (pid {os.getpid()} on {socket.gethostname()}, promote)"]
    assert "step-4" in d.decision.remove and not (root / "step-4").exists()
    assert (root / ".step-3.promote" / "model.safetensors").exists()


def test_ls_lists_files_that_make_no_one_checkpoint_each_on_its_own(tmp_path):
    """model.safetensors beside an unrelated x.pt: no loader reads them as one
    checkpoint, so each is its own row (not one corrupt row hiding both)."""
    import torch
    from safetensors.numpy import save_file

    root = tmp_path / "m"
    root.mkdir()
    save_file(_weights(1), str(root / "model.safetensors"))
    torch.save({"a": torch.ones(3)}, str(root / "x.pt"))
    rows = {r.name: (r.format, r.state) for r in ls(str(root)).checkpoints}
    assert rows == {"model.safetensors": ("safetensors", "complete"),
                    "x.pt": ("torch", "complete")}
