"""DeepSpeed ZeRO checkpoints read through every verb (issue 18), checked bit for bit against
DeepSpeed's own views of the same files (tests/fixtures_deepspeed.py: checkpoints written by
DeepSpeed itself, ZeRO-1/2/3 in fp32, bf16 and fp16, at 2 and 3 ranks, with its
``zero_to_fp32`` output, its ``load_checkpoint`` + ``safe_get_full_*`` view and its
``ds_to_universal`` output).

What the reader gives (``ckptctl/formats/deepspeed.py``): ``model.<name>`` (fp32 master
weights, frozen params, buffers, tied names), ``optim.state.<name>.{exp_avg,exp_avg_sq,step}``,
``optim.param_groups.<g>.*``, ``module16.<name>``, ``lr_scheduler.*``, ``step``,
``meta.deepspeed.*`` and ``client_state.*``. Known, by design, and tested
as such: ZeRO-3 saves no module weights (``module16.*`` holds the buffer only, a note says
so); at ZeRO-1 frozen params live in the module only, so ``model.frozen.*`` is the module's
copy and zero_to_fp32 leaves them out (a note says so); buffers keep their stored dtype;
frozen params at ZeRO-2/3 come back in the working dtype, as zero_to_fp32 returns them.


    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_deepspeed.py
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import pytest

from fixtures_torch import copy_ckpt

torch = pytest.importorskip("torch")

W2 = ("z1-fp32", "z2-fp32", "z3-fp32", "z1-bf16", "z2-bf16", "z3-bf16", "z2-fp16",
      "z1-bf16-accfp32")
W3 = ("z2-fp32", "z3-fp32")
ALL = [(n, 2) for n in W2] + [(n, 3) for n in W3]
IDS = [f"{n}-w{w}" for n, w in ALL]
#: how inspect names each variant's precision, and the dtype its module (and frozen params) holds
PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16-accfp32": "bf16, BF16_Optimizer"}
WORKING = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "bf16-accfp32": torch.bfloat16}


# ------------------------------------------------------------------ helpers


def _tensor(ck, name: str) -> "torch.Tensor":
    """Entry ``name`` as a torch tensor, rebuilt from the bytes ckptctl's reader returns."""
    from ckptctl.formats.tensorio import read_tensor

    t = ck.tensors[name]
    dtype = getattr(torch, t.dtype.name)
    raw = bytearray(read_tensor(ck, name).tobytes())
    if not raw:
        return torch.empty(t.shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(t.shape)


def _raw(t: "torch.Tensor") -> bytes:
    t = t.detach().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(got, want) -> bool:
    """Bit for bit: dtype, shape, ``torch.equal`` and the raw bytes (NaN, -0.0)."""
    want = torch.as_tensor(want)
    return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got, want) and _raw(got) == _raw(want))


def _widened(got, want) -> bool:
    """A float entry stored narrower than zero_to_fp32 gives it (which widens to fp32):
    equal once widened, and the widening is exact."""
    if got.dtype == want.dtype:
        return _same(got, want)
    return (got.is_floating_point() and want.dtype == torch.float32
            and torch.finfo(got.dtype).bits < 32 and _same(got.to(torch.float32), want))


def _one_line(err: str, *words) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    for w in words:
        assert w in err, err
    return err.strip()


def _json(cli, *args) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == 0, f"ckptctl {' '.join(map(str, args))}: exit {code}: {out}{err}"
    return json.loads(out)


def _model_names(v) -> list[str]:
    """Every name of the model as DeepSpeed's oracles name it (tied alias and buffer too)."""
    e = v.entry
    return sorted({*e["trainable"], *e["frozen"], *e["tied"], *e["buffers"]})


def _module16_oracle(v, full: dict, name: str):
    """What ``module16.<name>`` must hold: the engine module's weight as loaded (the tied
    alias is its target; a buffer is the buffer)."""
    name = v.entry["tied"].get(name, name)
    return full[f"buffer.{name}"] if name in v.entry["buffers"] else full[f"module16.{name}"]


@pytest.fixture(params=ALL, ids=IDS)
def v(request, deepspeed_ckpts):
    name, world = request.param
    return deepspeed_ckpts.variant(name, world)


# ------------------------------------------------------------------ 1. every variant


