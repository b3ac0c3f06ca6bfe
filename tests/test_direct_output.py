"""consolidate's local outputs on ext4 go past the page cache: a
:class:`~ckptctl.storage.directwrite.DirectWriter` gathers blocks and source spans into
page-aligned buffers, hashes them there and writes them with O_DIRECT on a thread. The
bytes are the ones the kernel-copy path writes, every byte is hashed, a file system
without O_DIRECT (tmpfs) gets plain writes, a full disk is an error in words with no
thread left behind, and where ``fincore`` exists, the bulk is checked to miss the page
cache."""
from __future__ import annotations

import errno
import functools
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptctl.convert.copier as copier
from ckptctl.errors import FormatError, StorageError
from ckptctl.convert.copier import Span, SpanWriter
from ckptctl.writing.output import Cancelled, OutputDir
from ckptctl.storage import digest_bytes, hash_file, open_store
from ckptctl.storage import localio
from ckptctl.storage.directwrite import DirectWriter
from ckptctl.storage.localio import DIRECT_ALIGN, copies_through_memory
from conftest import cached_bytes
from test_direct_writes import _flags, _pattern

KiB, MiB = 1 << 10, 1 << 20
SMALL = 64 * KiB  # a staging buffer small enough that the tests cross many of them


def _direct_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckptctl-direct")]


def _needs_ext4(path) -> None:
    if not copies_through_memory(str(path)):
        pytest.skip(f"{path} is not on ext2/3/4")


def _write(path: Path, pieces: list[bytes], **kw) -> tuple[str, int]:
    path.write_bytes(b"")
    with DirectWriter(str(path), **kw) as w:
        for p in pieces:
            assert w.write(p) == len(p)
        return w.result()


@pytest.mark.parametrize("pieces", [
    [_pattern(1000)],                                        # smaller than one buffer
    [_pattern(SMALL)],                                       # exactly one buffer
    [_pattern(3 * SMALL)],                                   # an exact multiple
    [_pattern(5 * SMALL + 8 + 3)],                           # full buffers + unaligned tail
    [_pattern(4096 + 17, i) for i in range(40)],             # many small writes
    [b""],                                                   # nothing at all
], ids=["small", "one-buffer", "multiple", "tail", "many-small", "empty"])
def test_every_byte_lands_and_is_hashed(tmp_path, pieces):
    f = tmp_path / "out.bin"
    want = b"".join(pieces)
    assert _write(f, pieces, buffer=SMALL) == (digest_bytes(want), len(want))
    assert f.read_bytes() == want
    assert _direct_threads() == []


def test_the_default_buffer_an_exact_multiple_and_one_byte_more(tmp_path):
    data = _pattern(64 * MiB + 1)
    f = tmp_path / "big.bin"
    assert _write(f, [data[:-1]]) == (digest_bytes(data[:-1]), len(data) - 1)
    assert f.read_bytes() == data[:-1]
    assert _write(f, [memoryview(data)]) == (digest_bytes(data), len(data))
    assert f.read_bytes() == data


