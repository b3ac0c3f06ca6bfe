"""``dcp.load`` through :class:`ckptctl.dcp.Reader` (issue 37), from one process: every
source loads bit for bit equal to what was saved (DCP with objects and zstd, an HF folder
of shards, a torch.save file with a transposed view, a delta pack whose base is on S3),
names map with ``prefix`` and ``rename``, and what must not load does not: a hostile
pickle is refused before any entry is loaded, and a flipped byte in a sealed source makes
the load raise with the destination untouched. The torchrun loads at other meshes are in
``tests/test_dcp_reader_torchrun.py``.
"""
from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from conftest import dcp_save  # noqa: E402
from test_conversion_unsafe import _hostile_dcp  # noqa: E402

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ckptctl.dcp import Reader  # noqa: E402
from ckptctl.errors import CkptError, Finding, UsageError  # noqa: E402

pytest_plugins = ["fixtures_s3"]


def _load(state: dict, reader: Reader) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        dcp.load(state, storage_reader=reader)
    return state


def _zeros_like(sd):
    """The same tree, tensors zeroed, every other leaf None (to be loaded)."""
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_zeros_like(v) for v in sd)
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"emb.weight": torch.randn(12, 8, generator=g),
                      "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
                      "head.bias": torch.arange(5, dtype=torch.int64),
                      "scale": torch.tensor(0.5)},
            "optim": {"state": {"emb.weight": {"exp_avg": torch.randn(12, 8, generator=g)}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]},
            "step": 42}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                                  b.view(torch.uint8) if b.dim() else b)
    return a == b


@pytest.mark.parametrize("zstd", [False, True])
def test_a_dcp_checkpoint_loads_as_saved(tmp_path, zstd):
    sd = _state()
    dcp_save(tmp_path / "ck", sd, zstd=zstd)
    out = _zeros_like(sd)
    r = Reader(tmp_path / "ck")
    _load(out, r)
    assert _equal(out, sd)
    assert r.bytes_read == sum(t.numel() * t.element_size() for t in (
        sd["model"]["emb.weight"], sd["model"]["norm.weight"], sd["model"]["head.bias"],
        sd["optim"]["state"]["emb.weight"]["exp_avg"]))  # + the 0-dim scale, read whole


def _to(sd, device: str):
    if isinstance(sd, dict):
        return {k: _to(v, device) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_to(v, device) for v in sd)
    return sd.to(device) if isinstance(sd, torch.Tensor) else sd


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the device check)")
@pytest.mark.parametrize("zstd", [False, True])
def test_a_dcp_checkpoint_loads_into_cuda_tensors_as_saved(tmp_path, zstd):
    """The loading path a GPU job takes: destinations on the GPU are filled by copies, whole
    and, for a transposed (non-contiguous) destination, strided."""
    sd = _state()
    dcp_save(tmp_path / "ck", sd, zstd=zstd)
    out = _to(_zeros_like(sd), "cuda")
    emb_t = torch.zeros(8, 12, device="cuda")
    out["model"]["emb.weight"] = emb_t.t()
    _load(out, Reader(tmp_path / "ck"))
    assert out["model"]["emb.weight"].device.type == "cuda"
    assert _equal(_to(out, "cpu"), sd)
    assert torch.equal(emb_t.t().cpu(), sd["model"]["emb.weight"])


def test_a_partial_state_dict_reads_only_what_it_names(tmp_path):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    out = {"model": {"emb.weight": torch.zeros(12, 8)}}
    r = Reader(tmp_path / "ck")
    _load(out, r)
    assert torch.equal(out["model"]["emb.weight"], sd["model"]["emb.weight"])
    assert r.bytes_read == 12 * 8 * 4


