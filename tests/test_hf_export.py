"""Complete HF exports (issue 8, item 6).

* ``consolidate --to safetensors`` of a folder carries its side files (config.json,
  generation_config.json, tokenizer files, vocab/merges, ``*.model``; ``--include GLOB``
  repeatable for more) into DST through the same commit protocol (durable before the index
  and the manifest; removed with the rest when the run fails) and lists them in the
  manifest with their content hashes. A glob that matches nothing, or matches checkpoint
  data, is a usage error; so is ``--include`` with another target.
* ``seal --update`` reseals a sealed checkpoint after files were added on purpose: every
  listed file must still match its hash (else exit 1 and the old manifest stays, byte for
  byte); the new files are hashed; the new manifest replaces the old one atomically; step,
  tags and hash algorithm are kept unless given. Without ``--update`` the extra file is
  still reported (``seal`` names it; ``verify`` warns with EXTRA_FILE, exit 1 with
  ``--strict``).

Source models are written by the safetensors library and torch's ``dcp.save``; hashes are
recomputed here with xxhash / hashlib, independent of ckptctl.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from conftest import write_tiny_dcp

MANIFEST = "ckptctl.manifest.json"
SIDE = {
    "config.json": b'{"model_type": "llama", "hidden_size": 4}\n',
    "generation_config.json": b'{"max_new_tokens": 16}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": b'{"model_max_length": 2048}\n',
    "special_tokens_map.json": b'{"eos_token": "</s>"}\n',
    "vocab.json": b'{"a": 0, "b": 1}\n',
    "merges.txt": b"#version: 0.2\na b\n",
    "tokenizer.model": bytes(range(256)) * 64,  # sentencepiece: binary
}
OTHER = {"README.md": b"# a model\n", "notes.txt": b"not carried by default\n"}


@pytest.fixture
def hf(tmp_path) -> tuple[Path, dict]:
    """An HF model folder: sharded safetensors + index, side files, unrelated files."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = {"model.embed_tokens.weight": rng.standard_normal((16, 4), dtype=np.float32),
         "model.norm.weight": rng.standard_normal(4, dtype=np.float32),
         "lm_head.weight": rng.standard_normal((16, 4), dtype=np.float32)}
    d = tmp_path / "hf-src"
    d.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["lm_head.weight", "model.embed_tokens.weight"],
              "model-00002-of-00002.safetensors": ["model.norm.weight"]}
    for f, names in shards.items():
        save_file({n: w[n] for n in names}, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(a.nbytes for a in w.values())},
         "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    for name, data in {**SIDE, **OTHER}.items():
        (d / name).write_bytes(data)
    return d, w


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def test_consolidate_carries_side_files(cli, hf, tmp_path):
    from safetensors.numpy import load_file

    src, w = hf
    out = tmp_path / "out"
    code, stdout, err = cli("consolidate", str(src), str(out), "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["side_files"] == sorted(SIDE)
    assert doc["files"] == sorted([*SIDE, "model.safetensors"])
    assert doc["bytes"] == sum((out / f).stat().st_size for f in doc["files"])
    on_disk = sorted(p.name for p in out.iterdir())
    assert on_disk == sorted([*SIDE, "model.safetensors", MANIFEST])  # README, notes: no
    for name, data in SIDE.items():
        assert (out / name).read_bytes() == data, name
    m = _manifest(out)["files"]
    assert sorted(m) == doc["files"]
    for name in doc["files"]:
        data = (out / name).read_bytes()
        assert m[name] == {"size": len(data), "hash": _xxh(data)}, name
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(w) and all(got[n].tobytes() == w[n].tobytes() for n in w)
    code, stdout, err = cli("verify", str(out), "--level", "full")
    assert code == 0, (stdout, err)  # no EXTRA_FILE: the side files are listed
    code, stdout, err = cli("consolidate", str(src), str(tmp_path / "h"))
    assert code == 0, err
    assert f"side files carried from the source: {', '.join(sorted(SIDE))}" in stdout


def test_include_globs(cli, hf, tmp_path):
    src, _ = hf
    out = tmp_path / "out"
    code, stdout, err = cli("consolidate", str(src), str(out), "--include", "README.md",
                            "--include", "*.txt", "--max-shard-size", "100B", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["side_files"] == sorted([*SIDE, *OTHER])  # merges.txt once
    for name, data in {**SIDE, **OTHER}.items():
        assert (out / name).read_bytes() == data
    assert "model.safetensors.index.json" in doc["files"]
    assert sorted(_manifest(out)["files"]) == doc["files"]
    code, stdout, err = cli("verify", str(out), "--level", "full")
    assert code == 0, (stdout, err)


@pytest.mark.parametrize("args,words", [
    (["--include", "LICENSE*"], "--include 'LICENSE*' matches no file"),
    (["--include", "*.safetensors"], "which is checkpoint data"),
    (["--include", "*.index.json"], "which is checkpoint data"),
    (["--include", "README.md", "--to", "torch"], "--to torch carries none"),
])
def test_include_refusals(cli, hf, tmp_path, args, words):
    src, _ = hf
    code, stdout, err = cli("consolidate", str(src), str(tmp_path / "o"), *args)
    assert code == 2, (stdout, err)
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_side_files_only_with_the_model(cli, tmp_path):
    """A DCP run folder with a config beside it: carried for the model, not for --only optim."""
    torch = pytest.importorskip("torch")
    from conftest import dcp_save

    src = tmp_path / "step-3"
    dcp_save(src, {"model": {"w": torch.ones(2, 2)},
                   "optim": {"state": {"w": {"exp_avg": torch.zeros(2, 2)}}}})
    (src / "config.json").write_bytes(SIDE["config.json"])
    code, out, err = cli("consolidate", str(src), str(tmp_path / "m"), "--only", "model",
                         "--json")
    assert code == 0 and json.loads(out)["side_files"] == ["config.json"], err
    code, out, err = cli("consolidate", str(src), str(tmp_path / "o"), "--only", "optim",
                         "--json")
    assert code == 0 and json.loads(out)["files"] == ["optim.safetensors"], err


def test_failed_export_leaves_no_side_files(cli, hf, tmp_path):
    """The side files go through the output's commit protocol: when the run fails after
    writing them (here the manifest, written last, cannot be: a folder sits at its name),
    they are removed with the weights."""
    src, _ = hf
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).mkdir()
    code, stdout, err = cli("consolidate", str(src), str(out), "--force")
    assert code == 3 and err == f"ckptctl: error: {out / MANIFEST}: is a directory\n", err
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST]