def test_entries_equal_deepspeeds_own_view(v):
    """model.*, optim.state.*, module16.*, step, lr_scheduler and the client state of every
    variant equal what DeepSpeed's load_checkpoint and zero_to_fp32 give, bit for bit."""
    from ckptctl.formats import open_checkpoint

    ck = open_checkpoint(str(v.tag_dir))
    full = v.load_full()
    e = v.entry
    assert ck.format == "deepspeed" and ck.step == 3
    for n in e["trainable"]:  # fp32 master weights and Adam's state
        assert _same(_tensor(ck, f"model.{n}"), full[f"param.{n}"]), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert _same(_tensor(ck, f"optim.state.{n}.{key}"), full[f"{key}.{n}"]), (n, key)
    assert {k for k in ck.tensors if k.startswith("optim.state.")} == \
        {f"optim.state.{n}.{k}" for n in e["trainable"] for k in ("exp_avg", "exp_avg_sq", "step")}
    model = sorted(k[len("model."):] for k in ck.tensors if k.startswith("model."))
    assert model == _model_names(v)
    # tied: the alias reads the target's bytes, and inspect knows it is one storage
    assert ck.info["aliases"] == {"model.head.weight": "model.emb.weight"}
    assert _same(_tensor(ck, "model.head.weight"), full["param.emb.weight"])
    # the buffer, in its stored dtype
    assert _same(_tensor(ck, "model.pos_scale"), full["buffer.pos_scale"])
    # frozen params: ZeRO-1 keeps them in the module only (model.* is that copy); ZeRO-2/3
    # partition them in the working dtype
    for n in e["frozen"]:
        got = _tensor(ck, f"model.{n}")
        assert got.dtype == WORKING[v.dtype], n
        assert _same(got, full[f"module16.{n}"]), n
    if v.zero_to_fp32 is not None:  # every tensor zero_to_fp32 gives, under model.
        z = v.load_zero_to_fp32()
        for n, want in z.items():
            assert _widened(_tensor(ck, f"model.{n}"), want), n
        missing = set(_model_names(v)) - set(z)
        assert missing == (set(e["frozen"]) if v.stage == 1 else set())
    # module16: the module's weights as saved; ZeRO-3 saves placeholders, the buffer only
    m16 = sorted(k[len("module16."):] for k in ck.tensors if k.startswith("module16."))
    assert m16 == (["pos_scale"] if v.stage == 3 else _model_names(v))
    for n in m16:
        assert _same(_tensor(ck, f"module16.{n}"), _module16_oracle(v, full, n)), n
    # plain entries
    objs = {k: o.value for k, o in ck.objects.items()}
    assert objs["step"] == full["global_steps"] == 3
    assert {k: objs[f"client_state.{k}"] for k in ("epoch", "note")} == \
        {"epoch": 1, "note": "x"} == {k: full["client_state"][k] for k in ("epoch", "note")}
    assert {k[len("lr_scheduler."):]: x for k, x in objs.items()
            if k.startswith("lr_scheduler.")} == full["lr_scheduler"]
    assert objs["optim.param_groups.0.weight_decay"] == 0.1
    assert objs["optim.param_groups.1.weight_decay"] == 0.0
    assert objs["meta.deepspeed.ds_version"] == \
        json.loads((v.root / "manifest.json").read_text())["deepspeed"]
    assert objs["meta.deepspeed.dp_world_size"] == v.world


def test_inspect_names_stage_ranks_and_dtype(v, cli):
    r = _json(cli, "inspect", str(v.tag_dir))
    origin = f"ZeRO-{v.stage}, {v.world} ranks, {PRECISION[v.dtype]}"
    assert (r["format"], r["origin"], r["step"], r["step_source"]) == \
        ("deepspeed", origin, 3, "entry")
    assert {p: r["closure"][p] for p in ("model", "optim", "step", "lr_scheduler")} == \
        dict.fromkeys(("model", "optim", "step", "lr_scheduler"), True)
    assert r["closure"]["module16"] is True
    notes = " | ".join(r["notes"])
    assert ("ZeRO-3 saves no module weights" in notes) == (v.stage == 3)
    assert ("frozen.weight, frozen.bias: in no partition" in notes
            and "zero_to_fp32 leaves out" in notes) == (v.stage == 1)
    code, out, err = cli("inspect", str(v.tag_dir))
    assert code == 0, err
    assert f"deepspeed ({origin}), step 3 (from entry), not sealed" in out, out
    assert ("note     " in out) == (v.stage in (1, 3)), out


def test_inspect_counts_the_recorded_buffers_apart(deepspeed_ckpts, cli):
    v = deepspeed_ckpts.variant("z2-fp32")
    r = _json(cli, "inspect", str(v.tag_dir))
    assert (r["num_params"], r["num_buffers"]) == (1303, 13)


