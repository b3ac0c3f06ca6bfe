"""zstd-compressed DCP chunks (issue 7, items 14 and 15): decompressed once, streaming,
within ``--max-memory``; a stream that expands past what its metadata declares is refused
after at most that much work."""
from __future__ import annotations

import pickle

import pytest

from conftest import dcp_save, run_measured

torch = pytest.importorskip("torch")


def _save_zstd(path, sd):
    dcp_save(path, sd, zstd=True)


def _run(*args):
    """``ckptctl ARGS`` in a child: (exit code, stderr, its own peak RSS in MiB)."""
    code, _, err, _, peak = run_measured(*args, timeout=120)
    return code, err, peak


@pytest.fixture(scope="module")
def zeros_zstd(tmp_path_factory):
    """A 256 MiB tensor of zeros: a few KiB once compressed, a bomb's ratio."""
    p = tmp_path_factory.mktemp("z") / "step-1"
    _save_zstd(p, {"w": torch.zeros(64 << 20, dtype=torch.float32).reshape(-1, 4096)})
    return p


def test_zstd_bomb_streams_within_memory(zeros_zstd, tmp_path):
    size = sum(f.stat().st_size for f in zeros_zstd.iterdir())
    assert size < 1 << 20  # 256 MiB declared, tiny on disk
    code, err, _ = _run("verify", str(zeros_zstd), "--level", "full", "--check-finite")
    assert code == 0, err
    code, err, peak = _run("consolidate", str(zeros_zstd), str(tmp_path / "out"), "--to", "torch",
                           "--max-memory", "64MiB")
    assert code == 0, err
    # import torch alone is ~220 MiB here; the 256 MiB tensor never sits in memory
    assert peak < 400, peak
    assert torch.load(tmp_path / "out" / "model.pt", weights_only=True,
                      mmap=True)["w"].abs().sum() == 0


def test_stream_longer_than_declared_is_refused(zeros_zstd, tmp_path):
    """Metadata that declares a small tensor over a chunk that expands to 256 MiB: refused
    once the declared size (plus a zip's overhead) is passed, one line, exit 3."""
    import shutil

    import torch.distributed.checkpoint  # noqa: F401  (classes for the trusted re-pickle)

    d = shutil.copytree(zeros_zstd, tmp_path / "lie")
    md = pickle.loads((d / ".metadata").read_bytes())
    meta = md.state_dict_metadata["w"]
    meta.size = torch.Size([16, 4096])
    meta.chunks[0].sizes = torch.Size([16, 4096])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    code, err, _ = _run("consolidate", str(d), str(tmp_path / "out"), "--to", "torch")
    assert code == 3 and err.count("\n") == 1, err
    assert "zstd" in err and "Traceback" not in err
    code, err, _ = _run("verify", str(d), "--level", "structure")
    assert code == 1, err
