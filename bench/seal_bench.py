"""``ckptctl seal`` of an unsealed DCP checkpoint against reading and hashing the same files.

Issue 34: a seal runs every check the format carries (the CRC-32 of each zip record) in the
read that hashes the files, so sealing costs no second pass: a cold seal should stay within
5% of hashing alone, a warm one within 30%. This measures, round-robin, cold (each file
dropped from the page cache first, ``posix_fadvise``) and warm:

* ``cat > /dev/null`` and ``sha256sum``: reading, and hashing, the files;
* ``ckptctl verify --level full`` of the unsealed checkpoint: the CRCs alone;
* ``ckptctl seal``: hashes and CRCs in one read, the manifest written (it is removed before
  each run, so each run seals afresh);
* with ``--before DIR`` (a checkout of an earlier ckptctl, e.g. ``git worktree add DIR
  REV``): that checkout's ``seal`` of the same checkpoint, run with ``PYTHONPATH=DIR``,
  so that the ratio is the cost of the checks this seal added.

The checkpoint is a real DCP (``torch.distributed.checkpoint.save`` in one process, bf16
weights, fp32 master weights and Adam moments) of ``--size-gb``, kept with ``--keep``.

    .venv/bin/python bench/seal_bench.py [--size-gb 2] [--reps 5] [--before /tmp/base]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GB, Series, ckptctl_exe, files_of, generate_dcp, load_average,  # noqa: E402
                    machine_facts, median, run_rounds, table, write_section)

MANIFEST = "ckptctl.manifest.json"


def commands(ck: str, d: Path, out: Path, before: str | None) -> dict:
    """{name: (argv, the file the run leaves)}: run_rounds removes it before each run."""
    files = " ".join(f"'{p}'" for p in files_of(d) if p.name != MANIFEST)
    cmds = {
        "cat > /dev/null": (["sh", "-c", f"cat {files} > /dev/null && : > '{out}'"], out),
        "sha256sum": (["sh", "-c", f"sha256sum {files} > '{out}'"], out),
        "ckptctl verify --level full (CRCs)": (
            ["sh", "-c", f"'{ck}' verify --level full --quiet '{d}' && : > '{out}'"], out),
        "ckptctl seal": ([ck, "seal", "--quiet", str(d)], d / MANIFEST),
    }
    if before:
        cmds["seal before the checks (--before)"] = (
            ["env", f"PYTHONPATH={before}", sys.executable, "-m", "ckptctl", "seal", "--quiet",
             str(d)], d / MANIFEST)
    return cmds


def rows(series: dict[str, Series], nbytes: int, base: str) -> list[list]:
    ref = series[base].wall_s
    return [[name, f"{s.wall_s:.2f}", s.spread, f"{s.wall_s / ref:.2f}x",
             f"{nbytes / s.wall_s / GB:.2f}", f"{s.cpu_s:.2f}", f"{s.peak_rss_mb:.0f}"]
            for name, s in series.items()]


def ratio_line(series: dict[str, Series]) -> str:
    """The seal's median wall over the earlier seal's, run by run (pairs in one round)."""
    a, b = series.get("ckptctl seal"), series.get("seal before the checks (--before)")
    if not a or not b:
        return ""
    pairs = [x.wall_s / y.wall_s for x, y in zip(a.runs, b.runs)]
    return f"seal / seal before the checks, round by round: median {median(pairs):.3f} " \
           f"(min {min(pairs):.3f}, max {max(pairs):.3f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before", metavar="DIR", help="a checkout of an earlier ckptctl to "
                    "compare seal with (PYTHONPATH=DIR)")
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoint here and reuse it")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    a = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    ck = ckptctl_exe()
    base = Path(a.keep or tempfile.mkdtemp(prefix="seal-bench-")).resolve()
    d = base / "dcp"
    if not (d / ".metadata").exists():
        log(f"writing a {a.size_gb:g} GB DCP checkpoint ...")
        generate_dcp(d, int(a.size_gb * GB), a.files)
    (d / MANIFEST).unlink(missing_ok=True)
    inputs = [p for p in files_of(d) if p.name != MANIFEST]
    nbytes = sum(p.stat().st_size for p in inputs)
    out = base / "peer.out"
    load0 = load_average()
    parts, ratios = [], []
    for cold in (True, False):
        series, _, left = run_rounds(commands(ck, d, out, a.before), a.reps, inputs, cold,
                                     set(), log)
        head = ["command", "wall s", "spread", "x cat", "GB/s", "CPU s", "peak RSS MB"]
        parts.append(f"**{'cold' if cold else 'warm'}** ({'dropped from the page cache' if cold else 'page cache warm'}"
                     + (f"; at most {left / 1e6:.0f} MB still cached before a run" if cold and left
                        else "") + "):\n\n"
                     + table(head, rows(series, nbytes, "cat > /dev/null")))
        ratios.append(f"{'cold' if cold else 'warm'}: {ratio_line(series)}")
    facts = machine_facts()
    body = (f"## seal: hashes and the format's checks in one read\n\n"
            f"Checkpoint: DCP written by `torch.distributed.checkpoint.save`, "
            f"{nbytes / GB:.2f} GB in {len(inputs)} files; median of {a.reps} round-robin "
            f"runs; load {load0} before, {load_average()} after.\n\n"
            + "\n\n".join(parts) + "\n\n"
            + ("\n".join(f"- {r}" for r in ratios if r.split(': ', 1)[1]) + "\n\n"
               if a.before else "")
            + f"Command: `.venv/bin/python bench/seal_bench.py --size-gb {a.size_gb:g} "
            f"--reps {a.reps}" + (" --before DIR" if a.before else "") + "`\n\n"
            + "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + "\n")
    print(body)
    if not a.no_write:
        write_section("seal", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
