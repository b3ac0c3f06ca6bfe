"""``--json`` is one schema across commands (issue 8, item 2; README "JSON output"):

* every document carries ``"schema_version": 3`` (2: issue 21's one vocabulary renamed keys;
  3: issue 35's, verify's counts and verdict);
* the same key means the same thing everywhere: ``url`` (the checkpoint's URL; ``src`` and
  ``dst`` for conversions), ``bytes`` (a byte count), ``files`` (always a list of names),
  ``num_files`` (always a count), ``seconds`` (a duration), times as ISO-8601 UTC strings;
* on failure stdout holds ``{"schema_version": 3, "error": {code, exit_code, message,
  path}}`` beside the one line on stderr.

Every command is run through the CLI on a real DCP checkpoint that torch wrote, success
and failure, and the documents are checked against the files on disk.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl.formats.manifest import MANIFEST
from ckptctl.catalog.vocabulary import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
#: keys whose meaning the schema fixes, and the type each must have wherever it appears
TYPED = {"schema_version": int, "url": str, "src": str, "dst": str, "bytes": int,
         "num_files": int, "seconds": (int, float)}
#: keys the schema retired: a document that still has one mixes two meanings
RETIRED = {"total_bytes", "bytes_written"}
ERROR_KEYS = {"code", "exit_code", "message", "path"}


def _walk(doc, where="$"):
    """Every (path, dict) in a JSON document."""
    if isinstance(doc, dict):
        yield where, doc
        for k, v in doc.items():
            yield from _walk(v, f"{where}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _walk(v, f"{where}[{i}]")


def _check_schema(doc: dict) -> None:
    assert doc["schema_version"] == SCHEMA_VERSION
    assert next(iter(doc)) == "schema_version"  # first, so `head` shows it
    for where, d in _walk(doc):
        for k, v in d.items():
            assert k not in RETIRED, f"{where}.{k}"
            if k in TYPED and v is not None:
                assert isinstance(v, TYPED[k]) and not isinstance(v, bool), (where, k, v)
            if k == "files":
                assert isinstance(v, list) and all(isinstance(x, str) for x in v), (where, v)
            if k in ("modified", "created") and v is not None:
                assert v.endswith("Z") and dt.datetime.fromisoformat(v).tzinfo, (where, k, v)


def _json_ok(cli, *args) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == 0, (code, out, err)
    doc = json.loads(out)
    _check_schema(doc)
    return doc


def _json_error(cli, code_, *args) -> dict:
    """Run a failing command with --json: the error object on stdout, one line on stderr."""
    code, out, err = cli(*args, "--json")
    assert code == code_, (code, out, err)
    doc = json.loads(out)
    assert set(doc) == {"schema_version", "error"} and doc["schema_version"] == SCHEMA_VERSION, doc
    e = doc["error"]
    assert set(e) == ERROR_KEYS and e["exit_code"] == code, e
    assert isinstance(e["code"], str) and e["code"].isupper() and e["message"], e
    assert "Traceback" not in err and err.strip(), err
    # and without --json, stdout stays empty and stderr says the same
    code2, out2, _ = cli(*args)
    assert (code2, out2) == (code, ""), (code2, out2)
    return e


def _sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def run(tiny_dcp, tmp_path) -> Path:
    """``run/step-42``: a DCP checkpoint torch wrote (3 tensors, step entry 42)."""
    root = tmp_path / "run"
    root.mkdir()
    shutil.move(str(tiny_dcp), root / "step-42")
    return root


def test_ls_json(cli, run):
    doc = _json_ok(cli, "ls", str(run))
    assert doc["root"] == str(run)
    (row,) = doc["checkpoints"]
    sizes = _sizes(run / "step-42")
    assert row["url"] == str(run / "step-42") and row["name"] == "step-42"
    assert row["bytes"] == sum(sizes.values()) and row["num_files"] == len(sizes)
    assert (row["step"], row["format"], row["state"]) == (42, "dcp", "complete")
    mtime = dt.datetime.fromisoformat(row["modified"]).timestamp()
    newest = max(p.stat().st_mtime for p in (run / "step-42").iterdir())
    assert abs(mtime - newest) < 2  # the time is UTC: the same instant as the file's


def test_inspect_json(cli, run):
    ck = run / "step-42"
    doc = _json_ok(cli, "inspect", str(ck))
    sizes = _sizes(ck)
    assert doc["url"] == str(ck) and doc["bytes"] == sum(sizes.values())
    assert doc["num_files"] == len(sizes) and doc["num_tensors"] == len(doc["tensors"]) == 3
    assert doc["step"] == 42 and doc["step_source"] == "entry"
    assert all(isinstance(t["bytes"], int) for t in doc["tensors"])


def test_verify_json(cli, run):
    ck = run / "step-42"
    doc = _json_ok(cli, "verify", str(ck), "--level", "full")
    assert doc["url"] == str(ck) and doc["ok"] is True and doc["problems"] == []
    assert doc["step"] == 42 and doc["num_files"] == len(_sizes(ck))


def test_seal_json(cli, run):
    ck = run / "step-42"
    sizes = _sizes(ck)
    doc = _json_ok(cli, "seal", str(ck))
    assert doc["url"] == str(ck) and doc["action"] == "sealed" and doc["step"] == 42
    assert doc["num_files"] == len(sizes) and doc["bytes"] == sum(sizes.values())
    again = _json_ok(cli, "seal", str(ck))  # verified against its manifest: same numbers
    assert (again["action"], again["num_files"], again["bytes"], again["manifest_id"]) == \
        ("verified", doc["num_files"], doc["bytes"], doc["manifest_id"])


def test_reshard_dry_run_json(cli, run, tmp_path):
    out = tmp_path / "out"
    doc = _json_ok(cli, "reshard", str(run / "step-42"), str(out), "--world-size", "2",
                   "--dry-run")
    assert (doc["src"], doc["dst"], doc["dry_run"]) == (str(run / "step-42"), str(out), True)
    assert doc["files"] == [] and doc["num_files"] == 0 and not out.exists()
    assert doc["num_chunks"] == sum(r["num_chunks"] for r in doc["ranks"]) > 0
    assert doc["bytes"] == sum(r["write_bytes"] for r in doc["ranks"])


def test_reshard_json(cli, run, tmp_path):
    out = tmp_path / "out"
    doc = _json_ok(cli, "reshard", str(run / "step-42"), str(out), "--world-size", "2")
    written = {n: s for n, s in _sizes(out).items() if n != MANIFEST}
    assert doc["files"] == sorted(written) and doc["num_files"] == len(written)
    assert doc["bytes"] == sum(written.values()) and doc["dry_run"] is False
    assert set(written) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}


@pytest.mark.parametrize("to", ["safetensors", "torch", "dcp"])
def test_consolidate_json(cli, run, tmp_path, to):
    out = tmp_path / "out"
    doc = _json_ok(cli, "consolidate", str(run / "step-42"), str(out), "--to", to,
                   "--only", "model")
    written = {n: s for n, s in _sizes(out).items() if n != MANIFEST}
    assert doc["files"] == sorted(written) and doc["num_files"] == len(written)
    assert doc["bytes"] == sum(written.values())
    assert (doc["num_tensors"], doc["num_objects"]) == (3, 0)


# ------------------------------------------------------------------------------- failures


def test_ls_json_error(cli, tmp_path):
    e = _json_error(cli, 3, "ls", str(tmp_path / "nope"))
    assert e == {"code": "MISSING_FILE", "exit_code": 3, "path": str(tmp_path / "nope"),
                 "message": f"{tmp_path / 'nope'}: no such file or directory"}


def test_inspect_json_error(cli, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    e = _json_error(cli, 3, "inspect", str(notes))
    assert (e["code"], e["path"], e["message"]) == \
        ("UNSUPPORTED_FORMAT", str(notes), f"{notes}: not a checkpoint")


def test_verify_json_error(cli, tmp_path):
    e = _json_error(cli, 2, "verify", str(tmp_path), "--workers", "0")
    assert e["code"] == "USAGE" and "--workers" in e["message"] and e["path"] is None


def test_verify_finding_is_a_document_not_an_error(cli, run):
    """A finding is verify's answer (exit 1): its report, not an error object."""
    (run / "step-42" / "__0_0.distcp").unlink()
    code, out, _ = cli("verify", str(run / "step-42"), "--json")
    doc = json.loads(out)
    _check_schema(doc)
    assert code == 1 and doc["ok"] is False and "error" not in doc
    assert [p["code"] for p in doc["problems"]] == ["MISSING_FILE"]


