"""``ckptctl pack`` / ``unpack`` and packs read as checkpoints (issue 10, helper P).

Real checkpoints written by torch (DCP), transformers (sharded safetensors) and
``torch.save``; every round trip is proven byte for byte against the source files, and
every reader (inspect, verify, ls, consolidate, reshard) gives the same answer on a pack
as on its source."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.formats.manifest import MANIFEST, Manifest
from ckptctl.formats.pack import PACK_INDEX
from ckptctl.packs.pack import pack
from ckptctl.packs.unpack import unpack

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- writers


def _state(changed=(), *, seed=0) -> dict:
    """A small model + optimizer state; tensors named in ``changed`` slightly perturbed
    (what one training step does to the layers it trains)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model = {"emb.weight": torch.randn(1100, 1024, generator=g),  # 4.4 MB: two chunks
             "l0.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
             "l1.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
             "l2.w": torch.randn(64, 64, generator=g).to(torch.float16),
             "norm.weight": torch.ones(1024),
             "pos": torch.arange(1000, dtype=torch.int64)}
    optim = {f"{k}.exp_avg": torch.randn(v.shape, generator=g) * 1e-3
             for k, v in model.items() if v.is_floating_point() and k != "emb.weight"}
    g2 = torch.Generator().manual_seed(1000 + seed)
    for k in changed:
        d = model if k in model else optim
        v = d[k]
        d[k] = (v.float() + 1e-3 * torch.randn(v.shape, generator=g2)).to(v.dtype)
    return {"model": model, "optim": optim, "step": 100 + len(changed)}


def write_dcp(path: Path, changed=()) -> Path:
    from conftest import dcp_save

    dcp_save(path, _state(changed))
    return path


#: the tensors a "training step" changes: half the model, all moments
CHANGED = ("emb.weight", "l1.w", "l0.w.exp_avg", "l1.w.exp_avg")


