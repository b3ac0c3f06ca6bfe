"""Sealed while saved (issue 21, part 2): :class:`ckptctl.dcp.SealingWriter` and the
training-loop callbacks of :mod:`ckptctl.callbacks`.

The contract checked everywhere: the manifest written during the save is byte for byte
the one ``seal`` writes for the same files (a copy of the folder without its manifest,
sealed afterwards: its ``created`` is when the newest file was written, whoever seals);
the checkpoint verifies at ``--level full`` and loads with
``dcp.load``. Covered: ``dcp.save``, ``dcp.async_save``, FSDP2 on 2 gloo ranks under
torchrun (this file is its worker script), ``memory://`` and a loopback S3 server, the
HF Trainer and Lightning on CPU, and a save that fails mid-write (nothing looks sealed).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

MANIFEST = "ckptctl.manifest.json"
ROOT = Path(__file__).resolve().parents[1]


def state(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(128, 64, generator=g), "b": torch.randn(7, generator=g),
                      "h": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
            "optim": {"lr": 0.01, "betas": [0.9, 0.95]}, "step": 12}


def resealed(folder: Path, tmp: Path) -> bytes:
    """What ``seal`` writes for a copy of ``folder`` without its manifest (same name:
    the step may come from it)."""
    from ckptctl.integrity.seal import seal

    copy = tmp / f"reseal-{uuid.uuid4().hex[:8]}" / folder.name
    shutil.copytree(folder, copy)
    (copy / MANIFEST).unlink()
    seal(str(copy))
    return (copy / MANIFEST).read_bytes()


def resealed_in_place(url: str, storage_options: dict | None = None) -> tuple[bytes, bytes]:
    """(the manifest the writer committed at ``url``, what ``seal`` writes there after it is
    removed): in place, as a copy elsewhere (a download, another prefix) would carry new
    modification times, and a manifest's ``created`` is its newest file's."""
    from ckptctl.integrity.seal import seal
    from ckptctl.storage import open_store

    store = open_store(url, storage_options)
    written = store.read(MANIFEST)
    store.remove(MANIFEST)
    seal(url, storage_options)
    return written, open_store(url, storage_options).read(MANIFEST)


def verify_full(url: str, storage_options: dict | None = None) -> None:
    from ckptctl.integrity.verify import verify

    r = verify(url, storage_options, level="full")
    assert not [p for p in r.problems if p.severity == "error"], r.problems


def assert_loads(url: str, want: dict) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    got = {"model": {k: torch.empty_like(v) for k, v in want["model"].items()},
           "optim": {"lr": 0.0, "betas": [0.0, 0.0]}, "step": 0}
    dcp.load(got, checkpoint_id=url)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["step"] == want["step"] and got["optim"] == want["optim"]


# -- dcp.save / dcp.async_save ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_save_seals_as_seal_would(tmp_path, threads):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter
    from conftest import run_cli

    sd = state()
    folder = tmp_path / "run" / "step-12"
    w = SealingWriter(folder, thread_count=threads)
    dcp.save(sd, storage_writer=w)
    stored = (folder / MANIFEST).read_bytes()
    assert stored == resealed(folder, tmp_path)
    from ckptctl.formats.manifest import Manifest

    assert json.loads(stored)["step"] == 12
    assert w.manifest_id == Manifest.parse(stored, "m").id
    assert sorted(json.loads(stored)["files"]) == sorted(
        p.name for p in folder.iterdir() if p.name != MANIFEST)
    code, out, err = run_cli("verify", "--level", "full", str(folder))
    assert code == 0, out + err
    assert_loads(str(folder), state())


def test_async_save_seals(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter

    folder = tmp_path / "step-12"
    w = SealingWriter(tmp_path / "elsewhere", tags=["async"], hash="sha256")
    dcp.async_save(state(), checkpoint_id=folder, storage_writer=w).result()  # reset() to it
    assert not (tmp_path / "elsewhere").exists()
    stored = (folder / MANIFEST).read_bytes()
    from ckptctl.integrity.seal import seal

    copy = tmp_path / "copy" / "step-12"
    shutil.copytree(folder, copy)
    (copy / MANIFEST).unlink()
    seal(str(copy), hash="sha256", tags=["async"])
    assert stored == (copy / MANIFEST).read_bytes()
    verify_full(str(folder))
    assert_loads(str(folder), state())


def test_resave_into_the_same_folder_reseals(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter

    folder = tmp_path / "step-12"
    dcp.save(state(0), storage_writer=SealingWriter(folder))
    first = (folder / MANIFEST).read_bytes()
    dcp.save(state(1), storage_writer=SealingWriter(folder))
    assert (folder / MANIFEST).read_bytes() != first
    assert (folder / MANIFEST).read_bytes() == resealed(folder, tmp_path)
    verify_full(str(folder))


# -- a save that fails leaves nothing sealed -----------------------------------------------------


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("no pickling for you")


def _fail_in_plan(sd):
    sd["optim"]["bad"] = Unpicklable()


def _fail_mid_file(monkeypatch):
    from ckptctl import dcp as sealing

    real = sealing.HashingStream.write

    def write(self, b):
        if self.pos > 4096:
            raise OSError(28, "No space left on device")
        return real(self, b)

    monkeypatch.setattr(sealing.HashingStream, "write", write)


@pytest.mark.parametrize("how", ["object", "disk-full"])
def test_failed_save_leaves_nothing_sealed(tmp_path, monkeypatch, how):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter

    folder = tmp_path / "step-12"
    dcp.save(state(), storage_writer=SealingWriter(folder))  # a sealed one is there first
    assert (folder / MANIFEST).exists()
    sd = state(1)
    if how == "object":
        _fail_in_plan(sd)
    else:
        _fail_mid_file(monkeypatch)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # a BaseException
        dcp.save(sd, storage_writer=SealingWriter(folder))
    names = {p.name for p in folder.iterdir()}
    assert MANIFEST not in names and ".metadata" not in names, names


def test_refuses_saves_without_collectives(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter
    from ckptctl.errors import UsageError

    with pytest.raises(UsageError, match="use_collectives=True"):
        dcp.save(state(), storage_writer=SealingWriter(tmp_path / "s"), use_collectives=False)
    assert not (tmp_path / "s" / MANIFEST).exists()


# -- fsspec URLs ------------------------------------------------------------------------------


def test_memory_url(tmp_path):
    import fsspec
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter

    url = f"memory://sw-{uuid.uuid4().hex[:8]}/step-12"
    dcp.save(state(), storage_writer=SealingWriter(url))
    written, sealed = resealed_in_place(url)
    assert written == sealed
    verify_full(url)
    local = tmp_path / "step-12"
    fsspec.filesystem("memory").get(url + "/", str(local) + "/", recursive=True)
    assert_loads(str(local), state())


def test_s3_url(tmp_path, s3_bucket):
    import torch.distributed.checkpoint as dcp

    from ckptctl.dcp import SealingWriter

    url = s3_bucket.url("run/step-12")
    so = s3_bucket.storage_options
    dcp.save(state(), storage_writer=SealingWriter(url, storage_options=so))
    written, sealed = resealed_in_place(url, so)
    assert written == sealed
    verify_full(url, so)
    local = tmp_path / "step-12"
    s3_bucket.fs().get(s3_bucket.path("run/step-12") + "/", str(local) + "/", recursive=True)
    assert_loads(str(local), state())


# -- FSDP2 on 2 gloo ranks --------------------------------------------------------------------


def test_fsdp2_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", __file__, str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    folder = tmp_path / "step-2"
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    assert (folder / MANIFEST).read_bytes() == resealed(folder, tmp_path)
    verify_full(str(folder))
    import torch
    import torch.distributed.checkpoint as dcp

    full = torch.load(tmp_path / "full.pt", weights_only=True)
    got = {"model": {k: torch.empty_like(v) for k, v in full.items()}}
    dcp.load(got, checkpoint_id=str(folder))
    assert all(torch.equal(got["model"][k], v) for k, v in full.items())


def fsdp_worker(out: Path) -> None:
    """torchrun worker: 2 AdamW steps of a small MLP under ``fully_shard``, then a
    SealingWriter save of the sharded state to ``out/step-2``; rank 0
    also saves the full model state to ``out/full.pt``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from ckptctl.dcp import SealingWriter

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, storage_writer=SealingWriter(out / "step-2"))
    full, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, out / "full.pt")
    dist.barrier()
    dist.destroy_process_group()
    # under load, CI saw a rank abort after this point, in torch's teardown at interpreter
    # exit ("terminate called without an active exception"; twice, never on this box):
    # the work is done and flushed, so leave without the C++ destructors; the test then
    # checks every byte (manifest, verify --level full, dcp.load)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- training loops ---------------------------------------------------------------------------


