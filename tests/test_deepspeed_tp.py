"""Tensor-parallel (AutoTP) DeepSpeed ZeRO checkpoints (issue 18): each TP rank's ZeRO view
joined by the affine map DeepSpeed records, checked bit for bit against DeepSpeed's own
views (tests/fixtures/write_deepspeed_tp.py: TP2 x DP2 at ZeRO-1/2/3, fp32 and bf16, TP4 x
DP1 and TP2 x DP1; ``load_checkpoint`` + ``safe_get_full_*`` per TP rank, and
``ds_to_universal``'s join), and the layouts the map can describe but ckptctl does not
rebuild exactly refused by name.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_deepspeed_tp.py
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from fixtures_torch import copy_ckpt
from test_deepspeed import _json, _one_line, _same, _tensor

torch = pytest.importorskip("torch")

TP = [("tp2-z1-fp32", 4), ("tp2-z2-bf16", 4), ("tp2-z3-fp32", 4), ("tp4-z2-fp32", 4),
      ("tp2-z2-fp32", 2)]
IDS = [f"{n}-w{w}" for n, w in TP]


@pytest.fixture(params=TP, ids=IDS)
def v(request, deepspeed_ckpts):
    name, world = request.param
    return deepspeed_ckpts.tp(name, world)


def _joined(v, fulls: list[dict], key: str, name: str):
    """The logical tensor of ``name`` from each TP rank's DeepSpeed view (``key.name``):
    the shards concatenated along the split dim, or rank 0's copy of a replicated one (the
    others checked equal to it)."""
    dim = v.entry["split_dim"].get(name)
    parts = [f[f"{key}.{name}"] for f in fulls]
    if dim is None:
        assert all(_same(p, parts[0]) for p in parts[1:]), name
        return parts[0]
    return torch.cat(parts, dim=dim)


def _universal(v, name: str, key: str):
    d = torch.load(v.universal_tag / "zero" / name / f"{key}.pt", weights_only=False)
    t = d["param"] if isinstance(d, dict) else d
    return t.reshape(v.entry["logical_params"][name])


def test_entries_equal_deepspeeds_own_view(v):
    """Every trainable parameter's fp32 master and Adam state equal ds_to_universal's join
    and DeepSpeed's per-TP-rank views joined along the split dim; module16, frozen, tied,
    buffer, step and client state as DeepSpeed loads them."""
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(v.tag_dir))
    fulls = [v.load_full(t) for t in range(v.tp)]
    e = v.entry
    assert (ck.format, ck.step) == ("deepspeed", 3)
    assert ck.info["deepspeed"]["tp"] == v.tp and ck.info["deepspeed"]["dp"] == v.dp
    for n in e["trainable"]:
        got = _tensor(ck, f"model.{n}")
        assert list(got.shape) == e["logical_params"][n], n
        assert _same(got, _joined(v, fulls, "param", n)), n
        assert _same(got, _universal(v, n, "fp32")), n
        for key in ("exp_avg", "exp_avg_sq"):
            got = _tensor(ck, f"optim.state.{n}.{key}")
            assert _same(got, _joined(v, fulls, key, n)), (n, key)
            assert _same(got, _universal(v, n, key)), (n, key)
        assert _same(_tensor(ck, f"optim.state.{n}.step"), fulls[0][f"step.{n}"]), n
    assert ck.info["aliases"] == {"model.head.weight": "model.emb.weight"}
    assert _same(_tensor(ck, "model.head.weight"), fulls[0]["param.emb.weight"])
    assert _same(_tensor(ck, "model.pos_scale"), fulls[0]["buffer.pos_scale"])
    for n in e["frozen"]:
        assert _same(_tensor(ck, f"model.{n}"), _joined(v, fulls, "module16", n)), n
    m16 = sorted(k[len("module16."):] for k in ck.tensors if k.startswith("module16."))
    if v.stage == 3:
        assert m16 == ["pos_scale"]
    else:
        for n in e["logical_params"]:
            assert _same(_tensor(ck, f"module16.{n}"), _joined(v, fulls, "module16", n)), n
    objs = {k: o.value for k, o in ck.objects.items()}
    assert objs["step"] == fulls[0]["global_steps"] == 3
    assert {k: objs[f"client_state.{k}"] for k in ("epoch", "note")} == {"epoch": 1, "note": "x"}
    assert {k[len("lr_scheduler."):]: x for k, x in objs.items()
            if k.startswith("lr_scheduler.")} == fulls[0]["lr_scheduler"]


def test_inspect_names_tp_and_dp_and_each_ranks_partitions(v, cli):
    r = _json(cli, "inspect", str(v.tag_dir))
    assert r["origin"] == (f"ZeRO-{v.stage}, TP {v.tp} x DP {v.dp} ({v.tp * v.dp} ranks), "
                           f"{'bf16' if v.dtype == 'bf16' else 'fp32'}")
    assert sorted((x["mp_rank"], x["rank"]) for x in r["ranks"]) == \
        [(t, d) for t in range(v.tp) for d in range(v.dp)]
    # each TP rank's pieces cover each of its parameter shards exactly once
    shards = v.entry["shard_shapes"]
    for t in range(v.tp):
        held: dict[str, int] = {}
        for x in r["ranks"]:
            if x["mp_rank"] == t:
                for g in x["groups"]:
                    for n, (_, count) in g["params"].items():
                        held[n] = held.get(n, 0) + count
        want = {n: int(torch.Size(shards[n][t]).numel()) for n in v.entry["trainable"]}
        assert held == want, t
    assert any("replicated on every TP rank" in n for n in r["notes"]), r["notes"]
    code, out, err = cli("inspect", str(v.tag_dir))
    assert code == 0 and "tp0/dp0: " in out and f"tp{v.tp - 1}/dp{v.dp - 1}: " in out, out + err


@pytest.mark.parametrize("name,world", [("tp2-z1-fp32", 4), ("tp4-z2-fp32", 4)])
def test_consolidate_model_equals_the_universal_join(deepspeed_ckpts, cli, tmp_path, name, world):
    from safetensors.torch import load_file

    v = deepspeed_ckpts.tp(name, world)
    out = tmp_path / "hf"
    code, so, err = cli("consolidate", str(v.tag_dir), str(out), "--only", "model", "--to",
                        "safetensors", "--strip-prefix", "model.")
    assert code == 0, so + err
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted([*v.entry["logical_params"], "head.weight", "pos_scale"])
    for n in v.entry["trainable"]:
        assert _same(got[n], _universal(v, n, "fp32")), n
    code, so, err = cli("verify", str(out), "--level", "full")
    assert code == 0, so + err


@pytest.mark.parametrize("name,world,to", [("tp2-z2-bf16", 4, 3), ("tp2-z3-fp32", 4, 2)])
def test_reshard_loads_in_torch_with_the_joined_values(deepspeed_ckpts, cli, tmp_path, name,
                                                       world, to):
    import torch.distributed.checkpoint as dcp

    v = deepspeed_ckpts.tp(name, world)
    out = tmp_path / "dcp"
    code, so, err = cli("reshard", str(v.tag_dir), str(out), "--world-size", str(to))
    assert code == 0, so + err
    fulls = [v.load_full(t) for t in range(v.tp)]
    e = v.entry
    nan = lambda shape: torch.full(shape, float("nan"))  # noqa: E731
    sd = {"model": {n: nan(e["logical_params"][n]) for n in e["trainable"]},
          "optim": {"state": {n: {k: nan(e["logical_params"][n]) for k in ("exp_avg", "exp_avg_sq")}
                              for n in e["trainable"]}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for n in e["trainable"]:
        assert _same(sd["model"][n], _joined(v, fulls, "param", n)), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert _same(sd["optim"]["state"][n][k], _joined(v, fulls, k, n)), (n, k)


def test_universal_written_from_tp_equals_ds_to_universal(deepspeed_ckpts, cli, tmp_path):
    """consolidate --to deepspeed-universal of a TP checkpoint: every trainable parameter's
    fp32, exp_avg and exp_avg_sq file holds what DeepSpeed's own converter joined."""
    v = deepspeed_ckpts.tp("tp2-z1-fp32", 4)
    out = tmp_path / "ds" / "global_step3_universal"
    code, so, err = cli("consolidate", str(v.tag_dir), str(out), "--to", "deepspeed-universal")
    assert code == 0, so + err
    for n in v.entry["trainable"]:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            got = torch.load(out / "zero" / n / f"{key}.pt", weights_only=True)["param"]
            assert _same(got, _universal(v, n, key)), (n, key)


