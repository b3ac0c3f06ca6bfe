"""Safetensors exports side by side, and one-file outputs (issue 35 items 2 and 4).

Item 2: one rule says what a folder of safetensors files is
(:func:`ckptctl.formats.safetensors.split_exports`): an HF index and the shards named
after it (or shard-named files without their index) are the folder's one model; any other
complete ``*.safetensors`` file is an export of its own (``folder/model-bf16.safetensors``),
and a lone one is the folder's model. Every verb groups with it (ls, inspect, verify, seal,
consolidate, diff, latest, gc, rm); a folder that holds only exports is a usage error that
names them (exit 2), as a run's root is; a file is counted in one row only, a sub-folder
that is a checkpoint of its own keeping its bytes.

Item 4: ``consolidate SRC out/x.safetensors`` writes that one file (``x.pt``: torch.save),
``--to`` defaulting to what the extension says and refused where it disagrees; a
``--max-shard-size`` that would split it is refused before a byte is written.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from ckptctl.formats.detect import group_checkpoints, open_checkpoint
from ckptctl.formats.manifest import MANIFEST
from ckptctl.formats.safetensors import split_exports
from ckptctl.catalog.ls import ls

INDEX = "model.safetensors.index.json"


def _bf16(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes (truncated), without torch."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def _write_st(path: Path, tensors: dict[str, tuple[str, tuple, bytes]], meta=None) -> None:
    """A safetensors file by hand: ``{name: (dtype, shape, raw bytes)}``."""
    header, pos, blobs = {}, 0, []
    for name, (dtype, shape, raw) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        blobs.append(raw)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _f32(w: dict[str, np.ndarray]) -> dict[str, tuple]:
    return {n: ("F32", a.shape, a.tobytes()) for n, a in w.items()}


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 4), dtype=np.float32),
            "b": rng.standard_normal(4, dtype=np.float32)}


def _two_exports(d: Path) -> dict[str, np.ndarray]:
    """An fp32 and a bf16 export of the same weights, side by side, with a config."""
    w = _weights()
    _write_st(d / "model.safetensors", _f32(w))
    _write_st(d / "model-bf16.safetensors", {n: ("BF16", a.shape, _bf16(a)) for n, a in w.items()})
    (d / "config.json").write_text("{}")
    return w


def _hf_sharded(d: Path, *, index: bool = True) -> dict[str, np.ndarray]:
    w = _weights(1)
    names = {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for n, f in names.items():
        _write_st(d / f, {n: ("F32", w[n].shape, w[n].tobytes())})
    if index:
        (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    (d / "config.json").write_text("{}")
    return w


def _rows(root) -> dict[str, tuple]:
    return {r.name: (r.format, r.state, r.bytes) for r in ls(str(root)).checkpoints}


def _size(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths)


# ------------------------------------------------------------------ the rule

@pytest.mark.parametrize("names, model, exports", [
    (["model.safetensors", "model-bf16.safetensors", "config.json"],
     [], ["model-bf16.safetensors", "model.safetensors"]),
    (["model.safetensors", "config.json"], ["model.safetensors"], []),
    (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX,
      "consolidated.safetensors"],
     ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX],
     ["consolidated.safetensors"]),
    # shard-named files without their index: one model (incomplete while one is missing)
    (["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"],
     ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"], []),
    # torch's HuggingFaceStorageWriter(save_distributed=True): one file per rank, one model
    (["shard-00001-model-00001-of-00001.safetensors",
      "shard-00002-model-00001-of-00001.safetensors", "model-fp8.safetensors"],
     ["shard-00001-model-00001-of-00001.safetensors",
      "shard-00002-model-00001-of-00001.safetensors"], ["model-fp8.safetensors"]),
    # an index over one unsharded file; another index names its own stem's shards
    ([INDEX, "model.safetensors", "adapter.safetensors"], ["model.safetensors", INDEX],
     ["adapter.safetensors"]),
    (["optim.safetensors.index.json", "optim-00001-of-00001.safetensors"],
     ["optim-00001-of-00001.safetensors", "optim.safetensors.index.json"], []),
    (["config.json"], [], []),
])
def test_split_exports(names, model, exports):
    assert split_exports(names) == (model, exports)


def test_grouping_counts_each_file_once():
    files = {"model.safetensors": 10, "config.json": 1,             # the root: a model
             "step-1/.metadata": 2, "step-1/__0_0.distcp": 20,      # a checkpoint below it
             "hf/model-00001-of-00001.safetensors": 30, f"hf/{INDEX}": 3,
             "hf/consolidated.safetensors": 40, "hf/logs/train.txt": 4,
             "hf/checkpoint-5/model.safetensors": 50,
             "acc/model.safetensors": 5, "acc/optimizer.bin": 6, "acc/random_states_0.pkl": 1,
             "acc/pytorch_model_fsdp_0/.metadata": 7}  # a training state owns what is below
    groups = group_checkpoints(files)
    assert sorted(groups) == ["", "acc", "hf", "hf/checkpoint-5", "hf/consolidated.safetensors",
                              "step-1"]
    seen = [f for g in groups.values() for f in g]
    assert sorted(seen) == sorted(files) and len(seen) == len(set(seen))
    assert sorted(groups[""]) == ["config.json", "model.safetensors"]
    assert sorted(groups["hf"]) == sorted(f"hf/{f}" for f in (
        INDEX, "logs/train.txt", "model-00001-of-00001.safetensors"))
    assert "acc/pytorch_model_fsdp_0/.metadata" in groups["acc"]


# ------------------------------------------------------------------ two exports side by side

def test_two_exports_list_as_two_good_checkpoints_and_verify_0(tmp_path, cli):
    run = tmp_path / "run"
    _two_exports(run / "exp")
    code, out, err = cli("ls", str(run), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert sorted(rows) == ["exp/model-bf16.safetensors", "exp/model.safetensors"]
    for name, r in rows.items():
        assert (r["format"], r["state"]) == ("safetensors", "complete"), r
        assert r["bytes"] == (run / name).stat().st_size and r["num_files"] == 1
    for name in rows:  # each export, as ls names it
        code, out, err = cli("verify", str(run / name), "--level", "full")
        assert code == 0, (out, err)
    code, out, err = cli("verify", str(run), "--all", "--level", "full")
    assert code == 0, (out, err)
    code, out, err = cli("ls", str(run / "exp"))  # the folder itself: its two exports
    assert code == 0 and "model-bf16.safetensors" in out and "corrupt" not in out, (out, err)


@pytest.mark.parametrize("verb", [["verify"], ["inspect"], ["seal"], ["rm"], ["pin"],
                                  ["consolidate", "{out}"], ["diff", "{one}"]])
def test_a_verb_given_the_folder_of_exports_names_them(tmp_path, cli, verb):
    d = tmp_path / "exp"
    _two_exports(d)
    args = [a.format(out=tmp_path / "out", one=d / "model.safetensors") for a in verb[1:]]
    before = sorted(os.listdir(d))
    code, out, err = cli(verb[0], str(d), *args)
    assert code == 2, (out, err)
    assert "holds 2 checkpoints (model.safetensors, model-bf16.safetensors)" in err, err
    assert "corrupt" not in out + err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(d)) == before and not (tmp_path / "out").exists()


def test_verify_names_verify_all(tmp_path, cli):
    d = tmp_path / "exp"
    _two_exports(d)
    code, out, err = cli("verify", str(d), "--json")
    assert code == 2 and f"ckptctl verify {d}/ --all" in err, (out, err)
    code, out, err = cli("verify", str(d), "--all", "--json")
    assert code == 0, (out, err)


def test_every_verb_on_each_export(tmp_path, cli):
    run = tmp_path / "run"
    w = _two_exports(run / "exp")
    one, bf16 = run / "exp" / "model.safetensors", run / "exp" / "model-bf16.safetensors"
    ck = open_checkpoint(str(bf16))
    assert sorted(ck.tensors) == sorted(w) and ck.tensors["w"].dtype.name == "bfloat16"
    code, out, err = cli("inspect", str(one), "--json")
    assert code == 0 and json.loads(out)["num_tensors"] == 2, err
    code, out, err = cli("diff", str(one), str(bf16), "--cast")
    assert code == 0, (out, err)
    code, out, err = cli("latest", str(run))
    assert code == 0 and out.strip() in (str(one), str(bf16)), (out, err)
    code, out, err = cli("gc", str(run), "--keep-last", "1", "--dry-run", "--json")
    assert code == 0, (out, err)
    assert "corrupt" not in out


def test_seal_of_a_folder_holding_an_export_beside_its_model(tmp_path, cli):
    """An HF index with its shards is the folder's checkpoint; consolidated.safetensors
    beside it is an export of its own: never sealed into the folder, never counted twice."""
    run = tmp_path / "run"
    hf = run / "hf"
    w = _hf_sharded(hf)
    _write_st(hf / "consolidated.safetensors", _f32(w))
    own = [hf / f for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            INDEX, "config.json")]
    rows = _rows(run)
    assert rows == {"hf": ("hf-safetensors", "complete", _size(*own)),
                    "hf/consolidated.safetensors": ("safetensors", "complete",
                                                    _size(hf / "consolidated.safetensors"))}
    code, out, err = cli("verify", str(hf), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["num_files"] == len(own), (out, err)
    code, out, err = cli("seal", str(hf))
    assert code == 0, err
    assert sorted(json.loads((hf / MANIFEST).read_text())["files"]) == sorted(p.name for p in own)
    rows = _rows(run)
    assert rows["hf"][:2] == ("hf-safetensors", "sealed")
    assert rows["hf/consolidated.safetensors"][1] == "complete"
    code, out, err = cli("verify", str(hf), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["problems"] == [], (out, err)  # no EXTRA_FILE
    code, out, err = cli("inspect", str(hf), "--json")
    assert code == 0 and json.loads(out)["num_tensors"] == 2, err


def test_rm_of_the_folder_keeps_the_export_beside_it(tmp_path, cli):
    hf = tmp_path / "hf"
    w = _hf_sharded(hf)
    _write_st(hf / "consolidated.safetensors", _f32(w))
    code, out, err = cli("seal", str(hf))
    assert code == 0, err
    code, out, err = cli("rm", str(hf))
    assert code == 0, (out, err)
    assert sorted(os.listdir(hf)) == ["consolidated.safetensors"]


def test_shards_without_their_index_are_one_checkpoint(tmp_path):
    run = tmp_path / "run"
    _hf_sharded(run / "hf", index=False)
    assert [(n, r[1]) for n, r in _rows(run).items()] == [("hf", "complete")]
    (run / "hf" / "model-00002-of-00002.safetensors").unlink()
    assert [(n, r[1]) for n, r in _rows(run).items()] == [("hf", "incomplete")]


def test_rank_files_of_the_hf_storage_writer_are_one_checkpoint(tmp_path):
    run = tmp_path / "run"
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    for r in range(2):
        meta = {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2 * r, 0]}})}
        _write_st(run / "dist" / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors",
                  {"w": ("F32", (2, 2), a[2 * r:2 * r + 2].tobytes())}, meta)
    _write_st(run / "dist" / "model-bf16.safetensors", {"w": ("BF16", (4, 2), _bf16(a))})
    rows = _rows(run)
    assert {n: r[1] for n, r in rows.items()} == {"dist": "complete",
                                                  "dist/model-bf16.safetensors": "complete"}
    ck = open_checkpoint(str(run / "dist"))
    assert ck.tensors["w"].shape == (4, 2) and len(ck.tensors["w"].chunks) == 2


def test_a_root_that_is_a_checkpoint_counts_only_its_own_bytes(tmp_path, cli):
    """The root holds a model and a checkpoint folder below it: two rows, no byte twice,
    and a verb given the root acts on its own files only."""
    root = tmp_path / "out"
    w = _weights()
    _write_st(root / "model.safetensors", _f32(w))
    (root / "config.json").write_text("{}")
    _hf_sharded(root / "checkpoint-5")
    for where in (root, tmp_path):  # the same rows whichever folder is listed
        rows = ls(str(where)).checkpoints
        total = sum(p.stat().st_size for p in where.rglob("*") if p.is_file())
        assert len(rows) == 2 and sum(r.bytes for r in rows) == total, rows
        mine = next(r for r in rows if r.name in ("out", ""))
        assert mine.bytes == _size(root / "model.safetensors", root / "config.json")
    code, out, err = cli("seal", str(root))
    assert code == 0, err
    assert sorted(json.loads((root / MANIFEST).read_text())["files"]) == \
        ["config.json", "model.safetensors"]
    assert {r.name: r.state for r in ls(str(tmp_path)).checkpoints} == \
        {"out": "sealed", "out/checkpoint-5": "complete"}


# ------------------------------------------------------------------ one-file outputs

@pytest.fixture
def src(tmp_path) -> tuple[Path, dict]:
    torch = pytest.importorskip("torch")
    from conftest import dcp_save

    g = torch.Generator().manual_seed(3)
    sd = {"model": {"emb.weight": torch.randn(64, 8, generator=g),
                    "norm.weight": torch.randn(8, generator=g)}}
    p = tmp_path / "step-7"
    dcp_save(p, sd)
    return p, sd["model"]


def _no_leftovers(folder: Path, *keep: str) -> None:
    assert sorted(os.listdir(folder)) == sorted(keep), os.listdir(folder)


def test_consolidate_to_a_safetensors_file(src, tmp_path, cli):
    from safetensors.torch import load_file

    ck, want = src
    dst = tmp_path / "out" / "x.safetensors"  # its folder does not exist yet
    code, out, err = cli("consolidate", str(ck), str(dst), "--only", "model",
                         "--strip-prefix", "model.", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["to"] == "safetensors" and doc["files"] == ["x.safetensors"]
    assert doc["manifest_id"] is None and doc["side_files"] == []
    assert dst.is_file() and doc["bytes"] == dst.stat().st_size
    got = load_file(dst)
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
    _no_leftovers(dst.parent, "x.safetensors")
    code, out, err = cli("verify", str(dst), "--level", "full")
    assert code == 0, (out, err)
    assert [(r.name, r.state) for r in ls(str(dst.parent)).checkpoints] == [("out", "complete")]


@pytest.mark.parametrize("name, to", [("x.pt", None), ("x.pt", "torch"), ("x.bin", None)])
def test_consolidate_to_a_torch_file(src, tmp_path, cli, name, to):
    import torch

    ck, want = src
    dst = tmp_path / name
    code, out, err = cli("consolidate", str(ck), str(dst), "--only", "model",
                         *(["--to", to] if to else []), "--json")
    assert code == 0, err
    assert json.loads(out)["to"] == "torch"
    got = torch.load(dst, weights_only=True)
    assert sorted(got["model"]) == sorted(want)
    assert all(got["model"][k].equal(want[k]) for k in want)


def test_one_file_force_and_refusals(src, tmp_path, cli):
    ck, _ = src
    dst = tmp_path / "x.safetensors"
    code, _, err = cli("consolidate", str(ck), str(dst), "--only", "model")
    assert code == 0, err
    first = dst.read_bytes()
    code, _, err = cli("consolidate", str(ck), str(dst), "--only", "model", "--dtype", "bf16")
    assert code == 2 and "exists" in err and "--force" in err, err
    assert dst.read_bytes() == first
    code, _, err = cli("consolidate", str(ck), str(dst), "--only", "model", "--dtype", "bf16",
                       "--force")
    assert code == 0, err
    assert dst.stat().st_size < len(first)  # replaced by the bf16 file
    folder = tmp_path / "old.safetensors"  # a folder an older ckptctl wrote by that name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(first)
    code, _, err = cli("consolidate", str(ck), str(folder), "--only", "model", "--force")
    assert code == 2 and "is a folder" in err, err
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    _no_leftovers(tmp_path, "step-7", "x.safetensors", "old.safetensors")


@pytest.mark.parametrize("name, args, words", [
    ("y.safetensors", ["--max-shard-size", "100B"], "splits the output into"),
    ("y.pt", ["--to", "safetensors"], "not a .pt file"),
    ("y.safetensors", ["--to", "torch"], "not a .safetensors file"),
    ("y.safetensors", ["--to", "dcp"], "writes a folder"),
    ("y.safetensors", ["--include", "config.json"], "is one file"),
])
def test_one_file_usage_errors(src, tmp_path, cli, name, args, words):
    ck, _ = src
    code, out, err = cli("consolidate", str(ck), str(tmp_path / name), "--only", "model", *args)
    assert code == 2 and words in err, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    _no_leftovers(tmp_path, "step-7")


def test_a_folder_destination_still_shards(src, tmp_path, cli):
    ck, _ = src
    code, out, err = cli("consolidate", str(ck), str(tmp_path / "hf"), "--only", "model",
                         "--max-shard-size", "100B", "--json")
    assert code == 0, err
    files = json.loads(out)["files"]
    assert INDEX in files and len(files) == 3, files


def test_consolidate_to_a_file_on_s3(src, s3_bucket):
    import torch
    from safetensors.torch import load as load_bytes

    from ckptctl.ops import consolidate

    ck, want = src
    opts = s3_bucket.storage_options
    r = consolidate(str(ck), s3_bucket.url("out/x.safetensors"), only="model",
                    strip_prefix="model.", dst_storage_options=opts)
    assert r.files == ["x.safetensors"] and r.manifest_id is None
    fs = s3_bucket.fs()
    assert sorted(fs.find(s3_bucket.path("out"))) == [s3_bucket.path("out/x.safetensors")]
    got = load_bytes(fs.cat_file(s3_bucket.path("out/x.safetensors")))
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
    r = consolidate(str(ck), s3_bucket.url("out/x.pt"), only="model", dst_storage_options=opts)
    assert r.to == "torch"
    import io

    got = torch.load(io.BytesIO(fs.cat_file(s3_bucket.path("out/x.pt"))), weights_only=True)
    assert all(got["model"][k].equal(want[k]) for k in want)
