"""``ckptctl diff``: real checkpoints written by torch, safetensors and ckptctl's own
writers, compared across formats and layouts; statistics checked against torch."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import dcp_save, run_measured
from fixtures_torch import copy_ckpt

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from ckptctl.model import DTYPES  # noqa: E402
from ckptctl.convert.diff import decode, diff  # noqa: E402


def _row(r, name):
    (e,) = [e for e in r.entries if e.name == name]
    return e


def _expected(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The statistics, computed independently with torch in float64."""
    x, y = a.double().flatten(), b.double().flatten()
    d = (x - y).abs()
    return {"max_abs_diff": d.max().item(),
            "rel_l2": (d.norm() / y.norm()).item(),
            "fraction_changed": (x != y).double().mean().item(),
            "changed": int((x != y).sum())}


@pytest.fixture(scope="module")
def derived(torch_ckpts, tmp_path_factory):
    """The FSDP fixture resharded to a 2-D mesh and consolidated to safetensors and
    torch.save by ckptctl itself, plus the reference torch ``state dict``."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("derived")
    src = str(torch_ckpts.dcp["fsdp"])
    for args in (("reshard", src, str(root / "r2d"), "--mesh", "dp=2,tp=2", "--rules", "llama"),
                 ("consolidate", src, str(root / "st"), "--to", "safetensors", "--only", "model"),
                 ("consolidate", src, str(root / "pt"), "--to", "torch", "--only", "model")):
        code, out, err = run_cli(*args, "-q")
        assert code == 0, (args, out, err)
    ref = torch.load(torch_ckpts.reference["fsdp"], weights_only=True)
    return root, ref


# ------------------------------------------------------------------------ identical


def test_identical_across_formats_and_layouts(torch_ckpts, derived, cli):
    """A 4-rank FSDP DCP checkpoint against its 2-D reshard, its consolidated safetensors
    and torch.save, torch's own dcp_to_torch_save and the zstd-transformed save."""
    root, _ = derived
    src = str(torch_ckpts.dcp["fsdp"])
    full = diff(src, str(torch_ckpts.reference["fsdp"]))
    assert full.equal and full.counts == {"identical": 175}
    assert {e.proof for e in full.entries if e.kind == "tensor"} == {"bytes"}
    assert {e.proof for e in full.entries if e.kind == "object"} == {"values"}
    assert full.bytes_compared == full.bytes == full.bytes_identical > 10 << 20
    assert full.bytes_decoded == 0  # nothing differed: nothing decoded
    r = diff(src, str(torch_ckpts.dcp["fsdp_zstd"]))
    assert r.equal and r.counts == {"identical": 175}
    resharded = diff(src, str(root / "r2d"))
    assert resharded.equal and resharded.counts == full.counts
    assert diff(str(root / "r2d"), src).counts == full.counts  # either side's layout leads
    for other in ("st", "pt"):
        r = diff(src, str(root / other), only=["model.*"])
        assert r.equal and r.counts == {"identical": 39}, other
    code, out, err = cli("diff", src, str(root / "st"), "--only", "model.*")
    assert code == 0 and err == ""
    assert out.splitlines()[:2] == ["identical: 39 tensors (bit for bit)",
                                    "identical: 39 entries (4.0 MiB)"]
    assert "39 byte-identical (read and compared)" in out


