"""Every verb that deletes, re-seals or seals as it saves keeps to the rails ``rm`` and
``gc`` keep (issue 34, parts 5 and 7).

- ``promote --delete-source`` makes the check ``rm`` makes
  (:func:`ckptctl.catalog.ownership.check_removable`) once the copy is committed: a source
  holding a user's file, or the base of a delta pack beside it, stays, and the command
  says why (exit 1); the copy is there and restores. A rerun once the cause is gone
  removes the source. Locally and on the loopback S3 server.
- ``seal --update`` of a checkpoint a delta pack is made against refuses (exit 1, the
  pack named) when it would change the checkpoint's id; an update that keeps the id (a
  tag) goes through. Locally and on S3.
- :class:`ckptctl.dcp.SealingWriter` seals nothing ``seal`` refuses (an object entry the
  safe loader refuses), and a re-save on fewer shards leaves a folder that verifies.
- ``--force`` refuses a pinned checkpoint, or a pack's base, even beside a stale
  ``.ckptctl-writing`` marker.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli, write_tiny_dcp

from ckptctl.formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER, Manifest
from ckptctl.formats.pack import PACK_INDEX
from ckptctl.tiering.promote import promote
from test_gc_packs import _ckpt, _files
from test_promote_packs import Place, _restores, cold, place  # noqa: F401 - fixtures

NOTES = b"# what this run was for\n"


# --------------------------------------------------------------------------- helpers


def _put(place: Place, rel: str, data: bytes) -> None:
    """Write one file at ``rel`` in ``place`` (a user's file dropped into a checkpoint)."""
    if place.bucket:
        place.bucket.fs().pipe_file(place.bucket.path(rel), data)
        return
    path = place.tmp / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _drop(place: Place, rel: str) -> None:
    if place.bucket:
        place.bucket.fs().rm_file(place.bucket.path(rel))
    else:
        (place.tmp / rel).unlink()


def _plain(place: Place, rel: str, step: int) -> Path:
    """A sealed plain checkpoint at ``rel`` in ``place`` (promoted there from a local
    ``hot/`` one, returned)."""
    hot = place.tmp / "hot" / f"step-{step}"
    if not hot.exists():
        _ckpt(hot, step)
    r = promote(str(hot), place.url(rel), None, place.opts)
    assert r.action == "promoted", r
    return hot


@pytest.fixture
def based(place):
    """``t/step-60`` (plain) and ``t/step-80``, a delta pack made against it beside it;
    the local originals by step."""
    hot60 = _plain(place, "t/step-60", 60)
    hot80 = place.tmp / "hot" / "step-80"
    _ckpt(hot80, 80)
    r = promote(str(hot80), place.url("t/step-80"), None, place.opts, pack=True)
    assert r.action == "packed", r
    base_id = Manifest.parse((hot60 / MANIFEST).read_bytes(), "m").id
    assert json.loads(place.tree("t/step-80")[PACK_INDEX])["base"]["id"] == base_id
    return {60: hot60, 80: hot80}


# ------------------------------------------------------------------- promote --delete-source


def test_delete_source_keeps_a_source_holding_a_users_file(place):
    _plain(place, "src/step-60", 60)
    _put(place, "src/step-60/NOTES.md", NOTES)
    before = place.tree("src/step-60")
    code, out, err = run_cli("promote", place.url("src/step-60"), place.url("warm/step-60"),
                             "--delete-source")
    assert code == 1, (out, err)
    assert "kept the source" in err and "NOTES.md" in err and "is committed" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert place.tree("src/step-60") == before  # nothing of it went
    _restores(place, "warm/step-60", place.tmp / "hot" / "step-60")  # the copy is whole
    assert "NOTES.md" not in place.tree("warm/step-60")
    # --json: the same refusal, as a document, with the same exit code
    code, out, err = run_cli("promote", place.url("src/step-60"), place.url("warm/step-60"),
                             "--delete-source", "--json")
    assert code == 1 and "NOTES.md" in out + err, (out, err)
    assert place.tree("src/step-60") == before
    # the note moved away: a rerun finds the copy up to date and removes the source
    _drop(place, "src/step-60/NOTES.md")
    code, out, err = run_cli("promote", place.url("src/step-60"), place.url("warm/step-60"),
                             "--delete-source")
    assert code == 0 and "already committed" in out and "source removed" in out, (out, err)
    assert not place.exists("src/step-60")


def test_delete_source_keeps_the_base_of_a_sibling_pack(place, cold):
    hot, ids = cold
    before = place.tree("cold")
    code, out, err = run_cli("promote", place.url("cold/step-60"), place.url("warm/step-60"),
                             "--delete-source")
    assert code == 1, (out, err)
    assert "kept the source" in err and "cold/step-80" in err and "delta pack" in err, err
    assert place.tree("cold") == before  # the cold tier still holds its chain
    _restores(place, "cold/step-80", hot / "step-80")
    code, out, err = run_cli("verify", "--level", "full", place.url("warm/step-60"))
    assert code == 0, (out, err)  # the copy committed


def test_delete_source_keeps_a_plain_base_of_a_pack(place, based):
    before = place.tree("t")
    code, out, err = run_cli("promote", place.url("t/step-60"), place.url("u/step-60"),
                             "--delete-source", "--json")
    assert code == 1 and "t/step-80" in out + err, (out, err)
    assert place.tree("t") == before
    _restores(place, "t/step-80", based[80])
    _restores(place, "u/step-60", based[60])


def test_delete_source_still_removes_an_ordinary_source(place):
    _plain(place, "src/step-60", 60)
    code, out, err = run_cli("promote", place.url("src/step-60"), place.url("warm/step-60"),
                             "--delete-source", "--json")
    assert code == 0 and json.loads(out)["deleted_source"], (out, err)
    assert not place.exists("src/step-60")
    _restores(place, "warm/step-60", place.tmp / "hot" / "step-60")


# --------------------------------------------------------------------------- seal --update


def test_seal_update_of_a_base_refuses_while_a_pack_depends_on_it(place, based):
    man = place.tree("t/step-60")[MANIFEST]
    _put(place, "t/step-60/tokenizer.json", b"{}")
    code, out, err = run_cli("seal", "--update", place.url("t/step-60"))
    assert code == 1, (out, err)
    assert "t/step-80" in err and "new id" in err, err
    assert place.tree("t/step-60")[MANIFEST] == man  # the id the pack names, still
    _restores(place, "t/step-80", based[80])
    # an update that keeps the id (the files table unchanged: a tag) is no threat
    _drop(place, "t/step-60/tokenizer.json")
    code, out, err = run_cli("seal", "--update", "--tag", "kept", place.url("t/step-60"))
    assert code == 0, (out, err)
    after = Manifest.parse(place.tree("t/step-60")[MANIFEST], "m")
    assert after.tags == ["kept"] and after.id == Manifest.parse(man, "m").id
    code, out, err = run_cli("verify", "--level", "full", place.url("t/step-80"))
    assert code == 0, (out, err)  # its base chain still checks out


def test_seal_update_of_a_checkpoint_no_pack_needs(place):
    _plain(place, "t/step-60", 60)
    _put(place, "t/step-60/tokenizer.json", b"{}")
    code, out, err = run_cli("seal", "--update", place.url("t/step-60"))
    assert code == 0, (out, err)
    assert "tokenizer.json" in Manifest.parse(place.tree("t/step-60")[MANIFEST], "m").files


def test_rm_makes_the_same_check(place, based):
    code, out, err = run_cli("rm", place.url("t/step-60"))
    assert code == 1 and "t/step-80" in err and "--orphan-dependants" in err, (out, err)
    _put(place, "t/step-80/NOTES.md", NOTES)
    code, out, err = run_cli("rm", place.url("t/step-80"))
    assert code == 1 and "NOTES.md" in err, (out, err)
    assert place.exists("t/step-60") and place.exists("t/step-80")


# --------------------------------------------------------------------------- SealingWriter


class Opaque:
    """A class the weights-only loader does not know."""


def _state(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(5, generator=g)},
            "optim": {"lr": 0.01}, "step": 12}


