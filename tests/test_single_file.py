"""Single-file checkpoints are first class (issue 35, item 3): ``train.pt``, a Lightning
``epoch=0-step=2.ckpt`` and ``model.safetensors`` are sealed (a manifest beside the file,
``FILE.ckptctl.manifest.json``), verified against it, promoted (local and the loopback S3
server), packed and unpacked byte for byte, pinned, removed and drained by ``watch``,
with the commit-last rules of folders.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

from ckptctl.errors import Finding, UsageError
from ckptctl.tiering.gc import gc
from ckptctl.catalog.ls import ls
from ckptctl.packs.pack import pack
from ckptctl.packs.unpack import unpack
from ckptctl.tiering.pins import pin, unpin
from ckptctl.tiering.policy import Policy
from ckptctl.tiering.promote import promote
from ckptctl.tiering.rm import remove
from ckptctl.integrity.seal import seal
from ckptctl.integrity.verify import verify

SIDE = ".ckptctl.manifest.json"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _torch_file(path: Path, step: int = 7, n: int = 64) -> Path:
    """A real torch.save checkpoint (zip format) at ``path``."""
    import torch

    g = torch.Generator().manual_seed(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.randn(n, n, generator=g), "b": torch.ones(n)},
                "step": step}, path)
    return path


def _lightning_file(path: Path) -> Path:
    """What Lightning's ModelCheckpoint writes: ``epoch=0-step=2.ckpt``, a torch.save dict."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.4.0",
                "state_dict": {"layer.weight": torch.arange(64.0).reshape(8, 8)},
                "optimizer_states": [], "lr_schedulers": []}, path)
    return path


def _safetensors_file(path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.arange(256, dtype=np.float32).reshape(16, 16)}, str(path))
    return path


MAKERS = {"train.pt": _torch_file, "epoch=0-step=2.ckpt": _lightning_file,
          "model.safetensors": _safetensors_file}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDE)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_seal_writes_a_manifest_beside_the_file_and_verify_checks_its_hash(tmp_path, name):
    f = MAKERS[name](tmp_path / "run" / name)
    r = seal(str(f), tags=["t"])
    assert r.action == "sealed" and r.num_files == 1 and r.bytes == f.stat().st_size
    doc = json.loads(_sidecar(f).read_text())
    assert list(doc["files"]) == [name] and doc["tags"] == ["t"]
    v = verify(str(f), level="full")
    assert v.ok and v.sealed and v.content == "hashes", v.problems
    assert v.num_files == 1
    code, out, err = run_cli("verify", "--level", "full", str(f))
    assert code == 0, err
    from ckptctl.formats.detect import open_checkpoint

    ck = open_checkpoint(str(f))  # inspect's view: sealed, its step from the manifest
    assert ck.info["manifest"].id == r.manifest_id
    assert r.step is None or ck.info["step_source"] == "manifest"
    # sealing a sealed file verifies it; nothing else is written beside it
    again = seal(str(f))
    assert again.action == "verified" and again.manifest_id == r.manifest_id
    assert sorted(p.name for p in f.parent.iterdir()) == [name, name + SIDE]


def test_a_flipped_byte_after_sealing_fails_verify(tmp_path):
    f = _torch_file(tmp_path / "train.pt")
    seal(str(f))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    v = verify(str(f), level="full")
    assert not v.ok and [p.code for p in v.problems if p.severity == "error"] == ["HASH_MISMATCH"]
    code, _, _ = run_cli("verify", "--level", "full", str(f))
    assert code == 1
    with pytest.raises(Finding):  # a seal of it does not certify the damage
        seal(str(f))


def test_seal_update_of_a_file_changes_its_step_and_keeps_its_id(tmp_path):
    f = _torch_file(tmp_path / "train.pt")
    first = seal(str(f))
    r = seal(str(f), step=9, update=True)
    assert r.action == "updated" and r.step == 9 and r.manifest_id == first.manifest_id
    assert verify(str(f), level="full").ok


def test_ls_shows_a_sealed_file_and_never_its_sidecars(tmp_path):
    run = tmp_path / "run"
    a = _torch_file(run / "step-1.pt", 1)
    _lightning_file(run / "epoch=0-step=2.ckpt")
    seal(str(a))
    pin(str(a), "keep")
    rows = {c.name: c for c in ls(str(run)).checkpoints}
    assert sorted(rows) == ["epoch=0-step=2.ckpt", "step-1.pt"]
    assert rows["step-1.pt"].state == "sealed" and rows["step-1.pt"].pinned
    assert rows["step-1.pt"].num_files == 1 and rows["step-1.pt"].bytes == a.stat().st_size
    assert rows["epoch=0-step=2.ckpt"].state == "complete"
    assert [c.name for c in ls(str(a)).checkpoints] == ["step-1.pt"]
    assert ls(str(a)).checkpoints[0].state == "sealed"


