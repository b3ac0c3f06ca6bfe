"""Hints that hold up during an incident (issue 35, items 6 and 7):

* verify of a checkpoint a ckptctl writer left unfinished says which writer it was and
  the fix that keeps its work (a killed promote: rerun it, it resumes; --force is for the
  writers that start over), also for a local promote's destination that is not there yet;
* a sealed checkpoint whose file fails its content hash names the entries the damaged
  bytes are in, from the format's own CRC-32s (nothing more where the format has none);
* ``watch --once`` says what is settling and exits 0 when that is all that is left;
* ``watch --log-format json`` prints nothing but JSON (no text copy of each event);
* ``watch --status`` shows one rate per hop, the one measured on that hop.

No test here depends on timing: clocks are injected, kills are exceptions raised at a
chosen point.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import dcp_save, run_cli

from ckptctl.tiering.config import load_config
from ckptctl.formats.manifest import WRITING_MARKER
from ckptctl.service.drains import measured_plan
from ckptctl.service.status import read_status
from ckptctl.service.watch import Watcher


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


WQ = "model.layers.0.attention.wq.weight"


def _llama_ish(path: Path, step: int = 1) -> None:
    """A small DCP checkpoint with a few named tensors, one file per tensor group."""
    import torch

    g = torch.Generator().manual_seed(step)
    sd = {"model": {"layers.0.attention.wq.weight": torch.randn(32, 16, generator=g),
                    "layers.0.attention.wk.weight": torch.randn(32, 16, generator=g),
                    "norm.weight": torch.ones(16)},
          "step": step}
    dcp_save(path, sd)


def _verify(*args: str) -> tuple[int, dict]:
    code, out, err = run_cli("verify", *args, "--json")
    assert code in (0, 1), (code, out, err)
    return code, json.loads(out)


# ---------------------------------------------------------------- a killed promote


def _kill_promote_after_first_file(monkeypatch, src: Path, dst: Path) -> None:
    """Run promote until its second file: an exception there, as a kill would stop it."""
    from ckptctl.tiering.promote import promote
    from ckptctl.storage.transfer import Transfer

    real, sent = Transfer.copy, []

    def copy(self, rel, size, want):
        if sent:
            raise KeyboardInterrupt  # what SIGINT raises; SIGKILL leaves the same folder
        sent.append(rel)
        return real(self, rel, size, want)

    monkeypatch.setattr(Transfer, "copy", copy)
    with pytest.raises(KeyboardInterrupt):
        promote(str(src), str(dst), workers=1)
    monkeypatch.setattr(Transfer, "copy", real)
    assert sent, "the promote never started"


def test_verify_after_a_killed_promote_says_to_rerun_it(tmp_path, monkeypatch):
    src, dst = tmp_path / "hot" / "step-1", tmp_path / "warm" / "step-1"
    _llama_ish(src)
    _kill_promote_after_first_file(monkeypatch, src, dst)
    assert not dst.exists()  # a local promote publishes by a rename, at its commit
    code, doc = _verify(str(dst), "--level", "quick")
    assert code == 1 and [p["code"] for p in doc["problems"]] == ["NOT_COMMITTED"], doc
    msg = doc["problems"][0]["message"]
    assert "nothing committed here yet" in msg and "a promote (pid " in msg, msg
    assert "rerun the same promote to resume it" in msg and "--force" not in msg, msg
    assert doc["problems"][0]["path"].endswith(f".step-1.ckptctl-promote/{WRITING_MARKER}")
    # a place that is simply not there stays exit 3
    code, _, err = run_cli("verify", str(tmp_path / "warm" / "step-2"))
    assert code == 3 and "no such" in err, err
    # the advice holds: the rerun resumes and commits
    code, out, err = run_cli("promote", str(src), str(dst), "--json")
    assert code == 0 and json.loads(out)["files_skipped"] >= 1, out + err
    assert _verify(str(dst), "--level", "full")[0] == 0


def test_a_promote_marker_in_place_says_the_same(tmp_path):
    """A remote destination holds the promote's marker itself (no rename there): verify of
    it names the promote, on every level."""
    from ckptctl.tiering.promote import _marker

    dst = tmp_path / "step-1"
    _llama_ish(dst)
    (dst / WRITING_MARKER).write_bytes(_marker("xxh3-128:00", None))
    for level in ("quick", "structure", "full"):
        code, doc = _verify(str(dst), "--level", level)
        (p,) = doc["problems"]
        assert code == 1 and p["code"] == "NOT_COMMITTED", doc
        assert p["message"].startswith("a promote (pid ") and "resume" in p["message"], p


@pytest.mark.parametrize("command, words", [
    ("consolidate --to safetensors", "a `ckptctl consolidate --to safetensors` (pid 1 on "
                                     "elsewhere, started T) did not finish: rerun with "
                                     "--force to start it over"),
    ("rm", "a `ckptctl rm` (pid 1 on elsewhere, started T) did not finish removing it: "
           "rerun the rm"),
    (None, "a ckptctl writer (pid 1 on elsewhere, started T) did not finish: rerun with "
           "--force the command that wrote it"),
])
def test_each_writer_gets_its_own_fix(tmp_path, command, words):
    dst = tmp_path / "step-1"
    _llama_ish(dst)
    doc = {"pid": 1, "host": "elsewhere", "started": "T"}
    if command:
        doc["command"] = command
    (dst / WRITING_MARKER).write_text(json.dumps(doc))
    code, out = _verify(str(dst), "--level", "quick")
    assert code == 1 and out["problems"][0]["message"].startswith(words), out


def test_a_torn_marker_still_gives_the_general_fix(tmp_path):
    dst = tmp_path / "step-1"
    _llama_ish(dst)
    (dst / WRITING_MARKER).write_bytes(b'{"pid": 1, "host')
    code, doc = _verify(str(dst), "--level", "quick")
    assert code == 1 and doc["problems"][0]["message"].startswith(
        "a ckptctl writer did not finish: rerun with --force"), doc


# ---------------------------------------------------------------- damaged bytes, named


def _flip_inside(ckpt: Path, name: str) -> str:
    """Flip one byte of tensor ``name``'s data in its DCP file; returns that file."""
    from ckptctl.formats.detect import open_checkpoint
    from ckptctl.formats.tensorio import locate_payload

    ck = open_checkpoint(str(ckpt))
    ext = ck.tensors[name].chunks[0].extent
    p = locate_payload(ck, ext)
    path = ckpt / ext.file
    data = bytearray(path.read_bytes())
    data[p.offset + p.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return ext.file


def test_a_hash_mismatch_names_the_damaged_tensor(tmp_path):
    ck = tmp_path / "step-1"
    _llama_ish(ck)
    assert run_cli("seal", str(ck))[0] == 0
    rel = _flip_inside(ck, WQ)
    code, doc = _verify(str(ck), "--level", "full")
    assert code == 1 and doc["content"] == "hashes", doc
    (p,) = [p for p in doc["problems"] if p["code"] == "HASH_MISMATCH"]
    assert p["path"].endswith(rel) and p["entry"] == WQ, p
    assert p["message"] == ("content hash differs from the manifest (xxh3-128); the damaged "
                            f"bytes are in {WQ} (CRC-32 of its zip record)"), p
    # the text report names it too
    code, out, _ = run_cli("verify", str(ck), "--level", "full")
    assert code == 1 and f"the damaged bytes are in {WQ}" in " ".join(out.split()), out


def test_a_hash_mismatch_in_a_zstd_chunk_names_its_tensor(tmp_path):
    """DCP's stream.zstd/1 chunks: decoded with their zip CRCs, as an unsealed verify does."""
    pytest.importorskip("torch.distributed.checkpoint._extension")
    import torch

    from ckptctl.formats.detect import open_checkpoint

    ck = tmp_path / "step-1"
    dcp_save(ck, {"model": {"w": torch.randn(256, 64), "b": torch.zeros(64)}}, zstd=True)
    assert run_cli("seal", str(ck))[0] == 0
    ext = open_checkpoint(str(ck)).tensors["model.w"].chunks[0].extent
    assert ext.encoding == "torch_zip+zstd", ext
    path = ck / ext.file
    data = bytearray(path.read_bytes())
    data[ext.offset + ext.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    code, doc = _verify(str(ck), "--level", "full")
    (p,) = [p for p in doc["problems"] if p["code"] == "HASH_MISMATCH"]
    assert code == 1 and p["entry"] == "model.w", p
    assert p["message"].endswith("the damaged bytes are in model.w (CRC-32 of its zip "
                                 "record)"), p


def test_a_hash_mismatch_in_safetensors_names_only_the_file(tmp_path):
    """safetensors carries no checksum: the file, nothing made up about its entries."""
    import numpy as np
    from safetensors.numpy import save_file

    ck = tmp_path / "step-1"
    ck.mkdir()
    save_file({"w": np.arange(64, dtype=np.float32)}, str(ck / "model.safetensors"))
    assert run_cli("seal", str(ck))[0] == 0
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-8] ^= 0x40
    (ck / "model.safetensors").write_bytes(bytes(data))
    code, doc = _verify(str(ck), "--level", "full")
    (p,) = [p for p in doc["problems"] if p["code"] == "HASH_MISMATCH"]
    assert code == 1 and p["entry"] is None, p
    assert p["message"] == "content hash differs from the manifest (xxh3-128)", p


# ---------------------------------------------------------------- watch --once, settling


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "ckptctl.toml"
    path.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n'
                    f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n')
    (tmp_path / "hot").mkdir(exist_ok=True)
    return path


def test_once_says_what_is_settling_and_exits_0(tmp_path):
    from ckptctl.cli.watch_cmd import pending_words

    cfg = _config(tmp_path)
    _llama_ish(tmp_path / "hot" / "step-1")
    now = [1000.0]
    w = Watcher(load_config(str(cfg)), settle=60, clock=lambda: now[0])
    p = w.run_once()
    assert p.unchanged == {"step-1": 0.0} and p.ok and not p.drained
    now[0] += 12
    p = w.run_once()
    assert p.unchanged == {"step-1": 12.0} and p.ok
    assert pending_words(p.pending, p.unchanged, 60) == \
        "1 pending: settling (newest unchanged for 12 s; --settle 60)"
    # through the CLI (its own clock, and its own config: no status shared with the
    # Watcher above): the words, and exit 0 since nothing failed
    (tmp_path / "b").mkdir()
    cfg = _config(tmp_path / "b")
    _llama_ish(tmp_path / "b" / "hot" / "step-1")
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--settle", "3600")
    assert code == 0, out + err
    assert re.search(r"0 hops, 0 removed, 1 pending: settling \(newest unchanged for \d+ s; "
                     r"--settle 3600\), 0 failed$", out.strip()), out
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--settle", "3600", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["drained"] is False, doc
    assert set(doc["unchanged_seconds"]) == {"step-1"}
    # an incomplete one is not on its way by itself: exit 1, and it says so
    bad = tmp_path / "b" / "hot" / "step-2"
    _llama_ish(bad, 2)
    (bad / ".metadata").unlink()
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--settle", "3600")
    assert code == 1 and "2 pending: 1 settling (newest unchanged for" in out, out
    assert "1 incomplete, 0 failed" in out, out


# ---------------------------------------------------------------- the JSON log alone


def test_json_log_leaves_stdout_to_json(tmp_path):
    cfg = _config(tmp_path)
    _llama_ish(tmp_path / "hot" / "step-1")
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--settle", "0", "--log-format", "json")
    assert code == 0 and out == "", out  # no text copy of any event
    events = [json.loads(line) for line in err.splitlines()]  # every stderr line is JSON
    assert {"found", "sealed", "promoted", "pass"} <= {e["event"] for e in events}, events
    _llama_ish(tmp_path / "hot" / "step-2", 2)
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--settle", "0", "--log-format", "json", "--json")
    assert code == 0 and json.loads(out)["drained"] is True, out
    assert all(json.loads(line) for line in err.splitlines())


def test_json_log_loop_as_a_service(tmp_path):
    """The loop under a service manager: stderr is the JSON log, stdout (--json) one
    document per line, and neither holds a line of text, up to the SIGTERM that stops it."""
    import os
    import signal
    import subprocess
    import sys

    cfg = _config(tmp_path)
    _llama_ish(tmp_path / "hot" / "step-1")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch", "--no-nice",
         "--settle", "0", "--interval", "3600", "--log-format", "json", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=Path(__file__).resolve().parents[1])
    try:
        first = proc.stdout.readline()  # blocks until the first pass is reported: no sleep
        proc.send_signal(signal.SIGTERM)  # between passes (or in one): it stops, exit 0
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    docs = [json.loads(line) for line in (first + out).splitlines()]  # JSON lines only
    assert docs[0]["promoted"][0]["name"] == "step-1" and len(docs) == 1, first + out
    events = [json.loads(line) for line in err.splitlines()]  # the log: JSON only
    assert {"found", "sealed", "promoted", "pass"} <= {e["event"] for e in events}, err


