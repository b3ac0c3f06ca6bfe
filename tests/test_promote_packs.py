"""``promote`` of delta packs (issue 17, item 1): a delta pack never lands where its base
is not, ``--delete-source`` never removes what the copy still needs, and the id promote
prints is the checkpoint's, in every mode. Locally and on the rclone S3 server.

A cold tier is built the way an operator builds one: ``promote --pack`` of two sealed
safetensors checkpoints (written by ``safetensors.numpy``), the second a delta pack
against the first. Every destination is proven by restoring it: ``ckptctl diff`` against
the original says identical, ``verify --level full`` passes, the restored files are the
original's byte for byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

from ckptctl.formats.manifest import MANIFEST, Manifest
from ckptctl.formats.pack import PACK_INDEX
from ckptctl.tiering.promote import promote
from test_gc_packs import _ckpt, _files  # the same sealed checkpoints as the gc pack tests


_tree = _files  # every file of a folder, by relative path, with its bytes


class Place:
    """Folders of one test, on the local disk or in one S3 bucket (CLI: AWS_* env)."""

    def __init__(self, tmp_path: Path, bucket=None):
        self.tmp, self.bucket = tmp_path, bucket
        self.opts = bucket.storage_options if bucket else None

    def url(self, rel: str) -> str:
        return self.bucket.url(rel) if self.bucket else str(self.tmp / rel)

    def tree(self, rel: str) -> dict[str, bytes]:
        """The files at ``rel``, wherever it is."""
        if not self.bucket:
            return _tree(self.tmp / rel)
        fs = self.bucket.fs()
        root = self.bucket.path(rel)
        return {k[len(root) + 1:]: fs.cat_file(k) for k in sorted(fs.find(root))}

    def exists(self, rel: str) -> bool:
        return bool(self.tree(rel)) if self.bucket else (self.tmp / rel).exists()


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path, monkeypatch):
    if request.param == "local":
        return Place(tmp_path)
    bucket = request.getfixturevalue("s3_bucket")
    for k, v in bucket.server.env.items():  # the CLI's S3 URLs find the server here
        monkeypatch.setenv(k, v)
    return Place(tmp_path, bucket)


@pytest.fixture
def cold(place, tmp_path):
    """hot/step-60 and hot/step-80 (sealed, local) and the cold tier: cold/step-60 a full
    pack, cold/step-80 a delta pack against it; the original ids by step."""
    hot = tmp_path / "hot"
    ids = {}
    for step in (60, 80):
        _ckpt(hot / f"step-{step}", step)
        r = promote(str(hot / f"step-{step}"), place.url(f"cold/step-{step}"), None,
                    place.opts, pack=True)
        assert r.action == "packed", r
        ids[step] = Manifest.parse((hot / f"step-{step}" / MANIFEST).read_bytes(), "m").id
    assert json.loads(place.tree("cold/step-80")[PACK_INDEX])["base"]["id"] == ids[60]
    return hot, ids


def _printed_id(out: str) -> str:
    return [ln for ln in out.splitlines() if ln.startswith("id ")][-1][3:]


def _restores(place: Place, rel: str, original: Path) -> None:
    """``rel`` is (or unpacks to) exactly ``original``: diff says identical, verify full
    passes; a pack is also unpacked to a local folder and compared byte for byte."""
    code, out, err = run_cli("verify", "--level", "full", place.url(rel))
    assert code == 0, (out, err)
    code, out, err = run_cli("diff", str(original), place.url(rel))
    assert code == 0 and "identical" in out, (out, err)
    files = place.tree(rel)
    if PACK_INDEX in files:
        back = place.tmp / "unpacked" / rel
        code, out, err = run_cli("unpack", place.url(rel), str(back))
        assert code == 0, err
        assert _tree(back) == _tree(original)
    else:
        assert files == _tree(original)


# --------------------------------------------------------------------------- restore


def test_restore_from_cold_gives_a_plain_restorable_checkpoint(place, cold):
    hot, ids = cold
    code, out, err = run_cli("promote", place.url("cold/step-80"), place.url("restored/step-80"))
    assert code == 0, err
    assert "unpacked" in out and _printed_id(out) == ids[80], out
    assert PACK_INDEX not in place.tree("restored/step-80")
    _restores(place, "restored/step-80", hot / "step-80")
    # --json says the same id; a rerun finds it there
    code, out, err = run_cli("promote", place.url("cold/step-80"),
                             place.url("restored/step-80"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["action"] == "up-to-date" and doc["manifest_id"] == ids[80], out


def test_restore_from_a_pack_tier_by_name(tmp_path, monkeypatch):
    """The issue's own words: ``ckptctl promote cold:step-80 restored/step-80``, with
    ``cold`` a ``pack = true`` tier of the config."""
    hot = tmp_path / "hot"
    for step in (60, 80):
        _ckpt(hot / f"step-{step}", step)
    (tmp_path / "ckptctl.toml").write_text(
        f'[[tier]]\nname = "hot"\nurl = "{hot}"\n\n'
        f'[[tier]]\nname = "cold"\nurl = "{tmp_path / "cold"}"\npack = true\n')
    monkeypatch.chdir(tmp_path)
    for step in (60, 80):
        code, out, err = run_cli("promote", f"hot:step-{step}", "cold:")
        assert code == 0 and "packed" in out, err
    assert json.loads((tmp_path / "cold" / "step-80" / PACK_INDEX).read_bytes())["base"]
    code, out, err = run_cli("promote", "cold:step-80", "restored/step-80")
    assert code == 0, err
    want = Manifest.parse((hot / "step-80" / MANIFEST).read_bytes(), "m").id
    assert _printed_id(out) == want
    assert _tree(tmp_path / "restored" / "step-80") == _tree(hot / "step-80")
    code, out, err = run_cli("verify", "--level", "full", "restored/step-80")
    assert code == 0, out


# --------------------------------------------------------------------------- pack places


def test_pack_base_none_from_a_delta_pack_has_no_base(place, cold):
    hot, ids = cold
    code, out, err = run_cli("promote", place.url("cold/step-80"), place.url("cold2/step-80"),
                             "--pack", "--base", "none", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["action"] == "packed" and doc["manifest_id"] == ids[80], doc
    files = place.tree("cold2/step-80")
    assert json.loads(files[PACK_INDEX])["base"] is None
    man = Manifest.parse(files[MANIFEST], "m")
    assert man.base is None and man.checkpoint_id == ids[80]
    # no dependency: it restores with the whole cold tier gone
    code, out, err = run_cli("rm", place.url("cold/step-80"))
    assert code == 0, err
    code, out, err = run_cli("rm", place.url("cold/step-60"))
    assert code == 0, err
    _restores(place, "cold2/step-80", hot / "step-80")


def test_a_delta_pack_is_copied_as_it_is_only_where_its_base_is(place, cold, tmp_path):
    hot, ids = cold
    # warm/ gets step-60 first (a full pack: copied as it is), so step-80's base is there
    for step in (60, 80):
        code, out, err = run_cli("promote", place.url(f"cold/step-{step}"),
                                 place.url(f"warm/step-{step}"), "--pack")
        assert code == 0 and _printed_id(out) == ids[step], (out, err)
    assert place.tree("warm/step-80") == place.tree("cold/step-80")  # the chain carried
    _restores(place, "warm/step-80", hot / "step-80")
    # other/ holds another checkpoint under the base's name: never taken for the base
    other = tmp_path / "x" / "step-60"
    _ckpt(other, 61)
    promote(str(other), place.url("other/step-60"), None, place.opts)
    code, out, err = run_cli("promote", place.url("cold/step-80"), place.url("other/step-80"),
                             "--pack")
    assert code == 0 and _printed_id(out) == ids[80], (out, err)
    index = json.loads(place.tree("other/step-80")[PACK_INDEX])
    assert index["base"] is None or index["base"]["id"] != ids[60]
    _restores(place, "other/step-80", hot / "step-80")


# --------------------------------------------------------------------------- delete-source


def test_delete_source_of_a_delta_pack_leaves_a_restorable_copy(place, cold):
    hot, ids = cold
    code, out, err = run_cli("promote", place.url("cold/step-80"),
                             place.url("restored/step-80"), "--delete-source")
    assert code == 0 and "source removed" in out and _printed_id(out) == ids[80], (out, err)
    assert not place.exists("cold/step-80")
    _restores(place, "restored/step-80", hot / "step-80")
    # to a pack place without its base: packed again without one, then the source goes
    promote(str(hot / "step-80"), place.url("cold/step-80"), None, place.opts, pack=True)
    code, out, err = run_cli("promote", place.url("cold/step-80"), place.url("far/step-80"),
                             "--pack", "--delete-source")
    assert code == 0 and _printed_id(out) == ids[80], (out, err)
    assert not place.exists("cold/step-80")
    _restores(place, "far/step-80", hot / "step-80")
    # beside its base: moved as it is, the base stays
    promote(str(hot / "step-80"), place.url("cold/step-80"), None, place.opts, pack=True)
    code, out, err = run_cli("promote", place.url("cold/step-80"), place.url("cold/moved-80"),
                             "--pack", "--delete-source", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["pack"]["carried"] and doc["manifest_id"] == ids[80], out
    assert not place.exists("cold/step-80") and place.exists("cold/step-60")
    _restores(place, "cold/moved-80", hot / "step-80")


def test_delete_source_keeps_a_source_the_copy_is_made_against(tmp_path):
    hot = tmp_path / "hot"
    src = _ckpt(hot / "step-80", 80)
    want = _tree(src)
    code, out, err = run_cli("promote", str(src), str(tmp_path / "p" / "step-80"), "--pack",
                             "--base", str(src), "--delete-source")
    assert code == 1 and "made against it" in err, (out, err)
    got = _tree(src)  # the source stays (with the pack's reference to it), the copy
    assert {k: got.get(k) for k in want} == want  # is there and restores
    code, out, err = run_cli("verify", "--level", "full", str(tmp_path / "p" / "step-80"))
    assert code == 0, out
