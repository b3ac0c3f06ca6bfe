"""Megatron legacy checkpoints (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``, issue 19)
merged into logical tensors by the GPT rules, checked bit for bit against the full tensors
the rank files were cut from (tests/fixtures/write_megatron_legacy.py splits them exactly as
megatron-core's layers do, and tests/test_megatron_fixtures.py checks that split against
megatron-core's own TP=2 shards).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron_legacy.py
"""
from __future__ import annotations

import io
import json

import pytest

from fixtures_torch import copy_ckpt
from test_deepspeed import _json, _one_line, _same, _tensor

torch = pytest.importorskip("torch")

LEGACY = ("legacy-tp2pp2", "legacy-tp4", "legacy-tp2-distopt")


@pytest.fixture(params=LEGACY)
def run(request, megatron_ckpts):
    return megatron_ckpts.legacy(request.param)


def _folder(run):
    return run.run / ("release" if run.entry.get("release") else "iter_0000020")


def test_merged_model_equals_the_full_tensors(run):
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(_folder(run)))
    full = run.load_full()["model"]
    assert ck.format == "megatron-legacy" and ck.step == 20
    tensors = {k[len("model."):] for k, t in ck.tensors.items() if k.startswith("model.")}
    assert tensors == {k for k, v in full.items() if isinstance(v, torch.Tensor)}
    bad = [k for k in tensors if not _same(_tensor(ck, f"model.{k}"), full[k])]
    assert bad == []
    # the rank files of every TP x PP rank are the checkpoint's
    assert ck.info["megatron"] == {"layout": "legacy", "tp": run.tp, "pp": run.pp}


def test_inspect_says_the_layout_step_and_what_is_kept_per_rank(run, cli):
    r = _json(cli, "inspect", str(_folder(run)))
    assert r["origin"] == f"Megatron legacy, TP {run.tp} x PP {run.pp}"
    assert (r["step"], r["step_source"]) == (20, "entry")
    assert any("padded vocabulary" in n for n in r["notes"])
    if run.entry.get("optimizer"):
        assert r["closure"]["optim"] and r["closure"]["rng"]
    if run.entry.get("optimizer") is True:
        assert any("optimizer state stays per rank" in n for n in r["notes"])
    if run.entry.get("optimizer") == "distributed":
        assert any("distributed optimizer's state (distrib_optim.pt per rank, " in n
                   for n in r["notes"]), r["notes"]


