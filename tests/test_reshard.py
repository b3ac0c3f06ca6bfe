"""reshard and consolidate: values equal torch's, round trips are byte-identical, memory
stays in row blocks, bad layouts are refused before writing, S3 both ways."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.formats import open_checkpoint, tensor_bytes
from ckptctl.formats.safetensors_write import write_file
from ckptctl.model import DTYPES
from ckptctl.ops import consolidate, reshard, verify
from fixtures_torch import copy_ckpt

DCP_LAYOUTS = ["fsdp", "tp", "2d", "fsdp_zstd"]


def _flat(path, **kw):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(torch.load(path, weights_only=False, map_location="cpu", **kw))[0]


def _same(a, b) -> list[str]:
    bad = [k for k in a if k not in b]
    for k, v in a.items():
        if k not in b:
            continue
        if isinstance(v, torch.Tensor):
            w = b[k]
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape
                    and torch.equal(v.view(-1).view(torch.uint8) if v.numel() else v,
                                    w.view(-1).view(torch.uint8) if w.numel() else w)):
                bad.append(k)
        elif v != b[k]:
            bad.append(k)
    return bad + [k for k in b if k not in a]


@pytest.fixture(scope="module")
def torch_reference(torch_ckpts, tmp_path_factory):
    """What torch's own dcp_to_torch_save makes of each fixture (the reference)."""
    return {x: torch_ckpts.reference[x] for x in DCP_LAYOUTS}


@pytest.mark.parametrize("layout", DCP_LAYOUTS)
def test_consolidate_torch_equals_dcp_to_torch_save(torch_ckpts, torch_reference, layout,
                                                    tmp_path):
    out = tmp_path / "c"
    r = consolidate(str(torch_ckpts[layout]), str(out), to="torch", max_memory="1MiB")
    assert r.files == ["model.pt"] and r.manifest_id
    assert _same(_flat(torch_reference[layout]), _flat(out / "model.pt", mmap=True)) == []
    assert verify(str(out), level="full").ok


@pytest.mark.parametrize("layout", ["fsdp", "2d"])
def test_consolidate_safetensors_equals_load_file(torch_ckpts, torch_reference, layout, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    r = consolidate(str(torch_ckpts[layout]), str(out), to="safetensors", only="model",
                    max_shard_size="2MB", max_memory="1MiB")
    assert len(r.files) > 2 and "model.safetensors.index.json" in r.files
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    ref = {k: v for k, v in _flat(torch_reference[layout]).items() if k.startswith("model.")}
    assert _same(ref, got) == []
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(ref)
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())


def test_consolidate_dtype_strip_and_only(torch_ckpts, torch_reference, tmp_path, cli):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    code, _, err = cli("consolidate", str(torch_ckpts["tp"]), str(out), "--to", "safetensors",
                       "--only", "model", "--dtype", "bf16", "--strip-prefix", "model.", "--json")
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    ref = _flat(torch_reference["tp"])
    assert set(got) == {k[len("model."):] for k in ref if k.startswith("model.")}
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ref["model." + k].to(torch.bfloat16))
    optim = tmp_path / "optim.pt"
    code, _, err = cli("consolidate", str(torch_ckpts["tp"]), str(optim), "--to", "torch",
                       "--only", "optim")
    assert code == 0, err
    got = _flat(optim, mmap=True)
    assert got and all(k.startswith("optim.") for k in got)
    assert _same({k: v for k, v in ref.items() if k.startswith("optim.")}, got) == []