def test_manifest_hashes_fast_path(torch_ckpts, tmp_path):
    """Two sealed copies: identical by their manifests' hashes, no tensor byte read."""
    from ckptctl.ops import seal

    a = copy_ckpt(torch_ckpts.dcp["fsdp"], tmp_path / "a")
    b = copy_ckpt(torch_ckpts.dcp["fsdp"], tmp_path / "b")
    seal(str(a))
    seal(str(b))
    r = diff(str(a), str(b))
    assert r.equal and r.counts == {"identical": 175}
    assert {e.proof for e in r.entries if e.kind == "tensor"} == {"hashes"}
    assert r.bytes_fast_pathed == r.bytes > 10 << 20 and r.bytes_compared == 0
    # one data file changed on purpose: its tensors are read, the others still fast
    rel = "__1_0.distcp"
    data = bytearray((b / rel).read_bytes())
    from ckptctl.formats.detect import open_checkpoint

    ck = open_checkpoint(str(b))
    t = ck.tensors["model.layers.0.attention.wq.weight"]
    (c,) = [c for c in t.chunks if c.extent.file == rel]
    from ckptctl.formats.tensorio import locate_payload

    p = locate_payload(ck, c.extent)
    data[p.offset:p.offset + 4] = np.float32(7.0).tobytes()
    _recrc(data, c.extent, p)  # a new value, as a writer would record it (seal checks CRCs)
    (b / rel).write_bytes(bytes(data))
    # the manifests are trusted as they are (verify --level full re-proves them): an
    # in-place edit is seen once b is sealed again
    (b / "ckptctl.manifest.json").unlink()
    seal(str(b))
    r = diff(str(a), str(b))
    assert not r.equal and r.counts == {"identical": 174, "different": 1}
    e = _row(r, "model.layers.0.attention.wq.weight")
    assert e.status == "different" and e.changed == 1
    assert 0 < r.bytes_compared < r.bytes and r.bytes_fast_pathed > 0
    assert r.bytes_fast_pathed + r.bytes_compared == r.bytes


def _recrc(data: bytearray, ext, p) -> None:
    """Record the CRC-32 of the payload record at ``p`` (in the zip at ``ext``) anew in
    the zip's central directory, local header and data descriptor."""
    import struct
    import zlib

    crc = zlib.crc32(data[p.offset:p.offset + p.length])
    en = next(e for e in p.entries if e.method == 0 and e.usize == p.length
              and not e.name.endswith(".pkl"))
    at = data.find(b"PK\x01\x02" + bytes(12), ext.offset)  # placeholder, replaced below
    zip_ = bytes(data[ext.offset:ext.offset + ext.length])
    i = zip_.find(b"PK\x01\x02")
    while i >= 0:
        nlen = struct.unpack_from("<H", zip_, i + 28)[0]
        if zip_[i + 46:i + 46 + nlen].decode() == en.name:
            at = ext.offset + i
            break
        i = zip_.find(b"PK\x01\x02", i + 4)
    struct.pack_into("<I", data, at + 16, crc)
    local = ext.offset + en.header_offset
    if struct.unpack_from("<I", data, local + 14)[0]:
        struct.pack_into("<I", data, local + 14, crc)
    end = p.offset + p.length
    if data[end:end + 4] == b"PK\x07\x08":
        struct.pack_into("<I", data, end + 4, crc)


# ------------------------------------------------------------------------ differences


def _perturbed(ref: dict, tmp_path: Path, name: str, fn, *, keys=None) -> Path:
    """The reference's model tensors as one safetensors file, ``fn`` applied to ``name``."""
    model = {f"model.{k}": v.clone() for k, v in ref["model"].items()}
    model[name] = fn(model[name])
    if keys is not None:
        model = {keys(k): v for k, v in model.items()}
    out = tmp_path / "hf"
    out.mkdir()
    save_file(model, str(out / "model.safetensors"))
    return out


