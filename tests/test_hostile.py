"""Broken and hostile inputs: each is one line naming the file, exit 3, no traceback, and
nothing runs or gets allocated on the input's say-so."""
from __future__ import annotations

import json
import pickle
import shutil
import struct
import subprocess
import sys

import pytest

from ckptctl.errors import FormatError, NotFoundError, UnsafeInputError


def _one_line_error(cli, url, *words):
    code, out, err = cli("inspect", str(url))
    assert code == 3, (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def _patch_metadata(ckpt, fn):
    """Load .metadata with torch (trusted: we wrote it), change it, write it back."""
    import torch.distributed.checkpoint  # noqa: F401  (classes must be importable)

    md = pickle.loads((ckpt / ".metadata").read_bytes())
    fn(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_garbage_metadata(tiny_dcp, cli):
    (tiny_dcp / ".metadata").write_bytes(b"\x00garbage" * 10)
    _one_line_error(cli, tiny_dcp, ".metadata", "pickle")


def test_truncated_metadata(tiny_dcp, cli):
    data = (tiny_dcp / ".metadata").read_bytes()
    (tiny_dcp / ".metadata").write_bytes(data[: len(data) // 2])
    _one_line_error(cli, tiny_dcp, ".metadata", "truncated")


def test_empty_metadata(tiny_dcp, cli):
    (tiny_dcp / ".metadata").write_bytes(b"")
    _one_line_error(cli, tiny_dcp, ".metadata")


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_that_runs_code_is_refused(tiny_dcp, cli, tmp_path):
    canary = tmp_path / "canary"
    (tiny_dcp / ".metadata").write_bytes(pickle.dumps({"x": _Evil(str(canary))}))
    _one_line_error(cli, tiny_dcp, ".metadata", "open", "not allowed")
    assert not canary.exists()


def test_pickle_with_os_system_nested_in_real_metadata(tiny_dcp, cli, tmp_path):
    canary = tmp_path / "canary2"

    class Boom:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {canary}",))

    _patch_metadata(tiny_dcp, lambda md: md.state_dict_metadata.__setitem__("evil", Boom()))
    _one_line_error(cli, tiny_dcp, "not allowed")
    assert not canary.exists()


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "a/../../x.distcp"])
def test_relative_path_escaping_root(tiny_dcp, cli, path):
    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = path
    _patch_metadata(tiny_dcp, escape)
    _one_line_error(cli, tiny_dcp, "escapes the checkpoint root")


def test_symlink_pointing_outside(tiny_dcp, tmp_path):
    from ckptctl.formats import open_checkpoint, read_tensor

    outside = tmp_path / "outside.distcp"
    shard = next(tiny_dcp.glob("*.distcp"))
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    ck = open_checkpoint(str(tiny_dcp))
    with pytest.raises(UnsafeInputError, match="outside the checkpoint root"):
        read_tensor(ck, "model.emb.weight")


def test_links_on_the_way_are_followed_only_inside_the_root(tmp_path):
    """A link anywhere below the root (a folder on the way, a chain of links) that leads
    out is refused; links that stay inside, and the root itself behind a link, are not."""
    from ckptctl.storage import open_store

    outside, root = tmp_path / "outside", tmp_path / "real-root"
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"secret")
    (root / "in").mkdir(parents=True)
    (root / "in" / "y.bin").write_bytes(b"ok")
    (root / "out").symlink_to(outside)  # a folder on the way leads out
    (root / "hop").symlink_to(root / "out")  # a chain: inside, then out
    (root / "alias").symlink_to(root / "in")  # stays inside
    (tmp_path / "root-link").symlink_to(root)
    for store in (open_store(str(root)), open_store(str(tmp_path / "root-link"))):
        for rel in ("out/x.bin", "hop/x.bin", "out", "out/not-there/z.bin"):
            with pytest.raises(UnsafeInputError, match="outside the checkpoint root"):
                store.full(rel)
        assert store.read("alias/y.bin") == b"ok"
        assert store.full("in/new/deeper.bin").endswith("in/new/deeper.bin")  # not there yet
        assert store.full("in/y.bin/below").endswith("below")  # a file on the way: no link


def test_missing_shard(tiny_dcp, cli):
    next(tiny_dcp.glob("*.distcp")).unlink()
    _one_line_error(cli, tiny_dcp, ".distcp", "missing")


def test_shape_overflow_in_dcp(tiny_dcp, cli):
    def huge(md):
        md.state_dict_metadata["model.emb.weight"].size = __import__("torch").Size([2**40, 2**40])
    _patch_metadata(tiny_dcp, huge)
    _one_line_error(cli, tiny_dcp, "absurdly large")


def _st(tmp_path, header: bytes, data: bytes = b"", hlen: int | None = None):
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)
    return p


