"""Empty tensors (a dimension of size 0) reshard and consolidate like any other tensor, as
torch does (issue 7, item 6): torch's own loaders read the outputs back equal to what
``dcp.save`` was given."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.ops import verify


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {
        "rows.weight": torch.zeros(0, 4),
        "cols.weight": torch.zeros(4, 0),
        "flat.bias": torch.zeros(0),
        "cube.weight": torch.zeros(2, 0, 3, dtype=torch.bfloat16),
        "layers.0.attention.wq.weight": torch.zeros(0, 8),  # column-parallel under llama
        "layers.0.attention.wo.weight": torch.zeros(8, 0),  # row-parallel: shards the 0 dim
        "dense.weight": torch.randn(5, 3, generator=g),
    }}


def _like(sd: dict) -> dict:
    """Same shapes, other values: what dcp.load must overwrite."""
    return {k: {n: torch.full_like(t, 7) for n, t in v.items()} for k, v in sd.items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y), k


@pytest.fixture
def empty_dcp(tmp_path):
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "src"))
    return tmp_path / "src", sd


@pytest.mark.parametrize("layout", [["--world-size", "2"], ["--world-size", "3"],
                                    ["--mesh", "dp=2,tp=2", "--rules", "llama"]],
                         ids=["dp2", "dp3", "dp2tp2"])
def test_empty_tensors_reshard_and_consolidate(cli, tmp_path, empty_dcp, layout):
    from safetensors.torch import load_file

    src, sd = empty_dcp
    out = tmp_path / "resharded"
    code, _, err = cli("reshard", str(src), str(out), *layout)
    assert code == 0, err
    assert verify(str(out), level="full").ok
    with warnings.catch_warnings():  # torch: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        got = _like(sd)
        dcp.load(got, checkpoint_id=str(out))
    _equal(sd["model"], got["model"])
    code, _, err = cli("consolidate", str(out), str(tmp_path / "pt"), "--to", "torch")
    assert code == 0, err
    _equal(sd["model"], torch.load(tmp_path / "pt" / "model.pt", weights_only=True)["model"])
    code, _, err = cli("consolidate", str(out), str(tmp_path / "st"), "--strip-prefix", "model.")
    assert code == 0, err
    _equal(sd["model"], load_file(tmp_path / "st" / "model.safetensors"))