def test_read_in_reads_straight_into_the_buffer_and_stops_at_the_end(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(_pattern(3 * SMALL + 100))
    f = tmp_path / "out.bin"
    f.write_bytes(b"")
    fd = os.open(src, os.O_RDONLY)
    try:
        with DirectWriter(str(f), "sha256", buffer=SMALL) as w:
            w.write(b"hdr")
            assert w.read_in(fd, 10, 2 * SMALL) == 2 * SMALL
            assert w.read_in(fd, 3 * SMALL, 500) == 100  # the source ends
            digest, n = w.result()
    finally:
        os.close(fd)
    raw = src.read_bytes()
    want = b"hdr" + raw[10:10 + 2 * SMALL] + raw[3 * SMALL:]
    assert f.read_bytes() == want and (digest, n) == (digest_bytes(want, "sha256"), len(want))


def test_the_aligned_bulk_skips_the_page_cache(tmp_path):
    _needs_ext4(tmp_path)
    f = tmp_path / "d.bin"
    _write(f, [_pattern(MiB + 5, i) for i in range(16)], buffer=4 * MiB)
    cached = cached_bytes(f)
    if cached is None:
        pytest.skip("fincore not available")
    assert cached <= 2 * DIRECT_ALIGN, cached  # the tail's page, not 16 MiB


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tmpfs_gets_plain_writes_the_same_bytes(tmp_path):
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert not copies_through_memory(str(d))
        data = _pattern(3 * SMALL + 7)
        assert _write(d / "t.bin", [data], buffer=SMALL) == (digest_bytes(data), len(data))
        assert (d / "t.bin").read_bytes() == data
    finally:
        shutil.rmtree(d)


def test_a_device_refusing_the_alignment_gets_plain_writes(tmp_path, monkeypatch):
    real = os.pwrite
    refused = []

    def pwrite(fd, buf, off):
        if _flags(fd) & os.O_DIRECT:
            refused.append(off)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, off)

    monkeypatch.setattr(localio.os, "pwrite", pwrite)
    monkeypatch.setattr(localio, "_no_direct", set())
    data = _pattern(4 * SMALL + 9)
    f = tmp_path / "e.bin"
    assert _write(f, [data], buffer=SMALL) == (digest_bytes(data), len(data))
    assert f.read_bytes() == data
    assert len(refused) <= 1  # refused once, remembered from then on


# --------------------------------------------------------------------------- SpanWriter


def _spans_and_blocks(src: Path) -> list:
    """A safetensors-like file: a header of unaligned length, then spans of ``src``
    (one longer than a copy step) and blocks, mixed."""
    src.write_bytes(_pattern(5 * SMALL + 123, 7))
    return [b"\x2a\x00\x00\x00\x00\x00\x00\x00{\"header\": 1}   ",
            Span(src.name, 0, 3 * SMALL + 1), memoryview(_pattern(SMALL + 3, 1)),
            Span(src.name, 3 * SMALL + 1, SMALL), b"x" * 5,
            Span(src.name, 100, 2 * SMALL + 23)]


def _span_write(folder: Path, items: list, src_dir: Path) -> tuple[tuple[str, int], bytes]:
    with OutputDir(open_store(str(folder)), command="test") as od:
        with od.open("f.bin") as f:
            w = SpanWriter(f, open_store(str(src_dir)))
            try:
                for it in items:
                    w.write(it)
                got = w.result()
            finally:
                w.close()
        od.commit()
    return got, (folder / "f.bin").read_bytes()


@pytest.fixture
def small_steps(monkeypatch):
    """SpanWriter copying in small steps through small direct buffers."""
    monkeypatch.setattr(copier, "COPY_STEP", SMALL)
    monkeypatch.setattr(copier, "DirectWriter", functools.partial(DirectWriter, buffer=SMALL))


def test_span_writer_lands_the_bytes_the_kernel_path_lands(tmp_path, monkeypatch, small_steps):
    _needs_ext4(tmp_path)
    items = _spans_and_blocks(tmp_path / "src.bin")
    raw = (tmp_path / "src.bin").read_bytes()
    want = b"".join(raw[i.offset:i.offset + i.length] if isinstance(i, Span) else bytes(i)
                    for i in items)
    progress = []
    direct, data = _span_write(tmp_path / "new", items, tmp_path)
    assert data == want and direct == (digest_bytes(want), len(want))
    with monkeypatch.context() as m:  # today's path: kernel copies, hashed behind
        m.setattr(copier, "copies_through_memory", lambda path: False)
        kernel, old = _span_write(tmp_path / "old", items, tmp_path)
    assert old == data and kernel == direct
    assert _direct_threads() == []
    # progress counts every byte
    with OutputDir(open_store(str(tmp_path / "p")), command="test") as od:
        with od.open("f.bin") as f:
            w = SpanWriter(f, open_store(str(tmp_path)), on_bytes=progress.append)
            for it in items:
                w.write(it)
            w.result()
    assert sum(progress) == len(want)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_span_writer_on_tmpfs_keeps_the_kernel_copy(tmp_path, monkeypatch):
    import shutil
    import tempfile

    import ckptctl.writing.output as output

    copied = []
    real = output.kernel_copy
    monkeypatch.setattr(output, "kernel_copy",
                        lambda *a: copied.append(a[3]) or real(*a))
    monkeypatch.setattr(copier, "DirectWriter", None)  # never made there
    items = _spans_and_blocks(tmp_path / "src.bin")
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        got, data = _span_write(d / "out", items, tmp_path)
        assert got == (digest_bytes(data), len(data)) == hash_file(open_store(str(d / "out")),
                                                                   "f.bin")
        assert sum(copied) == sum(len(i) for i in items if isinstance(i, Span))
    finally:
        shutil.rmtree(d)


