"""seal + verify: the corruption matrix (DCP, HF safetensors, torch.save; local and S3),
crafted metadata, and the manifest's commit protocol."""
from __future__ import annotations

import json
import os
import pickle
import struct

import pytest

from ckptctl.errors import Finding
from ckptctl.ops import seal, verify
from fixtures_torch import copy_ckpt

FORMATS = ["dcp", "hf", "torch"]


def _make(fmt, torch_ckpts, dst):
    if fmt == "dcp":
        return copy_ckpt(torch_ckpts["fsdp"], dst)
    if fmt == "hf":
        return copy_ckpt(torch_ckpts.hf_sharded, dst)
    dst.mkdir(parents=True)
    copy_ckpt(torch_ckpts.bin, dst / "pytorch_model.bin")
    return dst


def _data_file(d):
    for pat in ("__1_0.distcp", "model-00002-of-00003.safetensors", "pytorch_model.bin"):
        if (d / pat).exists():
            return d / pat
    raise AssertionError(list(d.iterdir()))


def _flip(path, at=None):
    size = path.stat().st_size
    at = size - 100 if at is None else at  # tensor bytes sit at the end of each format's file
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)


CORRUPTIONS = {
    "flip": (_flip, "full", "HASH_MISMATCH"),
    "truncate": (_truncate, "quick", "SIZE_MISMATCH"),
    "delete": (lambda p: p.unlink(), "quick", "MISSING_FILE"),
    "temp": (lambda p: (p.parent / ".metadata.tmp").write_bytes(b"x"), "quick", "STRAY_TEMP"),
}


def _target(where, d, request):
    if where == "local":
        return str(d), None
    b = request.getfixturevalue("s3_bucket")
    b.upload(d, "ck")
    return b.url("ck"), b.storage_options


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_matrix_sealed(fmt, kind, where, torch_ckpts, tmp_path, request):
    d = _make(fmt, torch_ckpts, tmp_path / "step-20")
    assert seal(str(d)).action == "sealed"
    corrupt, level, code = CORRUPTIONS[kind]
    corrupt(_data_file(d))
    url, opts = _target(where, d, request)
    r = verify(url, opts, level=level)
    assert code in [p.code for p in r.problems], r.problems
    assert r.ok == (kind == "temp")  # a stray temp file is a warning: it fails --strict only
    assert not r.judge(strict=True).ok
    if kind == "flip":  # invisible to the cheaper levels
        assert verify(url, opts, level="structure").ok


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_clean_checkpoint_verifies(fmt, where, torch_ckpts, tmp_path, request, cli):
    d = _make(fmt, torch_ckpts, tmp_path / "step-20")
    url, opts = _target(where, d, request)
    assert verify(url, opts, level="full").ok
    if where == "local":
        code, out, err = cli("verify", url, "--level", "full", "--json", "--check-finite")
        assert code == 0, out + err
        doc = json.loads(out)
        assert doc["ok"] and doc["problems"] == [] and doc["num_files"] > 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_seal_then_verify_round_trip(torch_ckpts, tmp_path, where, request, cli):
    d = copy_ckpt(torch_ckpts["2d"], tmp_path / "step-20")
    url, opts = _target(where, d, request)
    r = seal(url, opts, tags=["nightly"])
    assert r.action == "sealed" and r.step == 20 and r.manifest_id.startswith("xxh3-128:")
    v = verify(url, opts, level="full")
    assert v.ok and v.sealed and v.hash == "xxh3-128"
    again = seal(url, opts)
    assert again.action == "verified" and again.manifest_id == r.manifest_id
    if where == "local":
        man = json.loads((d / "ckptctl.manifest.json").read_text())
        assert man["tags"] == ["nightly"] and man["format"] == "dcp" and man["schema"] == 1
        assert set(man["files"]) == {p.name for p in d.iterdir()} - {"ckptctl.manifest.json"}
        code, out, _ = cli("ls", str(tmp_path), "--json")
        assert json.loads(out)["checkpoints"][0]["state"] == "sealed"


def test_seal_sha256(torch_ckpts, tmp_path, cli):
    import hashlib

    d = copy_ckpt(torch_ckpts.hf_single, tmp_path / "m")
    code, out, err = cli("seal", str(d), "--hash", "sha256", "--step", "7", "--json")
    assert code == 0, err
    man = json.loads((d / "ckptctl.manifest.json").read_text())
    f = d / "model.safetensors"
    assert man["files"]["model.safetensors"]["hash"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert man["step"] == 7 and json.loads(out)["hash"] == "sha256"
    assert verify(str(d), level="full").ok


def test_seal_refuses_incomplete(torch_ckpts, tmp_path, cli):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    (d / "__2_0.distcp").unlink()
    code, _, err = cli("seal", str(d))
    assert code == 1 and "MISSING_FILE" in err and err.count("\n") == 1
    assert not (d / "ckptctl.manifest.json").exists()
    (d / ".metadata").unlink()
    code, _, err = cli("seal", str(d))
    assert code == 1 and "NOT_COMMITTED" in err


def test_verify_unsealed_dcp(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    (d / ".metadata").unlink()
    assert [p.code for p in verify(str(d), level="quick").problems] == ["NOT_COMMITTED"]
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "b" / "step-20")
    _truncate(d / "__3_0.distcp")
    assert "SIZE_MISMATCH" in [p.code for p in verify(str(d), level="quick").problems]
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "c" / "step-20")
    (d / "__0_0.distcp").unlink()
    assert "MISSING_FILE" in [p.code for p in verify(str(d), level="quick").problems]


