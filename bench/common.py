"""Shared helpers for the benchmarks in ``bench/``.

* :func:`measure` runs a command as a subprocess and returns its wall time and peak RSS
  (``ru_maxrss`` from ``os.wait4``: the largest resident set of the child and of any
  descendants it waited for; exact, no polling);
* :func:`evict` / :func:`resident_bytes` drop files from the page cache with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` and check how much of them is still cached;
* :func:`warm` reads files once so that the next reads come from the page cache;
* :func:`run_rounds` runs commands round-robin, cold or warm, and measures each run
  (with :func:`flush`, :func:`remove` and :func:`median` beside it);
* :func:`table` renders a Markdown table (printed to the terminal and written to
  ``BENCHMARKS.md``); :func:`write_section` replaces the text between
  ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in ``BENCHMARKS.md``;
* :func:`machine_facts` describes the machine; :func:`generate_dcp` writes a real DCP
  checkpoint (``torch.distributed.checkpoint.save`` in one process) of a given size, in a
  subprocess so that the benchmark process itself stays small.

Run ``python bench/common.py gen-dcp OUT --size-gb 1 --files 4`` to write a checkpoint by hand.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import statistics
import subprocess
import threading
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
GB = 1e9  # throughput is reported in decimal GB/s, like dd and the FACTS file

INTRO = """\
# Benchmarks

Reproducible measurements of ckptctl against the standard tools, each written by a script in
`bench/` between `<!-- bench:NAME -->` markers (rerunning a script replaces its section only).

How to run (from the repository root, after `make venv`):

```
.venv/bin/python bench/verify_bench.py            # 4 GB DCP checkpoint, ~2-3 minutes
.venv/bin/python bench/verify_bench.py --size-gb 1 --no-write   # quick look, no file update
```

Machine so far: a 2-core AMD EPYC virtual machine, 24 GiB RAM, one virtio disk (about
0.4 GB/s writing and 0.4-0.6 GB/s reading data the host has not cached; the host caches
the disk, so re-reads after dropping this machine's page cache run at 1-2.5 GB/s), page-cache
reads 5-12 GB/s. Dropping all caches (`/proc/sys/vm/drop_caches`) is not allowed there:
"cold" runs evict each file with `posix_fadvise(POSIX_FADV_DONTNEED)` instead.

Numbers are noisy on shared virtual machines (other jobs often share the two cores; each
section records the load average): compare ratios measured in the same run, not absolute
numbers across runs or machines. Every section records its machine and exact command.
"""


# --------------------------------------------------------------------------- running
@dataclass
class Run:
    """One measured subprocess."""
    cmd: list[str]
    wall_s: float
    peak_rss_mb: float
    returncode: int
    cpu_s: float = 0.0  # user + system seconds of the process tree
    stdout: str = ""
    stderr: str = ""


def measure(cmd: list[str], *, capture: bool = False, env: dict | None = None,
            cwd: str | os.PathLike | None = None, check: bool = True) -> Run:
    """Run ``cmd`` (no shell) and return wall seconds and peak RSS of its process tree.

    Output goes to /dev/null unless ``capture`` (then it is read through pipes, which
    costs a little: only capture small outputs, e.g. ``sha256sum``'s digest lines).
    """
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE if capture else out,
                         env=env, cwd=cwd, text=capture)
    got: dict[str, str] = {}
    readers = []
    if capture:  # drain the pipes in threads: Popen.communicate() would reap the child itself
        for name, pipe in (("out", p.stdout), ("err", p.stderr)):
            t = threading.Thread(target=lambda n=name, f=pipe: got.__setitem__(n, f.read()),
                                 daemon=True)
            t.start()
            readers.append(t)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting again
    for t in readers:
        t.join()
    if capture:
        p.stdout.close()
        p.stderr.close()
    run = Run(list(cmd), wall, ru.ru_maxrss / 1024, p.returncode, ru.ru_utime + ru.ru_stime,
              got.get("out", ""), got.get("err", ""))
    if check and run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}: {run.stderr[-2000:]}")
    return run


@dataclass
class Series:
    """Repeated runs of one command: medians and the spread."""
    name: str
    runs: list[Run] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def peak_rss_mb(self) -> float:
        return max(r.peak_rss_mb for r in self.runs)

    @property
    def cpu_s(self) -> float:
        return statistics.median(r.cpu_s for r in self.runs)

    @property
    def spread(self) -> str:
        w = sorted(r.wall_s for r in self.runs)
        return f"{w[0]:.2f}-{w[-1]:.2f}" if len(w) > 1 else f"{w[0]:.2f}"


# --------------------------------------------------------------------------- page cache
def evict(paths) -> None:
    """Drop the files' pages from the page cache (clean pages only: ``sync`` first).

    This evicts from this machine's page cache; a virtual machine's host may still cache
    the disk, so "cold" here means "not in the guest page cache".
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths) -> int | None:
    """Bytes of the files now in the page cache (``fincore``), or None if unknown."""
    exe = shutil.which("fincore")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--bytes", "--noheadings", "--raw", "--output", "RES",
                              *map(str, paths)], capture_output=True, text=True, check=True)
        return sum(int(x) for x in out.stdout.split())
    except (subprocess.CalledProcessError, ValueError):
        return None


