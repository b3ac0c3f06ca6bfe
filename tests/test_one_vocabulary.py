"""One vocabulary, really (issue 35, item 9, and item 10's warnings):

* ``num_files`` and ``bytes`` are one count in every verb: the files a checkpoint owns,
  ckptctl's markers (manifest, pin, writing marker) and leftover temp files aside; a
  user's ``NOTES.md`` beside it counts only once a seal lists it;
* verify's counts are ``num_*`` (``num_files_read``, ``num_tensors_checked``), schema 3;
* every verb shows a place as it was given (a relative path stays relative, a
  ``file://`` URL stays one, an absolute path stays absolute), in ``--json`` and in text;
* verify's warnings (EXTRA_FILE, STRAY_TEMP) exit 0 with ``"ok": true`` and a count;
  ``--strict`` makes them exit 1 with ``"ok": false``;
* verify's report fits 80 columns: files relative to the checkpoint, messages wrapped.

The cross-verb value walk itself is ``tests/test_json_vocabulary.py``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptctl.formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER
from conftest import run_cli, write_tiny_dcp


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """``run/step-42`` (a DCP checkpoint torch wrote: ``.metadata`` and one data file),
    the working directory its places are given relative to."""
    write_tiny_dcp(tmp_path / "run" / "step-42")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _json(*args: str, codes=(0,)) -> dict:
    code, out, err = run_cli(*args, "--json")
    assert code in codes, (args, code, out, err)
    return json.loads(out)


def _text(*args: str, code_=0) -> str:
    code, out, err = run_cli(*args)
    assert code == code_, (args, code, out, err)
    return out


def _counts(ck: str) -> dict[str, tuple[int, int]]:
    """verb -> (num_files, bytes) of the checkpoint ``ck`` (``run/NAME``)."""
    row = _json("ls", "run")["checkpoints"][0]
    inspect = _json("inspect", ck)
    verify = _json("verify", ck, codes=(0, 1))
    return {"ls": (row["num_files"], row["bytes"]),
            "inspect": (inspect["num_files"], inspect["bytes"]),
            "verify": (verify["num_files"], None)}


def _sizes(folder: Path, *names: str) -> int:
    return sum((folder / n).stat().st_size for n in names)


# ------------------------------------------------------------------ num_files, bytes

def test_num_files_leaves_ckptctls_markers_aside(work):
    ck = work / "run" / "step-42"
    data = sorted(p.name for p in ck.iterdir())
    want = (len(data), _sizes(ck, *data))
    assert _counts("run/step-42") == {"ls": want, "inspect": want, "verify": (want[0], None)}
    sealed = _json("seal", "run/step-42")
    assert (sealed["num_files"], sealed["bytes"]) == want
    assert run_cli("pin", "run/step-42")[0] == 0
    assert {MANIFEST, PIN_FILE} <= {p.name for p in ck.iterdir()}
    assert _counts("run/step-42") == {"ls": want, "inspect": want, "verify": (want[0], None)}
    doc = _json("rm", "run/step-42", "--force")
    assert (doc["num_files"], doc["bytes"]) == want


def test_a_users_file_counts_once_a_seal_lists_it(work):
    """NOTES.md beside an unsealed checkpoint is not its file (gc and rm would not take it);
    sealed in, it is; put beside a sealed one, it is not (EXTRA_FILE)."""
    ck = work / "run" / "step-42"
    data = sorted(p.name for p in ck.iterdir())
    (ck / "NOTES.md").write_text("eval loss 3.1\n")
    alone = (len(data), _sizes(ck, *data))
    assert _counts("run/step-42") == {"ls": alone, "inspect": alone,
                                      "verify": (alone[0], None)}
    sealed = _json("seal", "run/step-42")  # seal lists every file but its own markers
    with_notes = (len(data) + 1, _sizes(ck, *data, "NOTES.md"))
    assert (sealed["num_files"], sealed["bytes"]) == with_notes
    assert _counts("run/step-42") == {"ls": with_notes, "inspect": with_notes,
                                      "verify": (with_notes[0], None)}


def test_a_note_beside_a_sealed_checkpoint_is_not_counted(work):
    ck = work / "run" / "step-42"
    data = sorted(p.name for p in ck.iterdir())
    sealed = _json("seal", "run/step-42")
    (ck / "NOTES.md").write_text("eval loss 3.1\n")
    want = (len(data), _sizes(ck, *data))
    assert (sealed["num_files"], sealed["bytes"]) == want
    assert _counts("run/step-42") == {"ls": want, "inspect": want, "verify": (want[0], None)}
    again = _json("seal", "run/step-42")  # verified against its manifest: the same count
    assert (again["action"], again["num_files"], again["bytes"]) == ("verified", *want)


def test_a_pack_counts_its_own_files(work):
    assert run_cli("pack", "run/step-42", "cold/step-42")[0] == 0
    pack = work / "cold" / "step-42"
    own = sorted(p.name for p in pack.iterdir() if p.name != MANIFEST)
    want = (len(own), _sizes(pack, *own))
    row = _json("ls", "cold")["checkpoints"][0]
    inspect = _json("inspect", "cold/step-42")
    verify = _json("verify", "cold/step-42", "--level", "full")
    assert (row["num_files"], row["bytes"]) == (inspect["num_files"], inspect["bytes"]) == want
    assert verify["num_files"] == want[0] and verify["ok"]


# ------------------------------------------------------------------ schema 3

def test_verify_counts_are_num_keys(work):
    doc = _json("verify", "run/step-42", "--level", "full")
    assert doc["schema_version"] == 3
    assert doc["num_files_read"] == 1 and doc["num_tensors_checked"] == 3, doc  # its data file
    assert not {"files_read", "tensors_checked", "files_checked"} & set(doc), doc
    assert (doc["num_errors"], doc["num_warnings"], doc["strict"]) == (0, 0, False)


# ------------------------------------------------------------------ places, as given

def test_relative_places_stay_relative_in_every_verb(work):
    ls = _json("ls", "run")
    assert (ls["root"], ls["checkpoints"][0]["url"]) == ("run", "run/step-42")
    assert _json("inspect", "run/step-42")["url"] == "run/step-42"
    assert _json("verify", "run/step-42")["url"] == "run/step-42"
    latest = _json("latest", "run")
    assert (latest["root"], latest["url"]) == ("run", "run/step-42")
    assert _json("pin", "run/step-42")["url"] == "run/step-42"
    gc = _json("gc", "run", "--keep-last", "1", "--dry-run")
    assert (gc["root"], gc["checkpoints"][0]["url"]) == ("run", "run/step-42")
    assert _json("unpin", "./run/step-42")["url"] == "./run/step-42"
    (work / "run" / "step-42" / ".metadata.tmp").write_bytes(b"x")
    (problem,) = _json("verify", "run/step-42")["problems"]
    assert (problem["code"], problem["path"]) == ("STRAY_TEMP", "run/step-42/.metadata.tmp")
    assert [c["url"] for c in _json("verify", "run", "--all")["checkpoints"]] == ["run/step-42"]
    os.chdir(work / "run")
    assert _json("ls", ".")["checkpoints"][0]["url"] == "step-42"


def test_relative_places_stay_relative_in_text(work):
    assert _text("inspect", "run/step-42").splitlines()[0] == "run/step-42"
    assert _text("verify", "run/step-42").startswith("run/step-42: OK (structure;")
    assert _text("seal", "run/step-42").startswith("run/step-42: sealed: 2 files")
    assert _text("pin", "run/step-42").strip() == "pinned run/step-42"
    (work / "empty").mkdir()
    assert _text("ls", "empty").strip() == "no checkpoints under empty"


def test_urls_and_absolute_paths_stay_as_given(work):
    url = f"file://{work}/run"
    ls = _json("ls", url)
    assert (ls["root"], ls["checkpoints"][0]["url"]) == (url, f"{url}/step-42")
    assert _json("inspect", f"{url}/step-42")["url"] == f"{url}/step-42"
    assert _json("latest", url)["url"] == f"{url}/step-42"
    absolute = str(work / "run")
    assert _json("ls", absolute)["checkpoints"][0]["url"] == f"{absolute}/step-42"
    assert _json("verify", f"{absolute}/step-42")["url"] == f"{absolute}/step-42"


# ------------------------------------------------------------------ warnings and --strict

def test_a_note_beside_a_sealed_checkpoint_is_a_warning(work):
    assert run_cli("seal", "run/step-42")[0] == 0
    (work / "run" / "step-42" / "NOTES.md").write_text("eval loss 3.1\n")
    doc = _json("verify", "run/step-42")
    assert (doc["ok"], doc["num_errors"], doc["num_warnings"], doc["strict"]) == \
        (True, 0, 1, False)
    assert [(p["code"], p["severity"]) for p in doc["problems"]] == [("EXTRA_FILE", "warning")]
    out = _text("verify", "run/step-42")
    assert "EXTRA_FILE" in out and "NOTES.md" in out
    assert out.splitlines()[-1].startswith("run/step-42: OK, 1 warning (structure;")
    strict = _json("verify", "run/step-42", "--strict", codes=(1,))
    assert (strict["ok"], strict["strict"], strict["num_warnings"]) == (False, True, 1)
    out = _text("verify", "run/step-42", "--strict", code_=1)
    assert out.splitlines()[-1].startswith("run/step-42: 1 problem (a warning, --strict)")
    every = _json("verify", "run", "--all")
    assert every["ok"] and every["num_ok"] == 1 and every["strict"] is False
    every = _json("verify", "run", "--all", "--strict", codes=(1,))
    assert not every["ok"] and every["num_ok"] == 0 and every["strict"] is True


def test_a_stray_temp_file_is_a_warning_and_an_error_still_fails(work):
    ck = work / "run" / "step-42"
    (ck / ".metadata.tmp").write_bytes(b"x")
    assert _json("verify", "run/step-42")["ok"] is True
    assert run_cli("verify", "run/step-42", "--strict")[0] == 1
    data = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size - 100)
    doc = _json("verify", "run/step-42", "--level", "quick", codes=(1,))
    assert not doc["ok"] and doc["num_errors"] >= 1 and doc["num_warnings"] == 1, doc


# ------------------------------------------------------------------ verify's report, 80 columns

def test_the_report_fits_80_columns_with_paths_relative_to_the_checkpoint(tmp_path,
                                                                          monkeypatch):
    """A long message (an unfinished writer's) wraps; the file is named relative to the
    checkpoint, which the summary line names (verify of an absolute path: ~200 columns
    before)."""
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "run" / "step-42"
    write_tiny_dcp(deep)
    (deep / WRITING_MARKER).write_text(json.dumps(
        {"command": "reshard src dst", "pid": 1, "host": "elsewhere",
         "started": "2026-01-01T00:00:00Z"}))
    (deep / ".metadata.tmp").write_bytes(b"x")
    code, out, _ = run_cli("verify", str(deep))
    assert code == 1
    *table, summary = out.splitlines()
    assert summary.startswith(f"{deep}: 2 problems (1 error, 1 warning)")
    assert table[0].split() == ["code", "severity", "where", "message"]
    assert all(len(line) <= 80 for line in table), "\n".join(table)
    assert str(tmp_path) not in "\n".join(table)
    assert table[1].split()[:3] == ["STRAY_TEMP", "warning", ".metadata.tmp"]
    assert table[2].split()[:3] == ["NOT_COMMITTED", "error", WRITING_MARKER]
    message = _json("verify", str(deep), codes=(1,))["problems"][1]["message"]
    assert len(message) > 80 and " ".join(" ".join(table[2:]).split()).endswith(message)


def test_a_narrow_message_column_goes_below_its_row(tmp_path):
    """When the other columns leave the message under 30 columns (a long entry name),
    each message is printed under its row, indented, whole."""
    import torch

    from conftest import dcp_save

    ck = tmp_path / "step-1"
    name = "model.layers.0.attention.a_rather_long_projection_name.weight"
    dcp_save(ck, {name: torch.zeros(64, 64)})
    assert run_cli("seal", str(ck))[0] == 0
    data = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    code, out, _ = run_cli("verify", str(ck), "--level", "full")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split() == ["code", "severity", "where"]
    row = next(i for i, line in enumerate(lines) if line.startswith("HASH_MISMATCH"))
    assert lines[row].split()[2:] == [data.name, f"[{name}]"]
    assert lines[row + 1].startswith("    content hash differs from the manifest")
    assert all(len(line) <= 80 for line in lines[row + 1:-1])