def test_client_state_step_does_not_make_the_tag_unreadable(deepspeed_ckpts, cli, tmp_path):
    tag = copy_ckpt(deepspeed_ckpts.variant("z2-fp32").tag_dir, tmp_path / "run")
    f = tag / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=True)
    sd["step"] = 3  # engine.save_checkpoint(dir, client_state={"step": 3, ...})
    torch.save(sd, f)
    r = _json(cli, "inspect", str(tag))
    assert r["step"] == 3


# ------------------------------------------------------------------ 2. consolidate

CONSOLIDATED = [("z2-fp32", 2), ("z3-bf16", 2), ("z2-fp16", 2), ("z3-fp32", 3)]


def _consolidate_model(cli, v, out, *extra):
    return cli("consolidate", str(v.tag_dir), str(out), "--only", "model", "--to",
               "safetensors", "--strip-prefix", "model.", *extra)


def _assert_equals_zero_to_fp32(v, out: Path) -> None:
    from safetensors.torch import load_file

    assert sorted(p.name for p in out.iterdir()) == ["ckptctl.manifest.json", "model.safetensors"]
    got, want = load_file(str(out / "model.safetensors")), v.load_zero_to_fp32()
    assert sorted(got) == sorted(want)
    bad = [n for n in want if not _same(got[n], want[n])]  # same dtypes too: no --dtype needed
    assert bad == []


@pytest.mark.parametrize("name,world", CONSOLIDATED, ids=[f"{n}-w{w}" for n, w in CONSOLIDATED])
def test_consolidate_model_equals_zero_to_fp32(deepspeed_ckpts, cli, tmp_path, name, world):
    """The model part, prefix stripped, as safetensors: zero_to_fp32's output bit for bit
    (same names, dtypes and bytes: fp32 masters, buffers and working-dtype frozen params as
    stored, tied pair both present)."""
    v = deepspeed_ckpts.variant(name, world)
    out = tmp_path / "hf"
    code, so, err = _consolidate_model(cli, v, out)
    assert code == 0, so + err
    _assert_equals_zero_to_fp32(v, out)
    code, so, err = cli("verify", str(out), "--level", "full")
    assert code == 0, so + err


def test_consolidate_only_model_needs_no_drop(deepspeed_ckpts, cli, tmp_path):
    v = deepspeed_ckpts.variant("z2-fp32")
    out = tmp_path / "hf"
    code, so, err = _consolidate_model(cli, v, out)
    assert code == 0, so + err
    _assert_equals_zero_to_fp32(v, out)


# ------------------------------------------------------------------ 3. reshard -> dcp.load

RESHARDED = [("z2-fp32", 2, 3), ("z3-bf16", 2, 3), ("z1-bf16-accfp32", 2, 3), ("z3-fp32", 3, 2),
             ("z2-fp32", 3, 2)]


