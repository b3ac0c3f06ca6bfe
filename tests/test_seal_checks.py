"""A manifest certifies good bytes (issue 34, item 1): sealing runs every check the format
carries (zip CRC-32s, Megatron's ``integrity.json``, structure) in the read that hashes
the files, so a flipped byte that ``verify --level full`` reports in an unsealed DCP,
DeepSpeed or Megatron checkpoint is refused by every verb that seals (seal, promote, pack,
watch), locally and on S3, and verify still reports it after."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from ckptctl.tiering.config import load_config
from ckptctl.errors import Finding
from ckptctl.formats.manifest import MANIFEST
from fixtures_torch import copy_ckpt

torch = pytest.importorskip("torch")


def _flip_tensor_byte(folder: Path) -> tuple[str, str]:
    """Flip one bit inside the stored bytes of the checkpoint's largest tensor chunk (its
    zip record's CRC-32, or integrity.json's SHA-256, then disagrees; torch.load does not
    notice). Returns (file, tensor name)."""
    from ckptctl.formats import open_checkpoint
    from ckptctl.formats.tensorio import locate_payload

    ck = open_checkpoint(str(folder))
    t, c = max(((t, c) for t in ck.tensors.values() for c in t.chunks),
               key=lambda tc: tc[1].extent.length)
    ext = c.extent
    at = locate_payload(ck, ext).offset if ext.encoding == "torch_zip" else ext.offset
    f = folder / ext.file
    data = bytearray(f.read_bytes())
    data[at + 5] ^= 0x40
    f.write_bytes(bytes(data))
    return ext.file, t.name


@pytest.fixture(params=["dcp", "deepspeed", "megatron"])
def flipped(request, tmp_path, torch_ckpts) -> tuple[Path, str, str]:
    """An unsealed checkpoint of each writer, copied under ``tmp_path/hot`` with one
    tensor byte flipped: (folder, file, tensor)."""
    hot = tmp_path / "hot"
    if request.param == "dcp":
        ck = copy_ckpt(torch_ckpts["fsdp"], hot / "step-20")
    elif request.param == "deepspeed":
        v = request.getfixturevalue("deepspeed_ckpts").variant("z2-fp32")
        ck = copy_ckpt(v.tag_dir, hot / "global_step3")
    else:  # megatron-core 0.19's torch_dist, with its integrity.json
        from test_megatron import NEXT_VERSION

        run = request.getfixturevalue("megatron_ckpts").dist("tp2", NEXT_VERSION)
        ck = copy_ckpt(run.iter_dir(20), hot / "iter_0000020")
    assert run_cli("verify", str(ck), "--level", "full")[0] == 0
    rel, name = _flip_tensor_byte(ck)
    return ck, rel, name


def _still_reported(ck: Path) -> None:
    """No manifest was written, and verify still finds the flipped byte."""
    assert not (ck / MANIFEST).exists()
    code, out, err = run_cli("verify", str(ck), "--level", "full", "--json")
    codes = {p["code"] for p in json.loads(out)["problems"]}
    assert code == 1 and codes & {"CRC_MISMATCH", "HASH_MISMATCH"}, out + err


def test_seal_refuses_a_flipped_byte_naming_file_and_entry(flipped):
    ck, rel, name = flipped
    code, out, err = run_cli("seal", str(ck))
    assert code == 1 and err.count("\n") == 1, out + err
    assert "refusing to seal" in err and rel in err, err
    assert name in err or "zip record" in err or "integrity.json" in err, err
    _still_reported(ck)


def test_promote_and_pack_refuse_a_flipped_source(flipped, tmp_path):
    ck, rel, _ = flipped
    for verb in ("promote", "pack"):
        dst = tmp_path / verb / ck.name
        code, out, err = run_cli(verb, str(ck), str(dst))
        assert code == 1 and "refusing to seal" in err and rel in err, (verb, out, err)
        assert not (dst / MANIFEST).exists(), verb
    _still_reported(ck)


def test_watch_does_not_seal_or_carry_a_flipped_checkpoint(flipped, tmp_path, monkeypatch):
    from ckptctl.catalog.ls import ls
    from ckptctl.service.watch import Watcher

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ck, rel, _ = flipped
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n'
                   f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n')
    p = Watcher(load_config(str(cfg)), settle=0).run_once()
    assert not p.sealed and not p.promoted, p
    assert any(rel in f.message and f.what == "seal" for f in p.failed), p.failed
    assert not (tmp_path / "warm").exists() or not ls(str(tmp_path / "warm")).checkpoints
    _still_reported(ck)


def test_a_good_seal_is_what_it_was(torch_ckpts, tmp_path):
    """Checking in the same read changes nothing of what a good checkpoint gets: every file
    hashed once, the manifest's hashes those of the files."""
    from ckptctl.ops import seal
    from ckptctl.storage import hash_file, open_store

    ck = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    r = seal(str(ck))
    man = json.loads((ck / MANIFEST).read_text())
    store = open_store(str(ck))
    assert r.action == "sealed" and set(man["files"]) == {
        p.name for p in ck.iterdir() if p.name != MANIFEST}
    for rel, e in man["files"].items():
        assert hash_file(store, rel)[0] == e["hash"], rel


def test_on_s3_seal_and_promote_refuse_a_flipped_source(torch_ckpts, tmp_path, s3_bucket):
    from ckptctl.ops import promote, seal, verify

    ck = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    rel, _ = _flip_tensor_byte(ck)
    s3_bucket.upload(ck, "run/step-20")
    url, opts = s3_bucket.url("run/step-20"), s3_bucket.storage_options
    with pytest.raises(Finding, match="refusing to seal") as e:
        seal(url, opts)
    assert rel in str(e.value.path) + e.value.message
    with pytest.raises(Finding, match="refusing to seal"):
        promote(url, str(tmp_path / "warm" / "step-20"), opts, None)
    assert not (tmp_path / "warm" / "step-20" / MANIFEST).exists()
    r = verify(url, opts, level="full")
    assert not r.ok and not r.sealed and "CRC_MISMATCH" in {p.code for p in r.problems}
