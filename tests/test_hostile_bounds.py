"""Hostile inputs cost bounded time and memory, proportional to the real data (issue 7,
item 14): each runs the real CLI in a subprocess, bounded in wall time and peak RSS
(generous bounds: a regression to the old behaviour costs minutes and gigabytes).
"""
from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ckptctl.formats.safetensors_write import write_file
from conftest import run_measured, write_tiny_dcp

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 20.0  # the old behaviour took 51 s and 110 s; torch imports take seconds on a busy machine
MB = 600  # importing torch alone is ~230 MB
DEEP = 100_000


def run_bounded(tmp_path: Path, *args, seconds: float = SECONDS, mb: int = MB):
    """Run ``ckptctl ARGS``; assert it took < ``seconds`` and < ``mb`` MB peak RSS (of that
    process alone). Returns (exit code, stdout, stderr)."""
    code, stdout, stderr, wall, rss_mb = run_measured(*args, timeout=10 * seconds, cwd=ROOT)
    assert wall < seconds, f"{args}: {wall:.1f} s (bound {seconds} s) {stderr}"
    assert rss_mb < mb, f"{args}: peak RSS {rss_mb:.0f} MB (bound {mb} MB)"
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return code, stdout, stderr


def _one_line(code: int, err: str, *words: str) -> None:
    assert code == 3, err
    assert err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def _verify_finding(tmp_path, ckpt, code_name: str) -> None:
    code, out, err = run_bounded(tmp_path, "verify", ckpt, "--level", "full", "--json")
    assert code == 1, out + err
    assert code_name in [p["code"] for p in json.loads(out)["problems"]], out


def _splice(md, field_setter, payload: bytes) -> bytes:
    """Pickle ``md`` with a sentinel string in one field, then replace the sentinel's
    opcodes with ``payload`` (hand-made opcodes: nesting too deep to pickle normally)."""
    field_setter(md, "SENTINELXYZ")
    data = pickle.dumps(md)
    s = b"\x8c\x0bSENTINELXYZ"
    assert data.count(s) == 1
    return data.replace(s, payload)


def _nested_lists(n: int) -> bytes:
    return b"]" * n + b"a" * (n - 1)  # n EMPTY_LISTs, each APPENDed into the one before


# ----------------------------------------------------------------------- .metadata


def test_metadata_listing_one_chunk_a_million_times(tmp_path):
    ck = tmp_path / "dup"
    write_tiny_dcp(ck)
    import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata pickles)

    md = pickle.loads((ck / ".metadata").read_bytes())
    t = md.state_dict_metadata["model.emb.weight"]
    t.chunks = [t.chunks[0]] * 1_000_000  # the pickle memo: ~2 MB on disk
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    assert (ck / ".metadata").stat().st_size < 3 << 20
    code, _, err = run_bounded(tmp_path, "inspect", ck)
    _one_line(code, err, ".metadata", "model.emb.weight", "listed more than once")
    _verify_finding(tmp_path, ck, "CHUNK_OVERLAP")
    code, _, err = run_bounded(tmp_path, "consolidate", ck, tmp_path / "out")
    _one_line(code, err, "listed more than once")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["planner_data", "version", "top"])
def test_metadata_pickle_nested_thousands_deep(tmp_path, where):
    ck = tmp_path / "deep"
    write_tiny_dcp(ck)
    import torch.distributed.checkpoint  # noqa: F401

    md = pickle.loads((ck / ".metadata").read_bytes())
    if where == "top":
        data = b"\x80\x02" + _nested_lists(DEEP) + b"."
    elif where == "version":
        data = _splice(md, lambda m, v: setattr(m, "version", v), _nested_lists(DEEP))
    else:
        data = _splice(md, lambda m, v: m.planner_data.__setitem__("model.emb.weight", v),
                       _nested_lists(DEEP))
    (ck / ".metadata").write_bytes(data)
    if where == "top":
        code, _, err = run_bounded(tmp_path, "inspect", ck)
        _one_line(code, err, ".metadata", "not DCP metadata")
        return
    # the odd field is a hint (planner_data) or informative (version): the data still reads
    code, out, err = run_bounded(tmp_path, "inspect", ck, "--json")
    assert code == 0, err
    assert json.loads(out)["num_tensors"] == 3
    code, _, err = run_bounded(tmp_path, "verify", ck, "--level", "full")
    assert code == 0, err
    code, _, err = run_bounded(tmp_path, "consolidate", ck, tmp_path / "pt", "--to", "torch")
    assert code == 0, err
    import torch

    got = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    if where == "planner_data":  # its path hint was ignored: stored under its flat name
        assert torch.equal(got.pop("model.emb.weight"), torch.load(
            tmp_path / "pt" / "model.pt", weights_only=True)["model.emb.weight"])
    assert set(got) == {"model", "optim", "step"}


# ----------------------------------------------------------------------- empty tensors

ABSURD_EMPTY = {"a": (2**50, 0), "b": (0, 2**50), "c": (2**20, 2**20, 0), "d": (0,)}


