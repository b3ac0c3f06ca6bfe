"""``inspect`` and ``ls`` on real checkpoints: what they report, JSON shape, S3 cost, and
that inspecting DCP or safetensors never imports torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fixtures_torch import copy_ckpt


def test_inspect_json_fields(torch_ckpts, cli):
    code, out, err = cli("inspect", str(torch_ckpts["fsdp"]), "--json")
    assert code == 0, err
    doc = json.loads(out)
    for k in ("format", "step", "bytes", "num_files", "num_tensors", "num_objects",
              "num_params", "closure", "tensors"):
        assert k in doc
    assert doc["format"] == "dcp" and doc["step"] == 20
    assert doc["closure"] == {"model": True, "optim": True, "lr_scheduler": True, "rng": True,
                              "step": True, "dataloader": True, "meta": False}
    assert doc["num_params"] > 0 and doc["layout"]["world_size"] == 4
    t = doc["tensors"][0]
    assert set(t) >= {"name", "dtype", "shape", "num_chunks", "bytes"}
    import torch

    full = torch.load(torch_ckpts.full["fsdp"], weights_only=False)["model"]
    assert doc["num_params"] == sum(v.numel() for v in full.values())


def test_inspect_human_output(torch_ckpts, cli):
    code, out, _ = cli("inspect", str(torch_ckpts["2d"]), "--tensors", "--tree", "--show-objects")
    assert code == 0
    assert "dcp" in out and "step 20" in out and "closure" in out
    assert "layers" in out and "optim.param_groups.0.lr" in out


def test_inspect_filter(torch_ckpts, cli):
    code, out, _ = cli("inspect", str(torch_ckpts["tp"]), "--json", "--filter", "model.layers.0.*")
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names and all(n.startswith("model.layers.0.") for n in names)


def test_inspect_safetensors_and_torch(torch_ckpts, cli):
    for key, fmt in (("hf_single", "safetensors"), ("hf_sharded", "hf-safetensors"),
                     ("nested_pt", "torch"), ("bin", "torch")):
        code, out, err = cli("inspect", str(torch_ckpts[key]), "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["format"] == fmt and doc["num_tensors"] > 0


@pytest.mark.parametrize("name,prefix", [("step-1200", "step-1200"), ("global_step1200", "g"),
                                         ("checkpoint-1200", "c"), ("iter_0001200", "i")])
def test_step_from_name(tmp_path, torch_ckpts, name, prefix):
    from ckptctl.ops import inspect

    src = torch_ckpts.hf_single
    dst = copy_ckpt(src, tmp_path / name)
    assert inspect(str(dst)).step == 1200


NO_TORCH = """
import sys, json
from ckptctl.cli.main import main
try:
    main(["inspect", sys.argv[1], "--json", "--show-objects"])
except SystemExit as e:
    assert e.code == 0, e.code