# ---------------------------------------------------------------- one rate per hop


def test_status_shows_one_rate_per_hop(tmp_path):
    cfg = _config(tmp_path)
    _llama_ish(tmp_path / "hot" / "step-1")
    assert run_cli("--config", str(cfg), "watch", "--once", "--no-nice", "--settle", "0")[0] == 0
    st = read_status(str(cfg))
    (done,) = st["done"]
    assert done["bytes_per_second"] == st["rates"]["hot->warm"] > 0
    code, out, err = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0, err
    from ckptctl.cli.common import human_rate

    rate = human_rate(done["bytes_per_second"])
    hop_lines = [line for line in out.splitlines() if "hot -> warm" in line
                 and "/s" in line and not line.startswith("recover")]
    assert not [line for line in out.splitlines() if line.startswith("rate:")], out
    (row,) = [line for line in hop_lines if line.lstrip().startswith("hot -> warm")]
    assert rate in row and "measured on hot -> warm" in row, out
    doc = json.loads(run_cli("--config", str(cfg), "watch", "--status", "--json")[1])
    assert doc["plan"]["hops"][0]["bytes_per_second"] == done["bytes_per_second"]


def test_a_hop_that_moved_nothing_measures_no_rate(tmp_path):
    """A resumed hop that found every byte there took a moment and sent nothing: its
    bytes over its seconds is no rate; the plan keeps the hop's last real one."""
    cfg = _config(tmp_path)
    config = load_config(str(cfg))
    w = Watcher(config, settle=0)
    w.status["arrivals"] = [{"name": "step-2", "bytes": 10**9,
                             "modified": "2026-01-01T00:00:00Z"}]
    w.record_done("step-1", "hot", "warm", "promoted", 10**9, 10.0, rate=1e8)
    w.record_done("step-2", "hot", "warm", "promoted", 10**9, 0.01, rate=None)
    assert w.status["rates"] == {"hot->warm": 100000000}
    assert w.status["done"][-1]["bytes_per_second"] is None
    hop = measured_plan(config, w.status).hops[0]
    assert hop.bytes_per_second == 1e8 and hop.rate_source == "measured on hot -> warm"
    # a status file from before: its bytes over its seconds, as then
    old = {"arrivals": w.status["arrivals"], "done": [
        {"name": "step-1", "src": "hot", "dst": "warm", "action": "promoted",
         "bytes": 10**9, "seconds": 20.0}]}
    assert measured_plan(config, old).hops[0].bytes_per_second == 5e7


def test_drain_rate_counts_what_the_hop_carried():
    from ckptctl.service.drains import drain_rate

    assert drain_rate(1000, 250, 1.0, pack=False) == 250.0  # a resumed copy
    assert drain_rate(1000, 100, 2.0, pack=True) == 500.0   # a delta pack: S over its time
    assert drain_rate(1000, 0, 1.0, pack=True) is None