def test_safetensors_header_longer_than_file(tmp_path, cli):
    p = _st(tmp_path, b'{"a":1}', hlen=10_000)
    _one_line_error(cli, p, "m.safetensors", "larger than the file")


def test_safetensors_absurd_header(tmp_path, cli):
    p = _st(tmp_path, b"{}", hlen=2**62)
    _one_line_error(cli, p, "m.safetensors", "100 MB")


def test_safetensors_shape_overflow(tmp_path, cli):
    h = json.dumps({"w": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 4]}})
    p = _st(tmp_path, h.encode(), b"\0" * 4)
    _one_line_error(cli, p, "absurdly large")


def test_safetensors_offsets_past_end(tmp_path, cli):
    h = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    p = _st(tmp_path, h.encode(), b"\0" * 8)
    _one_line_error(cli, p, "past the end")


def test_safetensors_overlap(tmp_path, cli):
    h = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})
    p = _st(tmp_path, h.encode(), b"\0" * 12)
    _one_line_error(cli, p, "overlaps")


def test_safetensors_not_json(tmp_path, cli):
    p = _st(tmp_path, b"\xff\xfe not json", b"")
    _one_line_error(cli, p, "not valid JSON")


def test_hf_weight_map_escaping_root(tmp_path, cli):
    d = tmp_path / "hf"
    d.mkdir()
    h = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (d / "model-00001-of-00001.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 4)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 4}, "weight_map": {"w": "../../secret.safetensors"}}))
    _one_line_error(cli, d, "escapes the checkpoint root")


def test_hf_shard_missing(tmp_path, cli):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 4}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    _one_line_error(cli, d, "model-00001-of-00002.safetensors", "missing")


def test_malicious_torch_save(tmp_path, cli):
    canary = tmp_path / "canary3"
    p = tmp_path / "evil.pt"
    import torch

    torch.save({"x": _Evil(str(canary))}, p)
    _one_line_error(cli, p, "evil.pt")
    assert not canary.exists()


def test_not_a_checkpoint(tmp_path, cli):
    (tmp_path / "notes.txt").write_text("hello")
    _one_line_error(cli, tmp_path, "no checkpoint format recognised")


def test_nonexistent(tmp_path, cli):
    _one_line_error(cli, tmp_path / "nope", "nope")


def test_corrupt_chunk_zip_is_a_format_error(tiny_dcp):
    from ckptctl.formats import open_checkpoint, read_tensor

    shard = next(tiny_dcp.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    ck = open_checkpoint(str(tiny_dcp), read_step=False)
    with pytest.raises(FormatError):
        read_tensor(ck, "model.emb.weight")


def test_truncated_shard_is_a_format_error(tiny_dcp):
    from ckptctl.formats import open_checkpoint, read_tensor

    shard = next(tiny_dcp.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    ck = open_checkpoint(str(tiny_dcp), read_step=False)
    with pytest.raises(FormatError, match="short"):
        read_tensor(ck, "model.emb.weight")


def test_zstd_bomb_is_bounded(tmp_path):
    from ckptctl.formats.tensorio import decompress_bounded
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(FormatError, match="expands past"):
        decompress_bounded(bomb, "x", 1 << 20)


def test_no_traceback_in_a_real_process(tiny_dcp):
    (tiny_dcp / ".metadata").write_bytes(b"garbage")
    p = subprocess.run([sys.executable, "-m", "ckptctl", "inspect", str(tiny_dcp)],
                       capture_output=True, text=True)
    assert p.returncode == 3
    assert p.stderr.startswith("ckptctl: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert p.stdout == ""


def test_not_found_error_class(tmp_path):
    from ckptctl.formats import open_checkpoint

    with pytest.raises(NotFoundError):
        open_checkpoint(str(tmp_path / "missing"))


def test_torch_file_with_malformed_pickle_is_one_line_and_ls_goes_on(tmp_path, cli):
    """torch's weights-only unpickler raises IndexError on a STOP with an empty stack:
    one line for that file, and ``ls`` still lists its neighbours."""
    import zipfile

    import torch

    torch.save({"a": torch.ones(2)}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as z, \
            zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for n in z.namelist():
            out.writestr(n, b"\x80\x02." if n.endswith("data.pkl") else z.read(n))
    code, out, err = cli("inspect", str(tmp_path / "bad.pt"))
    assert code == 3 and err.count("\n") == 1 and "malformed pickle" in err, err
    code, out, err = cli("ls", str(tmp_path))
    assert code == 0 and "corrupt" in out and "complete" in out, (out, err)
