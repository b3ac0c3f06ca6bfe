"""Sanity checks of the torch-written fixtures themselves (see fixtures_torch.py).

They pin what the rest of the suite relies on: DCP file names, chunk tiling (uneven
splits included), the zstd transform descriptor, and that torch's own
``dcp_to_torch_save`` gives back the saver's full state dict bit for bit.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fixtures_torch import LAYOUTS, copy_ckpt

ZIP_MAGIC, ZSTD_MAGIC = b"PK\x03\x04", b"\x28\xb5\x2f\xfd"


def metadata(path):
    return FileSystemReader(path).read_metadata()  # trusted: we wrote it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dcp_files(torch_ckpts, layout):
    d = torch_ckpts[layout]
    ranks = [f"__{r}_0.distcp" for r in range(4)]
    assert sorted(os.listdir(d)) == [".metadata", *ranks]
    magic = ZSTD_MAGIC if layout.endswith("_zstd") else ZIP_MAGIC
    md = metadata(d)
    for info in md.storage_data.values():
        with open(d / info.relative_path, "rb") as f:
            f.seek(info.offset)
            assert f.read(4) == magic
        assert info.transform_descriptors == (["stream.zstd/1"] if layout.endswith("_zstd") else None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunks_tile_each_tensor(torch_ckpts, layout):
    for name, tm in metadata(torch_ckpts[layout]).state_dict_metadata.items():
        if not isinstance(tm, TensorStorageMetadata):
            continue
        cover = torch.zeros(tuple(tm.size), dtype=torch.int8)
        for c in tm.chunks:
            cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
        assert bool((cover == 1).all()), name


def test_uneven_splits(torch_ckpts):
    def rows(layout, key):
        chunks = metadata(torch_ckpts[layout]).state_dict_metadata[key].chunks
        return sorted((c.offsets[0], c.sizes[0]) for c in chunks)

    # torch.chunk over 4 ranks: 1001 -> 251,251,251,248; 342 -> 86,86,86,84
    assert rows("fsdp", "model.tok_embeddings.weight") == [(0, 251), (251, 251), (502, 251), (753, 248)]
    assert rows("tp", "model.layers.0.feed_forward.w1.weight") == [(0, 86), (86, 86), (172, 86), (258, 84)]
    # 2-D: TP splits first (342 -> 171,171), FSDP splits each TP shard (171 -> 86,85)
    assert rows("2d", "model.layers.0.feed_forward.w1.weight") == [(0, 86), (86, 85), (171, 86), (257, 85)]


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_equals_full_state_dict(torch_ckpts, layout):
    ref = torch.load(torch_ckpts.reference[layout], weights_only=True)
    full = torch.load(torch_ckpts.full[layout], weights_only=True)
    assert ref["step"] == 20 and ref["rng"]["cpu"].dtype == torch.uint8
    got, want = dict(flat({k: ref[k] for k in ("model", "optim")})), dict(flat(full))
    assert got.keys() == want.keys()
    assert sum(v.numel() for v in full["model"].values()) == 1_044_864
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_zstd_holds_the_same_tensors(torch_ckpts):
    a = torch.load(torch_ckpts.reference["fsdp"], weights_only=True)
    b = torch.load(torch_ckpts.reference["fsdp_zstd"], weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_hf_single_has_every_dtype(torch_ckpts):
    with safe_open(torch_ckpts.hf_single / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        assert tuple(f.get_tensor("dtype_zoo.scalar_float32").shape) == ()
        assert tuple(f.get_tensor("dtype_zoo.empty_bfloat16").shape) == (0, 8)
    assert {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.uint64, torch.complex64} <= dtypes
    assert len(dtypes) == 20


def test_hf_sharded_index_and_bin_agree(torch_ckpts):
    index = json.loads((torch_ckpts.hf_sharded / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(torch_ckpts.hf_sharded / shard, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert tensors.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    flat_bin = torch.load(torch_ckpts.bin, weights_only=True)
    assert flat_bin.keys() == tensors.keys()
    assert all(torch.equal(flat_bin[k], t) for k, t in tensors.items())


def test_nested_pt(torch_ckpts):
    n = torch.load(torch_ckpts.nested_pt, weights_only=True)
    assert n["meta"] == {"step": 1200, "lr": 3e-4, "name": "run-7", "done": False, "note": None}
    assert not n["transposed"].is_contiguous()
    assert n["shared_a"].untyped_storage().data_ptr() == n["shared_b"].untyped_storage().data_ptr()


def test_copy_ckpt_is_writable(torch_ckpts, tmp_path):
    dst = copy_ckpt(torch_ckpts["tp"], tmp_path)
    assert dst == tmp_path / "step-20"
    assert sorted(os.listdir(dst)) == sorted(os.listdir(torch_ckpts["tp"]))
    with open(dst / "__0_0.distcp", "r+b") as f:
        f.write(b"x")