bad = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
assert not bad, bad[:5]
"""


@pytest.mark.parametrize("key", ["fsdp", "fsdp_zstd", "hf_single", "hf_sharded"])
def test_inspect_never_imports_torch(torch_ckpts, key):
    p = subprocess.run([sys.executable, "-c", NO_TORCH, str(torch_ckpts[key])],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def test_help_is_fast_and_torch_free():
    code = ("import sys; from ckptctl.cli.main import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


# moto: a server that answers ranged GETs with 206. rclone answers them with 200 and a
# Content-Range, which obstore refuses: each process's first ranged read there costs one
# refused GET more before botocore takes over (tests/test_store_contract.py reads there).
def test_inspect_on_s3_reads_metadata_only(torch_ckpts, moto_bucket):
    from ckptctl.ops import inspect

    s3_bucket = moto_bucket
    s3_bucket.upload(torch_ckpts["fsdp"], "run/step-20")
    server = s3_bucket.server
    server.reset_log()
    r = inspect(s3_bucket.url("run/step-20"), s3_bucket.storage_options)
    gets = [q for q in server.request_log() if q.op == "GET"]
    assert r.num_files == 5 and r.step == 20
    assert 1 <= len(gets) <= 2, gets
    for q in gets:  # the step entry is one small ranged read; no tensor data
        if q.key.endswith(".distcp"):
            lo, hi = q.range.removeprefix("bytes=").split("-")
            assert int(hi) - int(lo) < 65536, q


def test_inspect_sharded_safetensors_on_s3_is_one_get_per_file(torch_ckpts, moto_bucket):
    from ckptctl.ops import inspect

    s3_bucket = moto_bucket
    s3_bucket.upload(torch_ckpts.hf_sharded, "hf")
    s3_bucket.server.reset_log()
    inspect(s3_bucket.url("hf"), s3_bucket.storage_options)
    gets = [q for q in s3_bucket.server.request_log() if q.op == "GET"]
    shards = [q for q in gets if q.key.endswith(".safetensors")]
    assert len(shards) == 3 and all(q.range for q in shards)
    assert len(gets) == 4  # + the index


def test_cli_reads_aws_env_for_s3(torch_ckpts, s3_bucket):
    s3_bucket.upload(torch_ckpts["tp"], "step-20")
    env = {**os.environ, **s3_bucket.server.env}
    p = subprocess.run([sys.executable, "-m", "ckptctl", "inspect", s3_bucket.url("step-20"),
                        "--json"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["num_files"] == 5
    assert s3_bucket.server.secret not in p.stdout + p.stderr


def _make_run(tmp_path, torch_ckpts):
    run = tmp_path / "run"
    copy_ckpt(torch_ckpts["fsdp"], run / "step-20")
    copy_ckpt(torch_ckpts["tp"], run / "step-10")
    broken = copy_ckpt(torch_ckpts["2d"], run / "step-30")
    (broken / ".metadata").unlink()  # a crash before DCP committed
    copy_ckpt(torch_ckpts.hf_sharded, run / "hf" / "checkpoint-5")
    shutil.copy(torch_ckpts.nested_pt, run / "step-7.pt")
    return run


def _check_ls(doc):
    rows = [(c["name"], c["step"], c["format"], c["state"]) for c in doc["checkpoints"]]
    print([c["reason"] for c in doc["checkpoints"]])
    assert rows == [("hf/checkpoint-5", 5, "hf-safetensors", "complete"),
                    ("step-7.pt", 7, "torch", "complete"),
                    ("step-10", 20, "dcp", "complete"),  # its step entry wins
                    ("step-20", 20, "dcp", "complete"),
                    ("step-30", 30, "dcp", "incomplete")], rows
    assert all(c["bytes"] > 0 for c in doc["checkpoints"])


def test_ls_local(tmp_path, torch_ckpts, cli):
    run = _make_run(tmp_path, torch_ckpts)
    code, out, err = cli("ls", str(run), "--json")
    assert code == 0, err
    _check_ls(json.loads(out))
    code, out, _ = cli("ls", str(run))
    assert "incomplete" in out and "step-20" in out


def test_ls_s3(tmp_path, torch_ckpts, s3_bucket, cli):
    run = _make_run(tmp_path, torch_ckpts)
    s3_bucket.upload(run, "run")
    o = s3_bucket.storage_options
    args = [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]
    code, out, err = cli("ls", s3_bucket.url("run"), "--json", *args)
    assert code == 0, err
    _check_ls(json.loads(out))


def test_ls_empty(tmp_path, cli):
    code, out, _ = cli("ls", str(tmp_path))
    assert code == 0 and "no checkpoints" in out


# ------------------------------------------------- numbers that agree (issue 8, item 3)


def _steps(cli, root, url) -> tuple:
    """(ls's step for ``url``, inspect's, verify's) through the CLI's JSON."""
    code, out, err = cli("ls", str(root), "--json")
    assert code == 0, err
    by_url = {c["url"]: c["step"] for c in json.loads(out)["checkpoints"]}
    steps = [by_url[str(url)]]
    for verb in ("inspect", "verify"):
        code, out, err = cli(verb, str(url), "--json")
        assert code == 0, err
        steps.append(json.loads(out)["step"])
    return tuple(steps)


def test_ls_inspect_and_verify_report_the_same_step(tmp_path, torch_ckpts, cli):
    import torch

    root = tmp_path / "run"
    root.mkdir()
    w = {"w": torch.arange(4, dtype=torch.float32)}
    cases = {  # file or folder -> the step all three must say
        copy_ckpt(torch_ckpts["tp"], root / "step-10"): 20,  # the entry wins over the name
        root / "epoch=0-step=2.ckpt": 2,  # Lightning: the global_step key
        root / "epoch=1-step=9.ckpt": 3,  # ... wins over the name
        root / "step-9.pt": 5,  # torch.save's global_step entry
        copy_ckpt(torch_ckpts.nested_pt, root / "epoch=4-step=33.ckpt"): 33,  # name only
    }
    torch.save({"state_dict": w, "global_step": 2, "epoch": 0}, root / "epoch=0-step=2.ckpt")
    torch.save({"state_dict": w, "global_step": 3, "epoch": 1}, root / "epoch=1-step=9.ckpt")
    torch.save({"model": w, "global_step": 5}, root / "step-9.pt")
    for url, want in cases.items():
        assert _steps(cli, root, url) == (want, want, want), url


@pytest.mark.parametrize("layout,mesh", [("fsdp", "dp=4"), ("tp", "tp=4"), ("2d", "dp=2,tp=2")])
def test_layout_names_the_mesh(torch_ckpts, cli, layout, mesh):
    code, out, err = cli("inspect", str(torch_ckpts[layout]), "--json")
    assert code == 0, err
    assert json.loads(out)["layout"]["mesh_guess"] == mesh
    code, out, err = cli("inspect", str(torch_ckpts[layout]))
    (line,) = [x for x in out.splitlines() if x.strip().startswith("layout")]
    assert line.endswith(f"mesh guess {mesh}"), line


def test_plurals_in_human_output(tmp_path, cli):
    import re

    import torch
    from safetensors.torch import save_file

    d = tmp_path / "one"
    d.mkdir()
    save_file({"w": torch.ones(3)}, str(d / "model.safetensors"))
    outs = []
    for args in (("inspect", str(d)), ("verify", str(d)), ("seal", str(d)),
                 ("consolidate", str(d), str(tmp_path / "c"), "--to", "torch")):
        code, out, err = cli(*args)
        assert code == 0, err
        outs.append(out)
    text = "".join(outs)
    assert "in 1 file;" in outs[0] and "1 tensor (" in outs[0] and "0 objects" in outs[0]
    assert "float32 1 tensor " in outs[0] and "1 data file," in outs[0]
    assert "1 file," in outs[1] and "1 file," in outs[2] and "1 tensor," in outs[3]
    assert not re.search(r"\b1 (files|tensors|objects|ranks|chunks|problems|data files)\b",
                         text), text
    assert "(s)" not in text