def test_consolidate_to_dcp(torch_ckpts, torch_reference, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "one"
    consolidate(str(torch_ckpts["2d"]), str(out), to="dcp")
    ck = open_checkpoint(str(out))
    assert all(len(t.chunks) == 1 for t in ck.tensors.values())
    dcp_to_torch_save(str(out), str(tmp_path / "x.pt"))
    assert _same(_flat(torch_reference["2d"]), _flat(tmp_path / "x.pt")) == []


@pytest.mark.parametrize("target", [("tp=2", "llama"), ("dp=2,tp=2", "llama"), ("dp=3", "fsdp")])
def test_reshard_values_equal_torch(torch_ckpts, torch_reference, target, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    mesh, rules = target
    out = tmp_path / "r"
    r = reshard(str(torch_ckpts["fsdp"]), str(out), mesh=mesh, rules=rules, max_memory="1MiB")
    assert r.world_size == len([p for p in out.iterdir() if p.suffix == ".distcp"])
    dcp_to_torch_save(str(out), str(tmp_path / "x.pt"))
    assert _same(_flat(torch_reference["fsdp"]), _flat(tmp_path / "x.pt")) == []
    assert verify(str(out), level="full").ok


def test_reshard_s3_to_s3(torch_ckpts, torch_reference, s3_bucket, tmp_path):
    s3_bucket.upload(torch_ckpts["2d"], "src/step-20")
    opts = s3_bucket.storage_options
    r = reshard(s3_bucket.url("src/step-20"), s3_bucket.url("dst/step-20"), world_size=2,
                storage_options=opts)
    assert r.manifest_id and verify(s3_bucket.url("dst/step-20"), opts, level="full").ok
    c = consolidate(s3_bucket.url("dst/step-20"), str(tmp_path / "local"), to="torch",
                    storage_options=opts, dst_storage_options={})
    assert c.num_tensors == 157
    assert _same(_flat(torch_reference["2d"]), _flat(tmp_path / "local" / "model.pt")) == []


def test_reshard_dry_run_and_refusals(torch_ckpts, tmp_path, cli):
    src = str(torch_ckpts["fsdp"])
    code, out, _ = cli("reshard", src, str(tmp_path / "x"), "--mesh", "dp=2,tp=2", "--rules",
                       "llama", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] and len(doc["ranks"]) == 4
    assert not (tmp_path / "x").exists()
    assert "Shard" in doc["placements"]["model.layers.0.attention.wq.weight"]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nmatch = "model.norm.weight"\nplacements = { tp = "Shard(1)" }\n')
    code, _, err = cli("reshard", src, str(tmp_path / "y"), "--mesh", "tp=2", "--rules", str(bad))
    assert code == 2 and "model.norm.weight" in err and "model.norm.weight" in err
    assert not (tmp_path / "y").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = cli("reshard", src, str(tmp_path / "full"), "--world-size", "2")
    assert code == 2 and "not empty" in err
    code, _, err = cli("reshard", src, str(tmp_path / "z"), "--world-size", "2", "--mesh", "dp=2")
    assert code == 2


def test_reshard_from_broken_source_leaves_nothing_committed(torch_ckpts, tmp_path, cli):
    src = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "src")
    with open(src / "__3_0.distcp", "r+b") as f:
        f.truncate(1000)
    code, _, err = cli("reshard", str(src), str(tmp_path / "out"), "--world-size", "2")
    assert code == 3 and err.count("\n") == 1
    out = tmp_path / "out"
    assert not (out / ".metadata").exists() and not (out / "ckptctl.manifest.json").exists()


def test_row_blocks_bound_memory(torch_ckpts):
    from ckptctl.convert.copier import chunk_blocks
    from ckptctl.convert.planner import consolidation_plan

    ck = open_checkpoint(str(torch_ckpts["tp"]))
    plan = consolidation_plan(ck, only={"model.tok_embeddings.weight"})
    (tc,) = plan.chunks
    blocks = [bytes(b) for b in chunk_blocks(ck, tc, budget=64 << 10)]  # consumed one by one
    assert len(blocks) > 4 and max(len(b) for b in blocks) <= 64 << 10
    assert b"".join(blocks) == tensor_bytes(ck, tc.name)


# ----------------------------------------------------------------------------- properties

DT = ["float32", "bfloat16", "int64", "uint8", "float16", "bool", "float8_e4m3fn"]


def _write_source(path, tensors):
    path.mkdir(parents=True, exist_ok=True)
    entries = [(n, DTYPES[d].safetensors, s, len(b)) for n, (d, s, b) in sorted(tensors.items())]
    with open(path / "model.safetensors", "wb") as f:
        write_file(f, entries, lambda n: [tensors[n][2]], {"format": "pt"})


def _rules_toml(mesh, placements):
    lines = [f'mesh = "{mesh}"']
    for name, pl in placements.items():
        inner = ", ".join(f'{k} = "{v}"' for k, v in pl.items())
        lines += ["[[rule]]", f'match = "{name}"', f"placements = {{ {inner} }}",
                  "allow_empty = true"]
    return "\n".join(lines) + "\n"


@st.composite
def layouts(draw, names_shapes):
    dims = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    names = ["dp", "tp"][: len(dims)]
    mesh = ",".join(f"{n}={d}" for n, d in zip(names, dims))
    placements = {}
    for name, shape in names_shapes:
        pl = {}
        for n in names:
            d = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
            pl[n] = "Replicate()" if d is None else f"Shard({d})"
        placements[name] = pl
    return mesh, placements


@st.composite
def checkpoints(draw):
    n = draw(st.integers(1, 3))
    out = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        dt = draw(st.sampled_from(DT))
        nbytes = int(np.prod(shape)) * DTYPES[dt].itemsize
        data = draw(st.binary(min_size=nbytes, max_size=nbytes))
        out[f"model.t{i}"] = (dt, shape, data)
    return out


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_property_round_trips(tmp_path_factory, data):
    src = checkpoints()
    tensors = data.draw(src)
    shapes = [(n, s) for n, (_, s, _) in tensors.items()]
    mesh_a, pl_a = data.draw(layouts(shapes))
    mesh_b, pl_b = data.draw(layouts(shapes))
    root = tmp_path_factory.mktemp("prop")
    _write_source(root / "src", tensors)
    (root / "a.toml").write_text(_rules_toml(mesh_a, pl_a))
    (root / "b.toml").write_text(_rules_toml(mesh_b, pl_b))
    reshard(str(root / "src"), str(root / "A"), rules=str(root / "a.toml"), max_memory="1MiB")
    reshard(str(root / "A"), str(root / "B"), rules=str(root / "b.toml"), max_memory="1MiB")
    reshard(str(root / "B"), str(root / "A2"), rules=str(root / "a.toml"), max_memory="1MiB")
    # A -> B -> A is byte-identical, file by file (the data files; .metadata holds a save id)
    a = sorted(p.name for p in (root / "A").glob("*.distcp"))
    assert a == sorted(p.name for p in (root / "A2").glob("*.distcp"))
    for name in a:
        assert (root / "A" / name).read_bytes() == (root / "A2" / name).read_bytes(), name
    # consolidate(reshard(x)) == consolidate(x) == the source tensors
    for d in ("src", "A", "B"):
        consolidate(str(root / d), str(root / f"c-{d}"), to="safetensors")
    ref = (root / "c-src" / "model.safetensors").read_bytes()
    assert (root / "c-A" / "model.safetensors").read_bytes() == ref
    assert (root / "c-B" / "model.safetensors").read_bytes() == ref
    ck = open_checkpoint(str(root / "B"))
    for n, (_, _, raw) in tensors.items():
        assert tensor_bytes(ck, n) == raw


def test_typed_storage_table_matches_torch():
    from ckptctl.formats.torchwrite import TYPED_STORAGE

    ours = {k: v for k, v in TYPED_STORAGE.items() if hasattr(torch, k)}
    theirs = {str(d).removeprefix("torch."): v
              for d, v in torch.storage._dtype_to_storage_type_map().items()}
    assert ours == {k: v for k, v in theirs.items() if k in ours}
    assert set(theirs) <= set(TYPED_STORAGE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "complex64", "uint16",
                                   "float8_e4m3fn", "float8_e5m2", "uint64"])
def test_streamed_torch_zip_loads_in_torch(dtype):
    import io

    from ckptctl.formats.torchwrite import TensorRef, TorchZipWriter, pickle_state

    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    t = t.to(getattr(torch, dtype)) if dtype not in ("uint16", "uint64") else t.to(torch.int64).to(
        getattr(torch, dtype))
    buf = io.BytesIO()
    w = TorchZipWriter(buf, pickle_state({"a": [TensorRef("0", dtype, (2, 3, 4)), 7]}))
    w.write_record("0", [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()])
    w.close()
    got = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert got["a"][1] == 7 and got["a"][0].dtype == t.dtype
    assert torch.equal(got["a"][0].view(torch.uint8), t.view(torch.uint8))
    import zipfile

    assert zipfile.ZipFile(io.BytesIO(buf.getvalue())).testzip() is None  # CRCs are right
