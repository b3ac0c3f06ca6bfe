"""Issue 35, items 8 and 10: garbage input and small traps.

* item 8, garbage input: random bytes named ``*.pt``/``*.bin``/``*.ckpt`` are "not a
  torch.save file" (the first bytes shown), said before torch is imported; a zip without
  ``data.pkl``, a plain pickle and an empty file say what they are; a ``.bin`` of random
  bytes beside safetensors model files says so; a truncated safetensors says where the
  header says the data ends and how long the file is; random bytes named
  ``*.safetensors`` are "not a safetensors file". inspect exits 3, verify reports a
  finding (exit 1), as for any malformed file.
* item 10: secret masking masks whole tokens (a key ``a`` leaves "unreachable" alone);
  ``latest`` says how it broke a tie at one step; ``--help`` lists the verbs in sections;
  ``ckptctl man`` and the man page shipped as data files (what the systemd unit names);
  ``plan --gpus/--gpus-per-node`` and the ``--measure`` hint when every rate is unknown.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.storage.failures import MIN_INNER_SECRET, scrub

ROOT = Path(__file__).resolve().parents[1]
RANDOM = bytes.fromhex("3f9a1c7e5b2d8f40") + bytes(range(256)) * 4  # fixed: no luck involved

#: Runs ``ckptctl ARGS`` in a fresh interpreter and reports on stderr's last line whether
#: torch got imported.
_REPORT_TORCH = ("import runpy, sys\n"
                 "sys.argv[0] = 'ckptctl'\n"
                 "try:\n"
                 "    runpy.run_module('ckptctl', run_name='__main__', alter_sys=True)\n"
                 "except SystemExit as e:\n"
                 "    code = e.code\n"
                 "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
                 "sys.exit(code)\n")


def _fresh(*args: str) -> tuple[int, str, list[str], bool]:
    """(exit code, stdout, stderr lines but the last, whether torch was imported)."""
    p = subprocess.run([sys.executable, "-c", _REPORT_TORCH, *args], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    lines = p.stderr.splitlines()
    assert lines and lines[-1].startswith("torch imported: "), p.stderr
    return p.returncode, p.stdout, lines[:-1], lines[-1].endswith("True")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ torch.save garbage


@pytest.mark.parametrize("name", ["random.pt", "random.bin", "random.ckpt"])
def test_random_bytes_are_not_a_torch_file_without_torch(tmp_path, name):
    f = tmp_path / name
    f.write_bytes(RANDOM)
    code, out, err, torch_imported = _fresh("inspect", str(f))
    assert (code, out, torch_imported) == (3, "", False), (err, torch_imported)
    assert err == [f"ckptctl: error: {f}: not a torch.save file (neither a zip with data.pkl "
                   "nor a legacy torch pickle: the first bytes are 3f 9a 1c 7e 5b 2d 8f 40 "
                   "...)"]
    code, out, err, torch_imported = _fresh("verify", str(f), "--json")
    assert (code, torch_imported) == (1, False), err
    (p,) = json.loads(out)["problems"]
    assert p["code"] == "MALFORMED_METADATA" and "not a torch.save file" in p["message"]
    assert "weights_only" not in out + "".join(err)


def _zip_without_pickle(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes/readme.txt", "hello")


def _plain_pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b""), "not a torch.save file (the file is empty)"),
    (_zip_without_pickle, "not a torch.save file (a zip archive without a data.pkl record: "
                          "1 record: notes/readme.txt)"),
    (_plain_pickle, "not a torch.save file (a Python pickle without torch's magic number: "
                    "torch.load cannot read it; the first bytes are 80 04 95"),
])
def test_what_the_bytes_are_not(cli, tmp_path, make, words):
    f = tmp_path / "x.pt"
    make(f)
    code, out, err = cli("inspect", str(f))
    assert (code, out) == (3, "")
    assert _one_line(err).startswith(f"ckptctl: error: {f}: {words}"), err


def test_a_zip_cut_short_says_so_without_torch(tmp_path):
    import torch

    f = tmp_path / "half.pt"
    torch.save({"w": torch.zeros(64)}, f)
    os.truncate(f, f.stat().st_size // 2)
    size = f.stat().st_size
    code, out, err, torch_imported = _fresh("inspect", str(f))
    assert (code, out, torch_imported) == (3, "", False), err
    assert err == [f"ckptctl: error: {f}: a zip cut short or damaged (no end of central "
                   f"directory record at its end; the file has {size:,} bytes): not a "
                   "readable torch.save file"]


def test_real_torch_files_pass_the_sniff(tmp_path):
    import torch

    from ckptctl.formats.torchsave import torch_bytes_problem
    from ckptctl.storage import open_store

    store = open_store(str(tmp_path))
    torch.save({"w": torch.ones(2)}, tmp_path / "zip.pt")
    for proto in (2, 4, 5):
        torch.save({"w": torch.ones(2)}, tmp_path / f"legacy{proto}.pt",
                   _use_new_zipfile_serialization=False, pickle_protocol=proto)
    for f in tmp_path.iterdir():
        assert torch_bytes_problem(store, f.name, f.stat().st_size) is None, f.name
    # protocol 0: torch.load(weights_only=True) cannot read it either; said so by name
    torch.save({"w": torch.ones(2)}, tmp_path / "p0.pt", _use_new_zipfile_serialization=False,
               pickle_protocol=0)
    why = torch_bytes_problem(store, "p0.pt", (tmp_path / "p0.pt").stat().st_size)
    assert why.startswith("a legacy torch.save file of pickle protocol 0 or 1"), why


def test_random_bin_beside_safetensors_says_what_it_is_not(cli, tmp_path):
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "extra.bin").write_bytes(RANDOM)
    for verb in ("inspect", "verify"):
        code, out, err = cli(verb, str(tmp_path))
        assert (code, out) == (3, ""), (verb, err)
        line = _one_line(err)
        assert line.startswith(f"ckptctl: error: {tmp_path / 'extra.bin'}: not a torch.save "
                               "file (neither a zip with data.pkl"), line
        assert "beside the model files" in line and "a torch.save file next to" not in line


# ------------------------------------------------------------------ safetensors garbage


def _safetensors(path: Path, n: int = 256) -> int:
    """A one-tensor safetensors file of ``n`` float32 values; returns where its data ends."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    blob = struct.pack("<Q", len(header)) + header.encode() + bytes(4 * n)
    path.write_bytes(blob)
    return len(blob)