def warm(paths, block: int = 8 << 20) -> None:
    """Read the files once so that they sit in the page cache."""
    buf = bytearray(block)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# --------------------------------------------------------------------------- rounds
def flush(p: Path) -> float:
    """fdatasync every file of ``p`` (a file or a folder); returns the seconds it took."""
    t0 = time.perf_counter()
    for f in ([p] if p.is_file() else files_of(p)):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def remove(p: Path) -> None:
    """Delete ``p``, a file or a folder, if it exists."""
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def median(xs):
    """The middle of ``xs`` (the mean of the two middle ones when their count is even)."""
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2


def run_rounds(cmds: dict[str, tuple[list[str], Path]], reps: int, inputs: list[Path],
               cold: bool, keep: set[str], log, *, env: dict | None = None,
               output_ok: Callable[[Path], str | None] | None = None,
               tag: str = "") -> tuple[dict[str, Series], dict[str, list[float]], int]:
    """Each command of ``cmds`` ({name: (argv, output path)}) ``reps`` times, round-robin.

    Before each run its output is removed and the ``inputs`` are dropped from the page
    cache (``cold``, see :func:`evict`) or read once (:func:`warm`); after it the output is
    ``fdatasync``-ed (timed apart, see :func:`flush`) and removed, but for the names in
    ``keep`` on the last round. A run that exits non-zero, leaves no output or whose output
    ``output_ok(out)`` finds wanting (it returns why, else None) raises RuntimeError.
    ``env``: the commands' environment (default: this one's); ``tag`` starts the progress
    line ``log`` gets after each round.

    Returns the series, the flush seconds and the most input bytes still cached right
    before a cold run.
    """
    series = {n: Series(n) for n in cmds}
    flushes: dict[str, list[float]] = {n: [] for n in cmds}
    left = 0
    for rep in range(reps):
        for name, (cmd, out) in cmds.items():
            remove(out)
            if cold:
                evict(inputs)
                left = max(left, resident_bytes(inputs) or 0)
            else:
                warm(inputs)
            r = measure(cmd, capture=True, env=env, check=False)
            why = (f"exited {r.returncode}" if r.returncode else
                   "no output" if not out.exists() else output_ok(out) if output_ok else None)
            if why:
                raise RuntimeError(f"{name}: {why} ({out}):\n{r.stdout[-1500:]}\n"
                                   f"{r.stderr[-3000:]}")
            flushes[name].append(flush(out))
            series[name].runs.append(r)
            if not (rep == reps - 1 and name in keep):
                remove(out)
        log(f"  {tag + ' ' if tag else ''}{'cold' if cold else 'warm'} round {rep + 1}/{reps}: "
            + ", ".join(f"{n} {s.runs[-1].wall_s:.2f}s/{s.runs[-1].cpu_s:.1f}cpu/"
                        f"{s.runs[-1].peak_rss_mb:.0f}MiB" for n, s in series.items()))
    return series, flushes, left


# --------------------------------------------------------------------------- output
def files_of(d: Path) -> list[Path]:
    """Every file under ``d``, sorted."""
    return sorted(p for p in d.rglob("*") if p.is_file())


def digests(d: Path) -> dict[str, tuple[int, str]]:
    """{relative path: (size, xxh3-128)} of every file under ``d``."""
    out = {}
    for p in files_of(d):
        import xxhash

        h = xxhash.xxh3_128()
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        out[p.relative_to(d).as_posix()] = (p.stat().st_size, h.hexdigest())
    return out


def add_output_args(ap) -> None:
    """``--keep DIR`` and ``--no-write`` (and the hidden ``--md``), shared by the benches."""
    ap.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)


