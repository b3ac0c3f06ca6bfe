"""bench/make_scale_dcp.py writes real DCP checkpoints: torch loads them with the exact values,
every chunk is byte for byte what torch.save writes, a 1-rank checkpoint is byte for byte what
dcp.save writes, and ckptctl's structure check and inspect accept them."""
from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

ROOT = Path(__file__).resolve().parent.parent
CKPTCTL = str(ROOT / ".venv" / "bin" / "ckptctl")
_spec = importlib.util.spec_from_file_location("make_scale_dcp", ROOT / "bench" / "make_scale_dcp.py")
gen = importlib.util.module_from_spec(_spec)
sys.modules["make_scale_dcp"] = gen
_spec.loader.exec_module(gen)

RANKS = 16


@pytest.fixture(scope="module", params=["fsdp", "2d"])
def scale16(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"scale16-{request.param}") / "ckpt"
    stats = gen.make(d, RANKS, mesh=request.param)
    return d, request.param, stats


def _load_full(d: Path, sp) -> dict:
    """dcp.load (no process group) into full-size plain tensors."""
    sd = {"model": {s.name[len("model."):]: torch.full(s.shape, -1, dtype=getattr(torch, s.dtype))
                    for s in sp},
          "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    return sd


def test_torch_reads_metadata_and_loads_exact_values(scale16):
    d, mesh, stats = scale16
    sp = gen.specs(RANKS, 30, mesh)
    md = FileSystemReader(str(d)).read_metadata()
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [".metadata"] + [f"__{r}_0.distcp" for r in range(RANKS)])
    assert isinstance(md.state_dict_metadata["step"], BytesStorageMetadata)
    sharded = [s for s in sp if s.kind != "rep"]
    assert len(sharded) == 30 and len(sp) - len(sharded) == 9
    for s in sp:
        tmd = md.state_dict_metadata[s.name]
        assert isinstance(tmd, TensorStorageMetadata)
        assert tuple(tmd.size) == s.shape and tmd.properties.dtype == getattr(torch, s.dtype)
        assert len(tmd.chunks) == (1 if s.kind == "rep" else RANKS)
        # the chunks tile the tensor exactly
        cover = torch.zeros(s.shape, dtype=torch.int32)
        for c in tmd.chunks:
            cover[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] += 1
        assert bool((cover == 1).all()), s.name
    assert stats["chunks"] == 30 * RANKS + 9 == len(md.storage_data) - 1
    # uneven: the last rank's dim-0 shard of every fsdp tensor is one row short
    if mesh == "fsdp":
        wq = md.state_dict_metadata["model.layers.0.attention.wq.weight"]
        assert [c.sizes[0] for c in wq.chunks] == [2] * (RANKS - 1) + [1]
    else:  # row-parallel weights are 2-D blocks (dp on dim 0, tp on dim 1)
        wo = md.state_dict_metadata["model.layers.0.attention.wo.weight"]
        assert {(c.offsets[0] > 0, c.offsets[1] > 0) for c in wo.chunks} == {
            (False, False), (False, True), (True, False), (True, True)}

    sd = _load_full(d, sp)
    assert sd["step"] == gen.STEP
    for s in sp:
        got = sd["model"][s.name[len("model."):]]
        want = gen.expected(s)
        assert torch.equal(got.view(torch.int16 if s.dtype == "bfloat16" else torch.int32),
                           want.view(torch.int16 if s.dtype == "bfloat16" else torch.int32)), s.name
    # values differ between tensors and along each one (a misplaced chunk would show)
    assert not torch.equal(gen.expected(sp[1])[:2], gen.expected(sp[2])[:2])


def test_every_chunk_is_torch_save_of_its_shard(scale16):
    d, mesh, _ = scale16
    md = FileSystemReader(str(d)).read_metadata()
    sp = {s.name: s for s in gen.specs(RANKS, 30, mesh)}
    files = {p.name: p.read_bytes() for p in d.glob("*.distcp")}
    ends = {}
    for idx, info in md.storage_data.items():
        blob = files[info.relative_path][info.offset:info.offset + info.length]
        ends.setdefault(info.relative_path, []).append((info.offset, info.length))
        if idx.fqn == "step":
            assert blob == gen.torch_save_bytes(gen.STEP)
            continue
        s = sp[idx.fqn]
        chunk = md.state_dict_metadata[idx.fqn].chunks[idx.index]
        assert tuple(chunk.offsets) == tuple(idx.offset)
        box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        shard = gen.expected(s)[box].clone(memory_format=torch.contiguous_format)
        assert blob == gen.torch_save_bytes(shard), (idx.fqn, tuple(idx.offset))
    for name, spans in ends.items():  # the items tile each file, nothing else in it
        spans.sort()
        pos = 0
        for off, n in spans:
            assert off == pos
            pos += n
        assert pos == len(files[name])


def test_one_rank_is_byte_identical_to_dcp_save(tmp_path):
    """At 1 rank the generator must write what dcp.save writes for the same state dict."""
    mine = tmp_path / "mine"
    gen.make(mine, 1)
    sp = gen.specs(1, 30, "fsdp")
    ref = tmp_path / "ref"
    sd = {"model": {s.name[len("model."):]: gen.expected(s) for s in sp}, "step": gen.STEP}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(ref), no_dist=True)
    assert sorted(p.name for p in ref.iterdir()) == sorted(p.name for p in mine.iterdir())
    assert (ref / "__0_0.distcp").read_bytes() == (mine / "__0_0.distcp").read_bytes()
    a = pickle.loads((ref / ".metadata").read_bytes())
    b = pickle.loads((mine / ".metadata").read_bytes())
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.planner_data == b.planner_data
    assert a.storage_data == b.storage_data
    assert {k: k.index for k in a.storage_data} == {k: k.index for k in b.storage_data}
    assert a.version == b.version


def test_ckptctl_verify_structure_and_inspect(scale16):
    d, _, _ = scale16
    r = subprocess.run([CKPTCTL, "verify", "--level", "structure", str(d)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([CKPTCTL, "inspect", "--json", str(d)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "dcp" and doc["step"] == gen.STEP
    assert doc["num_tensors"] == 39 and doc["layout"]["world_size"] == RANKS
    assert doc["layout"]["sharded_tensors"] == 30


def test_cache_generates_once(tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "CACHE", tmp_path / "cache")
    p = gen.cached(8, tensors=4, mesh="2d")
    assert (p / ".metadata").is_file() and len(list(p.glob("*.distcp"))) == 8
    md = FileSystemReader(str(p)).read_metadata()
    assert Path(md.storage_meta.checkpoint_id) == p
    before = {q.name: q.stat().st_mtime_ns for q in p.iterdir()}
    assert gen.cached(8, tensors=4, mesh="2d") == p
    assert {q.name: q.stat().st_mtime_ns for q in p.iterdir()} == before


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        gen.specs(12, mesh="2d")
    with pytest.raises(ValueError, match="mesh"):
        gen.specs(12, mesh="3d")


def test_ckptctl_verify_structure_more_files_than_kept_descriptors(tmp_path):
    """More rank files than Store keeps open (256): descriptors must not close under readers
    (they did: EBADF, exit 3, on 1,000-rank checkpoints)."""
    d = tmp_path / "ckpt"
    gen.make(d, 600, tensors=2)
    r = subprocess.run([CKPTCTL, "verify", "--level", "structure", str(d)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