def test_perturbed_tensor_statistics(torch_ckpts, derived, tmp_path, cli):
    """A sharded DCP tensor against a safetensors copy with a few changed elements: the
    numbers match torch's, computed here independently."""
    _, ref = derived
    name = "model.layers.1.feed_forward.w1.weight"  # FSDP-sharded on dim 0 over 4 ranks
    g = torch.Generator().manual_seed(1)

    def bump(t):
        t = t.clone()
        idx = torch.randperm(t.numel(), generator=g)[:500]
        t.view(-1)[idx] += torch.randn(500, generator=g) * 1e-2
        return t

    hf = _perturbed(ref, tmp_path, name, bump)
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        b = f.get_tensor(name)
    a = ref["model"][name.removeprefix("model.")]
    want = _expected(a, b)
    r = diff(str(torch_ckpts.dcp["fsdp"]), str(hf), only=["model.*"])
    assert not r.equal and r.counts == {"identical": 38, "different": 1}
    e = _row(r, name)
    assert (e.status, e.changed, e.numel) == ("different", want["changed"], a.numel())
    assert e.max_abs_diff == pytest.approx(want["max_abs_diff"], rel=1e-12)
    assert e.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-9)
    assert e.fraction_changed == pytest.approx(want["fraction_changed"], rel=1e-12)
    assert e.nonfinite_mismatch == 0
    code, out, err = cli("diff", str(torch_ckpts.dcp["fsdp"]), str(hf), "--only", "model.*")
    assert code == 1 and err == ""
    line = [x for x in out.splitlines() if x.startswith(name)][0]
    assert "different" in line and f"{want['max_abs_diff']:.3g}" in line
    assert "identical: 38 entries" in out and "different: 1" in out
    # tolerance: every change is below 0.1 in absolute terms
    loose = diff(str(torch_ckpts.dcp["fsdp"]), str(hf), only=["model.*"], atol=0.1)
    assert loose.equal and loose.counts == {"identical": 38, "equal_within_tolerance": 1}
    assert _row(loose, name).proof == "tolerance" and "values within atol=0.1" in loose.proven
    assert cli("diff", str(torch_ckpts.dcp["fsdp"]), str(hf), "--only", "model.*",
               "--atol", "0.1", "-q") == (0, "", "")
    # a tolerance just under the largest change leaves the elements over it
    tight = diff(str(torch_ckpts.dcp["fsdp"]), str(hf), only=["model.*"],
                 atol=want["max_abs_diff"] * 0.999)
    e = _row(tight, name)
    assert e.status == "different" and 1 <= e.outside_tolerance < e.changed
    # rtol alone, relative to B: isclose(a, b) with numpy's definition, checked with torch
    rt = diff(str(torch_ckpts.dcp["fsdp"]), str(hf), only=[name], rtol=0.5)
    close = torch.isclose(a.double(), b.double(), rtol=0.5, atol=0)
    assert _row(rt, name).outside_tolerance == int((~close).sum())