def test_a_truncated_span_is_refused_and_leaves_nothing(tmp_path, small_steps):
    _needs_ext4(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"x" * (3 * SMALL))
    out = tmp_path / "out"
    with pytest.raises(FormatError) as e:
        _span_write(out, [b"header", Span("a.bin", SMALL, 3 * SMALL)], tmp_path)
    assert e.value.code == "SIZE_MISMATCH" and "a.bin" in str(e.value)
    assert not out.exists() and _direct_threads() == []


def test_a_cancelled_run_stops_at_the_next_write(tmp_path, small_steps):
    _needs_ext4(tmp_path)
    with pytest.raises(Cancelled):
        with OutputDir(open_store(str(tmp_path / "out")), command="test") as od:
            with od.open("f.bin") as f:
                w = SpanWriter(f, open_store(str(tmp_path)))
                try:
                    w.write(b"x" * (3 * SMALL))
                    od.cancelled.set()
                    w.write(b"y")
                finally:
                    w.close()
    assert not (tmp_path / "out").exists() and _direct_threads() == []


def test_a_full_disk_is_an_error_in_words_with_no_thread_left(small_ext4, tmp_path):
    mnt = small_ext4("16M")
    with pytest.raises(OSError) as e:  # the writer itself: the original error
        _write(mnt / "big.bin", [_pattern(MiB)] * 40, buffer=4 * MiB)
    assert e.value.errno == errno.ENOSPC
    assert _direct_threads() == []
    os.unlink(mnt / "big.bin")
    # through consolidate's writer: in words, and the output is removed
    src = tmp_path / "src.bin"
    src.write_bytes(_pattern(8 * MiB))
    with pytest.raises(StorageError, match="no space left on device"):
        _span_write(mnt / "out", [b"hdr", *[Span("src.bin", 0, 8 * MiB)] * 5], tmp_path)
    assert not (mnt / "out").exists() and _direct_threads() == []


# --------------------------------------------------------------------------- end to end