def test_hf_trainer_callback(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ckptctl.callbacks import HFSealingCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                       n_positions=16))
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))}
            for _ in range(16)]
    out = tmp_path / "hf"
    tier = tmp_path / "ckptctl.toml"
    tier.write_text(f'[[tier]]\nname = "hot"\nurl = "{out}"\n')
    args = TrainingArguments(str(out), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             use_cpu=True, report_to=[], logging_steps=100, disable_tqdm=True)
    cb = HFSealingCallback(tags=["hf"], watch=str(tier))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert [(Path(r.url).name, r.action, r.step) for r in cb.results] == [
        ("checkpoint-2", "sealed", 2), ("checkpoint-4", "sealed", 4)]
    from ckptctl.integrity.seal import seal

    for name in ("checkpoint-2", "checkpoint-4"):
        folder = out / name
        copy = tmp_path / "copy" / name
        shutil.copytree(folder, copy)
        (copy / MANIFEST).unlink()
        seal(str(copy), step=int(name.split("-")[1]), tags=["hf"])
        assert (folder / MANIFEST).read_bytes() == (copy / MANIFEST).read_bytes()
        verify_full(str(folder))


def test_hf_callback_refuses_a_save_outside_the_first_tier(tmp_path):
    pytest.importorskip("transformers")
    from ckptctl.callbacks import check_in_tier, first_tier
    from ckptctl.errors import UsageError

    tier = tmp_path / "ckptctl.toml"
    tier.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n')
    with pytest.raises(UsageError, match="not in the first tier"):
        check_in_tier(str(tmp_path / "elsewhere"), first_tier(str(tier)), str(tier))