def test_truncated_safetensors_says_so(cli, tmp_path):
    f = tmp_path / "model.safetensors"
    end = _safetensors(f)
    os.truncate(f, end - 100)
    code, out, err = cli("inspect", str(f))
    assert (code, out) == (3, "")
    assert _one_line(err) == (f"ckptctl: error: {f}: truncated safetensors: the header says "
                              f"the data ends at byte {end}, past the end of the file "
                              f"({end - 100} bytes)")
    code, out, err = cli("verify", str(f), "--json")
    (p,) = json.loads(out)["problems"]
    assert code == 1 and p["code"] == "SIZE_MISMATCH" and "truncated safetensors" in p["message"]


def test_truncated_inside_the_header(cli, tmp_path):
    f = tmp_path / "model.safetensors"
    _safetensors(f)
    os.truncate(f, 20)
    code, _, err = cli("inspect", str(f))
    assert code == 3 and "truncated safetensors: header length" in _one_line(err)
    assert "larger than the file (20 bytes)" in err


def test_random_bytes_are_not_safetensors(cli, tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(RANDOM)
    code, out, err = cli("inspect", str(f))
    assert (code, out) == (3, "")
    assert _one_line(err) == (f"ckptctl: error: {f}: not a safetensors file (what follows the "
                              "8-byte header length is not valid JSON: it does not open with "
                              "'{'; the first bytes are 3f 9a 1c 7e 5b 2d 8f 40 00 01 ...)")


# ------------------------------------------------------------------ secret masking

_SECRET_CHARS = st.characters(codec="ascii", categories=("L", "N", "P", "S"),
                              exclude_characters="*")


def test_a_short_key_leaves_words_alone():
    assert scrub("remote unreachable (connection refused)", ["a"]) == \
        "remote unreachable (connection refused)"
    assert scrub("key=a, secret a; url s3://a/x", ["a"]) == "key=***, secret ***; url s3://***/x"


@given(secret=st.text(_SECRET_CHARS, min_size=MIN_INNER_SECRET, max_size=40),
       before=st.text(max_size=30), after=st.text(max_size=30))
def test_a_secret_never_shows(secret, before, after):
    out = scrub(before + secret + after, [secret])
    assert secret not in out
    assert "***" in out


@given(secret=st.text(_SECRET_CHARS, min_size=1, max_size=40), text=st.text(max_size=80))
def test_text_without_the_secret_is_unchanged(secret, text):
    if secret not in text:
        assert scrub(text, [secret]) == text


@given(secret=st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1,
                      max_size=MIN_INNER_SECRET - 1),
       words=st.lists(st.text(st.characters(codec="ascii", categories=("L", "N")),
                              min_size=1, max_size=8), max_size=6))