def _dcp_load(path: Path, v, full: dict) -> dict:
    """torch's own ``dcp.load`` (one process, no process group) into NaN-filled placeholders
    shaped as DeepSpeed's oracle says; returns the loaded state."""
    import torch.distributed.checkpoint as dcp

    def nan(like):
        return torch.full_like(torch.as_tensor(like), float("nan"))

    model = {}
    for n in _model_names(v):
        if n in v.entry["trainable"] or n in v.entry["tied"]:
            model[n] = nan(full[f"param.{v.entry['tied'].get(n, n)}"])
        elif n in v.entry["buffers"]:
            model[n] = nan(full[f"buffer.{n}"])
        else:
            model[n] = nan(full[f"module16.{n}"])
    state = {n: {k: nan(full[f"{k}.{n}"]) for k in ("exp_avg", "exp_avg_sq", "step")}
             for n in v.entry["trainable"]}
    sd = {"model": model, "optim": {"state": state}, "step": -1,
          "client_state": {"epoch": -1, "note": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _dcp_tensor_types(path: Path) -> dict:
    """(dtype, shape) of every tensor DCP's .metadata records (dcp.load casts silently into
    the placeholder's dtype, so the stored dtype is checked here)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (m.properties.dtype, tuple(m.size)) for k, m in md.items()
            if isinstance(m, TensorStorageMetadata)}


@pytest.mark.parametrize("name,world,to", RESHARDED,
                         ids=[f"{n}-w{w}-to{t}" for n, w, t in RESHARDED])
def test_reshard_loads_in_torch_with_the_oracles_values(deepspeed_ckpts, cli, tmp_path,
                                                        name, world, to):
    v = deepspeed_ckpts.variant(name, world)
    out = tmp_path / "dcp"
    code, so, err = cli("reshard", str(v.tag_dir), str(out), "--world-size", str(to))
    assert code == 0, so + err
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(to)]
    full = v.load_full()
    sd = _dcp_load(out, v, full)
    stored = _dcp_tensor_types(out)
    want = {f"model.{n}": t for n, t in sd["model"].items()}
    want.update({f"optim.state.{n}.{k}": t for n, s in sd["optim"]["state"].items()
                 for k, t in s.items()})
    assert {k: x for k, x in stored.items() if not k.startswith("module16.")} == \
        {k: (t.dtype, tuple(t.shape)) for k, t in want.items()}
    for n in v.entry["trainable"]:
        assert _same(sd["model"][n], full[f"param.{n}"]), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert _same(sd["optim"]["state"][n][k], full[f"{k}.{n}"]), (n, k)
    assert _same(sd["model"]["head.weight"], full["param.emb.weight"])
    assert _same(sd["model"]["pos_scale"], full["buffer.pos_scale"])
    for n in v.entry["frozen"]:
        assert _same(sd["model"][n], full[f"module16.{n}"]), n
    if v.zero_to_fp32 is not None:
        assert all(_widened(sd["model"][n], t) for n, t in v.load_zero_to_fp32().items())
    assert (sd["step"], sd["client_state"]) == (3, {"epoch": 1, "note": "x"})
    code, so, err = cli("verify", str(out), "--level", "full")
    assert code == 0, so + err


# ------------------------------------------------------------------ 4. diff


def _diff_model(cli, v):
    """diff TAG zero_to_fp32.safetensors over the model: A's ``model.`` prefix mapped away,
    and --only naming the model's own names (B's names have no prefix, --map renames A only
    and --only matches after it, so ``--only 'model.*'`` alone would select none of B)."""
    only = [x for n in _model_names(v) for x in ("--only", n)]
    return cli("diff", str(v.tag_dir), str(v.zero_to_fp32), "--map", "model.=", *only, "--json")


@pytest.mark.parametrize("name,world", [("z2-fp32", 2), ("z3-fp32", 2), ("z3-bf16", 2),
                                        ("z3-fp32", 3)])
def test_diff_against_zero_to_fp32_is_identical(deepspeed_ckpts, cli, name, world):
    v = deepspeed_ckpts.variant(name, world)
    code, out, err = _diff_model(cli, v)
    assert code == 0, out + err
    r = json.loads(out)
    assert r["equal"] and r["counts"] == {"identical": len(_model_names(v))}
    assert {e["name_a"] for e in r["entries"]} == {f"model.{n}" for n in _model_names(v)}


@pytest.mark.parametrize("name", ["z1-fp32", "z1-bf16"])
def test_diff_at_zero1_names_the_frozen_params_only_in_a(deepspeed_ckpts, cli, name):
    v = deepspeed_ckpts.variant(name)
    code, out, err = _diff_model(cli, v)
    assert code == 1, out + err
    r = json.loads(out)
    rows = {e["name"]: e["status"] for e in r["entries"]}
    assert {n for n, s in rows.items() if s != "identical"} == set(v.entry["frozen"])
    assert {rows[n] for n in v.entry["frozen"]} == {"only_in_a"}
    assert r["counts"] == {"identical": len(_model_names(v)) - 2, "only_in_a": 2}
    code, out, err = cli("diff", str(v.tag_dir), str(v.zero_to_fp32), "--map", "model.=",
                         "--only", "frozen.*")
    assert code == 1 and "frozen.weight" in out and "only_in_a" in out, out + err


# ------------------------------------------------------------------ 5. save folders


@pytest.fixture
def run(deepspeed_ckpts, tmp_path) -> Path:
    """A writable copy of z2-fp32's save folder: global_step2, global_step3, latest."""
    return copy_ckpt(deepspeed_ckpts.variant("z2-fp32").save_dir, tmp_path / "run")


def test_save_folder_opens_the_tag_latest_names(deepspeed_ckpts, cli):
    v = deepspeed_ckpts.variant("z2-fp32")
    assert (v.save_dir / "latest").read_text() == "global_step3"
    code, out, err = cli("inspect", str(v.save_dir))
    assert code == 0, err
    assert out.splitlines()[0] == str(v.save_dir / "global_step3")
    assert "deepspeed (ZeRO-2, 2 ranks, fp32), step 3 (from entry)" in out
    r = _json(cli, "inspect", str(v.save_dir))
    assert r["url"] == str(v.save_dir / "global_step3") and r["step"] == 3
    assert r == _json(cli, "inspect", str(v.tag_dir))


def test_ls_latest_and_verify_of_a_save_folder(deepspeed_ckpts, cli):
    v = deepspeed_ckpts.variant("z2-fp32")
    rows = _json(cli, "ls", str(v.save_dir))["checkpoints"]
    assert [(r["name"], r["step"], r["format"], r["state"], r["num_files"]) for r in rows] == \
        [("global_step2", 2, "deepspeed", "complete", 3), ("global_step3", 3, "deepspeed",
                                                           "complete", 3)]
    code, out, err = cli("latest", str(v.save_dir))
    assert (code, err) == (0, "") and out.strip().endswith("/global_step3"), out
    assert Path(out.strip()).resolve() == v.tag_dir.resolve()
    r = _json(cli, "verify", str(v.tag_dir), "--level", "full")
    assert r["ok"] and r["problems"] == [] and r["num_files"] == 3 and r["num_files_read"] == 3
    assert r["num_tensors_checked"] == 33


def _diff(cli, a: str, b: str) -> dict:
    code, out, err = cli("diff", a, b, "--json")
    assert code in (0, 1), out + err
    return json.loads(out)


def test_seal_pack_and_promote(deepspeed_ckpts, run, cli, tmp_path):
    tag = run / "global_step3"
    pristine = deepspeed_ckpts.variant("z2-fp32").tag_dir  # the read-only, unsealed fixture
    code, out, err = cli("seal", str(tag))
    assert code == 0, out + err
    r = _json(cli, "verify", str(tag), "--level", "full")
    assert (r["ok"], r["sealed"], r["content"], r["step"], r["num_files"]) == \
        (True, True, "hashes", 3, 3), r
    assert _json(cli, "inspect", str(tag))["step_source"] == "manifest"
    pk = tmp_path / "packs" / "global_step3"
    code, out, err = cli("pack", str(tag), str(pk))
    assert code == 0, out + err
    r = _json(cli, "inspect", str(pk))
    assert r["format"] == "deepspeed" and r["origin"] == "ZeRO-2, 2 ranks, fp32" and r["pack"]
    for ref in (tag, pristine):  # the second has no manifest: every byte read and compared
        r = _diff(cli, str(pk), str(ref))
        assert r["equal"] and r["counts"] == {"identical": 87}, r["counts"]
    assert r["bytes_compared"] == r["bytes"] > 0 and r["bytes_fast_pathed"] == 0, r
    code, out, err = cli("verify", str(pk), "--level", "full")
    assert code == 0, out + err
    other = tmp_path / "other" / "global_step3"
    code, out, err = cli("promote", str(tag), str(other))
    assert code == 0, out + err
    r = _json(cli, "verify", str(other), "--level", "full")
    assert r["ok"] and r["sealed"] and r["problems"] == []
    assert _diff(cli, str(other), str(pristine))["equal"]


def test_gc_keeps_the_latest_tag_and_deepspeeds_files(run, cli):
    r = _json(cli, "gc", str(run), "--keep-last", "1")
    assert r["remove"] == ["global_step2"] and list(r["keep"]) == ["global_step3"]
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == ["global_step3/mp_rank_00_model_states.pt",
                    "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                    "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert (run / "latest").read_text() == "global_step3"
    code, out, err = cli("inspect", str(run))
    assert code == 0 and out.splitlines()[0] == str(run / "global_step3"), out + err


def test_gc_never_removes_the_tag_latest_names(run, cli):
    """A rolled-back run (`latest` names global_step2): gc --keep-last 1 keeps global_step2
    too, the tag DeepSpeed's load_checkpoint(save_dir) resumes, so `latest` never dangles."""
    (run / "latest").write_text("global_step2")
    r = _json(cli, "gc", str(run), "--keep-last", "1")
    assert r["remove"] == [] and set(r["keep"]) == {"global_step2", "global_step3"}, r
    assert any("latest" in why for why in r["keep"]["global_step2"]), r["keep"]
    assert (run / "global_step2" / "mp_rank_00_model_states.pt").is_file()
    code, out, err = cli("inspect", str(run))
    assert code == 0 and out.splitlines()[0] == str(run / "global_step2"), out + err


@pytest.mark.parametrize("verb", ["pack", "seal", "verify", "promote"])
def test_verbs_that_write_or_copy_a_whole_folder_name_the_tag(run, cli, tmp_path, verb):
    """A save folder holds several checkpoints: seal, verify, pack and promote given one
    refuse (exit 2) naming the tag its latest names; nothing is written anywhere."""
    args = {"pack": (str(run), str(tmp_path / "pk")), "seal": (str(run),),
            "verify": (str(run), "--level", "full"),
            "promote": (str(run), str(tmp_path / "warm" / "x"))}[verb]
    before = sorted(p.name for p in run.iterdir())
    code, out, err = cli(verb, *args)
    assert code == 2 and err.count("\n") == 1, (verb, out, err)
    assert f"`ckptctl {verb} {run}/global_step3`" in err, err
    assert sorted(p.name for p in run.iterdir()) == before
    assert not (tmp_path / "pk").exists() and not (tmp_path / "warm").exists()


def _flip_tensor_byte(tag: Path) -> None:
    """Flip one bit of model.fc1.weight's fp32 bytes inside a rank file (the zip record's
    CRC-32 then no longer matches; torch.load does not notice)."""
    from ckptctl.formats import open_checkpoint

    ext = open_checkpoint(str(tag)).tensors["model.fc1.weight"].chunks[0].extent
    f = tag / ext.file
    b = bytearray(f.read_bytes())
    b[ext.offset + 5] ^= 0x40
    f.write_bytes(bytes(b))


def test_verify_full_of_an_unsealed_tag_checks_the_zip_crcs(run, cli):
    tag = run / "global_step3"
    _flip_tensor_byte(tag)
    code, out, err = cli("verify", str(tag), "--level", "full", "--json")
    r = json.loads(out)
    assert code == 1 and "CRC_MISMATCH" in {p["code"] for p in r["problems"]}, out + err


def test_save_folder_without_latest_says_name_a_tag(run, cli):
    (run / "latest").unlink()
    code, out, err = cli("inspect", str(run))
    assert code in (2, 3) and "not a format ckptctl reads" not in err, err
    assert "global_step2" in err and "global_step3" in err, err


# ------------------------------------------------------------------ 6. universal checkpoints

UNIVERSAL = [(n, w) for n in ("z2-fp32", "z3-fp32") for w in (2, 3)]


@pytest.mark.parametrize("name,world", UNIVERSAL, ids=[f"{n}-w{w}" for n, w in UNIVERSAL])
def test_universal_checkpoint_equals_the_oracle(deepspeed_ckpts, cli, name, world):
    """ds_to_universal's output (ZeRO-3's bare flat tensors take param_shapes' shapes)."""
    from ckptctl.formats import open_checkpoint

    v = deepspeed_ckpts.variant(name, world)
    ck = open_checkpoint(str(v.universal_tag))
    full = v.load_full()
    assert ck.format == "deepspeed-universal" and ck.step == 3
    for n in v.entry["trainable"]:
        assert _same(_tensor(ck, f"model.{n}"), full[f"param.{n}"]), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert _same(_tensor(ck, f"optim.state.{n}.{k}"), full[f"{k}.{n}"]), (n, k)
    if v.stage == 2:  # --inject_missing_state: frozen, tied and buffer get their own fp32.pt
        z = v.load_zero_to_fp32()
        assert sorted(k[len("model."):] for k in ck.tensors if k.startswith("model.")) == sorted(z)
        assert all(_same(_tensor(ck, f"model.{n}"), t) for n, t in z.items())
    objs = {k: o.value for k, o in ck.objects.items()}
    assert (objs["step"], objs["client_state.epoch"], objs["client_state.note"]) == (3, 1, "x")
    assert objs["optim.param_groups.1.weight_decay"] == 0.0
    r = _json(cli, "inspect", str(v.universal_tag))
    assert r["origin"] == "universal checkpoint"
    assert all(r["closure"][p] for p in ("model", "optim", "step"))


def test_zero3_universal_keeps_frozen_tied_and_buffer(deepspeed_ckpts):
    from ckptctl.formats import open_checkpoint

    v = deepspeed_ckpts.variant("z3-fp32")
    ck = open_checkpoint(str(v.universal_tag))
    model = {k[len("model."):] for k in ck.tensors if k.startswith("model.")}
    left_out = set(_model_names(v)) - model
    assert not left_out or all(n in " ".join(ck.info.get("notes", [])) for n in left_out), left_out


def test_universal_root_opens_the_tag_latest_universal_names(deepspeed_ckpts, cli):
    v = deepspeed_ckpts.variant("z2-fp32")
    code, out, err = cli("inspect", str(v.universal))
    assert code == 0, err
    assert out.splitlines()[0] == str(v.universal_tag)


# ------------------------------------------------------------------ 7. broken and hostile


class _System:
    """Pickles as ``os.system(cmd)`` (torch.save writes the global ``posix.system``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _truncated(tag: Path) -> Path:
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    b = f.read_bytes()
    f.write_bytes(b[:len(b) // 2])
    return tag


def _rank_missing(tag: Path) -> Path:
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    return tag


def _latest(text: str):
    def make(tag: Path) -> Path:
        (tag.parent / "latest").write_text(text)
        return tag.parent
    return make


def _os_system(tag: Path) -> Path:
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "x": _System(tag.parent / "PWNED")}}, f)
    return tag


def _absurd_pickle(tag: Path) -> Path:
    """data.pkl's sizes in the zip's central directory set to ~2 GiB."""
    f = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    b = bytearray(f.read_bytes())
    i, patched = 0, 0
    while (i := b.find(b"PK\x01\x02", i)) >= 0:
        n = struct.unpack_from("<H", b, i + 28)[0]
        if bytes(b[i + 46:i + 46 + n]).endswith(b"/data.pkl"):
            struct.pack_into("<II", b, i + 20, 0x7FFFFFF0, 0x7FFFFFF0)  # csize, usize
            patched += 1
        i += 4
    assert patched == 1
    f.write_bytes(bytes(b))
    return tag


def _single(rel: str):
    def make(tag: Path) -> Path:
        return tag / rel
    return make


def _beside(name: str):
    def make(tag: Path) -> Path:
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / name)
        return tag
    return make


def _autoep(tag: Path) -> Path:
    f = tag / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=True)
    sd["ds_autoep_layers"] = [{"expert_key_prefix": "moe.experts", "num_experts": 4}]
    torch.save(sd, f)
    return tag


def _moe_groups(tag: Path) -> Path:
    """Expert param groups partitioned over fewer ranks (partition_count [2, 1])."""
    for f in tag.glob("*optim_states.pt"):
        sd = torch.load(f, weights_only=False)
        sd["optimizer_state_dict"]["partition_count"] = [2, 1]
        torch.save(sd, f)
    return tag


def _stage0(tag: Path) -> Path:
    for f in tag.glob("*optim_states.pt"):
        f.unlink()
    return tag


HOSTILE = {  # name: (make, code in --json, words of the one line[, variant])
    "truncated": (_truncated, "MALFORMED_METADATA",
                  ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "not a torch.save zip"]),
    "rank-missing": (_rank_missing, "MALFORMED_METADATA",
                     ["partition_count says 2 ranks", "1 optimizer files", "missing"]),
    "latest-escapes": (_latest("../x"), "MALFORMED_METADATA",
                       ["latest", "names '../x', not a tag folder"]),
    "latest-missing-tag": (_latest("global_step9"), "MALFORMED_METADATA",
                           ["latest", "names tag global_step9, which this folder does not hold"]),
    "os-system": (_os_system, "UNSAFE_INPUT",
                  ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "posix.system", "not allowed"]),
    "absurd-pickle": (_absurd_pickle, "MALFORMED_METADATA",
                      ["data.pkl is 2147483632 bytes", "past the 256 MiB"]),
    "one-rank-file": (_single("zero_pp_rank_0_mp_rank_00_optim_states.pt"), "UNSUPPORTED_FORMAT",
                      ["DeepSpeed ZeRO-1/2", "one file of a DeepSpeed checkpoint",
                       "open the folder"]),
    "one-rank-file-bf16": (_single("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                           "UNSUPPORTED_FORMAT", ["one file of a DeepSpeed checkpoint",
                                                  "open the folder"], "z1-bf16"),
    "one-rank-file-zero3": (_single("zero_pp_rank_1_mp_rank_00_model_states.pt"),
                            "UNSUPPORTED_FORMAT", ["DeepSpeed ZeRO-3", "open the folder"],
                            "z3-fp32"),
    "tensor-parallel-stray": (_beside("mp_rank_01_model_states.pt"), "MALFORMED_METADATA",
                              ["mp_world_size says 1 tensor-parallel ranks", "holds 2"]),
    "pipeline": (_beside("layer_01-model_00-model_states.pt"), "UNSUPPORTED_FORMAT",
                 ["DeepSpeed pipeline"]),
    "moe": (_beside("layer_0_expert_0_mp_rank_00_model_states.pt"), "UNSUPPORTED_FORMAT",
            ["DeepSpeed MoE"]),
    "stage0": (_stage0, "UNSUPPORTED_FORMAT", ["DeepSpeed (model states)"]),
    "autoep": (_autoep, "UNSUPPORTED_FORMAT", ["DeepSpeed AutoEP"]),
    "moe-groups": (_moe_groups, "UNSUPPORTED_FORMAT", ["DeepSpeed MoE", "[1, 2] ways"]),
}


def test_universal_with_tensor_parallel_metadata_is_refused(deepspeed_ckpts, cli, tmp_path):
    """A universal checkpoint whose fp32.pt carries TP re-slicing metadata (vocab padding,
    sub-params) is refused by name, never read as if it were the whole tensor."""
    uni = copy_ckpt(deepspeed_ckpts.variant("z2-fp32").universal_tag, tmp_path / "uni")
    f = uni / "zero" / "emb.weight" / "fp32.pt"
    d = torch.load(f, weights_only=False)
    d["vocab_tensor"] = True
    torch.save(d, f)
    code, out, err = cli("inspect", str(uni))
    assert (code, out) == (3, "") and err.count("\n") == 1, err
    assert "tensor-parallel slicing metadata (vocab_tensor)" in err, err


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_broken_and_hostile_input_is_one_line(deepspeed_ckpts, cli, tmp_path, case):
    make, json_code, words, *variant = HOSTILE[case]
    save = copy_ckpt(deepspeed_ckpts.variant(*variant or ["z2-fp32"]).save_dir, tmp_path / "run")
    url = make(save / "global_step3")
    marker = save / "PWNED"
    if case == "os-system":  # the payload is live: a full unpickler runs it
        torch.load(url / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
        assert marker.exists()
        marker.unlink()
    out = tmp_path / "out"
    for args in (("inspect", str(url)), ("consolidate", str(url), str(out)),
                 ("reshard", str(url), str(out), "--world-size", "2"),
                 ("diff", str(url), str(url))):
        code, so, err = cli(*args)
        assert (code, so) == (3, ""), (args, code, so, err)
        _one_line(err, "ckptctl: error: ", *words)
        assert not out.exists(), args
    code, so, err = cli("inspect", str(url), "--json")
    e = json.loads(so)["error"]
    assert (code, e["code"], e["exit_code"]) == (3, json_code, 3), e
    code, so, err = cli("verify", str(url))
    assert code in (1, 3) and "Traceback" not in err, (code, so, err)
    assert not marker.exists()
    assert not list(save.rglob("ckptctl.*"))  # nothing sealed or written into the source


# ------------------------------------------------------------------ 8. S3


def _opts(bucket) -> list[str]:
    o = bucket.storage_options
    return [f"--storage-option=endpoint_url={o['endpoint_url']}",
            f"--storage-option=key={o['key']}", f"--storage-option=secret={o['secret']}"]


def test_s3_inspect_and_consolidate_equal_local(deepspeed_ckpts, s3_bucket, cli, tmp_path):
    v = deepspeed_ckpts.variant("z3-bf16")
    s3_bucket.upload(v.save_dir, "run/z3-bf16")
    url = s3_bucket.url("run/z3-bf16")
    remote = _json(cli, "inspect", url, *_opts(s3_bucket))
    local = _json(cli, "inspect", str(v.save_dir))
    assert remote["url"] == f"{url}/global_step3"
    for r in (remote, local):
        r.pop("url")
    assert remote == local
    assert remote["origin"] == "ZeRO-3, 2 ranks, bf16"
    out_s3, out_local = tmp_path / "from-s3", tmp_path / "from-local"
    for src, out, extra in ((url, out_s3, _opts(s3_bucket)), (str(v.save_dir), out_local, [])):
        code, so, err = cli("consolidate", src, str(out), "--only", "model", "--to",
                            "safetensors", "--strip-prefix", "model.", *extra)
        assert code == 0, so + err
    assert (out_s3 / "model.safetensors").read_bytes() == \
        (out_local / "model.safetensors").read_bytes()
    _assert_equals_zero_to_fp32(v, out_s3)


@pytest.mark.parametrize("name,world", [("z1-fp32", 2), ("z2-fp32", 3), ("z3-bf16", 2),
                                        ("z3-fp32", 3)])
def test_each_ranks_view_covers_every_parameter_once(deepspeed_ckpts, cli, name, world):
    """inspect --json ``ranks``: per rank its optimizer file and, per group, where each
    trainable parameter's piece sits; the pieces of a parameter add up to its numel and
    stay inside the partition."""
    v = deepspeed_ckpts.variant(name, world)
    r = _json(cli, "inspect", str(v.tag_dir))
    assert [x["rank"] for x in r["ranks"]] == list(range(world))
    got: dict[str, int] = {}
    for view in r["ranks"]:
        assert view["file"].endswith("_optim_states.pt") and f"rank_{view['rank']}_" in view["file"]
        for g in view["groups"]:
            for p, (start, count) in g["params"].items():
                assert 0 <= start and start + count <= g["elements"], (p, start, count)
                got[p] = got.get(p, 0) + count
    assert got == {p: v.entry["numel"][p] for p in v.entry["trainable"]}