def _absurd_source(path: Path) -> dict[str, np.ndarray]:
    path.mkdir(parents=True)
    ts = {n: np.empty(s, dtype=np.float32) for n, s in ABSURD_EMPTY.items()}
    ts["w"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    entries = [(n, "F32", a.shape, a.nbytes) for n, a in sorted(ts.items())]
    with open(path / "model.safetensors", "wb") as f:
        write_file(f, entries, lambda n: [ts[n].tobytes()], {"format": "pt"})
    return ts


def test_empty_tensors_of_absurd_shape_cost_nothing(tmp_path):
    from safetensors.numpy import load_file

    src = tmp_path / "src"
    ts = _absurd_source(src)
    code, out, err = run_bounded(tmp_path, "inspect", src, "--json")
    assert code == 0, err
    code, _, err = run_bounded(tmp_path, "verify", src, "--level", "full", "--check-finite")
    assert code == 0, err
    code, _, err = run_bounded(tmp_path, "reshard", src, tmp_path / "dcp", "--world-size", "2")
    assert code == 0, err
    code, _, err = run_bounded(tmp_path, "verify", tmp_path / "dcp", "--level", "full")
    assert code == 0, err
    for fmt, dst in (("safetensors", tmp_path / "st"), ("torch", tmp_path / "pt")):
        code, _, err = run_bounded(tmp_path, "consolidate", tmp_path / "dcp", dst, "--to", fmt)
        assert code == 0, err
    got = load_file(tmp_path / "st" / "model.safetensors")
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in ts.items()}
    assert got["w"].tobytes() == ts["w"].tobytes()


# ----------------------------------------------------------------------- JSON


def _deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def test_safetensors_header_nested_thousands_deep(tmp_path):
    hdr = ('{"__metadata__":{"format":"pt"},"x":' + _deep_json() + "}").encode()
    hdr += b" " * ((-len(hdr)) % 8)
    ck = tmp_path / "st"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    code, _, err = run_bounded(tmp_path, "inspect", ck)
    _one_line(code, err, "model.safetensors", "header nests too deeply")
    _verify_finding(tmp_path, ck, "MALFORMED_METADATA")


def _small_hf(path: Path) -> None:
    path.mkdir()
    a = np.arange(4, dtype=np.float32)
    with open(path / "model-00001-of-00001.safetensors", "wb") as f:
        write_file(f, [("w", "F32", (4,), 16)], lambda n: [a.tobytes()], {"format": "pt"})


def test_hf_index_nested_thousands_deep(tmp_path):
    ck = tmp_path / "hf"
    _small_hf(ck)
    (ck / "model.safetensors.index.json").write_text(
        '{"metadata":{"total_size":16},"weight_map":{"w":' + _deep_json() + "}}")
    code, _, err = run_bounded(tmp_path, "inspect", ck)
    _one_line(code, err, "model.safetensors.index.json", "index nests too deeply")
    _verify_finding(tmp_path, ck, "MALFORMED_METADATA")


def test_manifest_nested_thousands_deep(tmp_path):
    ck = tmp_path / "hf"
    _small_hf(ck)
    (ck / "ckptctl.manifest.json").write_text('{"files":{},"x":' + _deep_json() + "}")
    code, _, err = run_bounded(tmp_path, "inspect", ck)
    _one_line(code, err, "ckptctl.manifest.json", "manifest nests too deeply")
    _verify_finding(tmp_path, ck, "MALFORMED_METADATA")


# ----------------------------------------------------------------------- ls ROOT


def test_one_bad_checkpoint_never_fails_ls(tmp_path):
    root = tmp_path / "runs"
    good = root / "step-100"
    write_tiny_dcp(good)
    deep_idx = root / "step-200"
    _small_hf(deep_idx)
    (deep_idx / "model.safetensors.index.json").write_text(
        '{"weight_map":{"w":' + _deep_json() + "}}")
    deep_man = root / "step-300"
    _small_hf(deep_man)
    (deep_man / "ckptctl.manifest.json").write_text("[" * DEEP + "]" * DEEP)
    dup = root / "step-400"
    shutil.copytree(good, dup)
    import torch.distributed.checkpoint  # noqa: F401

    md = pickle.loads((dup / ".metadata").read_bytes())
    md.state_dict_metadata["model.emb.weight"].chunks *= 2
    (dup / ".metadata").write_bytes(pickle.dumps(md))
    (root / "step-500").mkdir()
    (root / "step-500" / "model.pt").write_bytes(b"garbage")
    code, out, err = run_bounded(tmp_path, "ls", root, "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert rows["step-100"]["state"] == "complete"
    want = {"step-200": "index nests too deeply", "step-300": "manifest nests too deeply",
            "step-400": "listed more than once", "step-500/model.pt": "torch.save"}
    for name, reason in want.items():
        assert rows[name]["state"] == "corrupt" and reason in rows[name]["reason"], rows[name]