def test_promote_local_to_local_names_the_file_or_its_folder(tmp_path):
    f = _torch_file(tmp_path / "hot" / "train.pt")
    r = promote(str(f), str(tmp_path / "warm") + "/")
    dst = tmp_path / "warm" / "train.pt"
    assert r.action == "promoted" and r.dst == str(dst) and r.sealed_source
    assert dst.read_bytes() == f.read_bytes()
    assert _sidecar(dst).read_bytes() == _sidecar(f).read_bytes()  # the same id
    assert verify(str(dst), level="full").ok
    assert sorted(p.name for p in dst.parent.iterdir()) == ["train.pt", "train.pt" + SIDE]
    assert promote(str(f), str(dst)).action == "up-to-date"
    other = tmp_path / "cold" / "train.pt"
    assert promote(str(f), str(other)).action == "promoted" and verify(str(other)).ok
    with pytest.raises(UsageError, match="keeps its name"):
        promote(str(f), str(tmp_path / "cold" / "last.pt"))
    with pytest.raises(UsageError):
        promote(str(f), str(tmp_path / "hot"))  # itself


def test_promote_refuses_a_file_it_did_not_write_and_resumes_its_own(tmp_path):
    f = _torch_file(tmp_path / "hot" / "train.pt")
    man = seal(str(f))
    warm = tmp_path / "warm"
    warm.mkdir()
    shutil.copy(f, warm / "train.pt")  # someone's copy, no manifest beside it
    with pytest.raises(Finding) as e:
        promote(str(f), str(warm / "train.pt"))
    assert e.value.code == "ALREADY_EXISTS"
    # a promote killed after the file was published and before its manifest
    (warm / "train.pt.ckptctl-writing").write_text(json.dumps(
        {"command": "promote", "source": man.manifest_id, "pid": 1, "host": "x"}))
    assert not verify(str(warm / "train.pt"), level="quick").ok  # NOT_COMMITTED
    assert ls(str(warm)).checkpoints[0].state == "incomplete"
    r = promote(str(f), str(warm / "train.pt"))
    assert r.action == "promoted" and r.files_skipped == 1 and r.bytes_sent == 0
    assert sorted(p.name for p in warm.iterdir()) == ["train.pt", "train.pt" + SIDE]
    assert verify(str(warm / "train.pt"), level="full").ok


def test_promote_never_puts_a_file_into_a_checkpoint_folder(tmp_path, torch_ckpts):
    """A sealed DCP folder given as DST would hold a file its manifest does not list,
    and its row would swallow the copy: refused, nothing written there."""
    from fixtures_torch import copy_ckpt

    f = _torch_file(tmp_path / "hot" / "train.pt")
    ck = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "warm" / "step-20")
    seal(str(ck))
    before = sorted(p.name for p in ck.iterdir())
    with pytest.raises(Finding, match="checkpoint of its own") as e:
        promote(str(f), str(ck) + "/")
    assert e.value.code == "ALREADY_EXISTS"
    assert sorted(p.name for p in ck.iterdir()) == before
    assert promote(str(f), str(tmp_path / "warm") + "/").action == "promoted"  # beside it


def test_promote_delete_source_removes_the_file_and_its_sidecars(tmp_path):
    f = _torch_file(tmp_path / "hot" / "train.pt")
    seal(str(f))
    pin(str(f))
    with pytest.raises(Finding, match="pinned"):
        promote(str(f), str(tmp_path / "warm") + "/", delete_source=True)
    unpin(str(f))
    r = promote(str(f), str(tmp_path / "warm") + "/", delete_source=True)
    assert r.deleted_source and list((tmp_path / "hot").iterdir()) == []
    assert verify(str(tmp_path / "warm" / "train.pt"), level="full").ok


