"""Tidy output (issue 8, item 7): repeated problems grouped by code, ``ls`` skips files
that are not checkpoints and leaks no library warning, names never wrapped mid-word, one
natural order for every listing."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from fixtures_torch import copy_ckpt
from test_tty import REPO, _env, run_on_pty

from ckptctl.model import natural_key

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def ckptctl(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python [FLAGS] -m ckptctl ARGS`` with pipes (no TTY)."""
    return subprocess.run([sys.executable, *python_flags, "-m", "ckptctl", *args],
                          capture_output=True, text=True, env=_env(80), cwd=REPO, timeout=300,
                          check=False)


# ------------------------------------------------------------------ grouped problems


def test_repeated_problems_are_grouped_by_code(cli, torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    f = d / "__3_0.distcp"
    os.truncate(f, f.stat().st_size // 2)  # one truncated file: dozens of chunks past its end
    code, out, _ = cli("verify", str(d), "--json")
    problems = json.loads(out)["problems"]
    codes = {c: sum(p["code"] == c for p in problems) for c in {p["code"] for p in problems}}
    many = max(codes, key=codes.get)
    assert code == 1 and codes[many] > 10, codes  # --json keeps every problem
    code, out, err = cli("verify", str(d))
    lines = out.splitlines()
    assert code == 1 and err == ""
    rows = [line for line in lines if not re.match(r" {4}\S", line)]  # not a message line
    assert len(rows) <= 2 + 4 * len(codes), out  # header, 3 examples + "(+N more)", summary
    assert f"{many} ({codes[many]})" in out
    assert f"(+{codes[many] - 3} more)" in out
    examples = sum(line.count("__3_0.distcp [") for line in lines)
    assert examples == sum(min(n, 3) for n in codes.values())
    assert lines[-1].startswith(f"{d}: {len(problems)} problems")


# ------------------------------------------------------------------ ls: not checkpoints


@pytest.fixture
def mixed_root(tmp_path) -> Path:
    """Real checkpoints beside files with a checkpoint's suffix that are none."""
    import torch

    root = tmp_path / "root"
    root.mkdir()
    torch.save({"w": torch.arange(4.0), "step": 1}, root / "step-1.pt")
    torch.save({"w": torch.arange(4.0)}, root / "step-2.pt", _use_new_zipfile_serialization=False)
    whole = (root / "step-1.pt").read_bytes()
    (root / "step-3.pt").write_bytes(whole[:len(whole) // 2])  # a damaged one: corrupt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still writes these
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(root / "model.pt"))
    (root / "site.pth").write_text("/opt/lib/python3/site-packages/extra\nimport sys\n")
    (root / "blob.pt").write_bytes(b"garbage")  # not text to skip: may be a damaged one
    return root


def test_ls_skips_files_that_are_not_checkpoints(mixed_root):
    r = ckptctl("ls", str(mixed_root), "--json", python_flags=("-W", "always"))
    assert r.returncode == 0 and r.stderr == "", r.stderr  # no warning leaks, even with -W
    rows = {c["name"]: c["state"] for c in json.loads(r.stdout)["checkpoints"]}
    assert rows == {"step-1.pt": "complete", "step-2.pt": "complete", "step-3.pt": "corrupt",
                    "blob.pt": "corrupt"}
    r = ckptctl("ls", str(mixed_root), python_flags=("-W", "always"))
    assert r.returncode == 0 and r.stderr == ""
    assert "model.pt" not in r.stdout and "site.pth" not in r.stdout


@pytest.mark.parametrize("name, why", [
    ("model.pt", "a TorchScript archive"), ("site.pth", "a text file")])
def test_a_lone_non_checkpoint_says_so(mixed_root, name, why):
    for verb in ("ls", "inspect"):
        r = ckptctl(verb, str(mixed_root / name), python_flags=("-W", "always"))
        assert r.returncode == 3, r
        assert r.stderr == f"ckptctl: error: {mixed_root / name}: not a checkpoint: {why}" \
            + r.stderr.split(why, 1)[1], r.stderr
        assert r.stderr.count("\n") == 1 and "Warning" not in r.stderr


def test_library_warnings_are_shown_only_with_debug(mixed_root):
    # torch.load warns on a TorchScript archive; only --debug lets it through
    r = ckptctl("inspect", str(mixed_root / "model.pt"), python_flags=("-W", "always"))
    assert r.returncode == 3 and "Warning" not in r.stderr
    r = ckptctl("--debug", "inspect", str(mixed_root / "model.pt"), python_flags=("-W", "always"))
    assert "UserWarning" in r.stderr and "TorchScript" in r.stderr


# ------------------------------------------------------------------ natural order, no wrapping

ORDER = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w",
         "layers.10.w", "layers.11.w", "norm.weight"]
LONG = "model.transformer.blocks.7.attention.query_key_value_projection_with_rotary.weight"


@pytest.fixture
def shuffled(tmp_path) -> Path:
    """A torch.save file whose entries were saved out of order, one name over 80 columns."""
    import torch

    names = ["layers.10.w", "norm.weight", "layers.2.w", "layers.0.w", "layers.11.w",
             "embed.weight", "layers.1.w", "layers.3.w", LONG]
    f = tmp_path / "step-5.pt"
    torch.save({n: torch.zeros(2) for n in names}, f)
    return f


def test_natural_key():
    assert sorted([ORDER[i] for i in (5, 2, 7, 0, 6, 1, 4, 3)], key=natural_key) == ORDER
    assert sorted(["layers.10", "layers.2", "layers"], key=natural_key) == \
        ["layers", "layers.2", "layers.10"]


def test_inspect_lists_in_natural_order(cli, shuffled):
    names = [t["name"] for t in json.loads(cli("inspect", str(shuffled), "--tensors",
                                               "--json")[1])["tensors"]]
    assert names == sorted(ORDER + [LONG], key=natural_key)
    assert names.index("layers.2.w") < names.index("layers.10.w")
    tree = [n["prefix"] for n in json.loads(cli("inspect", str(shuffled), "--tree",
                                                "--json")[1])["tree"]]
    layers = [p for p in tree if p.startswith("layers")]
    assert layers == ["layers", "layers.0", "layers.1", "layers.2", "layers.3", "layers.10",
                      "layers.11"]
    out = cli("inspect", str(shuffled), "--tensors")[1]
    shown = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in names]
    assert shown == names


def test_ls_orders_names_naturally(cli, tmp_path):
    import torch

    for n in ("run-10.pt", "run-2.pt", "run-1.pt"):  # no step in these names
        torch.save({"w": torch.zeros(1)}, tmp_path / n)
    rows = json.loads(cli("ls", str(tmp_path), "--json")[1])["checkpoints"]
    assert [c["name"] for c in rows] == ["run-1.pt", "run-2.pt", "run-10.pt"]


def test_names_are_not_wrapped_at_80_columns(cli, shuffled):
    code, out = run_on_pty("inspect", str(shuffled), "--tensors", cols=80)
    text = ANSI.sub("", out)
    assert code == 0 and LONG in text, text  # whole, on one line
    assert all(n in text for n in ORDER)
    out = cli("inspect", str(shuffled), "--tensors")[1]  # plain output: never wrapped
    assert any(line.startswith(LONG + " ") and "float32" in line for line in out.splitlines())


def test_entry_names_in_brackets_are_shown_on_a_tty(cli, torch_ckpts, tmp_path):
    # rich would read "[model.w]" as markup and drop it: cells are plain text
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    f = d / "__3_0.distcp"
    os.truncate(f, f.stat().st_size - 1000)
    entry = json.loads(cli("verify", str(d), "--json")[1])["problems"][0]["entry"]
    code, out = run_on_pty("verify", str(d), cols=80)
    assert code == 1 and f"[{entry}]" in ANSI.sub("", out), out
