"""zstd-compressed DCP chunks (issue 7, items 14 and 15): decompressed once, streaming,
within ``--max-memory``; a stream that expands past what its metadata declares is refused
after at most that much work."""
from __future__ import annotations

import json
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


def _lying_copy(zeros_zstd, d):
    """A copy whose metadata declares a 16-row tensor over the chunk that expands to 256 MiB."""
    import shutil

    import torch.distributed.checkpoint  # noqa: F401  (classes for the trusted re-pickle)

    d = shutil.copytree(zeros_zstd, d)
    md = pickle.loads((d / ".metadata").read_bytes())
    meta = md.state_dict_metadata["w"]
    meta.size = torch.Size([16, 4096])
    meta.chunks[0].sizes = torch.Size([16, 4096])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


def test_stream_longer_than_declared_is_refused(zeros_zstd, tmp_path):
    """Metadata that declares a small tensor over a chunk that expands to 256 MiB: refused
    once the declared size (plus a zip's overhead) is passed, one line, exit 3."""
    d = _lying_copy(zeros_zstd, tmp_path / "lie")
    code, err, _ = _run("consolidate", str(d), str(tmp_path / "out"), "--to", "torch")
    assert code == 3 and err.count("\n") == 1, err
    assert "zstd" in err and "Traceback" not in err
    code, err, _ = _run("verify", str(d), "--level", "structure")
    assert code == 1, err


def test_reshard_of_a_bomb_is_the_verify_error_or_a_good_output(zeros_zstd, tmp_path, cli):
    """Issue 17, item 10: ``reshard`` of a zstd bomb was ``internal error: ValueError:
    stream is closed``. The bomb's-ratio chunk reshards (4 ranks read one chunk at four
    places) and the output is proven; the lying one is refused with the one line verify
    reports for it (exit 3), and nothing is left at DST."""
    out = tmp_path / "out"
    code, err, _ = _run("reshard", str(zeros_zstd), str(out), "--world-size", "4",
                        "--max-memory", "64MiB")
    assert code == 0, err
    code, _, err = cli("verify", str(out), "--level", "full")
    assert code == 0, err
    code, said, err = cli("diff", str(zeros_zstd), str(out))  # read and compared, streaming
    assert code == 0 and "byte-identical" in said, (said, err)
    from ckptctl.formats import open_checkpoint

    assert len(open_checkpoint(str(out), read_step=False).tensors["w"].chunks) == 4

    d = _lying_copy(zeros_zstd, tmp_path / "lie")
    code, out_, err = cli("verify", str(d), "--level", "structure", "--json")
    assert code == 1
    said = json.loads(out_)["problems"][0]["message"]
    for verb, opts in (("reshard", ("--world-size", "2")), ("consolidate", ("--to", "dcp"))):
        dst = tmp_path / f"{verb}-lie"
        code, err, _ = _run(verb, str(d), str(dst), *opts)
        assert code == 3 and err.count("\n") == 1, (verb, err)
        assert said in err and "internal error" not in err and "Traceback" not in err, err
        assert not dst.exists()


def test_readers_of_one_zstd_chunk_at_different_places_keep_their_own_stream(tmp_path):
    """Threads reading one zstd chunk at different places (the ranks of a reshard) once
    shared one stream, and one closed it under another (``ValueError: stream is closed``):
    each gets its bytes, every time."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptctl.formats import open_checkpoint
    from ckptctl.formats.tensorio import read_rows

    w = torch.randn(2048, 512, generator=torch.Generator().manual_seed(0))
    _save_zstd(tmp_path / "z", {"w": w})
    for _ in range(3):
        ck = open_checkpoint(str(tmp_path / "z"), read_step=False)
        t = ck.tensors["w"]
        c = t.chunks[0]
        assert c.extent.encoding == "torch_zip+zstd"

        def reader(q):  # rows [512 q, 512 (q + 1)), 32 at a time
            return b"".join(bytes(read_rows(ck, t, c, 512 * q + i, 512 * q + i + 32))
                            for i in range(0, 512, 32))

        with ThreadPoolExecutor(4) as pool:
            assert b"".join(pool.map(reader, range(4))) == w.numpy().tobytes()