def test_bf16_values_and_nan(tmp_path):
    """bf16 decoded without torch (bit shift) against torch's own widening; NaN equal only
    at the same positions; NaN payloads that differ are values-equal, not byte-identical."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    b = a.clone()
    b[5, :10] += 0.25
    b[7, 3] = float("nan")
    nan_a = torch.full((4, 4), float("nan"))
    nan_b = nan_a.clone()
    nan_b.view(torch.int32)[0, 0] |= 1  # another quiet NaN: bytes differ, both NaN
    same_nan = torch.tensor([1.0, float("nan"), 3.0])
    moved_nan = torch.tensor([float("nan"), 2.0, 3.0])
    save_file({"w": a, "n": nan_a, "s": same_nan, "m": same_nan.clone()}, str(tmp_path / "a.safetensors"))
    save_file({"w": b, "n": nan_b, "s": same_nan, "m": moved_nan}, str(tmp_path / "b.safetensors"))
    r = diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    w = _row(r, "w")
    fin = ~torch.isnan(b.float())
    want = _expected(a[fin], b[fin])
    assert w.status == "different" and w.dtype == "bfloat16"
    assert w.changed == want["changed"] + 1 and w.nonfinite_mismatch == 1
    assert w.max_abs_diff == pytest.approx(want["max_abs_diff"], rel=1e-12)
    assert w.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-9)
    assert w.fraction_changed == pytest.approx((want["changed"] + 1) / a.numel())
    n = _row(r, "n")
    assert (n.status, n.changed, n.proof) == ("equal_within_tolerance", 0, "tolerance")
    assert "NaN payloads" in n.note
    assert _row(r, "s").status == "identical"
    m = _row(r, "m")
    assert (m.status, m.nonfinite_mismatch, m.changed) == ("different", 2, 2)
    assert m.max_abs_diff == 0.0  # the one finite pair (3, 3) is equal
    # NaN positions differ: no tolerance makes them equal
    assert _row(diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                     atol=1e9), "m").status == "different"


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                  "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16", "float16"])
def test_decode_matches_torch(name):
    """Every code of an 8-bit float (and a sweep of 16-bit ones) decodes as torch does."""
    dt = getattr(torch, name)
    if dt.itemsize == 1:
        codes = torch.arange(256, dtype=torch.uint8)
    else:
        codes = torch.arange(0, 65536, 7, dtype=torch.int32).to(torch.int16)
    vals = codes.view(dt)
    got = decode(codes.numpy().tobytes(), DTYPES[name])
    want = vals.double().numpy()
    assert np.array_equal(got, want, equal_nan=True), name


def test_fp8_and_int_differences(tmp_path):
    g = torch.Generator().manual_seed(3)
    a8 = torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn)
    b8 = (a8.float() * 1.5).to(torch.float8_e4m3fn)
    ai = torch.randint(-2**62, 2**62, (100,), generator=g, dtype=torch.int64)
    bi = ai.clone()
    bi[3] += 1  # a change float64 cannot see: counted from the integers
    save_file({"f8": a8, "i": ai}, str(tmp_path / "a.safetensors"))
    save_file({"f8": b8, "i": bi}, str(tmp_path / "b.safetensors"))
    r = diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    want = _expected(a8, b8)
    f8 = _row(r, "f8")
    assert (f8.status, f8.changed) == ("different", want["changed"])
    assert f8.max_abs_diff == pytest.approx(want["max_abs_diff"])
    assert f8.rel_l2 == pytest.approx(want["rel_l2"])
    i = _row(r, "i")
    assert (i.status, i.changed, i.fraction_changed) == ("different", 1, 0.01)


def test_mismatches_only_in_and_exit_codes(tmp_path, cli):
    a = {"w": torch.ones(4, 2), "d": torch.ones(3), "s": torch.ones(6), "only_a": torch.ones(1)}
    b = {"w": torch.ones(4, 2), "d": torch.ones(3, dtype=torch.float16), "s": torch.ones(2, 3),
         "only_b": torch.zeros(2)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    A, B = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    r = diff(A, B)
    assert not r.equal
    assert r.counts == {"identical": 1, "dtype_mismatch": 1, "shape_mismatch": 1,
                        "only_in_a": 1, "only_in_b": 1}
    assert (_row(r, "d").dtype, _row(r, "d").dtype_b) == ("float32", "float16")
    assert (_row(r, "s").shape, _row(r, "s").shape_b) == ([6], [2, 3])
    code, out, err = cli("diff", A, B)
    assert code == 1 and err == ""
    assert out.splitlines()[1] == ("identical: 1 entry (32 B), dtype mismatch: 1, shape "
                                    "mismatch: 1, only in A: 1, only in B: 1")
    assert cli("diff", A, B, "--quiet") == (1, "", "")
    doc = json.loads(cli("diff", A, B, "--json")[1])
    assert doc["counts"] == r.counts and doc["equal"] is False
    assert cli("diff", A, A)[0] == 0
    code, _, err = cli("diff", A, str(tmp_path / "nope"))
    assert code == 3 and "no such file" in err
    code, _, err = cli("diff", A, B, "--atol", "-1")
    assert code == 2 and "--atol" in err
    code, _, err = cli("diff", A, B, "--map", "model.")
    assert code == 2 and "--map expects OLD=NEW" in err
    code, _, err = cli("diff", A, B, "--only", "nothing.*")
    assert code == 2 and "selects no entry" in err
    code, _, err = cli("diff", A, B, "--max-memory", "1KiB")
    assert code == 2 and "--max-memory" in err


def test_map_and_only(torch_ckpts, derived, tmp_path, cli):
    """An HF-style export stripped of ``model.``: --map model.= matches the names."""
    _, ref = derived
    hf = _perturbed(ref, tmp_path, "model.norm.weight", lambda t: t,
                    keys=lambda k: k.removeprefix("model."))
    src = str(torch_ckpts.dcp["fsdp"])
    r = diff(src, str(hf), maps=["model.="], only=["layers.*", "norm.weight", "output.weight",
                                                   "tok_embeddings.weight"])
    assert r.equal and r.counts == {"identical": 39}
    e = _row(r, "norm.weight")
    assert (e.name_a, e.name_b) == ("model.norm.weight", "norm.weight")
    unmapped = diff(src, str(hf))
    assert unmapped.counts == {"only_in_a": 175, "only_in_b": 39}
    r = diff(src, str(hf), maps=["model.="], only=["layers.0.*"])
    assert r.equal and len(r.entries) == 9
    # without --only the optimizer state is only in A: exit 1
    code, out, _ = cli("diff", src, str(hf), "--map", "model.=")
    assert code == 1 and "only in A: 136" in out


def test_objects_by_value_and_bytes(tmp_path):
    """DCP object entries decode as plain values; one that changed is different."""
    sd_a = {"w": torch.ones(2), "step": 7, "cfg": {"lr": 0.1, "name": "x"}}
    sd_b = {"w": torch.ones(2), "step": 8, "cfg": {"lr": 0.1, "name": "x"}}
    dcp_save(tmp_path / "a", sd_a)
    dcp_save(tmp_path / "b", sd_b)
    torch.save(sd_a, tmp_path / "a.pt")
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.counts == {"identical": 3, "different": 1}
    s = _row(r, "step")
    assert s.kind == "object" and s.status == "different" and "7 against 8" in s.note
    assert _row(r, "cfg.lr").proof == "values"
    assert diff(str(tmp_path / "a"), str(tmp_path / "a.pt")).counts == {"identical": 4}


# ------------------------------------------------------------------------ scale, places


def test_bounded_memory_on_a_larger_tensor(tmp_path):
    """256 MiB per side, one element changed near the end: peak RSS stays far below the
    data (reading either side whole would cost 256 MiB)."""
    n = 64 << 20  # float32 elements: 256 MiB
    a = torch.ones(n, dtype=torch.float32).reshape(8192, -1)
    save_file({"big": a}, str(tmp_path / "a.safetensors"))
    a[8000, 17] = 2
    save_file({"big": a}, str(tmp_path / "b.safetensors"))
    del a
    code, out, err, wall, rss = run_measured("diff", tmp_path / "a.safetensors",
                                             tmp_path / "b.safetensors", "--max-memory",
                                             "64MiB", "--json", timeout=300)
    assert code == 1, err
    doc = json.loads(out)
    (e,) = doc["entries"]
    assert (e["status"], e["changed"], e["max_abs_diff"]) == ("different", 1, 1.0)
    assert doc["bytes_compared"] == 256 << 20 and doc["bytes_decoded"] < 32 << 20
    assert rss < 200, f"peak RSS {rss:.0f} MiB for 2 x 256 MiB compared in {wall:.1f}s"


def test_s3_against_local(torch_ckpts, s3_bucket, derived, tmp_path, cli):
    """The FSDP checkpoint on S3 against its local 2-D reshard."""
    root, _ = derived
    s3_bucket.upload(torch_ckpts.dcp["fsdp"], "ck")
    opts = [f"{k}={v}" for k, v in s3_bucket.storage_options.items() if isinstance(v, str)]
    args = ["diff", s3_bucket.url("ck"), str(root / "r2d"), "--json"]
    for o in opts:
        args += ["--a-option", o]
    code, out, err = cli(*args)
    assert code == 0, (out, err)
    doc = json.loads(out)
    assert doc["counts"] == {"identical": 175} and doc["a"]["url"] == s3_bucket.url("ck")
    assert doc["bytes_compared"] > 10 << 20


def test_pack_against_its_source_and_a_reshard(torch_ckpts, derived, tmp_path):
    """A pack is one more source: identical to what it packed (by the hashes its index
    records) and, read through its chunks, to the 2-D reshard of that checkpoint."""
    from ckptctl.packs.pack import pack

    root, _ = derived
    src = copy_ckpt(torch_ckpts.dcp["fsdp"], tmp_path / "src")  # pack seals its source
    pack(str(src), str(tmp_path / "pk"))
    r = diff(str(tmp_path / "pk"), str(src))
    assert r.equal and r.counts == {"identical": 175}
    assert r.bytes_fast_pathed == r.bytes and r.bytes_compared == 0
    r = diff(str(tmp_path / "pk"), str(root / "r2d"))
    assert r.equal and r.counts == {"identical": 175}
    assert r.bytes_compared == r.bytes > 10 << 20


def test_every_dtype_across_formats(torch_ckpts, tmp_path):
    """safetensors' dtype zoo against a torch.save of the same tensors: identical; with the
    low bit of one byte flipped per tensor, each is different in exactly one element."""
    from safetensors.torch import load_file

    src = torch_ckpts.hf_single / "model.safetensors"
    tensors = load_file(str(src))
    torch.save(tensors, tmp_path / "same.pt")
    r = diff(str(src), str(tmp_path / "same.pt"))
    fp4 = "dtype_zoo.float4_e2m1fn_x2"  # safetensors: F4 [2, 6]; torch: 2 values a byte [2, 3]
    assert _row(r, fp4).status == "dtype_mismatch"
    assert {e.status for e in r.entries if e.name != fp4} == {"identical"}
    flipped = {}
    for k, v in tensors.items():
        v = v.clone()
        if k.startswith("dtype_zoo.") and v.numel() and k != fp4:
            v.view(-1).view(torch.uint8)[0] ^= 1
        flipped[k] = v
    save_file(flipped, str(tmp_path / "flipped.safetensors"))
    r = diff(str(src), str(tmp_path / "flipped.safetensors"))
    for e in r.entries:
        if not e.name.startswith("dtype_zoo.") or e.name in (fp4, "dtype_zoo.empty_bfloat16"):
            assert e.status == "identical", e
            continue
        assert (e.status, e.changed, e.numel) == ("different", 1, math.prod(e.shape)), e


def test_opaque_objects_compare_by_bytes(tmp_path):
    """accelerate's random_states_0.pkl is never unpickled: its bytes are compared."""
    import pickle

    for name, seed in (("a", 1), ("b", 2), ("c", 1)):
        d = tmp_path / name
        d.mkdir()
        save_file({"w": torch.ones(3)}, str(d / "model.safetensors"))
        (d / "random_states_0.pkl").write_bytes(pickle.dumps({"seed": seed}))
        torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                   d / "optimizer.bin")
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    (rng,) = [e for e in r.entries if e.name.startswith("rng")]
    assert (rng.kind, rng.status) == ("object", "different") and "payload bytes" in rng.note
    assert r.counts == {"identical": 4, "different": 1}
    same = diff(str(tmp_path / "a"), str(tmp_path / "c"))
    (rng,) = [e for e in same.entries if e.name.startswith("rng")]
    assert same.equal and (rng.status, rng.proof) == ("identical", "bytes")
    assert _row(same, "optim.param_groups.0.lr").proof == "values"


def test_blocks_are_compared_with_one_blas_thread(tmp_path, monkeypatch):
    """A library caller has numpy loaded with a BLAS thread per core; while diff compares,
    BLAS runs on one (the CLI sets OPENBLAS_NUM_THREADS itself)."""
    from threadpoolctl import threadpool_info

    import ckptctl.convert.diff as d

    seen = []
    real = d._compare_all

    def spy(*args, **kwargs):
        seen.extend(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
        return real(*args, **kwargs)

    monkeypatch.setattr(d, "_compare_all", spy)
    a = torch.arange(64, dtype=torch.float32)
    save_file({"w": a}, str(tmp_path / "a.safetensors"))
    save_file({"w": a + 1}, str(tmp_path / "b.safetensors"))
    r = diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert r.verdict == "different" and seen and set(seen) == {1}