def test_promote_local_to_s3_and_back(tmp_path, s3_bucket):
    opts = s3_bucket.storage_options
    f = _torch_file(tmp_path / "hot" / "train.pt", n=256)
    r = promote(str(f), s3_bucket.url("warm") + "/", None, opts)
    url = s3_bucket.url("warm/train.pt")
    assert r.action == "promoted" and r.dst == url
    fs = s3_bucket.fs()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket.path("warm"))) == \
        ["train.pt", "train.pt" + SIDE]
    v = verify(url, opts, level="full")
    assert v.ok and v.content == "hashes", v.problems
    assert [(c.name, c.state) for c in ls(s3_bucket.url("warm"), opts).checkpoints] == \
        [("train.pt", "sealed")]
    assert promote(str(f), url, None, opts).action == "up-to-date"
    back = tmp_path / "back" / "train.pt"
    r2 = promote(url, str(back), opts, None)
    assert r2.action == "promoted" and r2.manifest_id == r.manifest_id
    assert back.read_bytes() == f.read_bytes()
    assert verify(str(back), level="full").ok
    # pinned and removed there as locally: the sidecars go with the file
    assert pin(url, "keep", opts).pinned
    assert ls(s3_bucket.url("warm"), opts).checkpoints[0].pinned
    with pytest.raises(Finding, match="pinned"):
        remove(url, opts)
    unpin(url, opts)
    assert remove(url, opts).num_files == 1
    assert s3_bucket.fs().find(s3_bucket.path("warm")) == []


@pytest.mark.parametrize("server", ["s3_bucket", "moto_bucket"])
def test_seal_pack_and_promote_on_s3(tmp_path, request, server):
    """Sealed where it lies on S3 (rclone ignores conditional writes: the intent protocol
    publishes the sidecar; moto honours them: one exclusive PUT), packed there, copied
    there by the server, unpacked back."""
    s3_bucket = request.getfixturevalue(server)
    opts = s3_bucket.storage_options
    f = _torch_file(tmp_path / "hot" / "train.pt", n=256)
    s3_bucket.upload(tmp_path / "hot", "run")
    url = s3_bucket.url("run/train.pt")
    r = seal(url, opts, tags=["t"])
    assert r.action == "sealed" and r.num_files == 1
    assert seal(url, opts).action == "verified"
    v = verify(url, opts, level="full")
    assert v.ok and v.content == "hashes", v.problems
    assert {c.name: c.state for c in ls(s3_bucket.url("run"), opts).checkpoints} == \
        {"train.pt": "sealed"}
    p = pack(url, s3_bucket.url("packs/train.pt"), storage_options=opts,
             dst_storage_options=opts, workers=2)
    assert p.source_id == r.manifest_id
    assert verify(s3_bucket.url("packs/train.pt"), opts, level="full").ok
    c = promote(url, s3_bucket.url("copy") + "/", opts, opts)
    assert c.action == "promoted" and c.server_copy
    assert verify(s3_bucket.url("copy/train.pt"), opts, level="full").ok
    u = unpack(s3_bucket.url("packs/train.pt"), str(tmp_path / "out"), storage_options=opts)
    assert u.manifest_id == r.manifest_id
    assert (tmp_path / "out" / "train.pt").read_bytes() == f.read_bytes()
    assert verify(str(tmp_path / "out" / "train.pt"), level="full").ok


def test_pack_and_unpack_restore_the_file_byte_for_byte(tmp_path):
    f = _torch_file(tmp_path / "hot" / "train.pt", n=256)
    p = pack(str(f), str(tmp_path / "packs" / "train.pt"), workers=2)
    assert p.sealed_source and p.ratio > 1
    pv = verify(str(tmp_path / "packs" / "train.pt"), level="full")
    assert pv.ok and pv.sealed, pv.problems
    rows = ls(str(tmp_path / "packs")).checkpoints
    assert [(c.name, c.state) for c in rows] == [("train.pt", "sealed")]
    u = unpack(str(tmp_path / "packs" / "train.pt"), str(tmp_path / "out") + "/")
    out = tmp_path / "out" / "train.pt"
    assert u.manifest_id == p.source_id and u.dst == str(out)
    assert out.read_bytes() == f.read_bytes()
    assert _sidecar(out).read_bytes() == _sidecar(f).read_bytes()
    assert sorted(x.name for x in out.parent.iterdir()) == ["train.pt", "train.pt" + SIDE]
    assert verify(str(out), level="full").ok
    with pytest.raises(UsageError):  # there already: --force replaces it
        unpack(str(tmp_path / "packs" / "train.pt"), str(out))
    assert unpack(str(tmp_path / "packs" / "train.pt"), str(out), force=True).manifest_id \
        == p.source_id
    # a pack may sit beside the file it holds (the file is the source, not its folder)
    assert pack(str(f), str(f.parent / "packed"), workers=1).source_id == p.source_id
    assert verify(str(f.parent / "packed"), level="full").ok