# ------------------------------------------------------------------ seal --update

def _sealed(cli, tmp_path, *args) -> Path:
    pytest.importorskip("torch")
    d = tmp_path / "step-42"
    write_tiny_dcp(d)
    code, out, err = cli("seal", str(d), "--tag", "nightly", *args)
    assert code == 0, err
    return d


def test_seal_update_adds_new_files(cli, tmp_path):
    d = _sealed(cli, tmp_path)
    before = _manifest(d)
    (d / "tokenizer.json").write_bytes(SIDE["tokenizer.json"])
    code, out, err = cli("verify", str(d))  # a warning: exit 0, and 1 with --strict
    assert code == 0 and "EXTRA_FILE" in out and "tokenizer.json" in out
    assert cli("verify", str(d), "--strict")[0] == 1
    code, out, err = cli("seal", str(d))  # no --update: verified, the extra file reported
    assert code == 0, err
    assert "EXTRA_FILE" in out and "tokenizer.json" in out and "seal --update" in out
    assert _manifest(d) == before
    code, out, err = cli("seal", str(d), "--json")
    doc = json.loads(out)
    assert doc["action"] == "verified" and [p["code"] for p in doc["problems"]] == ["EXTRA_FILE"]
    old_id = doc["manifest_id"]

    code, out, err = cli("seal", str(d), "--update", "--tag", "release", "--json")
    assert code == 0, err
    doc = json.loads(out)
    after = _manifest(d)
    assert doc["action"] == "updated" and doc["num_files"] == len(before["files"]) + 1
    assert doc["manifest_id"] != old_id and doc["manifest_id"].startswith("xxh3-128:")
    assert after["files"]["tokenizer.json"] == {"size": len(SIDE["tokenizer.json"]),
                                                "hash": _xxh(SIDE["tokenizer.json"])}
    assert {k: v for k, v in after["files"].items() if k != "tokenizer.json"} == before["files"]
    assert after["step"] == before["step"] == 42
    assert after["tags"] == ["nightly", "release"]
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp")) == []
    code, out, err = cli("verify", str(d), "--level", "full")
    assert code == 0, (out, err)
    code, out, err = cli("seal", str(d), "--update", "--json")  # nothing new: verified
    assert code == 0 and json.loads(out)["action"] == "verified", err


