"""``pip install ckptctl`` without torch (issue 8, item 8): every verb that reads DCP and
safetensors works; a verb or input that needs torch says so in one line, exit 3.

* the slow test is the real thing: a copy of the working tree (what a fresh clone holds)
  installed with its declared dependencies into a new venv that has no torch, then the
  installed ``ckptctl`` run on checkpoints this process wrote with torch and safetensors;
* the fast test runs this checkout's CLI with ``import torch`` made to fail, to keep the
  hint on every torch-only path covered on every run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from conftest import write_tiny_dcp

REPO = Path(__file__).resolve().parent.parent
HINT = "needs PyTorch: pip install 'ckptctl[torch]'"

#: Runs ``ckptctl ARGS`` as if torch were not installed (``import torch`` raises).
_NO_TORCH = ("import runpy, sys\n"
             "sys.modules['torch'] = None\n"
             "sys.argv[0] = 'ckptctl'\n"
             "runpy.run_module('ckptctl', run_name='__main__', alter_sys=True)\n")


def _checkpoints(root: Path) -> dict[str, Path]:
    """A DCP checkpoint, a safetensors folder and a torch.save file, written by the real
    libraries of this (torch-equipped) process."""
    import torch
    from safetensors.torch import save_file

    dcp = root / "run" / "step-42"
    write_tiny_dcp(dcp)
    st = root / "run" / "step-7"
    st.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    save_file({"wte.weight": torch.randn(16, 8, generator=g),
               "ln.bias": torch.zeros(8, dtype=torch.bfloat16)}, str(st / "model.safetensors"))
    pt = root / "other" / "model.pt"
    pt.parent.mkdir()
    torch.save({"w": torch.arange(4.0), "step": 3}, pt)
    return {"dcp": dcp, "st": st, "pt": pt, "root": root / "run"}


def _local_hashes(folder: Path) -> dict[str, int | str]:
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes()) for p in folder.iterdir()
            if p.is_file() and p.name != "ckptctl.manifest.json"}


def _manifest_hashes(folder: Path) -> dict[str, str]:
    doc = json.loads((folder / "ckptctl.manifest.json").read_text())
    return {k: v["hash"] for k, v in doc["files"].items()}


def _check_torch_free_verbs(run, ck: dict[str, Path], out: Path) -> None:
    """What a torch-less install must do; ``run(*args)`` -> CompletedProcess."""
    def ok(*args):
        p = run(*args)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
        return p

    p = ok("ls", str(ck["root"]))
    lines = {line.split()[0]: line for line in p.stdout.splitlines()[1:]}
    assert set(lines) == {"step-7", "step-42"} and "complete" in lines["step-42"], p.stdout
    for key in ("dcp", "st"):
        ok("inspect", str(ck[key]))
        ok("verify", str(ck[key]), "--level", "full")
        ok("seal", str(ck[key]))
        ok("verify", str(ck[key]), "--level", "full")
        # the installed hashers agree with this process's xxhash, bit for bit
        assert _manifest_hashes(ck[key]) == _local_hashes(ck[key])
    p = ok("ls", str(ck["root"]))
    assert [line.split()[3] for line in p.stdout.splitlines()[1:]] == ["sealed", "sealed"], p.stdout
    p = ok("inspect", str(ck["dcp"]))
    assert "step 42" in p.stdout, p.stdout

    for args, what in ((("consolidate", str(ck["dcp"]), str(out / "c")), "consolidate"),
                       (("reshard", str(ck["dcp"]), str(out / "r"), "--world-size", "2"),
                        "reshard"),
                       (("inspect", str(ck["pt"])), str(ck["pt"]))):
        p = run(*args)
        assert p.returncode == 3, (args, p.stdout, p.stderr)
        assert p.stderr.strip() == f"ckptctl: error: {what}: {HINT}", p.stderr
    assert not (out / "c").exists() and not (out / "r").exists()
    # a torch.save zip is verified from its zip records and their CRCs: no torch needed
    p = ok("verify", str(ck["pt"]), "--level", "full", "--json")
    assert json.loads(p.stdout)["content"] == "crc", p.stdout


def test_torch_only_paths_give_the_install_hint(tmp_path):
    ck = _checkpoints(tmp_path / "ck")

    def run(*args):
        return subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True,
                              text=True, timeout=120, cwd=REPO)

    _check_torch_free_verbs(run, ck, tmp_path)
    p = run("ls", str(ck["pt"].parent))  # a torch.save zip: read from its records, no torch
    assert p.returncode == 0 and "complete" in p.stdout.splitlines()[1], p.stdout + p.stderr
    legacy = ck["pt"].parent / "legacy" / "old.pt"  # the legacy format needs torch: unknown
    legacy.parent.mkdir()
    import torch

    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    p = run("ls", str(legacy.parent))
    assert p.returncode == 0 and "unknown" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_pip_install_without_torch_in_a_clean_venv(tmp_path):
    src = tmp_path / "clone"  # what a fresh clone holds; a build writes here, not in the repo
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "ckptctl", src / "ckptctl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    p = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        str(src)], capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True, env=env)
    assert p.returncode != 0 and "No module named 'torch'" in p.stderr, "torch got installed"
    exe = venv / "bin" / "ckptctl"
    assert exe.exists(), "no console script"
    ck = _checkpoints(tmp_path / "ck")

    def run(*args):
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp_path)

    p = run("--help")
    assert p.returncode == 0 and "consolidate" in p.stdout, p.stderr
    _check_torch_free_verbs(run, ck, tmp_path)
