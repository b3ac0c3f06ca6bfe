"""Progress bars that know the total (issue 8, item 4): on a terminal only (stderr a TTY,
never with --json or --quiet), with percent, rate and ETA in the binary units of the rest of
the output; the total each op announces (``on_total``) is what its ``on_bytes`` then counts."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_torch import copy_ckpt

from ckptctl.ops import seal, verify

REPO = Path(__file__).resolve().parents[1]
#: What the bar draws and nothing else does: a percent, a rate, a size pair "x/y".
BAR = re.compile(r"\d+%|[KMG]iB/s|iB/\d")


def _env(cols: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return {**env, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": "24"}


def run_on_pty(*args: str, cols: int = 80, timeout: float = 120) -> tuple[int, str]:
    """``python -m ckptctl ARGS`` with stdin, stdout and stderr on one pseudo-terminal of
    ``cols`` columns: (exit code, everything it wrote, escape sequences included)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "ckptctl", *args], stdin=slave, stdout=slave,
                         stderr=slave, env=_env(cols), cwd=REPO, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                p.kill()
                raise AssertionError(f"ckptctl {' '.join(args)}: no output for {timeout}s")
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        p.wait(timeout=timeout)
    return p.returncode, out.decode("utf-8", "replace")


def run_piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True,
                          text=True, env=_env(80), cwd=REPO, timeout=300, check=False)


@pytest.fixture
def ckpt(torch_ckpts, tmp_path) -> Path:
    return copy_ckpt(torch_ckpts["fsdp"], tmp_path / "step-20")


def test_verify_full_draws_a_bar_with_total_on_a_tty(ckpt):
    code, out = run_on_pty("verify", str(ckpt), "--level", "full")
    assert code == 0, out
    pct = [int(x) for x in re.findall(r"(\d+)%", out)]
    assert pct and max(pct) == 100, out  # the total is known: the bar reaches 100%
    assert re.search(r"\d+\.\d (KiB|MiB)/\d+\.\d MiB", out), out  # done/total, binary units
    assert re.search(r"(\d+\.\d [KMG]iB|\?)/s", out), out  # the rate
    assert "OK (full" in out
    assert "MB" not in out.replace("MiB", "")  # never decimal units beside binary ones


def test_no_bar_without_a_tty_or_with_json_or_quiet(ckpt):
    r = run_piped("verify", str(ckpt), "--level", "full")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not BAR.search(r.stdout), r.stdout
    for flag in ("--json", "--quiet"):
        code, out = run_on_pty("verify", str(ckpt), "--level", "full", flag)
        assert code == 0 and not BAR.search(out), (flag, out)
    code, out = run_on_pty("verify", str(ckpt))  # structure level reads no data: no bar
    assert code == 0 and not BAR.search(out), out


def test_seal_draws_a_bar_on_a_tty(ckpt):
    code, out = run_on_pty("seal", str(ckpt))
    assert code == 0, out
    assert max(int(x) for x in re.findall(r"(\d+)%", out)) == 100, out
    assert "sealed" in out


class Count:
    def __init__(self):
        self.total, self.done, self.calls = None, 0, 0

    def on_total(self, n):
        assert self.total is None and self.done == 0, "the total comes once, before any byte"
        self.total = n

    def on_bytes(self, n):
        self.done += n


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_zstd"])
def test_verify_total_is_what_it_reads(torch_ckpts, tmp_path, layout):
    d = copy_ckpt(torch_ckpts[layout], tmp_path / "step-20")
    c = Count()
    r = verify(str(d), level="full", on_bytes=c.on_bytes, on_total=c.on_total)
    assert r.ok and c.total == c.done > 0, (c.total, c.done)  # unsealed: CRCs, zstd decoded
    s = Count()
    seal(str(d), on_bytes=s.on_bytes, on_total=s.on_total)
    data = sum(f.stat().st_size for f in d.iterdir() if f.name != "ckptctl.manifest.json")
    # sealing checks what verify checks, in the read that hashes: the same bytes, and
    # the files no entry names (.metadata)
    assert s.total == s.done == c.total + (d / ".metadata").stat().st_size
    assert s.total == data or layout == "fsdp_zstd"  # zstd chunks are decoded too
    c = Count()
    assert verify(str(d), level="full", on_bytes=c.on_bytes, on_total=c.on_total).ok
    assert c.total == c.done == data  # sealed: every listed file hashed


def test_verify_sample_total(torch_ckpts, tmp_path):
    d = copy_ckpt(torch_ckpts["tp"], tmp_path / "step-20")
    c = Count()
    assert verify(str(d), level="full", sample=0.5, on_bytes=c.on_bytes, on_total=c.on_total).ok
    assert c.total == c.done and 0 < c.done < sum(f.stat().st_size for f in d.iterdir())


def test_reshard_and_consolidate_totals_come_from_the_plan(torch_ckpts, tmp_path):
    from ckptctl.ops import consolidate, inspect, reshard

    src = str(torch_ckpts["fsdp"])
    tensor_bytes = inspect(src).tensor_bytes
    c = Count()
    reshard(src, str(tmp_path / "r"), world_size=2, on_bytes=c.on_bytes, on_total=c.on_total)
    # the plan's data bytes; on_bytes also counts zip headers, objects and .metadata
    assert c.total == tensor_bytes and tensor_bytes < c.done < tensor_bytes * 1.1
    c = Count()
    consolidate(src, str(tmp_path / "c"), to="safetensors", only="model", dtype="bf16",
                on_bytes=c.on_bytes, on_total=c.on_total)
    written = inspect(str(tmp_path / "c")).tensor_bytes  # every float tensor now 2 bytes
    assert c.total == written and written < c.done < written + (64 << 10)