def work_dir(keep: str | None, prefix: str) -> Path:
    """``--keep DIR`` emptied, or a new temp dir."""
    import tempfile

    if not keep:
        return Path(tempfile.mkdtemp(prefix=prefix))
    work = Path(keep).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A Markdown table, padded so that it also reads well in a terminal.

    ``align``: one letter per column, ``l`` or ``r`` (default: numbers right, text left).
    """
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if align is None:
        align = "".join("r" if rows and all(_numeric(r[i]) for r in rows) else "l"
                        for i in range(len(headers)))

    def line(r):
        return "| " + " | ".join(c.rjust(w) if a == "r" else c.ljust(w)
                                 for c, w, a in zip(r, widths, align)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _numeric(v) -> bool:
    if isinstance(v, (int, float)):
        return True
    return bool(re.fullmatch(r"[-+]?[\d.,]+[x%]?|-|", str(v)))


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> Path:
    """Put ``body`` between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in
    ``path`` (created with :data:`INTRO` when missing; the section is appended when new)."""
    import fcntl

    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    # two benchmarks finishing at once must not lose each other's section
    import hashlib
    import tempfile

    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"bench-section-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = path.read_text() if path.exists() else INTRO
        if pat.search(text):
            text = pat.sub(lambda _: block, text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def machine_facts() -> dict[str, str]:
    """CPU, cores, memory, kernel, Python: what a results section should record."""
    facts = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts["cpu"] = f"{cpu or platform.processor() or 'unknown'}, {os.cpu_count()} cores"
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        facts["memory"] = f"{kb / 2**20:.1f} GiB"
    except (OSError, AttributeError):
        pass
    facts["kernel"] = platform.release()
    facts["python"] = platform.python_version()
    return facts


def load_average() -> str:
    """The 1-minute load average with the core count: other work on the machine skews timings."""
    try:
        return f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def human_gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


# --------------------------------------------------------------------------- fixtures
def generate_dcp(out: str | os.PathLike, size_bytes: int, files: int = 4, seed: int = 0,
                 python: str = sys.executable) -> Run:
    """Write a DCP checkpoint of about ``size_bytes`` into ``out`` (which must not exist)
    in a subprocess; returns its measurement (wall time, peak RSS)."""
    return measure([python, str(Path(__file__).resolve()), "gen-dcp", str(out),
                    "--size-bytes", str(int(size_bytes)), "--files", str(files),
                    "--seed", str(seed)], capture=True)


def _gen_dcp_main(out: str, size_bytes: int, files: int, seed: int) -> None:
    """A transformer-like training state: bf16 weights, fp32 master weights and Adam moments
    (exp_avg, exp_avg_sq), a step and param groups; ``FileSystemWriter(thread_count=files)``
    spreads the tensors over ``files`` ``.distcp`` files (greedy by size)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    torch.manual_seed(seed)
    hidden = 2048
    ffn = 5504
    # per layer: 4 square attention matrices + 3 ffn matrices, 2 norms
    shapes = {"attn.wq": (hidden, hidden), "attn.wk": (hidden, hidden),
              "attn.wv": (hidden, hidden), "attn.wo": (hidden, hidden),
              "ffn.w1": (ffn, hidden), "ffn.w2": (hidden, ffn), "ffn.w3": (ffn, hidden),
              "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,)}
    bytes_per_param = 2 + 4 + 4 + 4  # bf16 weight + fp32 master, exp_avg, exp_avg_sq
    fixed = 4 * hidden * hidden + 2 * hidden  # attention and norms; the ffn width absorbs the rest
    per_layer = fixed + 3 * ffn * hidden
    layers = max(1, round(size_bytes / (per_layer * bytes_per_param)))
    ffn = max(64, round((size_bytes / (layers * bytes_per_param) - fixed) / (3 * hidden)))
    shapes.update({"ffn.w1": (ffn, hidden), "ffn.w2": (hidden, ffn), "ffn.w3": (ffn, hidden)})
    model, master, state = {}, {}, {}
    for i in range(layers):
        for k, shape in shapes.items():
            name = f"layers.{i}.{k}"
            w = torch.randn(shape) * 0.02 if len(shape) > 1 else torch.ones(shape)
            master[name] = w
            model[name] = w.to(torch.bfloat16)
            m = torch.randn(shape) * 1e-3
            state[name] = {"exp_avg": m, "exp_avg_sq": m.square().add_(1e-12),
                           "step": torch.tensor(100.0)}
    sd = {"model": model,
          "optim": {"state": state, "master": master,
                    "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                      "weight_decay": 0.1, "params": sorted(model)}]},
          "step": 100}
    dcp.save(sd, storage_writer=FileSystemWriter(out, thread_count=files))
    total = sum(f.stat().st_size for f in Path(out).iterdir())
    print(f"{out}: {layers} layers, hidden {hidden}, ffn {ffn}, {total} bytes")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen-dcp", help="write a DCP checkpoint of a given size")
    g.add_argument("out")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--size-gb", type=float, default=1.0)
    size.add_argument("--size-bytes", type=int)
    g.add_argument("--files", type=int, default=4)
    g.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "gen-dcp":
        _gen_dcp_main(a.out, a.size_bytes or int(a.size_gb * GB), a.files, a.seed)


if __name__ == "__main__":
    main()


def ckptctl_exe() -> str:
    """The ckptctl of this venv (or on PATH), its modules byte-compiled first: with
    ``PYTHONDONTWRITEBYTECODE`` set (this machine's default) a module edited since its
    ``.pyc`` was written is compiled again on every start (a no-op ``promote`` measured
    0.21-0.29 s so, 0.16-0.18 s compiled; an installed package has its ``.pyc`` files made
    at install)."""
    import compileall

    import ckptctl

    compileall.compile_dir(os.path.dirname(ckptctl.__file__), quiet=1)
    cand = Path(sys.executable).parent / "ckptctl"
    if cand.exists():
        return str(cand)
    found = shutil.which("ckptctl")
    if not found:
        sys.exit("ckptctl not found: run from the venv (.venv/bin/python bench/...)")
    return found
