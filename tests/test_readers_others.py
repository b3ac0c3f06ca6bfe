"""Readers on other people's checkpoints (issue 7 items 2-5, 8 for HF folders, 14 for nesting):
folders of several state files as one entry tree, parameter counts as the framework counts
them, legacy torch.save files, torch's HuggingFaceStorageWriter(save_distributed=True) output,
HF folders with a shard missing and torch.save files nested thousands deep.

Every checkpoint here is written by the real library (accelerate ``save_state``, transformers
``save_pretrained``, ``torch.save``, ``safetensors.torch.save_file``, torch's DCP writer) and
every value read through ckptctl is compared bit for bit with what that library loads.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl.errors import (
    FormatError,
    NotFoundError,
    UnsupportedFormatError,
    UsageError,
    shorten,
)
from ckptctl.formats import open_checkpoint, read_object, tensor_bytes
from ckptctl.formats.torchsave import MAX_NEST_DEPTH, flatten
from ckptctl.ops import consolidate, inspect, ls, reshard, verify


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- writers

WRITER = r'''
import json, sys, warnings
import torch
warnings.simplefilter("ignore")
out = sys.argv[1]

# accelerate save_state, both ways, with a registered custom object
from accelerate import Accelerator
from accelerate.utils import set_seed
set_seed(0)
acc = Accelerator(cpu=True)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
m, opt, sch = acc.prepare(m, opt, sch)
class Counter:
    def __init__(self): self.n = 3
    def state_dict(self): return {"n": self.n}
    def load_state_dict(self, d): self.n = d["n"]
acc.register_for_checkpointing(Counter())
for _ in range(2):
    loss = m(torch.randn(5, 4)).sum(); acc.backward(loss); opt.step(); sch.step(); opt.zero_grad()
acc.save_state(f"{out}/acc-st")
acc.save_state(f"{out}/acc-bin", safe_serialization=False)
counts = {"acc": {"params": sum(p.numel() for p in m.parameters()),
                  "buffers": sum(b.numel() for b in m.buffers())}}

# transformers GPT-2 with lm_head tied to wte, both ways
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
g.save_pretrained(f"{out}/gpt2-st")
g.save_pretrained(f"{out}/gpt2-bin", safe_serialization=False)
params = dict(g.named_parameters(remove_duplicate=False))
counts["gpt2"] = {"params": g.num_parameters(),
                  "buffers": sum(v.numel() for k, v in g.state_dict().items() if k not in params)}
json.dump(counts, open(f"{out}/counts.json", "w"))
'''


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """accelerate and transformers checkpoints, written once by a subprocess (accelerate
    keeps process-wide state)."""
    out = tmp_path_factory.mktemp("others")
    script = out / "write.py"
    script.write_text(WRITER)
    p = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _torch_flat(path) -> dict:
    return flatten(torch.load(path, weights_only=True, map_location="cpu"))


# --------------------------------------------------------------------------- item 2


@pytest.mark.parametrize("variant", ["st", "bin"])
def test_accelerate_folder_is_one_entry_tree(written, variant):
    d = written / f"acc-{variant}"
    ck = open_checkpoint(str(d))
    assert ck.format == "composite"
    model = (load_file(d / "model.safetensors") if variant == "st"
             else torch.load(d / "pytorch_model.bin", weights_only=True))
    expect = {"model." + k: v for k, v in model.items()}
    expect.update({"optim." + k: v for k, v in _torch_flat(d / "optimizer.bin").items()})
    expect.update({"lr_scheduler." + k: v for k, v in _torch_flat(d / "scheduler.bin").items()})
    got = set(ck.tensors) | set(ck.objects)
    assert got == set(expect) | {"rng.0", "custom.0"}, got ^ (set(expect) | {"rng.0", "custom.0"})
    for name, ref in expect.items():
        if isinstance(ref, torch.Tensor):
            assert tensor_bytes(ck, name) == _raw(ref), name
        else:
            assert read_object(ck, ck.objects[name]) == ref, name
    for name, f in (("rng.0", "random_states_0.pkl"), ("custom.0", "custom_checkpoint_0.pkl")):
        o = ck.objects[name]
        assert o.value is None and o.extent.encoding == "opaque"
        assert o.extent.length == (d / f).stat().st_size
    r = inspect(str(d), show_objects=True)
    assert {k for k, v in r.closure.items() if v} == {"model", "optim", "lr_scheduler", "rng", "meta"}
    rng = next(o for o in r.objects if o.name == "rng.0")
    assert rng.bytes == (d / "random_states_0.pkl").stat().st_size and "RNG" in rng.type
    assert rng.value is None
    v = verify(str(d), level="full", require="model,optim,lr_scheduler,rng")
    assert v.ok, v.problems


def test_opaque_pickles_are_never_unpickled(written, tmp_path, cli):
    d = _copy(written / "acc-st", tmp_path / "acc")
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Boom())
    pickle.loads(payload)  # the payload is live: unpickling it creates the marker
    assert marker.exists()
    marker.unlink()
    (d / "random_states_0.pkl").write_bytes(payload)
    (d / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps({"x": Boom()}))
    for args in (("inspect", str(d), "--show-objects", "--json"),
                 ("verify", str(d), "--level", "full"), ("ls", str(tmp_path))):
        code, _, err = cli(*args)
        assert code == 0, (args, err)
    code, _, err = cli("consolidate", str(d), str(tmp_path / "out"), "--to", "torch",
                       "--only", "model,optim,lr_scheduler")
    assert code == 0, err
    assert not marker.exists()


def test_hf_trainer_checkpoint_folder(written, tmp_path):
    """The HF Trainer's checkpoint-N layout: optimizer.pt, scheduler.pt, scaler.pt, an RNG
    file with numpy state (never unpickled) and training_args.bin (a pickled object)."""
    import numpy as np

    d = tmp_path / "checkpoint-3"
    d.mkdir()
    shutil.copy(written / "acc-st" / "model.safetensors", d)
    shutil.copy(written / "acc-st" / "optimizer.bin", d / "optimizer.pt")
    shutil.copy(written / "acc-st" / "scheduler.bin", d / "scheduler.pt")
    torch.save({"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 0}, d / "scaler.pt")
    torch.save({"numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, d / "rng_state.pth",
               _use_new_zipfile_serialization=True)
    torch.save(zipfile.ZipInfo("x"), d / "training_args.bin")  # any pickled object
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    ck = open_checkpoint(str(d))
    assert ck.format == "composite" and ck.step == 3
    heads = {n.split(".")[0] for n in list(ck.tensors) + list(ck.objects)}
    assert heads == {"model", "optim", "lr_scheduler", "scaler", "rng", "meta"}
    assert {n for n, o in ck.objects.items() if o.extent.encoding == "opaque"} == {
        "rng.0", "meta.training_args"}
    assert read_object(ck, ck.objects["scaler.scale"]) == 65536.0
    r = inspect(str(d))
    assert r.closure["rng"] and r.closure["meta"] and r.closure["optim"]


def test_bin_variant_does_not_merge_namespaces(written, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(written / "acc-bin" / "pytorch_model.bin", plain)
    (plain / "config.json").write_text("{}")
    ck = open_checkpoint(str(plain))  # a plain HF model folder keeps its names
    ref = torch.load(plain / "pytorch_model.bin", weights_only=True)
    assert ck.format == "torch" and set(ck.tensors) == set(ref)
    shutil.copy(written / "acc-bin" / "optimizer.bin", plain)
    ck = open_checkpoint(str(plain))  # now a training state: one tree, each file its prefix
    assert ck.format == "composite"
    assert {n.split(".")[0] for n in list(ck.tensors) + list(ck.objects)} == {"model", "optim"}
    assert {n for n in ck.tensors if n.startswith("model.")} == {"model." + k for k in ref}


@pytest.mark.parametrize("extra", ["extra.pt", "notes.pkl", "adapter_model.safetensors"])
def test_state_file_that_cannot_be_placed_is_refused(written, tmp_path, cli, extra):
    d = _copy(written / "acc-st", tmp_path / "acc")
    if extra.endswith(".safetensors"):
        save_file({"w": torch.zeros(2)}, d / extra)
    else:
        torch.save({"w": torch.zeros(2)}, d / extra)
    with pytest.raises(UnsupportedFormatError) as e:
        open_checkpoint(str(d))
    assert extra in str(e.value) and "refusing" in str(e.value)
    code, _, err = cli("inspect", str(d))
    assert code == 3 and extra in err and len(err.strip().splitlines()) == 1


def test_state_folder_with_a_nested_checkpoint_is_refused(written, tmp_path):
    from conftest import write_tiny_dcp

    d = _copy(written / "acc-st", tmp_path / "acc")
    (d / "model.safetensors").unlink()
    write_tiny_dcp(d / "pytorch_model_fsdp_0")  # accelerate's FSDP SHARDED_STATE_DICT layout
    with pytest.raises(UnsupportedFormatError, match="pytorch_model_fsdp_0/"):
        open_checkpoint(str(d))


def test_unplaceable_torch_file_next_to_model_weights_is_refused(written, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(written / "acc-bin" / "pytorch_model.bin", d)
    torch.save({"a": torch.ones(1)}, d / "other.pt")
    with pytest.raises(UnsupportedFormatError, match="other.pt"):
        open_checkpoint(str(d))
    (d / "pytorch_model.bin").unlink()
    torch.save({"a": torch.ones(1)}, d / "third.pt")
    with pytest.raises(UnsupportedFormatError, match="2 torch.save files"):
        open_checkpoint(str(d))


def test_consolidate_to_safetensors_refuses_objects(written, tmp_path, cli):
    d = written / "acc-st"
    code, _, err = cli("consolidate", str(d), str(tmp_path / "a"), "--to", "safetensors")
    assert code == 2, err
    line = err.strip()
    assert len(line.splitlines()) == 1
    assert "non-tensor entries" in line and "--only model" in line and "--to torch" in line
    n_objects = len(open_checkpoint(str(d)).objects)
    assert f"holds {n_objects} " in line and "custom.0" in line
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    code, _, err = cli("consolidate", str(d), str(tmp_path / "b"), "--to", "safetensors",
                       "--only", "model")
    assert code == 0, err
    got = load_file(tmp_path / "b" / "model.safetensors")
    ref = load_file(d / "model.safetensors")
    assert set(got) == {"model." + k for k in ref}
    assert all(_raw(got["model." + k]) == _raw(v) for k, v in ref.items())


def test_conversions_refuse_opaque_objects_unless_left_out(written, tmp_path, cli):
    d = written / "acc-bin"
    code, _, err = cli("consolidate", str(d), str(tmp_path / "t.pt"), "--to", "torch")
    assert code == 2 and "custom.0" in err and "rng.0" in err and "--only" in err, err
    with pytest.raises(UsageError, match="opaque"):
        reshard(str(d), str(tmp_path / "r"), world_size=2)
    with pytest.raises(UsageError, match="rng.0"):
        consolidate(str(d), str(tmp_path / "dcp"), to="dcp")
    r = consolidate(str(d), str(tmp_path / "ok.pt"), to="torch", only="model,optim,lr_scheduler")
    assert r.num_objects > 0
    got = torch.load(tmp_path / "ok.pt", weights_only=True)
    assert set(got) == {"model", "optim", "lr_scheduler"}
    ref = torch.load(d / "optimizer.bin", weights_only=True)
    assert got["optim"]["param_groups"] == ref["param_groups"]
    for k, st in ref["state"].items():
        for key, v in st.items():
            assert _raw(got["optim"]["state"][k][key]) == _raw(v)
    model = torch.load(d / "pytorch_model.bin", weights_only=True)
    assert {k: _raw(v) for k, v in got["model"].items()} == {k: _raw(v) for k, v in model.items()}


# --------------------------------------------------------------------------- item 3


@pytest.mark.parametrize("variant", ["st", "bin"])
def test_num_params_tied_gpt2_equals_transformers(written, variant):
    counts = json.loads((written / "counts.json").read_text())["gpt2"]
    d = written / f"gpt2-{variant}"
    r = inspect(str(d))
    assert (r.num_params, r.num_buffers) == (counts["params"], counts["buffers"])
    if variant == "bin":  # two names, one storage: recorded as an alias
        ck = open_checkpoint(str(d))
        assert ck.info["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
        assert tensor_bytes(ck, "lm_head.weight") == tensor_bytes(ck, "transformer.wte.weight")


@pytest.mark.parametrize("variant", ["st", "bin"])
def test_num_params_batchnorm_buffers_apart(written, variant, cli):
    counts = json.loads((written / "counts.json").read_text())["acc"]
    r = inspect(str(written / f"acc-{variant}"))
    assert (r.num_params, r.num_buffers) == (counts["params"], counts["buffers"])
    code, out, _ = cli("inspect", str(written / f"acc-{variant}"), "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["num_params"], doc["num_buffers"]) == (counts["params"],
                                                                     counts["buffers"])
    code, out, _ = cli("inspect", str(written / f"acc-{variant}"))
    assert f"buffers {counts['buffers']}" in out


def test_lightning_style_checkpoint_parts(tmp_path):
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    ckpt = {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.5.0",
            "state_dict": m.state_dict(), "loops": {"fit_loop": {"state_dict": {}, "epoch_progress":
                                                                 {"total": {"ready": 1}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None,
                                                               "kth_value": torch.tensor(1.5)}},
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "hyper_parameters": {"lr": 0.001, "hidden": torch.tensor([4])}}
    torch.save(ckpt, tmp_path / "epoch=0-step=2.ckpt")
    r = inspect(str(tmp_path / "epoch=0-step=2.ckpt"))
    assert r.num_params == sum(p.numel() for p in m.parameters())
    assert r.num_buffers == sum(b.numel() for b in m.buffers())
    parts = {t.name: t.part for t in r.tensors}
    assert parts["callbacks.ModelCheckpoint{'monitor': None}.kth_value"] == "meta"
    assert parts["hyper_parameters.hidden"] == "meta"
    assert parts["optimizer_states.0.state.0.exp_avg"] == "optim"
    assert r.closure["meta"] and r.closure["optim"] and r.closure["step"]


# --------------------------------------------------------------------------- item 4


def test_legacy_torch_save_is_read(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(3, 4, generator=g), "view": torch.randn(4, 6, generator=g).t(),
          "n": torch.arange(5), "lr": 0.1, "nested": {"b": torch.ones(2, dtype=torch.bfloat16)}}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:2] != b"PK"
    with pytest.raises(RuntimeError, match="mmap"):
        torch.load(path, weights_only=True, mmap=True)  # why we fall back
    ck = open_checkpoint(str(path))
    ref = flatten(torch.load(path, weights_only=True))
    assert set(ck.tensors) == {k for k, v in ref.items() if isinstance(v, torch.Tensor)}
    for k in ck.tensors:
        assert tensor_bytes(ck, k) == _raw(ref[k]), k
    assert read_object(ck, ck.objects["lr"]) == 0.1
    assert verify(str(path), level="full").ok


def test_shorten_cuts_at_word_boundaries():
    text = "the pickle refers to an unsupported global named something.very.long"
    for limit in range(5, len(text) + 5):
        s = shorten(text, limit)
        assert len(s) <= limit + 3
        if s != text:
            assert s.endswith("...") and text.startswith(s[:-3])
            assert text[len(s) - 3] in " ,;:([{", (limit, s)  # the cut falls on a space
    assert shorten("first line\nsecond", 50) == "first line"


def test_unloadable_torch_file_message_is_one_line_not_cut_mid_word(tmp_path, cli):
    path = tmp_path / "broken.pt"
    torch.save({"w": torch.zeros(3)}, path)
    data = bytearray(path.read_bytes())
    # a damaged record inside an intact zip: torch's own (long) message is the one shown
    # (a zip cut short is said in ckptctl's words: tests/test_garbage_and_traps.py)
    second = data.index(b"PK\x03\x04", 4)
    data[second:second + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(Exception) as theirs:
        torch.load(path, weights_only=True)
    original = str(theirs.value).strip().splitlines()[0]
    with pytest.raises(FormatError) as ours:
        open_checkpoint(str(path))
    msg = ours.value.message
    inner = msg[msg.index("(") + 1:-1]
    if inner.endswith("..."):
        cut = inner[:-3]
        assert original.startswith(cut) and original[len(cut)] in " ,;:([{"
    else:
        assert inner == original
    code, _, err = cli("inspect", str(path))
    assert code == 3 and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- item 5

HF_WRITER = r'''
import os, sys, warnings
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g),
            "c": torch.randn(3, 7, generator=g).to(torch.bfloat16), "r": torch.randn(3, generator=g)}
    sd = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
          "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
          "c": distribute_tensor(full["c"], mesh, [Shard(1)]),
          "r": distribute_tensor(full["r"], mesh, [Replicate()])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    if rank == 0:
        torch.save(full, out + ".full.pt")
    dist.barrier()
    dist.destroy_process_group()
    # gloo's C++ threads sometimes abort interpreter teardown ("terminate called without
    # an active exception", SIGABRT) after all work is done: leave before it (as the
    # fixtures in tests/fixtures do)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(rank_main, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
'''


def _write_like_hf_writer(d: Path, full: dict, boxes: dict) -> None:
    """Files laid out exactly as torch's HuggingFaceStorageWriter(save_distributed=True)
    writes them (filesystem.py: ``safetensors.torch.save(tensors, metadata=...)``):
    ``boxes`` maps rank -> {name: (offsets, slices)}."""
    d.mkdir()
    for rank, items in boxes.items():
        tensors = {n: full[n][sl].contiguous() for n, (_, sl) in items.items()}
        meta = {"DCP_SHARDING_INFO": json.dumps({n: {"saved_offsets": list(off)}
                                                 for n, (off, _) in items.items()}),
                "DCP_VERSION": "1.0", "format": "pt"}
        save_file(tensors, d / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", meta)


def _check_sharded(d: Path, full: dict):
    ck = open_checkpoint(str(d))
    assert ck.info.get("sharded_by") == "DCP_SHARDING_INFO"
    assert set(ck.tensors) == set(full)
    for n, ref in full.items():
        assert ck.tensors[n].shape == tuple(ref.shape), n
        assert tensor_bytes(ck, n) == _raw(ref), n
    r = verify(str(d), level="full")
    assert r.ok, r.problems
    return ck


def test_hf_storage_writer_distributed_layout(tmp_path, cli):
    g = torch.Generator().manual_seed(1)
    full = {"w": torch.randn(6, 4, generator=g), "c": torch.randn(3, 7, generator=g).bfloat16(),
            "r": torch.randn(3, generator=g)}
    _write_like_hf_writer(tmp_path / "hf", full, {
        0: {"w": ((0, 0), (slice(0, 3),)), "c": ((0, 0), (slice(None), slice(0, 4))),
            "r": ((0,), (slice(None),))},
        1: {"w": ((3, 0), (slice(3, 6),)), "c": ((0, 4), (slice(None), slice(4, 7)))}})
    ck = _check_sharded(tmp_path / "hf", full)
    assert [len(ck.tensors[n].chunks) for n in ("w", "c", "r")] == [2, 2, 1]
    assert inspect(str(tmp_path / "hf")).layout["world_size"] == 2
    code, _, err = cli("consolidate", str(tmp_path / "hf"), str(tmp_path / "one"))
    assert code == 0, err
    got = load_file(tmp_path / "one" / "model.safetensors")
    assert {k: _raw(v) for k, v in got.items()} == {k: _raw(v) for k, v in full.items()}


def test_hf_storage_writer_overlap_and_bad_offsets(tmp_path):
    full = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4)}
    _write_like_hf_writer(tmp_path / "overlap", full, {
        0: {"w": ((0, 0), (slice(0, 4),))}, 1: {"w": ((3, 0), (slice(3, 6),))}})
    r = verify(str(tmp_path / "overlap"), level="structure")
    assert [p.code for p in r.problems] == ["CHUNK_OVERLAP"]
    _write_like_hf_writer(tmp_path / "gap", full, {
        0: {"w": ((0, 0), (slice(0, 2),))}, 1: {"w": ((3, 0), (slice(3, 6),))}})
    assert [p.code for p in verify(str(tmp_path / "gap"), level="structure").problems] == ["CHUNK_GAP"]
    d = tmp_path / "bad"
    d.mkdir()
    save_file({"w": full["w"]}, d / "shard-00001-model-00001-of-00001.safetensors",
              {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})})
    with pytest.raises(FormatError, match="saved_offsets"):
        open_checkpoint(str(d))
    save_file({"w": full["w"]}, d / "shard-00001-model-00001-of-00001.safetensors",
              {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2**60, 0]}})})
    with pytest.raises(FormatError, match="absurdly large"):
        open_checkpoint(str(d))
    d = tmp_path / "dup"  # the same name in two rank files without sharding info is still
    d.mkdir()             # an error (two complete files are two exports: test_exports.py)
    save_file({"w": full["w"]}, d / "shard-00001-model-00001-of-00001.safetensors")
    save_file({"w": full["w"]}, d / "shard-00002-model-00001-of-00001.safetensors")
    with pytest.raises(FormatError, match="also stored"):
        open_checkpoint(str(d))


@pytest.mark.slow
def test_hf_storage_writer_real_two_gloo_ranks(tmp_path):
    import socket

    script = tmp_path / "w.py"
    script.write_text(HF_WRITER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, str(script), str(out), str(port)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    full = torch.load(str(out) + ".full.pt", weights_only=True)
    ck = _check_sharded(out, full)
    assert ck.tensors["c"].sharded_dims() == (1,) and len(ck.tensors["r"].chunks) == 1


# --------------------------------------------------------------------------- item 8 (HF)


def _hf_sharded(d: Path, n: int, *, index: bool, ext: str = "safetensors") -> dict:
    d.mkdir()
    g = torch.Generator().manual_seed(2)
    weight_map, tensors = {}, {}
    for k in range(1, n + 1):
        name = (f"model-{k:05d}-of-{n:05d}.safetensors" if ext == "safetensors"
                else f"pytorch_model-{k:05d}-of-{n:05d}.bin")
        part = {f"layers.{k}.w": torch.randn(2, 3, generator=g)}
        (save_file(part, d / name) if ext == "safetensors" else torch.save(part, d / name))
        weight_map.update({t: name for t in part})
        tensors.update(part)
    if index:
        idx = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
        (d / idx).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    return tensors


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
@pytest.mark.parametrize("index", [True, False])
def test_hf_folder_with_a_missing_shard_is_incomplete(tmp_path, index, ext, cli):
    root = tmp_path / "run"
    d = root / "checkpoint-7"
    root.mkdir()
    tensors = _hf_sharded(d, 19, index=index, ext=ext)
    ck = open_checkpoint(str(d))
    assert {n: tensor_bytes(ck, n) for n in ck.tensors} == {n: _raw(v) for n, v in tensors.items()}
    stem = "model" if ext == "safetensors" else "pytorch_model"
    for k in (4, 11, 19):
        (d / f"{stem}-{k:05d}-of-00019.{ext}").unlink()
    with pytest.raises(NotFoundError) as e:
        open_checkpoint(str(d))
    assert e.value.code == "MISSING_FILE"
    assert f"{stem}-00004-of-00019.{ext}" in str(e.value) and "3 of 19" in str(e.value)
    r = verify(str(d), level="quick")
    assert not r.ok and [p.code for p in r.problems] == ["MISSING_FILE"]
    code, out, _ = cli("verify", str(d), "--level", "quick")
    assert code == 1 and "00004-of-00019" in out
    rows = ls(str(root)).checkpoints
    assert [(c.name, c.state) for c in rows] == [("checkpoint-7", "incomplete")]


# --------------------------------------------------------------------------- item 14 (nesting)


def _deep_pickle(depth: int, kind: str) -> bytes:
    """A protocol-2 pickle of dicts (or lists) nested ``depth`` deep, built with opcodes
    torch's weights-only unpickler accepts (torch.save itself cannot write one: its
    pickler recurses)."""
    if kind == "list":
        return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    out = bytearray(b"\x80\x02}r" + struct.pack("<I", 0))
    for i in range(1, depth):  # a new dict holding the previous one under "a"
        out += (b"}X" + struct.pack("<I", 1) + b"aj" + struct.pack("<I", (i - 1) % 2)
                + b"sr" + struct.pack("<I", i % 2))
    return bytes(out + b".")


def _torch_zip(path: Path, data_pkl: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_torch_save_nested_thousands_deep_is_one_line_format_error(tmp_path, kind, cli):
    assert pickle.loads(_deep_pickle(3, kind)) == ({"a": {"a": {}}} if kind == "dict" else [[[]]])
    path = tmp_path / "deep.pt"
    _torch_zip(path, _deep_pickle(20_000, kind))
    assert isinstance(torch.load(path, weights_only=True), dict if kind == "dict" else list)
    with pytest.raises(FormatError, match="nests too deeply"):
        open_checkpoint(str(path))
    code, _, err = cli("inspect", str(path))
    assert code == 3 and "nests too deeply" in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1
    r = verify(str(path), level="structure")
    assert not r.ok and "nests too deeply" in r.problems[0].message
    rows = [(c.name, c.format, c.state) for c in ls(str(tmp_path)).checkpoints]
    assert rows == [("deep.pt", "torch", "corrupt")]
    assert "nests too deeply" in ls(str(tmp_path)).checkpoints[0].reason
    # just inside the bound still reads
    _torch_zip(path, _deep_pickle(MAX_NEST_DEPTH, kind))
    if kind == "dict":
        ck = open_checkpoint(str(path))
        assert list(ck.objects) == [".".join(["a"] * (MAX_NEST_DEPTH - 1))]


def test_accelerate_folder_on_s3(written, s3_bucket):
    """The remote path: torch.save parts are fetched to a temp file, opaque pickles never read."""
    s3_bucket.upload(written / "acc-bin", "acc")
    s3_bucket.server.reset_log()
    ck = open_checkpoint(s3_bucket.url("acc"), s3_bucket.storage_options)
    local = open_checkpoint(str(written / "acc-bin"))
    assert ck.format == "composite"
    assert set(ck.tensors) == set(local.tensors) and set(ck.objects) == set(local.objects)
    for n in ck.tensors:
        assert tensor_bytes(ck, n) == tensor_bytes(local, n), n
    read = {q.key.rsplit("/", 1)[-1] for q in s3_bucket.server.request_log() if q.op == "GET"}
    assert not read & {"random_states_0.pkl", "custom_checkpoint_0.pkl"}, read
