"""Tensors stored as views (issue 7, item 1; item 15): a DCP chunk may hold a transposed,
``channels_last`` or offset view of a storage; torch restores the view on load, and so
must every ckptctl reader. zstd chunks stream once, in order, within memory bounds.

Each test proves values against what torch itself loads."""
from __future__ import annotations

import pytest

from conftest import dcp_save

torch = pytest.importorskip("torch")


def _strided_state(seed: int = 0):
    """A model with a transposed parameter and a channels_last conv, after one Adam step
    (the moments inherit the layouts): what a real run saves."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(5, 8)
    lin.weight = torch.nn.Parameter(torch.randn(5, 8, generator=g).t())  # strides (1, 8)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    model = torch.nn.ModuleDict({"lin": lin, "conv": conv})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
    loss = conv(x).sum() + lin(torch.randn(2, 5, generator=g)).sum()
    loss.backward()
    opt.step()
    assert not model["lin"].weight.is_contiguous()
    assert not opt.state[model["conv"].weight]["exp_avg"].is_contiguous()
    sd = {"model": model.state_dict()}
    for name, p in model.named_parameters():
        st = opt.state[p]
        sd[f"optim.{name}.exp_avg"] = st["exp_avg"]
        sd[f"optim.{name}.exp_avg_sq"] = st["exp_avg_sq"]
    sd["wide"] = torch.arange(4 * 70000, dtype=torch.float32).reshape(4, 70000).t()  # > 1 MiB
    return sd


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _save(path, sd, zstd=False):
    dcp_save(path, sd, zstd=zstd)


def _same(a, b) -> bool:
    """Bit-for-bit equality of two tensors' values (layouts may differ)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.fixture(params=["plain", "zstd"])
def strided_dcp(request, tmp_path):
    sd = _strided_state()
    p = tmp_path / "step-1"
    _save(p, sd, zstd=request.param == "zstd")
    return p, _flat(sd)


def test_read_tensor_honours_strides(strided_dcp):
    from ckptctl.formats import open_checkpoint, read_tensor

    path, ref = strided_dcp
    ck = open_checkpoint(str(path))
    for name, want in ref.items():
        got = torch.from_numpy(read_tensor(ck, name).view("uint8").copy())
        assert torch.equal(got.view(-1), want.contiguous().view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_consolidate_strided_is_exact(strided_dcp, tmp_path, cli, to):
    path, ref = strided_dcp
    out = tmp_path / "out"
    code, _, err = cli("consolidate", str(path), str(out), "--to", to, "--max-memory", "8MiB")
    assert code == 0, err
    if to == "torch":
        got = _flat(torch.load(out / "model.pt", weights_only=True))
    else:
        from safetensors.torch import load_file

        got = load_file(out / "model.safetensors")
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert _same(got[name], want), name


def test_reshard_strided_then_consolidate(strided_dcp, tmp_path, cli):
    path, ref = strided_dcp
    code, _, err = cli("reshard", str(path), str(tmp_path / "r2"), "--world-size", "2",
                       "--max-memory", "8MiB")
    assert code == 0, err
    code, _, err = cli("consolidate", str(tmp_path / "r2"), str(tmp_path / "c"), "--to", "torch")
    assert code == 0, err
    got = _flat(torch.load(tmp_path / "c" / "model.pt", weights_only=True))
    for name, want in ref.items():
        assert _same(got[name], want), name


def test_verify_full_and_finite_on_strided(strided_dcp, cli):
    path, _ = strided_dcp
    code, out, err = cli("verify", str(path), "--level", "full", "--check-finite")
    assert code == 0, out + err


def test_view_into_larger_storage(tmp_path):
    """A chunk whose tensor is an offset, strided view of a larger storage (torch.save keeps
    views as such): the reader gathers exactly the view, as torch.load does."""
    import io

    from ckptctl.formats.tensorio import chunk_bytes, read_rows
    from ckptctl.model import DTYPES, Checkpoint, Chunk, Extent, TensorEntry
    from ckptctl.storage import open_store

    base = torch.arange(100, dtype=torch.float32)
    view = base[7:7 + 30].reshape(5, 6).t()[1:4]  # offset, transposed, sliced: (3, 5)
    buf = io.BytesIO()
    torch.save(view, buf)
    (tmp_path / "c.bin").write_bytes(buf.getvalue())
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert loaded.storage_offset() != 0 and not loaded.is_contiguous()
    shape = tuple(view.shape)
    t = TensorEntry("v", DTYPES["float32"], shape,
                    [Chunk((0, 0), shape, Extent("c.bin", 0, len(buf.getvalue()), "torch_zip"))])
    ck = Checkpoint(str(tmp_path), "dcp", files={"c.bin": len(buf.getvalue())}, tensors={"v": t},
                    store=open_store(str(tmp_path)))
    want = loaded.contiguous().numpy().tobytes()
    assert bytes(chunk_bytes(ck, t, t.chunks[0])) == want
    assert bytes(read_rows(ck, t, t.chunks[0], 1, 3)) == want[1 * 20:3 * 20]


def test_zstd_rows_decompress_once(tmp_path):
    """Row blocks of a zstd chunk asked in order stream it once (item 15): the compressed
    bytes are read about once, not once per block."""
    from ckptctl.formats import open_checkpoint
    from ckptctl.formats.tensorio import read_rows

    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 1024, generator=g)  # 2 MiB
    _save(tmp_path / "z", {"w": w}, zstd=True)
    ck = open_checkpoint(str(tmp_path / "z"))
    t = ck.tensors["w"]
    c = t.chunks[0]
    before = ck.store.stats.bytes_read
    parts = [bytes(read_rows(ck, t, c, r, r + 64)) for r in range(0, 512, 64)]
    assert b"".join(parts) == w.numpy().tobytes()
    assert ck.store.stats.bytes_read - before <= c.extent.length * 1.1


def test_consolidate_strided_from_s3_is_exact(strided_dcp, tmp_path, cli, s3_bucket):
    """The same views read through ranged GETs from the loopback S3 server."""
    import json

    path, ref = strided_dcp
    s3_bucket.upload(path, "ck")
    opts = [a for k, v in s3_bucket.storage_options.items() if not isinstance(v, dict)
            for a in ("-o", f"{k}={v}")]
    opts += [a for k, v in s3_bucket.storage_options.items() if isinstance(v, dict)
             for kk, vv in v.items() for a in ("-o", f"{k}.{kk}={vv}")]
    out = tmp_path / "out"
    code, so, err = cli("consolidate", s3_bucket.url("ck"), str(out), "--to", "torch",
                        "--json", *opts)
    assert code == 0, so + err
    assert json.loads(so)["num_tensors"] == len(ref)
    got = _flat(torch.load(out / "model.pt", weights_only=True))
    for name, want in ref.items():
        assert _same(got[name], want), name