def test_seal_json_error(cli, run):
    (run / "step-42" / "__0_0.distcp").unlink()  # seal refuses it: a finding, exit 1
    e = _json_error(cli, 1, "seal", str(run / "step-42"))
    assert e["code"] == "MISSING_FILE" and "refusing to seal" in e["message"]
    assert e["path"].startswith(str(run / "step-42"))


def test_reshard_json_error(cli, run, tmp_path):
    e = _json_error(cli, 2, "reshard", str(run / "step-42"), str(tmp_path / "o"),
                    "--mesh", "dp=two", "--dry-run")
    assert e["code"] == "USAGE" and "dp=two" in e["message"]
    e = _json_error(cli, 2, "reshard", str(run / "step-42"), str(tmp_path / "o"),
                    "--world-size", "2", "--max-memory", "-1GiB")
    assert e["code"] == "USAGE" and "--max-memory" in e["message"]
    assert not (tmp_path / "o").exists()


def test_consolidate_json_error(cli, run, tmp_path):
    e = _json_error(cli, 3, "consolidate", str(run / "nope"), str(tmp_path / "o"))
    assert e["code"] == "MISSING_FILE" and e["path"] == str(run / "nope")
    e = _json_error(cli, 2, "consolidate", str(run / "step-42"), str(tmp_path / "o"),
                    "--to", "onnx")
    assert e["code"] == "USAGE" and "--to" in e["message"]