def write_hf(path: Path, changed_layer: int | None = None) -> Path:
    """A sharded HF folder written by transformers (safetensors + index)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500,
                                   n_positions=64))
    if changed_layer is not None:
        with torch.no_grad():
            for p in m.transformer.h[changed_layer].parameters():
                p.add_(1e-3 * torch.randn_like(p))
    m.save_pretrained(path, max_shard_size="100KB", safe_serialization=True)
    return path


def write_torch(path: Path, changed=()) -> Path:
    import torch

    path.mkdir(parents=True)
    sd = _state(changed)
    flat = {f"model.{k}": v for k, v in sd["model"].items()}
    flat["model.lm_head.weight"] = flat["model.emb.weight"]  # tied: one storage
    flat["model.t"] = sd["model"]["l2.w"].t()  # a strided view
    torch.save({"state_dict": flat, "optim": sd["optim"], "global_step": 7}, path / "model.pt")
    return path


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def assert_same_tree(a: Path, b: Path) -> None:
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k] == fb[k], k


def index_of(p: Path) -> dict:
    return json.loads((p / PACK_INDEX).read_bytes())


# --------------------------------------------------------------------------- round trips


def test_round_trip_tiny_dcp(tiny_dcp, tmp_path):
    r = pack(str(tiny_dcp), str(tmp_path / "p"), workers=2)
    assert r.sealed_source and r.base is None and r.depth == 0
    assert sorted(x.name for x in (tmp_path / "p").iterdir()) == \
        [MANIFEST, PACK_INDEX, "data-00000.bin"]
    u = unpack(str(tmp_path / "p"), str(tmp_path / "out"), workers=2)
    assert_same_tree(tiny_dcp, tmp_path / "out")
    assert u.manifest_id == r.source_id == Manifest.parse(
        (tiny_dcp / MANIFEST).read_bytes(), "m").id
    pman = Manifest.parse((tmp_path / "p" / MANIFEST).read_bytes(), "m")
    assert pman.format == "pack" and pman.extra["packs"] == r.source_id and pman.base is None
    assert pman.step == 42


def test_round_trip_dcp_several_chunks(tmp_path):
    src = write_dcp(tmp_path / "step-1")
    r = pack(str(src), str(tmp_path / "p"), workers=2)
    idx = index_of(tmp_path / "p")
    segs = idx["files"]["__0_0.distcp"]["segments"]
    tensors = [s for s in segs if s["kind"] == "tensor"]
    assert len(tensors) == 10 and max(len(s["chunks"]) for s in tensors) == 2
    assert {s["itemsize"] for s in tensors} == {2, 4, 8}
    assert r.chunks["planes"] >= 10 and r.ratio > 1.1, r
    unpack(str(tmp_path / "p"), str(tmp_path / "out"))
    assert_same_tree(src, tmp_path / "out")


def test_round_trip_hf_sharded_safetensors(tmp_path):
    src = write_hf(tmp_path / "hf")
    shards = [p.name for p in src.glob("*.safetensors")]
    assert len(shards) > 2 and (src / "model.safetensors.index.json").exists()
    (src / "extra").mkdir()
    (src / "extra" / "empty.txt").write_bytes(b"")  # empty files and sub-folders come along
    (src / "extra" / "notes.md").write_text("fine-tuned\n")
    r = pack(str(src), str(tmp_path / "p"), workers=2)
    idx = index_of(tmp_path / "p")
    assert idx["files"]["extra/empty.txt"] == {"size": 0, "segments": []}
    from ckptctl.packs.segments import MIN_TENSOR_BYTES

    for s in shards:  # the JSON header raw, then the tensors (tiny ones stay raw)
        segs = idx["files"][s]["segments"]
        assert segs[0]["kind"] == "raw" and segs[0]["offset"] == 0
        assert all(x["length"] >= MIN_TENSOR_BYTES for x in segs if x["kind"] == "tensor")
        assert any(x["kind"] == "tensor" for x in segs), segs
    assert r.num_files == len(files_of(src))
    unpack(str(tmp_path / "p"), str(tmp_path / "out"))
    assert_same_tree(src, tmp_path / "out")


def test_round_trip_torch_save(tmp_path):
    src = write_torch(tmp_path / "t")
    r = pack(str(src), str(tmp_path / "p"), workers=2)
    segs = index_of(tmp_path / "p")["files"]["model.pt"]["segments"]
    tensors = [s for s in segs if s["kind"] == "tensor"]
    # one segment per storage record (the tied weight is one storage), dtypes from data.pkl
    assert len(tensors) == 10 and {s["itemsize"] for s in tensors} == {2, 4, 8}, r
    unpack(str(tmp_path / "p"), str(tmp_path / "out"))
    assert_same_tree(src, tmp_path / "out")
    from ckptctl.ops import inspect  # torch.load reads the file through the pack

    assert _strip(inspect(str(tmp_path / "p")).to_dict()) == _strip(inspect(str(src)).to_dict())


_DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "int32",
           "int64", "uint8", "bool", "float64"]


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.sampled_from(_DTYPES),
                                st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                      min_size=1, max_size=5),
       seed=st.integers(0, 2**16), delta=st.booleans())
def test_round_trip_property_over_dtypes_and_shapes(tmp_path_factory, specs, seed, delta):
    """Any mix of dtypes (fp32, bf16, fp16, fp8, ints, bool) and shapes (scalars, empty
    tensors, odd sizes): unpack gives the same bytes, with and without a base."""
    import torch
    from safetensors.torch import save_file

    from ckptctl.ops import seal

    d = tmp_path_factory.mktemp("prop")
    g = torch.Generator().manual_seed(seed)

    def tensors(bump: float) -> dict:
        out = {}
        for i, (dt, shape) in enumerate(specs):
            x = torch.randn(shape, generator=g) * 50 + bump * (i % 2)
            out[f"t{i}"] = (x > 0) if dt == "bool" else x.to(getattr(torch, dt))
        return out

    (d / "a").mkdir()
    save_file(tensors(0.0), str(d / "a" / "model.safetensors"))
    (d / "b").mkdir()
    g.manual_seed(seed)
    save_file(tensors(0.5), str(d / "b" / "model.safetensors"))
    seal(str(d / "a"))
    pack(str(d / "b"), str(d / "p"), base=str(d / "a") if delta else None, workers=2)
    unpack(str(d / "p"), str(d / "out"), workers=2)
    assert_same_tree(d / "b", d / "out")


# --------------------------------------------------------------------------- bases


@pytest.fixture
def dcp_pair(tmp_path):
    """run/step-1 and run/step-2 (half the model and some moments changed), sealed."""
    from ckptctl.ops import seal

    a = write_dcp(tmp_path / "run" / "step-1")
    b = write_dcp(tmp_path / "run" / "step-2", CHANGED)
    seal(str(a))
    seal(str(b))
    return a, b


def test_delta_pack_is_smaller_and_restores(dcp_pair, tmp_path):
    a, b = dcp_pair
    full = pack(str(b), str(tmp_path / "packs" / "full"), workers=2)
    r = pack(str(b), str(tmp_path / "packs" / "step-2"), base=str(a), workers=2)
    assert r.base == Manifest.parse((a / MANIFEST).read_bytes(), "m").id and r.depth == 1
    assert r.chunks["same"] >= 4, r.chunks  # changed ones: xor, or planes where xor is worse
    assert r.chunks.get("xor", 0) + r.chunks.get("planes", 0) >= 5, r.chunks
    assert r.bytes_out < full.bytes_out * 0.8, (r.bytes_out, full.bytes_out)
    assert r.base_segments == r.tensor_segments == 10
    idx = index_of(tmp_path / "packs" / "step-2")
    assert idx["base"] == {"id": r.base, "depth": 1, "url": "../../run/step-1"}
    pman = Manifest.parse((tmp_path / "packs" / "step-2" / MANIFEST).read_bytes(), "m")
    assert pman.base == r.base and pman.checkpoint_id == r.source_id
    # the base is found where the pack recorded it, relative to the pack
    unpack(str(tmp_path / "packs" / "step-2"), str(tmp_path / "out"))
    assert_same_tree(b, tmp_path / "out")
    # moved together, the relative URL still finds it
    shutil.move(str(tmp_path / "run"), tmp_path / "moved-run")
    shutil.move(str(tmp_path / "packs"), tmp_path / "moved-packs")
    (tmp_path / "moved-packs").rename(tmp_path / "packs")
    (tmp_path / "moved-run").rename(tmp_path / "run")
    unpack(str(tmp_path / "packs" / "step-2"), str(tmp_path / "out2"))
    assert_same_tree(tmp_path / "run" / "step-2", tmp_path / "out2")


def test_chain_of_packs_and_max_chain(dcp_pair, tmp_path):
    a, b = dcp_pair
    c = write_dcp(tmp_path / "run" / "step-3", CHANGED + ("l2.w",))
    p1, p2, p3 = (str(tmp_path / "packs" / n) for n in ("p1", "p2", "p3"))
    assert pack(str(a), p1, workers=2).depth == 0
    r2 = pack(str(b), p2, base=p1, workers=2)  # a base that is itself a pack
    r3 = pack(str(c), p3, base=p2, workers=2)
    assert (r2.depth, r3.depth) == (1, 2) and r3.base == r2.source_id
    assert r3.chunks.get("same", 0) >= 4
    unpack(p3, str(tmp_path / "out3"))
    assert_same_tree(c, tmp_path / "out3")
    # the chain bound: p2 is one deep, so a delta on it would be two deep
    r = pack(str(c), str(tmp_path / "packs" / "p3-full"), base=p2, max_chain=1, workers=2)
    assert r.base is None and r.depth == 0 and "max-chain 1" in r.full_reason
    assert "xor" not in r.chunks and "same" not in r.chunks
    unpack(str(tmp_path / "packs" / "p3-full"), str(tmp_path / "out3b"))
    assert_same_tree(c, tmp_path / "out3b")


def test_delta_safetensors_half_frozen(tmp_path):
    from ckptctl.ops import seal

    a = write_hf(tmp_path / "a")
    b = write_hf(tmp_path / "b", changed_layer=1)
    seal(str(a))
    seal(str(b))
    full = pack(str(b), str(tmp_path / "pf"), workers=2)
    r = pack(str(b), str(tmp_path / "pd"), base=str(a), workers=2)
    changed = r.chunks.get("xor", 0) + r.chunks.get("planes", 0)
    assert r.chunks["same"] > changed > 0, r.chunks
    assert r.bytes_out < full.bytes_out / 2, (r.bytes_out, full.bytes_out)
    unpack(str(tmp_path / "pd"), str(tmp_path / "out"), base=str(a))
    assert_same_tree(b, tmp_path / "out")


def test_delta_torch_save(tmp_path):
    from ckptctl.ops import seal

    a = write_torch(tmp_path / "a")
    b = write_torch(tmp_path / "b", CHANGED)
    seal(str(a))
    seal(str(b))
    r = pack(str(b), str(tmp_path / "pd"), base=str(a), workers=2)
    assert r.chunks["same"] >= 4, r.chunks
    assert r.chunks.get("xor", 0) + r.chunks.get("planes", 0) >= 4, r.chunks
    unpack(str(tmp_path / "pd"), str(tmp_path / "out"))
    assert_same_tree(b, tmp_path / "out")


# --------------------------------------------------------------------------- S3


def test_s3_round_trip_with_base(dcp_pair, tmp_path, s3_bucket):
    a, b = dcp_pair
    opts = s3_bucket.storage_options
    pa, pb = s3_bucket.url("packs/step-1"), s3_bucket.url("packs/step-2")
    pack(str(a), pa, dst_storage_options=opts, workers=2)
    r = pack(str(b), pb, base=pa, base_storage_options=opts, dst_storage_options=opts,
             workers=2)
    assert r.depth == 1 and r.chunks["same"] >= 4
    assert index_of_s3(s3_bucket, "packs/step-2")["base"]["url"] == "../step-1"
    u = unpack(pb, str(tmp_path / "out"), storage_options=opts, workers=2)
    assert_same_tree(b, tmp_path / "out")
    assert u.base == r.base and u.depth == 1
    from ckptctl.packs.unpack import open_pack_url

    ps = open_pack_url(pb, opts, workers=2)  # side-by-side payloads: one GET per run
    before = ps.raw.stats.reads
    assert all(len(b"".join(ps.iter_blocks(rel))) == n for rel, n in ps.files.items())
    nchunks = sum(len(f.refs) for f in ps.index.files.values())
    assert ps.raw.stats.reads - before <= nchunks // 3, (ps.raw.stats.reads - before, nchunks)
    # and back onto S3: the restored checkpoint is the source, same id
    u2 = unpack(pb, s3_bucket.url("restored/step-2"), storage_options=opts,
                dst_storage_options=opts, workers=2)
    fs = s3_bucket.fs()
    got = {k.rsplit("/", 1)[1]: fs.cat_file(k) for k in fs.find(s3_bucket.path("restored/step-2"))}
    assert got == files_of(b) and u2.manifest_id == r.source_id
    from ckptctl.ops import inspect, verify

    i = inspect(pb, opts)
    assert (i.format, i.step, i.num_tensors) == ("dcp", 104, 10)
    v = verify(pb, opts, level="full")
    assert v.ok and v.content == "hashes" and v.files_checked == 2, v.problems


def index_of_s3(bucket, prefix: str) -> dict:
    return json.loads(bucket.fs().cat_file(f"{bucket.path(prefix)}/{PACK_INDEX}"))


# --------------------------------------------------------------------------- packs as sources


def _strip(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("url", "bytes", "num_files", "pack")}


def test_inspect_verify_ls_on_a_pack(dcp_pair, tmp_path, cli):
    from ckptctl.ops import inspect, ls, verify

    a, b = dcp_pair
    pack(str(a), str(tmp_path / "run" / "p1"), workers=2)
    p2 = tmp_path / "run" / "p2"
    r = pack(str(b), str(p2), base=str(tmp_path / "run" / "p1"), workers=2)
    src, packed = inspect(str(b)), inspect(str(p2))
    assert _strip(packed.to_dict()) == _strip(src.to_dict())
    info = packed.pack
    assert (info["base"], info["depth"], info["manifest_id"]) == (r.base, 1, r.source_id)
    assert info["ratio"] == round(r.bytes_in / sum(
        p.stat().st_size for p in p2.iterdir()), 4) and info["chunks"] == r.chunks
    code, out, err = cli("inspect", str(p2))
    assert code == 0 and "pack" in out and f"{info['ratio']:.2f}" in out, out + err
    vs, vp = verify(str(b), level="full"), verify(str(p2), level="full")
    assert vp.ok and vp.problems == [] and vp.content == vs.content == "hashes"
    assert (vp.files_checked, vp.tensors_checked, vp.step) == \
        (vs.files_checked, vs.tensors_checked, vs.step)
    rows = {row.name: row for row in ls(str(tmp_path / "run")).checkpoints}
    assert (rows["p2"].state, rows["p2"].format, rows["p2"].step) == ("sealed", "dcp", 104)
    assert rows["p2"].bytes == sum(p.stat().st_size for p in p2.iterdir()
                                   if p.name != MANIFEST)  # its own files, manifest aside


def test_verify_full_on_a_pack_finds_a_corrupt_chunk(tmp_path):
    from ckptctl.ops import verify

    src = write_dcp(tmp_path / "s")
    pack(str(src), str(tmp_path / "p"), workers=2)
    idx = index_of(tmp_path / "p")
    seg = next(s for s in idx["files"]["__0_0.distcp"]["segments"] if s["kind"] == "tensor")
    c = seg["chunks"][0]
    data = tmp_path / "p" / c["data"]
    blob = bytearray(data.read_bytes())
    blob[c["at"] + c["clen"] // 2] ^= 0x40
    data.write_bytes(bytes(blob))
    assert verify(str(tmp_path / "p"), level="quick").ok  # no chunk decoded
    v = verify(str(tmp_path / "p"), level="full")
    assert not v.ok
    named = [p for p in v.problems if p.code == "MALFORMED_CHUNK"]
    assert named and named[0].message.startswith("chunk ") and "of __0_0.distcp" in \
        named[0].message and "checksum mismatch" in named[0].message, v.problems


def test_consolidate_and_reshard_read_a_pack(dcp_pair, tmp_path):
    from ckptctl.ops import consolidate, reshard

    a, b = dcp_pair
    pack(str(a), str(tmp_path / "p1"), workers=2)
    pack(str(b), str(tmp_path / "p2"), base=str(tmp_path / "p1"), workers=2)
    consolidate(str(b), str(tmp_path / "c-src"), to="safetensors", only="model")
    consolidate(str(tmp_path / "p2"), str(tmp_path / "c-pack"), to="safetensors", only="model")
    fs, fp = files_of(tmp_path / "c-src"), files_of(tmp_path / "c-pack")
    assert sorted(fs) == sorted(fp)
    for k in fs:
        if k != MANIFEST:
            assert fs[k] == fp[k], k
    reshard(str(b), str(tmp_path / "r-src"), world_size=2)
    reshard(str(tmp_path / "p2"), str(tmp_path / "r-pack"), world_size=2)
    rs, rp = files_of(tmp_path / "r-src"), files_of(tmp_path / "r-pack")
    assert sorted(rs) == sorted(rp)
    assert all(rs[k] == rp[k] for k in rs if k.endswith(".distcp"))


# --------------------------------------------------------------------------- CLI


def test_cli_pack_unpack_no_torch(tmp_path):
    """The CLI packs and unpacks a DCP checkpoint without importing torch."""
    from ckptctl.ops import seal

    src = write_dcp(tmp_path / "s")
    seal(str(src))
    code = ("import sys\nfrom ckptctl.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')\n")
    for args in (["pack", str(src), str(tmp_path / "p"), "--quiet"],
                 ["unpack", str(tmp_path / "p"), str(tmp_path / "o"), "--quiet"],
                 ["inspect", str(tmp_path / "p")]):
        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (args, p.stdout, p.stderr)
    assert_same_tree(src, tmp_path / "o")


def test_cli_pack_says_ratio_and_base(dcp_pair, tmp_path, cli):
    a, b = dcp_pair
    code, out, err = cli("pack", str(b), str(tmp_path / "p"), "--base", str(a), "--workers", "2")
    assert code == 0, err
    assert "ratio" in out and "base xxh3-128:" in out and "chain depth 1" in out, out
    code, out, err = cli("pack", str(b), str(tmp_path / "q"), "--base", str(a),
                         "--max-chain", "0")
    assert code == 0 and "note: " in out and "--max-chain 0" in out, out


def test_pin_seal_and_rm_handle_the_pack_folder_itself(tiny_dcp, tmp_path, cli):
    """Verbs that manage a folder (pin, seal, rm) work on the pack's own files, not
    through the read-only view of the checkpoint inside."""
    p = tmp_path / "run" / "p"
    pack(str(tiny_dcp), str(p), workers=2)
    code, out, err = cli("pin", str(p))
    assert code == 0 and (p / ".ckptctl-pinned").exists(), err
    code, out, err = cli("seal", str(p), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["action"] == "verified" and doc["num_files"] == 2, (out, err)
    code, out, err = cli("rm", str(p), "--force")
    assert code == 0 and not p.exists(), err
