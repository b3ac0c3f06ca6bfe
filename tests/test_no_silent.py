"""Nothing silently ignored (issue 8, item 5): a flag that would have no effect is a usage
error (exit 2) naming what it did not match, or the output says what was chosen for it.

* ``consolidate --strip-prefix P`` where no selected entry starts with P: exit 2, naming P
  and a few entry names; with ``--to dcp`` (which keeps names): exit 2.
* ``verify --sample F`` below ``--level full`` (only the full level reads contents): exit 2.
* ``reshard --mesh M`` without ``--rules``: the preset is chosen by the mesh's dim names
  (fsdp for dp alone, llama otherwise) and named in the human output ("rules: llama
  (preset, chosen for mesh dp=2,tp=2; ...)") and in the JSON ``rules`` object.
* a rule set that matches only part of a model: the dry run lists each rule with the count
  of tensors it placed (``(matched nothing)`` when none) and the tensors left replicated.
* ``consolidate --only optim --to safetensors`` writes ``optim.safetensors`` (and
  ``optim-0000i-of-0000N.safetensors`` + ``optim.safetensors.index.json`` when sharded),
  never ``model.safetensors``; config/tokenizer side files do not come along.
* ``inspect --filter GLOB`` that matches no entry: exit 2, naming the glob and entries.

Checkpoints are written by torch's own ``dcp.save``; outputs are read back with the
safetensors library and compared bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dcp_save

torch = pytest.importorskip("torch")


def _tensors() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "layers.0.attention.wq.weight": torch.randn(8, 4, generator=g),
        "layers.0.attention.wo.weight": torch.randn(4, 8, generator=g),
        "layers.0.mlp.fc_in.weight": torch.randn(6, 4, generator=g),  # no llama name
        "norm.weight": torch.randn(4, generator=g),
    }


@pytest.fixture
def ckpt(tmp_path) -> tuple[Path, dict]:
    """model + optimizer state (tensors only) + step, saved by dcp.save."""
    model = _tensors()
    g = torch.Generator().manual_seed(2)
    optim = {"state": {n: {"exp_avg": torch.randn(t.shape, generator=g)}
                       for n, t in model.items()}}
    sd = {"model": model, "optim": optim}
    p = tmp_path / "step-7"
    dcp_save(p, sd)
    (p / "config.json").write_text('{"model_type": "llama"}\n')
    return p, sd


def _usage(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ --strip-prefix

def test_strip_prefix_that_matches_nothing_is_a_usage_error(cli, ckpt, tmp_path):
    src, _ = ckpt
    err = _usage(cli, "consolidate", str(src), str(tmp_path / "o"), "--only", "model",
                 "--strip-prefix", "transformer.")
    assert "--strip-prefix 'transformer.'" in err and "matches no selected entry" in err
    assert "model.layers.0.attention.wo.weight" in err  # a few names, to see the real prefix
    assert not (tmp_path / "o").exists()
    err = _usage(cli, "consolidate", str(src), str(tmp_path / "o"), "--to", "dcp",
                 "--strip-prefix", "model.")
    assert "--to dcp keeps the names" in err
    # the prefix that matches works, names stripped
    code, out, err = cli("consolidate", str(src), str(tmp_path / "ok"), "--only", "model",
                         "--strip-prefix", "model.", "--json")
    assert code == 0, err
    assert json.loads(out)["files"] == ["config.json", "model.safetensors"]


# ------------------------------------------------------------------ --sample

@pytest.mark.parametrize("level", ["quick", "structure"])
def test_sample_needs_level_full(cli, ckpt, level):
    src, _ = ckpt
    err = _usage(cli, "verify", str(src), "--level", level, "--sample", "0.5")
    assert "--sample needs --level full" in err and f"--level {level}" in err
    err = _usage(cli, "verify", str(src), "--sample", "0.5")  # the default level: structure
    assert "--sample needs --level full" in err
    code, out, err = cli("verify", str(src), "--level", "full", "--sample", "0.5")
    assert code == 0, (out, err)


def test_sample_needs_level_full_in_the_library(ckpt):
    from ckptctl import errors
    from ckptctl.ops import verify

    with pytest.raises(errors.UsageError, match="--level full"):
        verify(str(ckpt[0]), level="quick", sample=0.1)


# ------------------------------------------------------------------ --mesh without --rules

@pytest.mark.parametrize("mesh,preset", [("dp=2,tp=2", "llama"), ("dp=4", "fsdp")])
def test_mesh_without_rules_names_the_preset(cli, ckpt, tmp_path, mesh, preset):
    src, _ = ckpt
    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--mesh", mesh, "--dry-run")
    assert code == 0, err
    assert f"rules: {preset} (preset, chosen for mesh {mesh}; give --rules to choose)" in out
    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--mesh", mesh, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["rules"]["name"], doc["rules"]["kind"], doc["rules"]["chosen"]) == \
        (preset, "preset", "default")
    code, out, err = cli("reshard", str(src), str(tmp_path / "o2"), "--mesh", mesh,
                         "--rules", preset)
    assert code == 0, err
    assert f"rules: {preset} (preset)" in out
    code, out, err = cli("reshard", str(src), str(tmp_path / "o3"), "--world-size", "2",
                         "--dry-run", "--json")
    assert json.loads(out)["rules"]["note"] == "fsdp (preset, from --world-size 2)"


# ------------------------------------------------------------------ what each rule matched

def test_dry_run_reports_what_each_rule_matched(cli, ckpt, tmp_path):
    src, sd = ckpt
    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--mesh", "tp=2",
                         "--rules", "llama", "--dry-run", "--json")
    assert code == 0, err
    rep = json.loads(out)["rules"]
    counts = [(m["rule"].split(" ")[0], m["pattern"].split("(")[2].split("|")[0], m["tensors"])
              for m in rep["matched"]]
    # column-parallel wq (model + its exp_avg), row-parallel wo (same), no embedding, no head
    assert counts == [("column-parallel", "wq", 2), ("row-parallel", "wo", 2),
                      ("vocab", "tok_embeddings", 0), ("output", "output", 0)], counts
    assert rep["matched"][0]["examples"] == ["model.layers.0.attention.wq.weight",
                                             "optim.state.layers.0.attention.wq.weight.exp_avg"]
    assert rep["matched"][0]["placements"] == "tp:Shard(0)"
    # what stayed replicated: fc_in and norm, model and optimizer state alike
    assert rep["replicated"] == 4
    assert rep["replicated_examples"] == ["model.layers.0.mlp.fc_in.weight",
                                          "model.norm.weight",
                                          "optim.state.layers.0.mlp.fc_in.weight.exp_avg"]
    placements = json.loads(out)["placements"]
    assert placements["model.layers.0.mlp.fc_in.weight"] == "tp:Replicate()"
    assert placements["model.layers.0.attention.wo.weight"] == "tp:Shard(1)"

    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--mesh", "tp=2",
                         "--rules", "llama", "--dry-run")
    assert code == 0, err
    assert "4 tensors stay replicated" in out
    lines = out.splitlines()
    assert any(ln.startswith("vocab embedding") and "(matched nothing)" in ln for ln in lines), out
    assert any(ln.startswith("(no rule)") and "model.layers.0.mlp.fc_in.weight" in ln
               for ln in lines), out


def test_rules_file_that_matches_nothing_is_reported(cli, ckpt, tmp_path):
    src, _ = ckpt
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nmatch = "*.attn.qkv.weight"\nplacements = { tp = "Shard(0)" }\n')
    code, out, err = cli("reshard", str(src), str(tmp_path / "o"), "--mesh", "tp=2",
                         "--rules", str(rules), "--dry-run", "--json")
    assert code == 0, err
    rep = json.loads(out)["rules"]
    assert rep["kind"] == "file" and rep["chosen"] == "given"
    assert [(m["rule"], m["tensors"]) for m in rep["matched"]] == [("*.attn.qkv.weight", 0)]
    assert rep["replicated"] == 8  # everything


# ------------------------------------------------------------------ --only optim naming

def test_only_optim_is_named_after_what_it_holds(cli, ckpt, tmp_path):
    from safetensors.numpy import load_file

    src, sd = ckpt
    out_dir = tmp_path / "o"
    code, out, err = cli("consolidate", str(src), str(out_dir), "--only", "optim", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["files"] == ["optim.safetensors"] and doc["side_files"] == []
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckptctl.manifest.json",
                                                         "optim.safetensors"]
    got = load_file(out_dir / "optim.safetensors")
    want = {f"optim.state.{n}.exp_avg": v["exp_avg"].numpy()
            for n, v in sd["optim"]["state"].items()}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    code, out, err = cli("verify", str(out_dir), "--level", "full")
    assert code == 0, (out, err)

    # sharded: optim-0000i-of-0000N + optim.safetensors.index.json; still a checkpoint
    code, out, err = cli("consolidate", str(src), str(tmp_path / "s"), "--only", "optim",
                         "--max-shard-size", "200B", "--json")
    assert code == 0, err
    files = json.loads(out)["files"]
    assert "optim.safetensors.index.json" in files and not any("model" in f for f in files)
    # 128 B, 128 B, 96 + 16 B against a 200 B limit: three shards
    assert files[:3] == [f"optim-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], files
    index = json.loads((tmp_path / "s" / "optim.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    code, out, err = cli("inspect", str(tmp_path / "s"), "--json")
    assert code == 0 and json.loads(out)["num_tensors"] == 4, err
    code, out, err = cli("verify", str(tmp_path / "s"), "--level", "full")
    assert code == 0, (out, err)


# ------------------------------------------------------------------ inspect --filter

def test_inspect_filter_that_matches_nothing(cli, ckpt):
    src, _ = ckpt
    err = _usage(cli, "inspect", str(src), "--filter", "layers.*")
    assert "--filter 'layers.*' matches no entry" in err and "model.layers.0" in err
    code, out, err = cli("inspect", str(src), "--filter", "layers.*", "--json")
    assert code == 2 and json.loads(out)["error"]["exit_code"] == 2
    code, out, err = cli("inspect", str(src), "--filter", "*.layers.*", "--tensors")
    assert code == 0, err
    assert "model.layers.0.mlp.fc_in.weight" in out and "model.norm.weight" not in out
