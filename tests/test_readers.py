"""Every tensor read through ckptctl is bit-identical to what torch loads, for every format,
on local disk and on a real S3 server (rclone serve s3 on loopback)."""
from __future__ import annotations

import pytest
import torch

from ckptctl.formats import open_checkpoint, read_object, tensor_bytes
from ckptctl.formats.torchsave import flatten

DCP_LAYOUTS = ["fsdp", "tp", "2d", "fsdp_zstd"]


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _load(path) -> dict:
    return flatten(torch.load(path, weights_only=False, map_location="cpu"))


def _load_dcp_flat(path) -> dict:
    """The reference, flattened by DCP itself."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(torch.load(path, weights_only=False, map_location="cpu"))[0]


def _assert_same(ck, expected: dict, *, objects: bool = True):
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert set(ck.tensors) == set(tensors), set(ck.tensors) ^ set(tensors)
    for name, ref in tensors.items():
        t = ck.tensors[name]
        shape, dtype = tuple(ref.shape), str(ref.dtype).removeprefix("torch.")
        if dtype == "float4_e2m1fn_x2" and ck.format.endswith("safetensors"):
            # safetensors records torch's packed fp4 pairs as F4 with the last dim doubled
            shape, dtype = shape[:-1] + (shape[-1] * 2,), "float4_e2m1"
        assert t.shape == shape, name
        assert t.dtype.name == dtype, name
        assert tensor_bytes(ck, name) == _raw(ref), f"{name} differs"
    if objects:
        others = {k: v for k, v in expected.items() if not isinstance(v, torch.Tensor)}
        assert set(ck.objects) == set(others)
        for name, ref in others.items():
            if isinstance(ref, (int, float, str, list)) and not any(
                    isinstance(x, torch.Tensor) for x in (ref if isinstance(ref, list) else [])):
                assert read_object(ck, ck.objects[name]) == ref, name


@pytest.fixture(params=["local", "s3"])
def where(request):
    return request.param


def _url(where, path, request) -> tuple[str, dict | None]:
    if where == "local":
        return str(path), None
    bucket = request.getfixturevalue("s3_bucket")
    bucket.upload(path if path.is_dir() else path.parent, "ck")
    url = bucket.url("ck") if path.is_dir() else bucket.url(f"ck/{path.name}")
    return url, bucket.storage_options


@pytest.mark.parametrize("layout", DCP_LAYOUTS)
def test_dcp_equals_torch_load(torch_ckpts, layout, where, request):
    url, opts = _url(where, torch_ckpts[layout], request)
    ck = open_checkpoint(url, opts)
    assert ck.format == "dcp" and ck.step == 20
    _assert_same(ck, _load_dcp_flat(torch_ckpts.reference[layout]))


@pytest.mark.parametrize("layout", DCP_LAYOUTS)
def test_dcp_model_equals_savers_full_state_dict(torch_ckpts, layout):
    ck = open_checkpoint(str(torch_ckpts[layout]))
    full = _load_dcp_flat(torch_ckpts.full[layout])
    for name, ref in full.items():
        if isinstance(ref, torch.Tensor) and name.startswith("model."):
            assert tensor_bytes(ck, name) == _raw(ref), name


def test_dcp_layouts_are_really_sharded(torch_ckpts):
    from ckptctl.model import layout_summary

    for layout, files in (("fsdp", 4), ("tp", 4), ("2d", 4)):
        lay = layout_summary(open_checkpoint(str(torch_ckpts[layout])))
        assert lay.world_size == files and lay.sharded_tensors > 0, layout
    zck = open_checkpoint(str(torch_ckpts["fsdp_zstd"]))
    assert {c.extent.encoding for t in zck.tensors.values() for c in t.chunks} == {"torch_zip+zstd"}


@pytest.mark.parametrize("name", ["hf_single", "hf_sharded"])
def test_safetensors_equals_load_file(torch_ckpts, name, where, request):
    from safetensors.torch import load_file

    d = torch_ckpts[name]
    expected = {}
    for f in sorted(d.glob("*.safetensors")):
        expected.update(load_file(f))
    url, opts = _url(where, d, request)
    ck = open_checkpoint(url, opts)
    assert ck.format == ("hf-safetensors" if name == "hf_sharded" else "safetensors")
    _assert_same(ck, expected, objects=False)


def test_safetensors_single_file_url(torch_ckpts, where, request):
    from safetensors.torch import load_file

    f = torch_ckpts.hf_single / "model.safetensors"
    url, opts = _url(where, f, request)
    ck = open_checkpoint(url, opts)
    assert list(ck.files) == ["model.safetensors"]
    _assert_same(ck, load_file(f), objects=False)


@pytest.mark.parametrize("name", ["nested_pt", "bin"])
def test_torch_save_equals_torch_load(torch_ckpts, name, where, request):
    url, opts = _url(where, torch_ckpts[name], request)
    ck = open_checkpoint(url, opts)
    assert ck.format == "torch"
    _assert_same(ck, _load(torch_ckpts[name]))


def test_zstd_dcp_step_and_objects(tmp_path):
    from conftest import write_tiny_dcp

    sd = write_tiny_dcp(tmp_path / "c", zstd=True)
    ck = open_checkpoint(str(tmp_path / "c"))
    assert ck.step == 42 and ck.info["step_source"] == "entry"
    assert read_object(ck, ck.objects["optim.param_groups.0.lr"]) == 0.01
    assert tensor_bytes(ck, "model.emb.weight") == _raw(sd["model"]["emb.weight"])