def test_tiers_json(cli, run, tmp_path):
    f = tmp_path / "ckptctl.toml"
    f.write_text(f'[[tier]]\nname = "hot"\nurl = "{run}"\nkeep = {{ last = 2 }}\n'
                 f'[[tier]]\nname = "cold"\nurl = "{tmp_path / "cold"}"\nbwlimit = "1MiB/s"\n')
    doc = _json_ok(cli, "tiers", "--config", str(f))
    assert doc["config"] == str(f) and doc["ok"] is True and doc["checked"] is True
    assert [(t["name"], t["url"], t["bwlimit_bytes_per_second"], t["keep"], t["ok"])
            for t in doc["tiers"]] == [("hot", str(run), None, {"last": 2}, True),
                                       ("cold", str(tmp_path / "cold"), 1 << 20, None, True)]
    assert isinstance(doc["tiers"][1]["bwlimit_bytes_per_second"], int)
    assert all(isinstance(t["seconds"], float) for t in doc["tiers"])


def test_tiers_json_error(cli, tmp_path):
    f = tmp_path / "ckptctl.toml"
    f.write_text('[[tier]]\nname = "hot"\nurl = "/x"\nkeep = { lats = 2 }\n')
    e = _json_error(cli, 2, "tiers", "--config", str(f))
    assert e["code"] == "USAGE" and e["path"] == str(f) and "'lats'" in e["message"]


def test_gc_json(cli, run):
    doc = _json_ok(cli, "gc", str(run), "--keep-last", "1", "--dry-run")
    assert doc["root"] == str(run) and doc["dry_run"] is True and doc["remove"] == []
    (c,) = doc["checkpoints"]
    assert (c["url"], c["action"], c["reasons"]) == \
        (str(run / "step-42"), "keep", ["last 1", "newest committed"])
    assert c["bytes"] == sum(_sizes(run / "step-42").values()) and doc["bytes"] == 0


def test_gc_json_error(cli, run):
    e = _json_error(cli, 2, "gc", str(run))
    assert e["code"] == "USAGE" and "empty policy" in e["message"]