def test_promote_between_a_pack_tier_on_s3_and_a_plain_tier(tmp_path, s3_bucket):
    opts = s3_bucket.storage_options
    f = _torch_file(tmp_path / "hot" / "train.pt", n=256)
    cold = s3_bucket.url("cold/train.pt")
    r = promote(str(f), cold, None, opts, pack=True)
    assert r.action == "packed"
    assert verify(cold, opts, level="full").ok
    back = tmp_path / "warm" / "train.pt"
    r2 = promote(cold, str(back), opts, None, pack=False)
    assert r2.action == "unpacked" and r2.manifest_id == r.manifest_id
    assert back.read_bytes() == f.read_bytes()
    assert verify(str(back), level="full").ok
    assert promote(cold, str(back), opts, None, pack=False).action == "up-to-date"


def test_rm_removes_the_file_and_its_sidecars(tmp_path):
    f = _torch_file(tmp_path / "run" / "train.pt")
    keep = _torch_file(tmp_path / "run" / "other.pt", 3)
    seal(str(f))
    pin(str(f), "release")
    with pytest.raises(Finding, match="pinned"):
        remove(str(f))
    assert remove(str(f), force=True).num_files == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [keep.name]


def test_a_pin_keeps_a_file_from_gc(tmp_path):
    run = tmp_path / "run"
    files = [_torch_file(run / f"step-{s}.pt", s) for s in (1, 2, 3)]
    for f in files:
        seal(str(f))
    pin(str(files[0]), "release")
    r = gc(str(run), Policy(last=1), grace=0)
    assert sorted(r.decision.remove) == ["step-2.pt"]
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["step-1.pt", "step-1.pt" + SIDE, "step-1.pt.ckptctl-pinned", "step-3.pt",
         "step-3.pt" + SIDE])


def test_watch_once_seals_promotes_and_trims_a_file(tmp_path):
    from ckptctl.tiering.config import load_config
    from ckptctl.service.watch import Watcher

    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n')
    _torch_file(tmp_path / "hot" / "step-1.pt", 1)
    _torch_file(tmp_path / "hot" / "step-2.pt", 2)
    p = Watcher(load_config(str(cfg)), settle=0).run_once()
    assert p.ok and sorted(p.sealed) == ["step-1.pt", "step-2.pt"], p.failed
    assert sorted(h.name for h in p.promoted) == ["step-1.pt", "step-2.pt"]
    warm = {c.name: c.state for c in ls(str(tmp_path / "warm")).checkpoints}
    assert warm == {"step-1.pt": "sealed", "step-2.pt": "sealed"}
    for name in warm:
        assert verify(str(tmp_path / "warm" / name), level="full").ok
    # hot keeps the last 1, the older one removed with its manifest
    assert sorted(p.name for p in (tmp_path / "hot").iterdir()) == ["step-2.pt",
                                                                   "step-2.pt" + SIDE]


def test_watch_drains_files_hop_by_hop_to_a_pack_tier_on_s3(tmp_path, s3_bucket):
    from ckptctl.tiering.config import load_config
    from ckptctl.service.watch import Watcher

    opts = s3_bucket.storage_options
    kv = ", ".join(f"{k} = {json.dumps(v)}" for k, v in opts.items() if not isinstance(v, dict))
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\nkeep = {{ last = 1 }}\n'
                   f'[[tier]]\nname = "cold"\nurl = "{s3_bucket.url("run1")}"\npack = true\n'
                   f'storage_options = {{ {kv} }}\n')
    for s in (1, 2):
        _torch_file(tmp_path / "hot" / f"step-{s}.pt", s, n=128)
    config = load_config(str(cfg))
    p = Watcher(config, settle=0).run_once()
    assert p.drained, p.to_dict()
    assert [(h.name, h.src, h.dst) for h in p.promoted] == [
        ("step-1.pt", "hot", "warm"), ("step-2.pt", "hot", "warm"),
        ("step-1.pt", "warm", "cold"), ("step-2.pt", "warm", "cold")]
    cold = s3_bucket.url("run1")
    assert {c.name: c.state for c in ls(cold, opts).checkpoints} == \
        {"step-1.pt": "sealed", "step-2.pt": "sealed"}
    for s in (1, 2):  # packs (folders named after the file) that verify and restore it
        assert verify(f"{cold}/step-{s}.pt", opts, level="full").ok
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == ["step-2.pt",
                                                                    "step-2.pt" + SIDE]
    back = tmp_path / "back"
    promote(f"{cold}/step-1.pt", str(back) + "/", opts, None, pack=False)
    assert verify(str(back / "step-1.pt"), level="full").ok
    again = Watcher(config, settle=0).run_once()
    assert again.drained and not again.promoted and not again.sealed