def test_a_short_secret_is_masked_as_a_token_only(secret, words):
    text = " ".join([*words[:3], secret, *words[3:]])
    out = scrub(text, [secret])
    assert secret not in re.findall(r"[A-Za-z0-9]+", out)  # no token of it is left
    # a word that merely contains it is untouched
    assert [w for w in out.split(" ") if w != "***"] == [w for w in words if w != secret]


def test_the_longer_of_two_overlapping_secrets_is_masked_whole():
    assert scrub("token abcdef and abc", ["abc", "abcdef"]) == "token *** and ***"


def test_tier_probe_reasons_are_scrubbed_by_token(monkeypatch):
    from ckptctl.tiering.config import Tier
    from ckptctl.errors import StorageError
    from ckptctl.tiering import tiers

    def refuse(tier):
        raise StorageError(tier.url, "remote unreachable (secret a, key a)")

    monkeypatch.setattr(tiers, "probe_tier", refuse)
    code, reason = tiers._probe_outcome(Tier("cold", "s3://b/run", storage_options={
        "secret": "a", "key": "a"}))
    assert reason == "remote unreachable (secret ***, key ***)"


# ------------------------------------------------------------------ latest: a tie


def _st_ckpt(folder: Path, mtime: float) -> None:
    from safetensors.numpy import save_file
    import numpy as np

    folder.mkdir(parents=True)
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(folder / "model.safetensors"))
    os.utime(folder / "model.safetensors", (mtime, mtime))


def test_latest_says_how_it_broke_a_tie(cli, tmp_path):
    _st_ckpt(tmp_path / "a" / "step-200", 1_700_000_500)
    _st_ckpt(tmp_path / "b" / "step-200", 1_700_000_000)
    _st_ckpt(tmp_path / "step-100", 1_700_000_900)
    code, out, err = cli("latest", str(tmp_path))
    assert (code, out) == (0, f"{tmp_path / 'a' / 'step-200'}\n")
    assert _one_line(err) == ("ckptctl: note: step 200 has 2 committed checkpoints "
                              "(a/step-200, b/step-200): took a/step-200, the one modified last")
    code, out, _ = cli("latest", str(tmp_path), "--json")
    doc = json.loads(out)
    assert doc["name"] == "a/step-200"
    assert doc["tie"] == {"others": ["b/step-200"], "chosen_by": "modified"}