def test_lightning_callback(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptctl.callbacks import LightningSealingCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)

        def training_step(self, batch, i):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)),
                                     batch_size=4)
    out = tmp_path / "pl"
    ck = ModelCheckpoint(dirpath=out, filename="step-{step}/model", auto_insert_metric_name=False,
                         every_n_train_steps=2, save_top_k=-1)
    cb = LightningSealingCallback(tags=["pl"])
    L.Trainer(max_steps=4, accelerator="cpu", callbacks=[ck, cb], logger=False,
              enable_progress_bar=False, enable_model_summary=False).fit(Tiny(), dl)
    assert [(Path(r.url).name, r.action, r.step) for r in cb.results] == [
        ("step-2", "sealed", 2), ("step-4", "sealed", 4)]
    from ckptctl.integrity.seal import seal

    for name in ("step-2", "step-4"):
        copy = tmp_path / "copy" / name
        shutil.copytree(out / name, copy)
        (copy / MANIFEST).unlink()
        seal(str(copy), step=int(name.split("-")[1]), tags=["pl"])
        assert (out / name / MANIFEST).read_bytes() == (copy / MANIFEST).read_bytes()


def test_lightning_callback_needs_a_folder_per_checkpoint(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from ckptctl.callbacks import LightningSealingCallback
    from ckptctl.errors import UsageError

    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"x")
    (tmp_path / "epoch=0-step=4.ckpt").write_bytes(b"y")
    with pytest.raises(UsageError, match="folder of its own"):
        LightningSealingCallback().seal_file(str(tmp_path / "epoch=0-step=4.ckpt"), 4)


def test_importing_ckptctl_imports_no_framework():
    code = ("import sys, ckptctl, ckptctl.callbacks\n"
            "bad = [m for m in ('torch', 'transformers', 'lightning', 'pytorch_lightning')"
            " if m in sys.modules]\n"
            "assert not bad, bad\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_callbacks_say_what_is_missing():
    code = ("import sys\n"
            "sys.modules['transformers'] = None\n"
            "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
            "from ckptctl._deps import MissingDependencyError\n"
            "import ckptctl.callbacks as cb\n"
            "for name in ('HFSealingCallback', 'LightningSealingCallback'):\n"
            "    try:\n"
            "        getattr(cb, name)\n"
            "    except MissingDependencyError as e:\n"
            "        print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "HFSealingCallback: needs transformers: pip install transformers",
        "LightningSealingCallback: needs lightning: pip install lightning"]


if __name__ == "__main__":  # the torchrun worker of test_fsdp2_torchrun
    fsdp_worker(Path(sys.argv[1]))