def test_verify_unsealed_full_decodes_every_chunk(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    f = d / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    i = data.rfind(b"PK\x05\x06")  # break the last chunk zip's directory
    data[i:i + 4] = b"XXXX"
    f.write_bytes(bytes(data))
    r = verify(str(d), level="full")
    assert "MALFORMED_CHUNK" in [p.code for p in r.problems]


def _patch(d, fn):
    import torch.distributed.checkpoint  # noqa: F401

    md = pickle.loads((d / ".metadata").read_bytes())
    fn(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def _sharded(md, name="model.tok_embeddings.weight"):
    return md.state_dict_metadata[name].chunks


def _resize(md, delta):
    import torch

    c = _sharded(md)[0]
    c.sizes = torch.Size([c.sizes[0] + delta, *c.sizes[1:]])


def _escape(md):
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"


def _extent_past_end(md):
    info = next(i for k, i in md.storage_data.items() if k.fqn == "model.output.weight")
    info.offset = 10**9


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


CRAFTED = {
    "overlap": (lambda md: _resize(md, +1), "CHUNK_OVERLAP"),
    "gap": (lambda md: _resize(md, -1), "CHUNK_GAP"),
    "extent_out_of_bounds": (_extent_past_end, "OUT_OF_BOUNDS"),
    "box_out_of_bounds": (lambda md: setattr(md.state_dict_metadata["model.tok_embeddings.weight"],
                                             "size", __import__("torch").Size([10, 128])),
                          "OUT_OF_BOUNDS"),
    "path_escape": (_escape, "PATH_ESCAPE"),
    "hostile_pickle": (lambda md: md.state_dict_metadata.__setitem__("x", _Evil()), "UNSAFE_INPUT"),
}


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("kind", list(CRAFTED))
def test_crafted_dcp_metadata(kind, where, torch_ckpts, tmp_path, request, cli):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    fn, code = CRAFTED[kind]
    _patch(d, fn)
    url, opts = _target(where, d, request)
    r = verify(url, opts, level="structure")
    assert code in [p.code for p in r.problems], r.problems
    if where == "local":
        rc, out, _ = cli("verify", url, "--json")
        assert rc == 1 and code in [p["code"] for p in json.loads(out)["problems"]]


def test_crafted_safetensors_overlap(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    h = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(12))
    r = verify(str(d), level="structure")
    assert [p.code for p in r.problems] == ["CHUNK_OVERLAP"]


def test_hf_index_disagrees(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts.hf_sharded, tmp_path / "hf")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "model-00003-of-00003.safetensors" if not idx["weight_map"][
        name].startswith("model-00003") else "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert "INDEX_MISMATCH" in [p.code for p in verify(str(d)).problems]


def test_require_and_check_finite(tmp_path, cli):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    t = torch.ones(100, dtype=torch.bfloat16)
    t[3], t[7] = float("nan"), float("inf")
    save_file({"w": t, "v": torch.zeros(3)}, d / "model.safetensors")
    code, out, _ = cli("verify", str(d), "--level", "full", "--check-finite", "--require",
                       "model,optim", "--json")
    doc = json.loads(out)
    assert code == 1
    assert sorted(p["code"] for p in doc["problems"]) == ["MISSING_STATE", "NON_FINITE"]
    assert doc["non_finite"] == {"w": {"nan": 1, "inf": 1}}


def test_sample_is_deterministic_subset(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")
    seal(str(d))
    a = verify(str(d), level="full", sample=0.4)
    b = verify(str(d), level="full", sample=0.4)
    assert a.ok and a.files_read == b.files_read == 2  # ceil(5 * 0.4)
    assert a.files_checked == 5  # every file is still checked for presence and size


def test_verify_exit_3_when_unreadable(tmp_path, cli):
    code, _, err = cli("verify", str(tmp_path / "nothing"))
    assert code == 3 and "nothing" in err


def test_manifest_write_is_exclusive_on_moto(torch_ckpts, moto_bucket):
    from ckptctl.storage import open_store

    moto_bucket.upload(torch_ckpts.hf_single, "m")
    url = moto_bucket.url("m")
    seal(url, moto_bucket.storage_options)
    store = open_store(url, moto_bucket.storage_options)
    with pytest.raises(Finding, match="already exists"):
        store.write_atomic("ckptctl.manifest.json", b"{}", exclusive=True)
    assert verify(url, moto_bucket.storage_options, level="full").ok


def test_local_manifest_write_is_exclusive(tmp_path):
    from ckptctl.storage import open_store

    s = open_store(str(tmp_path))
    s.write_atomic("m.json", b"1", exclusive=True)
    with pytest.raises(Finding):
        s.write_atomic("m.json", b"2", exclusive=True)
    assert (tmp_path / "m.json").read_bytes() == b"1"
    assert sorted(os.listdir(tmp_path)) == ["m.json"]  # no temp file left behind


def test_orphaned_multipart_upload_is_reported(torch_ckpts, moto_bucket):
    moto_bucket.upload(torch_ckpts.hf_single, "m")
    fs = moto_bucket.fs()
    fs.call_s3("create_multipart_upload", Bucket=moto_bucket.bucket, Key="m/model-2.safetensors")
    r = verify(moto_bucket.url("m"), moto_bucket.storage_options, level="quick")
    assert [p.code for p in r.problems] == ["ORPHANED_UPLOAD"]
    assert r.problems[0].path.endswith("m/model-2.safetensors")