def test_watch_json(cli, run, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = tmp_path / "ckptctl.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{run}"\n'
                   f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n')
    doc = _json_ok(cli, "--config", str(cfg), "watch", "--once", "--settle", "0", "--no-nice")
    assert doc["drained"] is True and doc["found"] == ["step-42"]
    (hop,) = doc["promoted"]
    assert (hop["name"], hop["src"], hop["dst"], hop["action"]) == \
        ("step-42", "hot", "warm", "promoted")
    sizes = _sizes(run / "step-42")  # sealed at the source by watch
    assert hop["bytes"] == sum(v for k, v in sizes.items() if k != MANIFEST)
    assert _sizes(tmp_path / "warm" / "step-42") == sizes
    status = _json_ok(cli, "--config", str(cfg), "watch", "--status")
    assert status["status"]["done"][0]["name"] == "step-42"


def test_watch_json_error(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTCTL_CONFIG", raising=False)
    e = _json_error(cli, 2, "watch", "--once")
    assert e["code"] == "USAGE" and "no tier config" in e["message"]


def test_promote_json(cli, run, tmp_path):
    dst = tmp_path / "warm" / "step-42"
    doc = _json_ok(cli, "promote", str(run / "step-42"), str(dst))
    landed = _sizes(dst)
    assert (doc["src"], doc["dst"], doc["action"]) == (str(run / "step-42"), str(dst), "promoted")
    assert doc["sealed_source"] is True and doc["num_files"] == len(landed) - 1  # + manifest
    assert doc["bytes"] == doc["bytes_sent"] == sum(n for f, n in landed.items() if f != MANIFEST)
    # the data, the marker and the manifest: nothing else, nothing twice
    assert doc["requests"]["destination"]["write_bytes"] > doc["bytes"]
    again = _json_ok(cli, "promote", str(run / "step-42"), str(dst))
    assert (again["action"], again["bytes_sent"]) == ("up-to-date", 0)


def test_promote_json_error(cli, run, tmp_path):
    (run / "step-42" / ".metadata").unlink()
    e = _json_error(cli, 1, "promote", str(run / "step-42"), str(tmp_path / "dst"))
    assert e["code"] == "NOT_COMMITTED" and "refusing to seal" in e["message"], e


def test_pack_json(cli, run, tmp_path):
    src, dst = run / "step-42", tmp_path / "packs" / "step-42"
    doc = _json_ok(cli, "pack", str(src), str(dst), "--workers", "2")
    landed = _sizes(dst)
    assert (doc["src"], doc["dst"], doc["base"], doc["depth"]) == (str(src), str(dst), None, 0)
    assert doc["sealed_source"] is True and doc["bytes_out"] == sum(landed.values())
    assert doc["bytes_in"] == sum(_sizes(src).values())  # its manifest included
    assert doc["ratio"] == round(doc["bytes_in"] / doc["bytes_out"], 4)
    assert sum(doc["chunks"].values()) > 0 and set(doc["chunks"]) <= {"zstd", "planes"}
    back = _json_ok(cli, "unpack", str(dst), str(tmp_path / "back"))
    assert (back["src"], back["dst"]) == (str(dst), str(tmp_path / "back"))
    assert back["manifest_id"] == doc["manifest_id"] and back["bytes"] == doc["bytes_in"]
    assert _sizes(tmp_path / "back") == _sizes(src)


def test_pack_json_error(cli, run, tmp_path):
    (run / "step-42" / ".metadata").unlink()
    e = _json_error(cli, 1, "pack", str(run / "step-42"), str(tmp_path / "p"))
    assert e["code"] == "NOT_COMMITTED", e
    assert not (tmp_path / "p").exists()


def test_unpack_json_error(cli, run, tmp_path):
    e = _json_error(cli, 2, "unpack", str(run / "step-42"), str(tmp_path / "out"))
    assert e["code"] == "USAGE" and "not a pack" in e["message"], e
    assert not (tmp_path / "out").exists()


def test_diff_json(cli, run, tmp_path):
    ck = run / "step-42"
    out = tmp_path / "r2"
    assert cli("reshard", str(ck), str(out), "--world-size", "2", "-q")[0] == 0
    doc = _json_ok(cli, "diff", str(ck), str(out))
    assert (doc["a"]["url"], doc["b"]["url"]) == (str(ck), str(out))
    assert (doc["a"]["format"], doc["b"]["format"], doc["equal"]) == ("dcp", "dcp", True)
    tensors = [e for e in doc["entries"] if e["kind"] == "tensor"]
    assert len(tensors) == 3 and {e["status"] for e in doc["entries"]} == {"identical"}
    assert doc["counts"] == {"identical": len(doc["entries"])}
    assert doc["bytes"] == doc["bytes_compared"] == sum(e["bytes"] for e in tensors) > 0
    # a difference is diff's answer (exit 1): its report, not an error object
    code, text, _ = cli("diff", str(ck), str(out), "--map", "model.=", "--json")
    doc = json.loads(text)
    _check_schema(doc)
    assert code == 1 and doc["equal"] is False and "error" not in doc
    assert doc["counts"]["only_in_a"] == doc["counts"]["only_in_b"] == 3


def test_diff_json_error(cli, run, tmp_path):
    e = _json_error(cli, 3, "diff", str(run / "step-42"), str(run / "nope"))
    assert e["code"] == "MISSING_FILE" and e["path"] == str(run / "nope")
    e = _json_error(cli, 2, "diff", str(run / "step-42"), str(run / "step-42"), "--rtol", "-1")
    assert e["code"] == "USAGE" and "--rtol" in e["message"]


def _wait_blocked_in_read(p: subprocess.Popen, deadline: float) -> None:
    """Wait until ``p`` sleeps in the FIFO's read(). A SIGINT that lands between its open()
    returning and that read() sets Python's flag but interrupts no system call, so the read
    would block for good (CI hung on it once under load). In read() it gets EINTR and raises
    KeyboardInterrupt at once. Where the kernel does not say (no wchan), go on as before."""
    wchan, told = f"/proc/{p.pid}/wchan", False
    while time.monotonic() < deadline:
        try:
            with open(wchan) as f:
                where = f.read().strip()
        except OSError:
            return
        if "pipe_read" in where:
            return
        told = told or where not in ("", "0")  # "0": running, or a kernel that hides it
        assert p.poll() is None, p.communicate()
        time.sleep(0.02)
    assert not told, f"ckptctl never blocked reading its --rules FIFO (last in {where})"


def test_interrupted_json_error(tmp_path):
    """Ctrl-C: "interrupted" on stderr, exit 130, and the error object on stdout. The
    command blocks reading its --rules file (a FIFO), so the signal lands mid-command."""
    fifo = tmp_path / "rules.toml"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "ckptctl", "reshard", str(tmp_path / "src"),
                          str(tmp_path / "dst"), "--mesh", "dp=2", "--rules", str(fifo),
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:  # opening the write end succeeds once ckptctl holds the read end
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.02)
        _wait_blocked_in_read(p, deadline)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        os.close(fd)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["ckptctl: interrupted"], err
    doc = json.loads(out)
    want = {"code": "INTERRUPTED", "exit_code": 130, "message": "interrupted", "path": None}
    assert doc == {"schema_version": SCHEMA_VERSION, "error": want}


def test_plan_json(cli, run, tmp_path):
    f = tmp_path / "ckptctl.toml"
    f.write_text(f'[[tier]]\nname = "hot"\nurl = "{run}"\n'
                 f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\nbwlimit = "1GB/s"\n')
    ck = run / "step-42"
    doc = _json_ok(cli, "plan", "--config", str(f), "--checkpoint", str(ck), "--save-seconds",
                   "60", "--mtbf", "2.8h", "--measure", "hot", "--measure-size", "1MiB")
    assert 1099 < doc["optimal_interval_seconds"] < 1100
    assert doc["checkpoint_url"] == str(ck) and doc["checkpoint_bytes"] == sum(_sizes(ck).values())
    assert [(h["src"], h["dst"]) for h in doc["hops"]] == [("hot", "warm")]
    assert [m["tier"] for m in doc["measured"]] == ["hot"] and doc["measured"][0]["removed"]
    assert sorted(os.listdir(run)) == ["step-42"]  # the probe is gone


def test_plan_json_error(cli, tmp_path):
    e = _json_error(cli, 2, "plan", "--checkpoint-size", "1TB", "--save-seconds", "60")
    assert e["code"] == "USAGE" and "--mtbf" in e["message"]


def test_report_json(cli, run):
    doc = _json_ok(cli, "report", str(run))
    assert doc["target"] == str(run) and doc["only"] == ["model"]
    (tier,) = doc["tiers"]
    assert [c["url"] for c in tier["checkpoints"]] == [str(run / "step-42")]
    assert doc["breakdown"]["url"] == str(run / "step-42") and doc["changes"] == []
    assert doc["notes"] == ["fewer than two readable checkpoints: no change to show"]


def test_report_json_error(cli, run):
    e = _json_error(cli, 2, "report", str(run), "--save-seconds", "60")
    assert e["code"] == "USAGE" and "--mtbf" in e["message"]


def test_every_command_with_json_is_covered():
    """A new command with --json must get its success and failure tests here."""
    import typer

    from ckptctl.cli.main import app

    group = typer.main.get_command(app)
    with_json = {name for name, cmd in group.commands.items()
                 if any("--json" in p.opts for p in cmd.params)}
    covered = {"ls", "inspect", "verify", "seal", "reshard", "consolidate", "tiers", "gc",
               "promote", "pack", "unpack", "diff", "plan", "watch", "latest", "rm", "pin",
               "unpin", "man", "report"}  # man: tests/test_garbage_and_traps.py
    assert with_json == covered, with_json ^ covered


def test_latest_json(cli, run):
    doc = _json_ok(cli, "latest", str(run))
    assert (doc["root"], doc["url"], doc["name"], doc["step"], doc["state"]) == \
        (str(run), str(run / "step-42"), "step-42", 42, "complete")
    assert doc["rejected"] == [] and doc["disagrees"] == []


def test_latest_json_none_is_a_document(cli, tmp_path):
    """No committed checkpoint is latest's answer (exit 1): its document, url null."""
    (tmp_path / "empty").mkdir()
    code, out, err = cli("latest", str(tmp_path / "empty"), "--json")
    doc = json.loads(out)
    _check_schema(doc)
    assert code == 1 and doc["url"] is None and "error" not in doc
    assert "no committed checkpoint" in err


def test_latest_json_error(cli, tmp_path):
    e = _json_error(cli, 3, "latest", str(tmp_path / "nope"))
    assert e["code"] == "MISSING_FILE" and e["path"] == str(tmp_path / "nope")


def test_pin_unpin_rm_json(cli, run):
    ck = run / "step-42"
    sizes = _sizes(ck)
    doc = _json_ok(cli, "pin", str(ck), "--reason", "paper")
    assert (doc["url"], doc["pinned"], doc["changed"], doc["reason"]) == \
        (str(ck), True, True, "paper")
    assert doc["pinned_at"].endswith("Z") and doc["by"]
    again = _json_ok(cli, "pin", str(ck), "--reason", "paper")
    assert (again["pinned"], again["changed"], again["pinned_at"]) == \
        (True, False, doc["pinned_at"])
    doc = _json_ok(cli, "unpin", str(ck))
    assert (doc["url"], doc["pinned"], doc["changed"]) == (str(ck), False, True)
    doc = _json_ok(cli, "rm", str(ck))
    assert (doc["url"], doc["num_files"], doc["bytes"], doc["was_pinned"]) == \
        (str(ck), len(sizes), sum(sizes.values()), False)
    assert not ck.exists()


def test_pin_rm_json_error(cli, run, tmp_path):
    e = _json_error(cli, 3, "pin", str(tmp_path / "nope"))
    assert e["code"] == "MISSING_FILE"
    e = _json_error(cli, 3, "unpin", str(tmp_path / "nope"))
    assert e["code"] == "MISSING_FILE"
    assert cli("pin", str(run / "step-42"), "-q")[0] == 0
    e = _json_error(cli, 1, "rm", str(run / "step-42"))  # pinned: refused, a finding
    assert e["path"] is None or e["path"].startswith(str(run))
    assert (run / "step-42").exists()


def test_inspect_shows_the_checkpoint_id(cli, run):
    """inspect names the checkpoint by its manifest id where it is sealed (issue 21), the
    id seal, promote, pack and diff give; unsealed: null, and no id line."""
    ck = run / "step-42"
    assert _json_ok(cli, "inspect", str(ck))["manifest_id"] is None
    code, text, _ = cli("inspect", str(ck))
    assert code == 0 and "  id  " not in text
    sealed = _json_ok(cli, "seal", str(ck))
    doc = _json_ok(cli, "inspect", str(ck))
    assert doc["sealed"] is True and doc["manifest_id"] == sealed["manifest_id"]
    code, text, _ = cli("inspect", str(ck))
    assert code == 0 and f"  id       {sealed['manifest_id']}" in text.splitlines()
