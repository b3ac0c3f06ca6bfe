"""Resuming at a new world size (issue 18), in the frameworks themselves:

* ``consolidate --to deepspeed-universal``: a universal checkpoint written by ckptctl from an
  FSDP2 DCP checkpoint (written by torch on 2 ranks) and from a ZeRO-2 one, resumed by
  DeepSpeed (``load_checkpoint`` with ``load_universal``) at another world size and stage;
* ``reshard`` of a ZeRO-3 bf16 checkpoint into DCP at 3 ranks, resumed by FSDP2
  (``dcp.load`` + ``set_state_dict``);

each with weights and Adam state equal to the source bit for bit.

The resumes run DeepSpeed under ``torch.distributed.run`` (``tests/fixtures/resume_deepspeed.py``);
the FSDP2 source is ``tests/fixtures/write_fsdp_tinylm.py`` (the DeepSpeed fixtures' model).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures_deepspeed import GENERATORS, RESUMER, _run_fresh, _torchrun

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

UNIVERSAL = "deepspeed-universal"


def _resume(src_root: Path, out: Path, *, world: int, stage: int, tmp: Path,
            scheduler: bool = True) -> dict:
    args = ["--load", src_root, "--universal", "--stage", str(stage), "--world-check",
            str(world), "--out", out] + ([] if scheduler else ["--no-scheduler-state"])
    _run_fresh(_torchrun(world, RESUMER, *args), tmp / "resume.log", out)
    return torch.load(out, weights_only=False)


def _trained(res: dict) -> dict:
    return {k: v for k, v in res.items() if k.split(".")[0] in ("param", "exp_avg", "exp_avg_sq",
                                                                "step")}


@pytest.fixture(scope="module")
def fsdp_source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    _run_fresh(_torchrun(2, GENERATORS / "write_fsdp_tinylm.py", "--out", out), out / "gen.log",
               out / "step-3")
    return out


@pytest.mark.slow  # ~80 s: DeepSpeed's own resume on 3 torchrun ranks
def test_fsdp2_dcp_resumes_in_deepspeed_at_another_world_size(fsdp_source, tmp_path, cli):
    """FSDP2 on 2 ranks -> universal -> DeepSpeed ZeRO-2 on 3 ranks."""
    dst = tmp_path / "uni" / "global_step3_universal"
    code, out, err = cli("consolidate", str(fsdp_source / "step-3"), str(dst), "--to", UNIVERSAL)
    assert code == 0, err
    assert (tmp_path / "uni" / "latest_universal").read_text() == "global_step3_universal"
    res = _resume(tmp_path / "uni", tmp_path / "res.pt", world=3, stage=2, tmp=tmp_path,
                  scheduler=False)
    full = torch.load(fsdp_source / "full.pt", weights_only=False)
    model, state = full["model"], full["optim"]["state"]
    got = _trained(res)
    assert len(got) == 4 * 5  # five trainable parameters: weight, two moments, step each
    for k, v in got.items():
        kind, _, name = k.partition(".")
        want = model[name] if kind == "param" else state[name][kind]
        assert torch.equal(torch.as_tensor(v).float(), torch.as_tensor(want).float()), k
    assert res["global_steps"] == 3 and res["world"] == 3
    assert [g["weight_decay"] for g in res["param_groups"]] == [0.1, 0.0]


def test_zero2_resumes_as_zero3_at_another_world_size(deepspeed_ckpts, tmp_path, cli):
    """ZeRO-2 on 2 ranks -> universal -> DeepSpeed ZeRO-3 on 3 ranks: weights, moments,
    steps, the scheduler and the client state come back."""
    v = deepspeed_ckpts.variant("z2-fp32")
    dst = tmp_path / "uni" / "global_step3_universal"
    code, out, err = cli("consolidate", str(v.save_dir), str(dst), "--to", UNIVERSAL)
    assert code == 0, err
    assert "not stored (16-bit copies of model.*" in out
    res = _resume(tmp_path / "uni", tmp_path / "res.pt", world=3, stage=3, tmp=tmp_path)
    want = _trained(v.load_full())
    got = _trained(res)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(torch.as_tensor(got[k]).float(), torch.as_tensor(want[k]).float()), k
    assert res["global_steps"] == 3 and res["lr_scheduler"] == {"last_batch_iteration": 2}
    assert {k: res["client_state"][k] for k in ("epoch", "note")} == {"epoch": 1, "note": "x"}


def test_ckptctl_reads_its_universal_output_back(deepspeed_ckpts, tmp_path, cli):
    """What ckptctl writes it reads as a universal checkpoint: the same model and optimizer
    entries as the source (diff says identical for them), sealed. (From a bf16 run the frozen
    parameters, kept in bf16 there, become fp32 master weights: a dtype difference.)"""
    v = deepspeed_ckpts.variant("z3-fp32")
    dst = tmp_path / "uni" / "global_step3_universal"
    code, out, err = cli("consolidate", str(v.tag_dir), str(dst), "--to", UNIVERSAL)
    assert code == 0, err
    code, out, err = cli("verify", str(dst), "--level", "full", "--json")
    assert code == 0 and json.loads(out)["ok"], out
    code, out, err = cli("diff", str(v.tag_dir), str(dst), "--only", "model.*", "--only",
                         "optim.state.*", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["equal"] and set(doc["counts"]) == {"identical"}, doc


def test_what_a_universal_checkpoint_cannot_hold_is_refused(tmp_path, cli):
    """A source without optimizer state (an HF model) is refused in one line, nothing
    written."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.ones(3)}, str(src / "model.safetensors"))
    dst = tmp_path / "uni" / "global_step1_universal"
    code, out, err = cli("consolidate", str(src), str(dst), "--to", UNIVERSAL)
    assert code == 2 and err.count("\n") == 1 and "param groups" in err, err
    assert not dst.exists() and not (tmp_path / "uni" / "latest_universal").exists()
    code, out, err = cli("consolidate", str(src), str(dst), "--to", UNIVERSAL,
                         "--strip-prefix", "model.")
    assert code == 2 and "--strip-prefix" in err


def test_zero3_resharded_to_dcp_resumes_in_fsdp2(deepspeed_ckpts, tmp_path, cli):
    """ZeRO-3 bf16 on 2 ranks -> reshard --world-size 3 -> FSDP2 on 3 ranks loads it: the
    fp32 master weights, moments, steps and hyper-parameters DeepSpeed itself held."""
    v = deepspeed_ckpts.variant("z3-bf16")
    dst = tmp_path / "fsdp" / "step-3"
    code, out, err = cli("reshard", str(v.save_dir), str(dst), "--world-size", "3")
    assert code == 0, err
    res_path = tmp_path / "res.pt"
    _run_fresh(_torchrun(3, GENERATORS / "load_fsdp_tinylm.py", "--load", dst, "--out",
                         res_path), tmp_path / "load.log", res_path)
    res = torch.load(res_path, weights_only=False)
    want = _trained(v.load_full())
    assert want
    for k, ref in want.items():
        kind, _, name = k.partition(".")
        got = res["model"][name] if kind == "param" else res["optim"]["state"][name][kind]
        assert torch.equal(torch.as_tensor(got).float(), torch.as_tensor(ref).float()), k
    assert [g["weight_decay"] for g in res["param_groups"]] == [0.1, 0.0]
    assert [g["betas"] for g in res["param_groups"]] == [(0.9, 0.95)] * 2
