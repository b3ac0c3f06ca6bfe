"""consolidate's kernel path: tensors stored as they go out (raw dim-0 shards, no cast)
are copied from the source files in the kernel (``copy_file_range``) and hashed from the
page cache behind the copies, or on ext4 read into an O_DIRECT writer's buffers and
hashed there (tests/test_direct_output.py has that writer's own tests). Values equal torch's bit for bit, the manifest's hash is
the file's, tensors that need reading (a cast, dim-1 shards) take the block path in the
same file, and a truncated source is refused with nothing left that looks valid."""
from __future__ import annotations

import json
import os

import pytest
import torch

from ckptctl.errors import FormatError
from ckptctl.ops import consolidate, verify
from ckptctl.storage import HashBehind, hash_file, open_store
from fixtures_torch import copy_ckpt


def _ref(torch_ckpts, layout: str) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    sd = torch.load(torch_ckpts.reference[layout], weights_only=False, map_location="cpu")
    return {k: v for k, v in flatten_state_dict(sd)[0].items() if k.startswith("model.")}


@pytest.fixture(params=["kernel", "direct"])
def copies(monkeypatch, request):
    """Bytes copied from the source files as stored by consolidate's writer, per call:
    in the kernel (forced here: what XFS, btrfs, tmpfs get), or on ext4 read straight
    into the buffers of its O_DIRECT writer (``tmp_path`` is on ext4 here)."""
    import ckptctl.convert.copier as copier
    import ckptctl.writing.output as output
    from ckptctl.storage.directwrite import DirectWriter

    calls: list[int] = []
    if request.param == "kernel":
        real = output.kernel_copy

        def spy(src_fd, dst_fd, offset, n, at=None):
            calls.append(n)
            return real(src_fd, dst_fd, offset, n, at)

        monkeypatch.setattr(copier, "copies_through_memory", lambda path: False)
        monkeypatch.setattr(output, "kernel_copy", spy)
    else:
        real_in = DirectWriter.read_in

        def spy_in(self, src_fd, offset, n):
            calls.append(n)
            return real_in(self, src_fd, offset, n)

        monkeypatch.setattr(DirectWriter, "read_in", spy_in)
    return calls


def _load(out) -> dict:
    from safetensors.torch import load_file

    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _bits_equal(ref: dict, got: dict) -> None:
    assert set(ref) == set(got)
    for k, v in ref.items():
        w = got[k]
        assert v.dtype == w.dtype and v.shape == w.shape, k
        assert torch.equal(v.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k


def test_fsdp_shards_are_copied_in_the_kernel_and_equal_torch(torch_ckpts, tmp_path, copies):
    out = tmp_path / "hf"
    r = consolidate(str(torch_ckpts["fsdp"]), str(out), to="safetensors", only="model",
                    max_memory="1MiB")
    ref = _ref(torch_ckpts, "fsdp")
    _bits_equal(ref, _load(out))
    tensor_bytes = sum(v.numel() * v.element_size() for v in ref.values())
    assert sum(copies) == tensor_bytes  # every tensor byte was copied as stored
    man = json.loads((out / "ckptctl.manifest.json").read_text())
    for rel, entry in man["files"].items():
        assert hash_file(open_store(str(out)), rel)[0] == entry["hash"], rel
    assert verify(str(out), level="full").ok and r.manifest_id


def test_tp_dim1_shards_and_a_cast_take_the_block_path(torch_ckpts, tmp_path, copies):
    # 2-D: some tensors are dim-1 (TP column) shards: read in blocks; the others are copied
    out = tmp_path / "mixed"
    consolidate(str(torch_ckpts["2d"]), str(out), to="safetensors", only="model",
                max_memory="1MiB")
    ref = _ref(torch_ckpts, "2d")
    _bits_equal(ref, _load(out))
    assert verify(str(out), level="full").ok
    # a cast needs every byte read: nothing is copied in the kernel
    copies.clear()
    cast = tmp_path / "bf16"
    consolidate(str(torch_ckpts["fsdp"]), str(cast), to="safetensors", only="model",
                dtype="bf16")
    assert copies == []
    got = _load(cast)
    for k, v in _ref(torch_ckpts, "fsdp").items():
        assert torch.equal(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v), k


def test_a_truncated_source_is_refused_and_leaves_nothing(torch_ckpts, tmp_path, copies):
    src = copy_ckpt(torch_ckpts["fsdp"], tmp_path / "src")
    data = sorted(p for p in src.iterdir() if p.suffix == ".distcp")
    victim = data[0]  # its model shards come first: cut inside them
    os.truncate(victim, 4096)
    out = tmp_path / "hf"
    with pytest.raises(FormatError) as e:
        consolidate(str(src), str(out), to="safetensors", only="model")
    assert victim.name in str(e.value)  # refused when the checkpoint is opened
    assert not out.exists()
    # a source that shrinks after it was opened: the copy itself comes up short
    from ckptctl.convert.copier import Span, SpanWriter
    from ckptctl.writing.output import OutputDir

    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    with pytest.raises(FormatError) as e:
        with OutputDir(open_store(str(out)), command="test") as od:
            with od.open("f.bin") as f:
                w = SpanWriter(f, open_store(str(tmp_path)))
                try:
                    w.write(b"header")
                    w.write(Span("a.bin", 50, 60))  # 10 bytes past the end
                finally:
                    w.close()
    assert e.value.code == "SIZE_MISMATCH" and "a.bin" in str(e.value)
    assert not out.exists()  # the unfinished output is removed


def test_hash_behind_follows_the_writer_and_refuses_a_short_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"")
    hb = HashBehind(str(p))
    with open(p, "ab") as f:
        for i in range(5):
            f.write(bytes([i]) * 1000)
            f.flush()
            hb.advance(1000)
    assert hb.result() == hash_file(open_store(str(tmp_path)), "f")
    hb = HashBehind(str(p))
    hb.advance(5001)  # one byte more than the file holds
    with pytest.raises(EOFError, match="ends at 5000 of 5001"):
        hb.result()