def test_seal_update_refuses_a_changed_file(cli, tmp_path):
    d = _sealed(cli, tmp_path)
    before = (d / MANIFEST).read_bytes()
    (d / "notes.txt").write_bytes(b"added on purpose\n")
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    (d / "__0_0.distcp").write_bytes(bytes(data))
    code, out, err = cli("seal", str(d), "--update")
    assert code == 1, (out, err)
    assert "HASH_MISMATCH" in err and "__0_0.distcp" in err
    assert (d / MANIFEST).read_bytes() == before
    (d / "__0_0.distcp").unlink()
    code, out, err = cli("seal", str(d), "--update")
    assert code == 1 and "MISSING_FILE" in err, (out, err)
    assert (d / MANIFEST).read_bytes() == before


def test_seal_update_keeps_the_hash_algorithm(cli, tmp_path):
    d = _sealed(cli, tmp_path, "--hash", "sha256")
    (d / "config.json").write_bytes(SIDE["config.json"])
    code, out, err = cli("seal", str(d), "--update", "--json")
    assert code == 0, err
    m = _manifest(d)
    assert m["hash"] == "sha256" and json.loads(out)["hash"] == "sha256"
    for name, rec in m["files"].items():
        data = (d / name).read_bytes()
        assert rec == {"size": len(data), "hash": hashlib.sha256(data).hexdigest()}, name
    code, out, err = cli("verify", str(d), "--level", "full")
    assert code == 0, (out, err)


def test_seal_update_of_an_unsealed_checkpoint_seals_it(cli, tmp_path):
    pytest.importorskip("torch")
    d = tmp_path / "step-42"
    write_tiny_dcp(d)
    code, out, err = cli("seal", str(d), "--update", "--json")
    assert code == 0 and json.loads(out)["action"] == "sealed", err


# ------------------------------------------------------------------ on S3

def test_consolidate_carries_side_files_from_s3(hf, s3_bucket, tmp_path):
    from ckptctl.ops import consolidate

    src, _ = hf
    s3_bucket.upload(src, "hf")
    out = tmp_path / "out"
    r = consolidate(s3_bucket.url("hf"), str(out), storage_options=s3_bucket.storage_options)
    assert r.side_files == sorted(SIDE)
    for name, data in SIDE.items():
        assert (out / name).read_bytes() == data, name


def test_seal_update_on_s3(moto_bucket, tmp_path):
    """moto enforces If-None-Match: the update replaces the manifest with a plain PUT."""
    pytest.importorskip("torch")
    from ckptctl.ops import seal, verify

    d = tmp_path / "step-42"
    write_tiny_dcp(d)
    first = seal(str(d))
    (d / "config.json").write_bytes(SIDE["config.json"])
    moto_bucket.upload(d, "step-42")
    url, opts = moto_bucket.url("step-42"), moto_bucket.storage_options
    assert [p.code for p in verify(url, opts).problems] == ["EXTRA_FILE"]
    r = seal(url, opts, update=True)
    assert r.action == "updated" and r.manifest_id != first.manifest_id
    doc = json.loads(moto_bucket.fs().cat_file(moto_bucket.path("step-42/" + MANIFEST)))
    assert doc["files"]["config.json"]["hash"] == _xxh(SIDE["config.json"])
    assert verify(url, opts, level="full").ok