# ------------------------------------------------------------------ refused, found


def _model_states(tag: Path) -> list[Path]:
    return sorted(tag.glob("*mp_rank_*_model_states.pt"))


def _edit_map(edit):
    """Rewrite every model-states file's AutoTP info with ``edit(uc_info)``."""
    def make(tag: Path) -> Path:
        for f in _model_states(tag):
            sd = torch.load(f, weights_only=False)
            edit(sd["universal_checkpoint_info"])
            torch.save(sd, f)
        return tag
    return make


def _no_map(uc):
    uc.pop("affine_map")


def _piece(uc, **change):
    for entry in uc["affine_map"]["params"].values():
        if len(entry["ranks"][0]["pieces"][0]["locations"]) == 1:  # a split param
            for r in entry["ranks"].values():
                r["pieces"][0].update(change)
            return


def _two_pieces(uc):
    for entry in uc["affine_map"]["params"].values():
        p = entry["ranks"][0]["pieces"]
        if len(p[0]["locations"]) == 1:
            p.append(dict(p[0]))
            return


def _no_info(uc):
    uc.clear()


def _version(uc):
    uc["affine_map"]["version"] = 2


def _drop_param(uc):
    params = uc["affine_map"]["params"]
    del params[r"^layers\.0\.up_proj\.weight$"]