def test_consolidate_only_model_to_safetensors_equals_the_full_tensors(run, cli, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    code, so, err = cli("consolidate", str(_folder(run)), str(out), "--only", "model",
                        "--to", "safetensors", "--strip-prefix", "model.")
    assert code == 0, so + err
    got = load_file(str(out / "model.safetensors"))
    full = run.load_full()["model"]
    assert sorted(got) == sorted(k for k, v in full.items() if isinstance(v, torch.Tensor))
    assert [k for k in got if not _same(got[k], full[k])] == []


def test_ls_of_the_run_lists_each_iteration_and_the_tracker(megatron_ckpts, cli):
    run = megatron_ckpts.legacy("legacy-tp2pp2").run
    r = _json(cli, "ls", str(run))
    assert [(c["name"], c["step"], c["format"], c["state"]) for c in r["checkpoints"]] == \
        [("iter_0000010", 10, "megatron-legacy", "complete"),
         ("iter_0000020", 20, "megatron-legacy", "complete")]
    assert r["pointers"][0]["names"] == "iter_0000020"


# ------------------------------------------------------------------ refused, found


def _edit_rank(tag, rel, edit):
    f = tag / rel
    sd = torch.load(f, weights_only=False)
    edit(sd)
    torch.save(sd, f)


def test_a_replicated_copy_that_differs_is_found(megatron_ckpts, cli, tmp_path):
    it = copy_ckpt(megatron_ckpts.legacy("legacy-tp4").run / "release", tmp_path / "release")

    def bump(sd):
        sd["model"]["decoder.final_layernorm.weight"][0] += 1
    _edit_rank(it, "mp_rank_02/model_optim_rng.pt", bump)
    code, out, err = cli("inspect", str(it))
    assert (code, out) == (3, ""), err
    _one_line(err, "decoder.final_layernorm.weight: replicated, but TP rank 2's copy differs")


def test_a_parameter_no_rule_names_is_refused_by_name(megatron_ckpts, cli, tmp_path):
    it = copy_ckpt(megatron_ckpts.legacy("legacy-tp4").run / "release", tmp_path / "release")
    for t in range(4):
        def add(sd):
            sd["model"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 16)
        _edit_rank(it, f"mp_rank_{t:02d}/model_optim_rng.pt", add)
    code, out, err = cli("inspect", str(it), "--json")
    e = json.loads(out)["error"]
    assert (code, e["code"]) == (3, "UNSUPPORTED_FORMAT"), e
    assert "decoder.layers.0.mlp.router.weight: no rule says how Megatron splits it" in e["message"]


def test_a_missing_rank_and_a_lone_rank_file_are_one_line(megatron_ckpts, cli, tmp_path):
    it = copy_ckpt(megatron_ckpts.legacy("legacy-tp2pp2").run / "iter_0000020",
                   tmp_path / "iter_0000020")
    code, out, err = cli("inspect", str(it / "mp_rank_00_000" / "model_optim_rng.pt"))
    assert code == 3
    _one_line(err, "one rank's file; open the iteration folder")
    import shutil

    shutil.rmtree(it / "mp_rank_01_001")
    code, out, err = cli("inspect", str(it))
    assert code == 3
    _one_line(err, "rank files missing: mp_rank_01_001")


def test_rng_state_with_numpy_is_kept_opaque_and_a_conversion_refuses_it(megatron_ckpts, cli,
                                                                        tmp_path):
    it = megatron_ckpts.legacy("legacy-tp2pp2").run / "iter_0000020"
    code, so, err = cli("consolidate", str(it), str(tmp_path / "out"), "--to", "torch")
    assert code == 2 and "opaque" in err and "rng_state.mp_rank_00_000" in err, err
    assert not (tmp_path / "out").exists()


def _generator():
    import importlib.util

    from fixtures_megatron import LEGACY_WRITER

    spec = importlib.util.spec_from_file_location("write_megatron_legacy", LEGACY_WRITER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mesh,tp,pp", [("tp=4", 4, 1), ("tp=1,pp=4", 1, 4)])
def test_reshard_to_another_tp_pp_equals_a_direct_split(megatron_ckpts, cli, tmp_path, mesh,
                                                        tp, pp):
    """TP=2 x PP=2 merged and split again at TP=4 (and PP=4): each rank file's model holds
    exactly what the fixture's generator (megatron-core's split rules) cuts from the full
    tensors, byte for byte, and the result merges back to them."""
    gen = _generator()
    run = megatron_ckpts.legacy("legacy-tp2pp2")
    full = run.load_full()["model"]
    out = tmp_path / "run" / "iter_0000020"
    code, so, err = cli("reshard", str(run.run / "iter_0000020"), str(out), "--to",
                        "megatron-legacy", "--mesh", mesh, "--drop", "optimizer.*",
                        "--drop", "rng_state.*")
    assert code == 0, so + err
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "20"
    names = [k for k, v in full.items() if isinstance(v, torch.Tensor)]
    for p in range(pp):
        local = gen.stage_names(names, 4, pp, p)
        for t in range(tp):
            rel = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + "/model_optim_rng.pt"
            sd = torch.load(out / rel, weights_only=False)
            assert (sd["iteration"], sd["args"].tensor_model_parallel_size,
                    sd["args"].pipeline_model_parallel_size) == (20, tp, pp)
            got = {k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}
            assert sorted(got) == sorted(local), rel
            bad = [k for k in got if not _same(got[k], gen.split(local[k], full[local[k]], tp, t))]
            assert bad == [], rel
            extra = [k for k in sd["model"] if k.endswith("_extra_state")]
            assert extra and all(isinstance(sd["model"][k], io.BytesIO) for k in extra)
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(out))
    assert all(_same(_tensor(ck, f"model.{k}"), full[k]) for k in names)


def test_reshard_to_legacy_refuses_per_rank_optimizer_state(megatron_ckpts, cli, tmp_path):
    run = megatron_ckpts.legacy("legacy-tp2pp2")
    code, so, err = cli("reshard", str(run.run / "iter_0000020"), str(tmp_path / "out"),
                        "--to", "megatron-legacy", "--mesh", "tp=4")
    assert code == 2 and not (tmp_path / "out").exists()
    _one_line(err, "cannot be split again", "--drop 'optimizer.*'")


# ------------------------------------------------------------------ the distributed optimizer

DISTOPT_REFUSAL = ("cannot convert distrib_optim.mp_rank_00, distrib_optim.mp_rank_01: "
                   "Megatron's distributed-optimizer buckets, whose parameter order the "
                   "checkpoint does not record; leave them out with --only model or --drop "
                   "'distrib_optim.*'")


def test_distributed_optimizer_buckets_are_carried_and_conversions_refuse_them(
        megatron_ckpts, cli, tmp_path):
    """distrib_optim.pt is inspected (one opaque optim object per rank), copied byte for
    byte by promote and checked by verify; a conversion that would have to rebuild it
    refuses it by name, and --drop leaves it out."""
    it = megatron_ckpts.legacy("legacy-tp2-distopt").run / "iter_0000020"
    r = _json(cli, "inspect", str(it), "--show-objects")
    names = {o["name"] for o in r["objects"]}
    assert {"distrib_optim.mp_rank_00", "distrib_optim.mp_rank_01"} <= names, names
    assert r["closure"]["optim"]
    r = _json(cli, "verify", str(it), "--level", "full")
    assert r["ok"] and r["num_files_read"] == 4, r
    code, so, err = cli("consolidate", str(it), str(tmp_path / "out"), "--to", "torch")
    assert code == 2 and not (tmp_path / "out").exists()
    _one_line(err, DISTOPT_REFUSAL)
    code, so, err = cli("reshard", str(it), str(tmp_path / "r"), "--world-size", "2",
                        "--drop", "rng_state.*")
    assert code == 2 and not (tmp_path / "r").exists()
    _one_line(err, DISTOPT_REFUSAL)
    code, so, err = cli("reshard", str(it), str(tmp_path / "r"), "--world-size", "2",
                        "--drop", "rng_state.*", "--drop", "distrib_optim.*")
    assert code == 0, so + err
    it = copy_ckpt(it, tmp_path / "hot" / "iter_0000020")  # promote seals its source
    warm = tmp_path / "warm" / "iter_0000020"
    code, so, err = cli("promote", str(it), str(warm))
    assert code == 0, so + err
    for rank in ("mp_rank_00", "mp_rank_01"):
        assert (warm / rank / "distrib_optim.pt").read_bytes() == \
            (it / rank / "distrib_optim.pt").read_bytes()


def test_a_broken_or_stray_distrib_optim_file_is_one_line(megatron_ckpts, cli, tmp_path):
    it = copy_ckpt(megatron_ckpts.legacy("legacy-tp2-distopt").run / "iter_0000020",
                   tmp_path / "iter_0000020")
    torch.save([1, 2, 3], it / "mp_rank_01" / "distrib_optim.pt")
    code, out, err = cli("inspect", str(it))
    assert (code, out) == (3, "")
    _one_line(err, "mp_rank_01/distrib_optim.pt", "not Megatron's distributed-optimizer state")
    (it / "mp_rank_01" / "distrib_optim.pt").unlink()
    (it / "mp_rank_02").mkdir()
    (it / "mp_rank_02" / "distrib_optim.pt").write_bytes(
        (it / "mp_rank_00" / "distrib_optim.pt").read_bytes())
    code, out, err = cli("inspect", str(it))
    assert (code, out) == (3, "")
    _one_line(err, "mp_rank_02/distrib_optim.pt", "without a rank file beside it")


def test_reshard_of_a_legacy_checkpoint_into_dcp_loads_with_dcp_load(megatron_ckpts, cli,
                                                                      tmp_path):
    """A legacy source becomes plain DCP (no Megatron common state to carry)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    run = megatron_ckpts.legacy("legacy-tp2pp2")
    out = tmp_path / "dcp"
    code, so, err = cli("reshard", str(run.run / "iter_0000020"), str(out), "--world-size",
                        "3", "--drop", "rng_state.*")
    assert code == 0, so + err
    assert not (out / "metadata.json").exists()
    full = {f"model.{k}": v for k, v in run.load_full()["model"].items()
            if isinstance(v, torch.Tensor)}
    sd = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert [k for k in full if not _same(sd[k], full[k])] == []