def test_an_hf_folder_of_shards_loads_under_a_prefix(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    w = {"a.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
         "b.weight": torch.randn(3, 4, generator=g), "b.bias": torch.randn(3, generator=g)}
    d = tmp_path / "hf"
    d.mkdir()
    shards = {"a.weight": "model-00001-of-00002.safetensors",
              "b.weight": "model-00002-of-00002.safetensors",
              "b.bias": "model-00002-of-00002.safetensors"}
    for f in sorted(set(shards.values())):
        save_file({n: w[n] for n, s in shards.items() if s == f}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": shards}))
    out = {"model": {n: torch.zeros_like(t) for n, t in w.items()}}
    _load(out, Reader(d, prefix=("", "model.")))
    assert _equal(out["model"], w)


def test_a_torch_save_file_with_a_transposed_view_loads(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 9, generator=g)
    torch.save({"w": w.t(), "step": 7}, tmp_path / "train.pt")
    out = {"w": torch.zeros(9, 5), "step": 0}
    _load(out, Reader(tmp_path / "train.pt"))
    assert torch.equal(out["w"], w.t()) and out["step"] == 7


def test_a_strided_destination_is_filled_in_place(tmp_path):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    big = torch.zeros(8, 12)
    out = {"model": {"emb.weight": big.t()}}  # a view whose rows are not contiguous
    _load(out, Reader(tmp_path / "ck"))
    assert torch.equal(big.t(), sd["model"]["emb.weight"])


def test_rename_maps_and_drops_entries(tmp_path):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    out = {"emb": torch.zeros(12, 8)}
    _load(out, Reader(tmp_path / "ck", rename=lambda n: "emb" if n == "model.emb.weight"
                      else None))
    assert torch.equal(out["emb"], sd["model"]["emb.weight"])
    with pytest.raises(UsageError, match="two entries are renamed"):
        Reader(tmp_path / "ck", rename=lambda n: "same").read_metadata()


def test_a_rules_file_renames_and_drops(tmp_path):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    rules = tmp_path / "names.toml"
    rules.write_text("[[rename]]\nmatch = 'model\\.emb\\.(.*)'\nto = 'tok.\\1'\n"
                     "[[rename]]\nmatch = '(model|optim)\\..*'\ndrop = true\n")
    out = {"tok": {"weight": torch.zeros(12, 8)}, "step": None}
    _load(out, Reader(tmp_path / "ck", rename=rules))
    assert torch.equal(out["tok"]["weight"], sd["model"]["emb.weight"]) and out["step"] == 42
    rules.write_text("[[rename]]\nmatch = '('\nto = 'x'\n")
    with pytest.raises(UsageError, match="not a rename rules file"):
        Reader(tmp_path / "ck", rename=rules).read_metadata()


def test_a_delta_pack_with_its_base_on_s3_loads_as_its_source(tmp_path, s3_bucket):
    from ckptctl.packs.pack import pack

    base_sd, sd = _state(0), _state(0)
    sd["model"]["emb.weight"][3] += 1.0
    dcp_save(tmp_path / "src" / "step-10", base_sd)
    dcp_save(tmp_path / "src" / "step-20", sd)
    opts = s3_bucket.storage_options
    pack(str(tmp_path / "src" / "step-10"), s3_bucket.url("run/step-10"), workers=1,
         dst_storage_options=opts)
    pack(str(tmp_path / "src" / "step-20"), s3_bucket.url("run/step-20"),
         base=s3_bucket.url("run/step-10"), workers=1, base_storage_options=opts,
         dst_storage_options=opts)
    out = _zeros_like(sd)
    _load(out, Reader(s3_bucket.url("run/step-20"), opts))
    assert _equal(out, sd)


def test_a_hostile_pickle_loads_nothing(tmp_path):
    marker = tmp_path / "PAYLOAD-RAN"
    tensors = _hostile_dcp(tmp_path / "ck", marker)
    out = {"model": {n: torch.zeros_like(t) for n, t in tensors.items()}, "step": 0,
           "extra": {"payload": None}}
    with pytest.raises(CheckpointException) as e:  # DCP's wrapper of each rank's error
        _load(out, Reader(tmp_path / "ck"))
    assert "object entry 'extra.payload' names posix.system" in str(e.value), e.value
    assert not marker.exists()
    assert all(not t.any() for t in out["model"].values()) and out["step"] == 0


def _rank_error(e: CheckpointException) -> BaseException:
    """The error rank 0 raised inside DCP's wrapper."""
    return e.failures[0][0] if isinstance(e.failures[0], tuple) else e.failures[0]


def _flip_data_byte(folder, tensor) -> str:
    """Flip one byte of ``tensor``'s data where it lies in ``folder``'s files; returns the
    file's name."""
    data = tensor.numpy().tobytes()
    for f in sorted(folder.iterdir()):
        raw = bytearray(f.read_bytes())
        at = raw.find(data)
        if at >= 0:
            raw[at + 5] ^= 0x01
            f.write_bytes(bytes(raw))
            return f.name
    raise AssertionError("the tensor's bytes are in no file")


def test_a_flipped_byte_in_a_sealed_source_raises_and_loads_nothing(tmp_path, cli):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    assert cli("seal", str(tmp_path / "ck"))[0] == 0
    name = _flip_data_byte(tmp_path / "ck", sd["model"]["emb.weight"])
    out = _zeros_like(sd)
    with pytest.raises(CheckpointException) as e:  # DCP's wrapper of each rank's error
        _load(out, Reader(tmp_path / "ck"))
    err = _rank_error(e.value)
    assert isinstance(err, Finding) and err.code == "HASH_MISMATCH" and name in str(err), err
    assert all(not t.any() for t in out["model"].values())


def test_a_flipped_byte_in_an_unsealed_source_fails_its_crc_and_loads_nothing(tmp_path):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    name = _flip_data_byte(tmp_path / "ck", sd["model"]["emb.weight"])
    out = _zeros_like(sd)
    with pytest.raises(CheckpointException) as e:
        _load(out, Reader(tmp_path / "ck"))
    err = _rank_error(e.value)
    assert isinstance(err, Finding) and "CRC" in err.code and name in str(err), err
    assert all(not t.any() for t in out["model"].values())
    _load(out, Reader(tmp_path / "ck", verify=False))  # asked not to check: it loads
    assert not _equal(out["model"], sd["model"])


def test_verify_needs_a_manifest(tmp_path):
    dcp_save(tmp_path / "ck", _state())
    with pytest.raises(UsageError, match="needs a sealed checkpoint"):
        Reader(tmp_path / "ck", verify=True).read_metadata()


def test_a_checkpoint_ckptctl_refuses_is_refused_by_name(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("no checkpoint here")
    with pytest.raises(CkptError):
        Reader(tmp_path / "ck").read_metadata()
    assert not issubclass(Finding, UsageError)



def test_a_runs_root_and_another_frameworks_folder_are_refused_by_name(tmp_path):
    """Where one checkpoint is meant: a run's root says how many it holds (usage, before
    anything loads), another framework's layout ckptctl does not read (a DeepSpeed
    pipeline) is named, never half-read. (An Orbax step, refused so until issue 39, is
    read: tests/test_orbax.py.)"""
    from test_foreign import deepspeed_pipeline

    from ckptctl.errors import UnsupportedFormatError

    for s in (10, 20):
        dcp_save(tmp_path / "run" / f"step-{s}", _state(s))
    with pytest.raises(UsageError, match="2 checkpoints"):
        Reader(tmp_path / "run").read_metadata()
    with pytest.raises(UnsupportedFormatError, match="DeepSpeed pipeline"):
        Reader(deepspeed_pipeline(tmp_path / "pipe" / "global_step5")).read_metadata()


def test_a_sealed_dcp_on_s3_loads_and_a_flipped_byte_there_loads_nothing(tmp_path, s3_bucket,
                                                                         cli):
    sd = _state()
    dcp_save(tmp_path / "ck", sd)
    assert cli("seal", str(tmp_path / "ck"))[0] == 0
    s3_bucket.upload(tmp_path / "ck", "run/step-42")
    opts = s3_bucket.storage_options
    out = _zeros_like(sd)
    _load(out, Reader(s3_bucket.url("run/step-42"), opts))
    assert _equal(out, sd)
    _flip_data_byte(tmp_path / "ck", sd["model"]["emb.weight"])
    s3_bucket.upload(tmp_path / "ck", "bad/step-42")
    out = _zeros_like(sd)
    with pytest.raises(CheckpointException) as e:
        _load(out, Reader(s3_bucket.url("bad/step-42"), opts))
    assert _rank_error(e.value).code == "HASH_MISMATCH"
    assert all(not t.any() for t in out["model"].values())


DS_VARIANTS = [("z1-bf16", 2), ("z2-fp16", 2), ("z3-bf16", 2), ("z2-fp32", 3), ("z3-fp32", 3)]


def _empty_like_entries(ck, prefixes: tuple[str, ...]) -> dict:
    """A flat state dict of zeros shaped like ``ck``'s tensors under ``prefixes``."""
    return {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype.name))
            for n, t in ck.tensors.items() if n.startswith(prefixes)}


@pytest.mark.parametrize("name, world", DS_VARIANTS, ids=[f"{n}-w{w}" for n, w in DS_VARIANTS])
@pytest.mark.parametrize("universal", [False, True], ids=["zero", "universal"])
def test_deepspeed_loads_equal_deepspeeds_own_view(deepspeed_ckpts, name, world, universal):
    """Weights and Adam state of a DeepSpeed checkpoint (and of its ds_to_universal join),
    loaded through the Reader from one process, equal DeepSpeed's load_checkpoint view."""
    from ckptctl.formats.detect import open_checkpoint

    v = deepspeed_ckpts.variant(name, world)
    src = v.universal_tag if universal else v.tag_dir
    if src is None:
        pytest.skip(f"{name}: no universal checkpoint in the fixture")
    ck = open_checkpoint(str(src))
    out = _empty_like_entries(ck, ("model.", "optim.state."))
    _load(out, Reader(src, rename=lambda n: n if n in out else None))
    full = v.load_full()
    for n in v.entry["trainable"]:
        assert torch.equal(out[f"model.{n}"], full[f"param.{n}"]), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(out[f"optim.state.{n}.{key}"], full[f"{key}.{n}"]), (n, key)


@pytest.mark.parametrize("layout", ["legacy-tp2pp2", "legacy-tp4"])
def test_megatron_legacy_rank_folders_load_as_the_full_tensors(megatron_ckpts, layout):
    """A legacy TP x PP folder, merged by the Reader at load time, equals the full tensors
    its rank files were cut from."""
    from ckptctl.formats.detect import open_checkpoint

    run = megatron_ckpts.legacy(layout)
    src = run.run / ("release" if run.entry.get("release") else "iter_0000020")
    out = _empty_like_entries(open_checkpoint(str(src)), ("model.",))
    _load(out, Reader(src, rename=lambda n: n if n in out else None))
    full = run.load_full()["model"]
    assert out and all(torch.equal(t, full[n[len("model."):]]) for n, t in out.items())


@pytest.mark.parametrize("name, world", [("tp2-z2-bf16", 4), ("tp4-z2-fp32", 4)])
def test_deepspeed_autotp_loads_equal_ds_to_universal(deepspeed_ckpts, name, world):
    """An AutoTP (tensor-parallel) DeepSpeed checkpoint: weights and Adam state loaded
    through the Reader equal ds_to_universal's join of the same checkpoint."""
    from ckptctl.formats.detect import open_checkpoint

    v = deepspeed_ckpts.tp(name, world)
    out = _empty_like_entries(open_checkpoint(str(v.tag_dir)), ("model.", "optim.state."))
    _load(out, Reader(v.tag_dir, rename=lambda n: n if n in out else None))
    for n in v.entry["trainable"]:
        for key, entry in (("fp32", f"model.{n}"), ("exp_avg", f"optim.state.{n}.exp_avg"),
                           ("exp_avg_sq", f"optim.state.{n}.exp_avg_sq")):
            d = torch.load(v.universal_tag / "zero" / n / f"{key}.pt", weights_only=False)
            want = (d["param"] if isinstance(d, dict) else d).reshape(
                v.entry["logical_params"][n])
            assert torch.equal(out[entry], want), (n, key)