def _missing_rank(tag: Path) -> Path:
    for f in tag.glob("*mp_rank_01*"):
        f.unlink()
    return tag


REFUSED = {  # name: (make, code, words)
    "patterns-only": (_edit_map(_no_map), "UNSUPPORTED_FORMAT",
                      ["without an AutoTP affine map, described by name patterns only",
                       "Megatron-DeepSpeed"]),
    "no-split-info": (_edit_map(_no_info), "UNSUPPORTED_FORMAT",
                      ["without an AutoTP affine map: the files do not record the split dims"]),
    "scaled": (_edit_map(lambda uc: _piece(uc, scale=0.5)), "UNSUPPORTED_FORMAT",
               ["held scaled by 0.5"]),
    "fused": (_edit_map(_two_pieces), "UNSUPPORTED_FORMAT", ["held as 2 pieces on TP rank 0",
                                                             "fused sub-parameters"]),
    "version": (_edit_map(_version), "UNSUPPORTED_FORMAT", ["AutoTP affine map version 2"]),
    "unnamed-param": (_edit_map(_drop_param), "UNSUPPORTED_FORMAT",
                      ["affine map does not name parameter layers.0.up_proj.weight"]),
    "tp-rank-missing": (_missing_rank, "MALFORMED_METADATA",
                        ["mp_world_size says 2 tensor-parallel ranks", "holds 1"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_map_does_not_make_exact_is_refused_in_one_line(deepspeed_ckpts, cli,
                                                                  tmp_path, case):
    make, json_code, words = REFUSED[case]
    tag = make(copy_ckpt(deepspeed_ckpts.tp("tp2-z2-fp32", 2).tag_dir, tmp_path / "tag"))
    for verb in ("inspect", "consolidate"):
        args = [str(tag)] + ([str(tmp_path / "out"), "--to", "safetensors", "--only", "model"]
                             if verb == "consolidate" else [])
        code, out, err = cli(verb, *args)
        assert (code, out) == (3, ""), (verb, code, err)
        _one_line(err, "ckptctl: error: ", *words)
        assert not (tmp_path / "out").exists()
    code, out, _ = cli("inspect", str(tag), "--json")
    e = json.loads(out)["error"]
    assert (code, e["code"], e["exit_code"]) == (3, json_code, 3), e