def test_latest_tie_at_one_time_goes_by_name(cli, tmp_path):
    _st_ckpt(tmp_path / "a" / "step-200", 1_700_000_000)
    _st_ckpt(tmp_path / "b" / "step-200", 1_700_000_000)
    code, out, err = cli("latest", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["name"] == "b/step-200"
    assert doc["tie"] == {"others": ["a/step-200"], "chosen_by": "name"}
    assert "the last by name (natural order): their modification times are equal" in err


def test_latest_without_a_tie_says_nothing(cli, tmp_path):
    _st_ckpt(tmp_path / "step-1", 1_700_000_000)
    _st_ckpt(tmp_path / "step-2", 1_700_000_000)
    code, out, err = cli("latest", str(tmp_path), "--json")
    assert (code, err) == (0, "") and json.loads(out)["tie"] is None


# ------------------------------------------------------------------ --help in sections


def _group():
    import typer

    from ckptctl.cli.main import app

    return typer.main.get_command(app)


def test_every_verb_is_in_a_section():
    from ckptctl.cli.app import sections

    got = sections(_group().commands)
    assert [t for t, _ in got] == ["Look", "Convert", "Compare and check",
                                   "Tiers and retention", "Service"]  # no "Other"
    listed = [v for _, verbs in got for v in verbs]
    assert sorted(listed) == sorted(_group().commands) and len(set(listed)) == len(listed)


def test_help_lists_the_sections_in_order(cli):
    code, out, _ = cli("--help")
    assert code == 0
    heads = re.findall(r"^(\w[\w ]*):$", out, flags=re.M)
    assert heads[-5:] == ["Look", "Convert", "Compare and check", "Tiers and retention",
                          "Service"], heads
    look = out.split("Look:\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in look.splitlines()] == ["ls", "inspect", "latest", "report"]
    # one column for every section
    cols = {len(m.group(1)) for m in re.finditer(r"^(  \w+ +)(\S)", out.split("Look:", 1)[1],
                                            flags=re.M)}
    assert len(cols) == 1, cols


# ------------------------------------------------------------------ ckptctl man


def test_man_prints_the_roff_when_not_a_terminal(cli):
    code, out, err = cli("man")
    assert (code, err) == (0, "")
    assert out == (ROOT / "man" / "ckptctl.1").read_text()


def test_man_json(cli):
    code, out, _ = cli("man", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["path"] == str(ROOT / "man" / "ckptctl.1")
    assert doc["source"] == "checkout"


def test_man_goes_through_man_on_a_terminal(tmp_path, monkeypatch):
    from ckptctl.cli.main import main

    bindir = tmp_path / "bin"
    bindir.mkdir()
    seen = tmp_path / "args"
    fake = bindir / "man"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with redirect_stdout(out), redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as e:
        main(["man"])
    assert e.value.code == 0 and out.getvalue() == ""
    assert seen.read_text().split() == ["-l", str(ROOT / "man" / "ckptctl.1")]


def test_man_not_installed_is_exit_3(cli, monkeypatch):
    from ckptctl.cli import man_cmd

    monkeypatch.setattr(man_cmd, "man_page", lambda: None)
    code, out, err = cli("man")
    assert (code, out) == (3, "")
    assert _one_line(err).startswith("ckptctl: error: ckptctl.1: the man page is not installed")
    code, out, _ = cli("man", "--json")
    assert code == 3 and json.loads(out)["error"]["code"] == "MISSING_FILE"


def test_the_man_page_the_unit_names_is_shipped():
    import glob
    import tomllib

    unit = (ROOT / "ckptctl" / "contrib" / "ckptctl-watch@.service").read_text()
    assert "Documentation=man:ckptctl(1)" in unit
    assert '.TH CKPTCTL 1 ' in (ROOT / "man" / "ckptctl.1").read_text()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["data-files"]["share/man/man1"]
    assert [p for pat in patterns for p in glob.glob(str(ROOT / pat))] == \
        [str(ROOT / "man" / "ckptctl.1")]


# ------------------------------------------------------------------ plan --gpus


PLAN = ("plan", "--checkpoint-size", "1TB", "--save-seconds", "60", "--mtbf", "2.8h")


def test_plan_gpus_make_the_nodes(cli):
    code, out, err = cli(*PLAN, "--gpus", "1020", "--gpus-per-node", "8", "--json")
    doc = json.loads(out)
    assert code == 0, err
    assert (doc["nodes"], doc["gpus"], doc["gpus_per_node"]) == (128, 1020, 8)
    code, out, _ = cli(*PLAN, "--gpus", "1024", "--gpus-per-node", "8", "--nodes", "128")
    assert code == 0 and "on P = 128 nodes (1,024 GPUs, 8 per node)" in out


@pytest.mark.parametrize("extra, words", [
    (("--gpus", "64", "--gpus-per-node", "8", "--nodes", "4"),
     "--nodes 4 contradicts --gpus 64 at --gpus-per-node 8 (8 nodes)"),
    (("--gpus", "64"), "--gpus 64 needs --gpus-per-node K"),
    (("--gpus-per-node", "8"), "--gpus-per-node 8 needs --gpus N"),
    (("--gpus", "4", "--nodes", "8"), "--gpus 4 cannot fill --nodes 8"),
    (("--gpus", "0", "--gpus-per-node", "8"), "--gpus must be a whole number >= 1"),
])
def test_plan_contradictory_counts_are_usage_errors(cli, extra, words):
    code, out, err = cli(*PLAN, *extra)
    assert (code, out) == (2, ""), err
    assert words in _one_line(err)


def _config(tmp_path: Path, warm_limit: str | None) -> str:
    f = tmp_path / "ckptctl.toml"
    limit = f'bwlimit = "{warm_limit}"\n' if warm_limit else ""
    f.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n'
                 f'[[tier]]\nname = "warm"\nurl = "{tmp_path / "warm"}"\n{limit}')
    return str(f)


def test_plan_suggests_measure_when_every_rate_is_unknown(cli, tmp_path):
    code, out, _ = cli("--config", _config(tmp_path, None), *PLAN)
    assert code == 0
    assert ("every hop's rate is unknown (no bwlimit, nothing measured): rerun with "
            "--measure hot --measure warm") in out and "ckptctl watch --status" in out
    code, out, _ = cli("--config", _config(tmp_path, "1GB/s"), *PLAN)
    assert code == 0 and "rerun with --measure" not in out