def _save(sd: dict, writer) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer)


def test_sealing_writer_never_seals_what_seal_refuses(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptctl.dcp import SealingWriter

    folder = tmp_path / "step-12"
    _save(_state(), SealingWriter(folder))  # a sealed one is there first
    sd = _state(1)
    sd["extra"] = {"hook": os.system, "obj": Opaque()}
    with pytest.raises(CheckpointException) as e:
        _save(sd, SealingWriter(folder, thread_count=2))
    assert "UNSAFE_INPUT" in str(e.value) or "safe loader" in str(e.value), e.value
    assert "extra.hook" in str(e.value) and "posix.system" in str(e.value), e.value
    assert "(+1 more)" in str(e.value), e.value  # extra.obj
    names = {p.name for p in folder.iterdir()}
    assert MANIFEST not in names and ".metadata" in names, names  # saved, not sealed
    code, out, err = run_cli("seal", str(folder))  # seal says the same of it
    assert code == 1 and "UNSAFE_INPUT" in err, (out, err)
    assert not (folder / MANIFEST).exists()
    # a safe save there afterwards seals as ever
    _save(_state(2), SealingWriter(folder))
    code, out, err = run_cli("verify", "--level", "full", str(folder))
    assert code == 0, (out, err)


def _resave_on_fewer_shards(url: str, opts: dict | None) -> None:
    from ckptctl.dcp import SealingWriter

    _save(_state(0), SealingWriter(url, storage_options=opts, thread_count=4))
    _save(_state(1), SealingWriter(url, storage_options=opts, thread_count=1))


def test_resave_on_fewer_shards_verifies(tmp_path):
    from ckptctl.dcp import SealingWriter

    folder = tmp_path / "step-12"
    _save(_state(0), SealingWriter(folder, thread_count=4))
    assert {p.name for p in folder.glob("*.distcp")} == {f"__0_{i}.distcp" for i in range(4)}
    _save(_state(1), SealingWriter(folder, thread_count=1))
    doc = json.loads((folder / MANIFEST).read_bytes())
    assert sorted(p.name for p in folder.iterdir()) == sorted([*doc["files"], MANIFEST])
    assert sorted(doc["files"]) == [".metadata", "__0_0.distcp"]
    code, out, err = run_cli("verify", "--level", "full", str(folder))
    assert code == 0, (out, err)


def test_resave_keeps_a_users_file(tmp_path):
    folder = tmp_path / "step-12"
    folder.mkdir()
    (folder / "NOTES.md").write_bytes(NOTES)
    _resave_on_fewer_shards(str(folder), None)
    assert (folder / "NOTES.md").read_bytes() == NOTES
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp"]


def test_resave_on_fewer_shards_verifies_on_s3(s3_bucket):
    url, opts = s3_bucket.url("run/step-12"), s3_bucket.storage_options
    _resave_on_fewer_shards(url, opts)
    from ckptctl.integrity.verify import verify

    r = verify(url, opts, level="full")
    assert r.ok and not r.problems, r.problems
    names = sorted(k.rsplit("/", 1)[-1] for k in s3_bucket.fs().find(s3_bucket.path("run/step-12")))
    assert names == sorted([".metadata", "__0_0.distcp", MANIFEST]), names


# --------------------------------------------------------------------------- --force


def _stale_marker(folder: Path) -> None:
    (folder / WRITING_MARKER).write_text(json.dumps({"pid": 1, "host": "elsewhere",
                                                     "command": "promote"}))


def test_force_refuses_a_pinned_checkpoint_beside_a_stale_marker(tmp_path):
    from ckptctl.tiering.pins import pin

    src = tmp_path / "src"
    write_tiny_dcp(src)
    dst = _ckpt(tmp_path / "dst" / "step-9", 9)
    pin(str(dst), "paper")
    _stale_marker(dst)
    before = _files(dst)
    code, out, err = run_cli("reshard", str(src), str(dst), "--world-size", "2", "--force")
    assert code == 2 and "pinned" in err, (out, err)
    assert _files(dst) == before
    # unpinned, the same leftover is what --force replaces
    (dst / PIN_FILE).unlink()
    code, out, err = run_cli("reshard", str(src), str(dst), "--world-size", "2", "--force")
    assert code == 0, (out, err)


def test_force_refuses_a_packs_base_beside_a_stale_marker(tmp_path):
    local = Place(tmp_path)
    _plain(local, "t/step-60", 60)
    _ckpt(tmp_path / "hot" / "step-80", 80)
    promote(str(tmp_path / "hot" / "step-80"), str(tmp_path / "t" / "step-80"), pack=True)
    src = tmp_path / "src"
    write_tiny_dcp(src)
    _stale_marker(tmp_path / "t" / "step-60")
    before = _files(tmp_path / "t")
    code, out, err = run_cli("reshard", str(src), str(tmp_path / "t" / "step-60"),
                             "--world-size", "2", "--force")
    assert code == 2 and "delta pack" in err and "step-80" in err, (out, err)
    assert _files(tmp_path / "t") == before
