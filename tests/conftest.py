"""Shared fixtures: real checkpoints written by torch (fixtures_torch) and by third-party
tools (fixtures_thirdparty), real S3 servers on loopback (fixtures_s3), and a tiny
in-process DCP checkpoint for the fast tests."""
from __future__ import annotations

import contextlib
import io
import signal
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# No test may depend on timing: hypothesis' per-example deadline (200 ms) and its too-slow
# health check fail a property test on a busy machine (one example took 304 ms once).
settings.register_profile("ckptctl", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ckptctl")

# A test run started in the background (`cmd &` in a script, nohup) has SIGINT ignored, and
# so would every CLI the tests start (an ignored signal stays ignored across exec): the
# Ctrl-C tests would then see no interrupt at all. Give the children Python's default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["fixtures_torch", "fixtures_s3", "fixtures_thirdparty", "fixtures_deepspeed",
                  "fixtures_megatron", "fixtures_cloud", "fixtures_orbax"]
collect_ignore = ["fixtures"]  # generator scripts, run by fixtures_torch / fixtures_thirdparty

TESTS = Path(__file__).parent


def cached_bytes(path) -> int | None:
    """Bytes of the file ``path`` in the page cache (``fincore``), or None without it."""
    import shutil
    import subprocess

    if not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``ckptctl ARGS`` in-process: (exit code, stdout, stderr)."""
    from ckptctl.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    return run_cli


def write_tiny_dcp(path: Path, *, zstd: bool = False) -> dict:
    """A small DCP checkpoint from one process (no process group); returns its state dict."""

    import torch

    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {"emb.weight": torch.randn(10, 4, generator=g),
                  "norm.weight": torch.ones(4, dtype=torch.bfloat16),
                  "head.bias": torch.arange(3, dtype=torch.int64)},
        "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]},
        "step": 42,
    }
    dcp_save(path, sd, zstd=zstd)
    return sd


def dcp_save(path: Path, sd: dict, *, zstd: bool = False) -> None:
    """``torch.distributed.checkpoint.save`` from one process (no process group), with
    DCP's ``stream.zstd/1`` transform when ``zstd``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    writer = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        writer = dcp.FileSystemWriter(str(path), _extensions=[ZStandard()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=None if writer else str(path), storage_writer=writer)


@contextlib.contextmanager
def _mounts():
    """``mount(args, where, what)``: run ``mount ARGS`` (the test is skipped with the reason
    where that fails: it needs root); everything mounted is unmounted at the end."""
    import shutil
    import subprocess

    mounted = []

    def mount(args: list[str], where: Path, what: str) -> Path:
        if not shutil.which("mount"):
            pytest.skip(f"{what} needs `mount`")
        r = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount {what}: {r.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for mnt in mounted:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs("3m")``: a size-capped tmpfs for out-of-space tests, unmounted after
    the test (needs root and mount permission; the test is skipped with the reason else)."""
    with _mounts() as mount:
        def make(size: str):
            mnt = tmp_path / f"small-{size}"
            mnt.mkdir()
            return mount(["-t", "tmpfs", "-o", f"size={size}", "tmpfs"], mnt,
                         "a small tmpfs for out-of-space tests")

        yield make


@pytest.fixture
def small_ext4(tmp_path):
    """``small_ext4("16M")``: a size-capped ext4 on a loop device (a block device, so
    O_DIRECT works there, unlike tmpfs), unmounted after the test (skipped without root,
    ``mkfs.ext4`` or loop devices)."""
    import shutil
    import subprocess

    with _mounts() as mount:
        def make(size: str):
            if not shutil.which("mkfs.ext4"):
                pytest.skip("needs mkfs.ext4 for a small ext4 file system")
            img, mnt = tmp_path / f"ext4-{size}.img", tmp_path / f"ext4-{size}"
            mnt.mkdir()
            subprocess.run(["truncate", "-s", size, str(img)], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
            return mount(["-o", "loop", str(img)], mnt, "a small ext4 on a loop device")

        yield make


@pytest.fixture
def tiny_dcp(tmp_path) -> Path:
    p = tmp_path / "step-42"
    write_tiny_dcp(p)
    return p


#: Runs ckptctl's ``__main__`` and, at exit, copies ``/proc/self/status`` to the file named
#: by its first argument: ``VmHWM`` is that process's own peak RSS (``ru_maxrss`` of a child
#: also counts the pages of the pytest process it was forked from).
_MEASURED = ("import atexit, runpy, sys\n"
             "out = sys.argv.pop(1)\n"
             "atexit.register(lambda: open(out, 'w').write(open('/proc/self/status').read()))\n"
             "sys.argv[0] = 'ckptctl'\n"
             "runpy.run_module('ckptctl', run_name='__main__', alter_sys=True)\n")


def run_measured(*args, timeout: float = 300, cwd=None):
    """Run ``ckptctl ARGS`` in a child: (exit code, stdout, stderr, wall seconds, peak RSS
    in MiB of that process alone)."""
    import subprocess
    import tempfile
    import time

    with tempfile.NamedTemporaryFile("r", suffix=".status") as st:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _MEASURED, st.name, *map(str, args)],
                           capture_output=True, text=True, timeout=timeout, cwd=cwd)
        wall = time.monotonic() - t0
        status = open(st.name).read()
    kib = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmHWM:")), 0)
    return p.returncode, p.stdout, p.stderr, wall, kib / 1024