def test_consolidate_to_safetensors_is_byte_identical_and_loads_bit_exact(torch_ckpts,
                                                                          tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckptctl.ops import consolidate, verify

    _needs_ext4(tmp_path)
    made = []
    monkeypatch.setattr(copier, "DirectWriter",
                        lambda *a, **kw: made.append(a) or DirectWriter(*a, **kw))
    new = tmp_path / "new"
    consolidate(str(torch_ckpts["fsdp"]), str(new), to="safetensors", only="model",
                max_memory="1MiB", max_shard_size="2MB")
    assert made  # the direct path wrote it
    _old_paths(monkeypatch)
    old = tmp_path / "old"
    consolidate(str(torch_ckpts["fsdp"]), str(old), to="safetensors", only="model",
                max_memory="1MiB", max_shard_size="2MB")
    files = sorted(p.name for p in new.iterdir())
    assert files == sorted(p.name for p in old.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1
    for name in shards:
        assert (new / name).read_bytes() == (old / name).read_bytes(), name
    assert (json_of(new) == json_of(old))
    sd = torch.load(torch_ckpts.reference["fsdp"], weights_only=False, map_location="cpu")
    ref = {k: v for k, v in flatten_state_dict(sd)[0].items() if k.startswith("model.")}
    got = {}
    for name in shards:
        got.update(load_file(new / name))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                           v.reshape(-1).view(torch.uint8)), k
    assert verify(str(new), level="full").ok
    assert _direct_threads() == []


def _old_paths(monkeypatch) -> None:
    """consolidate as before the direct writer: kernel copies, buffered writes."""
    import importlib

    for mod in (copier, importlib.import_module("ckptctl.convert.consolidate")):
        monkeypatch.setattr(mod, "copies_through_memory", lambda path: False)


@pytest.mark.parametrize("to, dst, dtype", [("safetensors", "hf", "bf16"),
                                            ("torch", "pt", None), ("torch", "x.pt", None)],
                         ids=["safetensors-cast", "torch-folder", "torch-file"])
def test_other_outputs_go_past_the_page_cache_with_the_same_bytes(torch_ckpts, tmp_path,
                                                                  monkeypatch, to, dst, dtype):
    """No span to copy (a cast; a torch.save zip): the same writer, blocks only."""
    import torch

    from ckptctl.ops import consolidate

    _needs_ext4(tmp_path)
    made = []
    monkeypatch.setattr(copier, "DirectWriter",
                        lambda *a, **kw: made.append(a) or DirectWriter(*a, **kw))
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    new, old = tmp_path / "new" / dst, tmp_path / "old" / dst
    consolidate(str(torch_ckpts["fsdp"]), str(new), to=to, only="model", dtype=dtype,
                max_memory="1MiB")
    assert made
    with monkeypatch.context() as m:
        _old_paths(m)
        consolidate(str(torch_ckpts["fsdp"]), str(old), to=to, only="model", dtype=dtype,
                    max_memory="1MiB")
    if new.is_file():
        assert new.read_bytes() == old.read_bytes()
        assert not list(new.parent.glob(".*partial"))
        torch.load(new, weights_only=True)
    else:
        assert json_of(new) == json_of(old)
        assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
        for p in new.iterdir():
            if p.name == "ckptctl.manifest.json":  # its "created" is the newest file's mtime
                assert _untimed(p) == _untimed(old / p.name)
            else:
                assert p.read_bytes() == (old / p.name).read_bytes(), p.name
    assert _direct_threads() == []


def _untimed(manifest: Path) -> dict:
    """A manifest without its ``created`` (two runs a second apart differ only there)."""
    import json

    doc = json.loads(manifest.read_text())
    doc.pop("created", None)
    return doc


def json_of(folder: Path) -> dict:
    """The manifest's file entries (hash, size) of a consolidated folder."""
    import json

    man = json.loads((folder / "ckptctl.manifest.json").read_text())
    return {rel: (e["hash"], e["size"]) for rel, e in man["files"].items()}


def test_staging_buffers_follow_max_memory(torch_ckpts, tmp_path, monkeypatch):
    """--max-memory counts the DirectWriters' staging buffers: a small budget gets small
    buffers, the default the writer's own 32 MiB."""
    from ckptctl.ops import consolidate

    _needs_ext4(tmp_path)
    made = []
    monkeypatch.setattr(copier, "DirectWriter",
                        lambda *a, **kw: made.append(kw["buffer"]) or DirectWriter(*a, **kw))
    consolidate(str(torch_ckpts["fsdp"]), str(tmp_path / "small"), only="model",
                max_memory="32MiB", max_shard_size="1MB", workers=2)
    assert made and set(made) == {copier.staging_size(32 * MiB, 2)} == {2 * MiB}
    made.clear()
    consolidate(str(torch_ckpts["fsdp"]), str(tmp_path / "default"), to="torch", only="model")
    assert made == [32 * MiB]


@settings(max_examples=300, deadline=None)
@given(mib=st.integers(1, 64 << 10), streams=st.integers(1, 64))
def test_read_ahead_and_staging_stay_within_the_budget(mib, streams):
    """What the streams hold (read-ahead blocks and two staging buffers each) is within
    --max-memory, or at the floor of one block ahead and 1 MiB buffers."""
    budget = mib * MiB
    depth = copier.stream_depth(budget, streams, staged=True)
    staging = copier.staging_size(budget, streams)
    held = streams * ((depth + 2) * copier.IO_BLOCK + 2 * staging)
    floor = streams * (3 * copier.IO_BLOCK + 2 * MiB)
    assert held <= max(budget, floor)
    assert staging % DIRECT_ALIGN == 0 and MiB <= staging <= 32 * MiB
