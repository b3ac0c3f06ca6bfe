"""``ckptctl verify --level full`` against ``cat``, ``sha256sum`` and ``xxhsum`` on the same files.

Issue 3's target: verify streams with bounded memory and hashes in parallel; its throughput
should be at least 0.8 of ``cat FILES > /dev/null``.

What it does, in one run:

1. writes a real DCP checkpoint (``torch.distributed.checkpoint.save`` in one process,
   ``FileSystemWriter(thread_count=--files)``: bf16 weights, fp32 master weights and Adam
   moments) of ``--size-gb``, seals it with ``ckptctl seal`` (xxh3-128) and a hard-linked
   copy with ``ckptctl seal --hash sha256`` (both timed and reported, not compared);
2. **warm** (every file in the page cache, checked with ``fincore``): each command
   ``--reps`` times, round-robin, median wall time;
3. **cold**: before every run each file is dropped from the page cache with
   ``posix_fadvise(POSIX_FADV_DONTNEED)`` (dropping all caches needs root privileges this
   machine does not give); ``fincore`` checks that nothing is left. This is the guest's page
   cache only: the virtual machine's host may still cache the disk (see the first cold
   read, reported separately);
4. **scaling**: a second checkpoint of ``--scale-gb`` is verified too, to check that peak RSS
   does not grow with the checkpoint size, and to split ckptctl's wall time into a fixed
   cost and a per-byte cost.

Throughput is bytes of all the checkpoint's files (as listed by the manifest) over wall time,
process start to exit; GB = 10^9 bytes. Peak RSS is ``ru_maxrss`` of the process tree.

    .venv/bin/python bench/verify_bench.py [--size-gb 4] [--files 4] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GB, ROOT, Series, ckptctl_exe, evict, generate_dcp, load_average,  # noqa: E402
                    machine_facts, measure, resident_bytes, table, tool_version, warm,
                    write_section)

MANIFEST = "ckptctl.manifest.json"


def checkpoint_files(d: Path) -> list[Path]:
    """The files the manifest lists (the ones ``verify --level full`` hashes)."""
    doc = json.loads((d / MANIFEST).read_text())
    return [d / rel for rel in sorted(doc["files"])]


def prepare(base: Path, size_gb: float, files: int, ck: str, log) -> dict:
    """Make (or reuse) ``base/xxh3`` (sealed xxh3-128) and ``base/sha256`` (hard links,
    sealed sha256). Returns the setup measurements."""
    xdir, sdir = base / "xxh3", base / "sha256"
    info = {}
    want = int(size_gb * GB)
    reuse = (xdir / MANIFEST).exists() and (sdir / MANIFEST).exists()
    if reuse:
        total = sum(p.stat().st_size for p in checkpoint_files(xdir))
        ndistcp = len(list(xdir.glob("*.distcp")))
        reuse = abs(total - want) < 0.05 * want and ndistcp == files
    if reuse:
        log(f"reusing the checkpoints in {base}")
        return {"reused": True}
    for d in (xdir, sdir):
        shutil.rmtree(d, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    log(f"writing a {size_gb:g} GB DCP checkpoint ({files} files) to {xdir} ...")
    info["generate"] = generate_dcp(xdir, want, files)
    log("  " + info["generate"].stdout.strip())
    sdir.mkdir()
    for p in xdir.iterdir():
        os.link(p, sdir / p.name)
    info["seal_xxh3"] = measure([ck, "seal", "--quiet", str(xdir)])
    info["seal_sha256"] = measure([ck, "seal", "--quiet", "--hash", "sha256", str(sdir)])
    return info


def cross_check(series: dict[str, Series], sdir: Path, xdir: Path) -> list[str]:
    """The manifests' digests must equal sha256sum's and xxhsum -H2's (first runs' output)."""
    notes = []
    for d, name in ((sdir, "sha256sum"), (xdir, "xxhsum -H2")):
        if name not in series:
            continue
        doc = json.loads((d / MANIFEST).read_text())
        out = series[name].runs[0].stdout
        got = {Path(line.split()[1]).name: line.split()[0] for line in out.splitlines() if line}
        bad = [rel for rel, rec in doc["files"].items() if got.get(rel) != rec["hash"]]
        notes.append(f"{name} agrees with the manifest on all {len(got)} files" if not bad
                     else f"{name} DISAGREES with the manifest on {bad}")
    return notes


CAPTURE = ("ckptctl", "sha256sum", "xxhsum")  # small outputs worth keeping; cat's goes to /dev/null


def run_series(cmds: dict[str, list[str]], reps: int, files: list[Path], cold: bool, log,
               slow_cpu_s: float = 5.0, ref_cpu_s: float = 2.0) -> tuple[dict[str, Series], int]:
    """Each command ``reps`` times, round-robin so that drift hits all alike. A command
    whose first run used more than ``slow_cpu_s`` CPU seconds, or a reference hasher (not
    cat, not ckptctl) more than ``ref_cpu_s``, runs once: CPU-bound, such runs vary little,
    and they would dominate the benchmark's run time (coreutils' sha256sum: ~3 s/GB).
    Returns the series and the most bytes found still cached right before a cold run."""
    series = {name: Series(name) for name in cmds}
    left_cached = 0
    for rep in range(reps):
        for name, cmd in cmds.items():
            first = series[name].runs[0] if rep else None
            if first and (first.cpu_s > slow_cpu_s or (
                    Path(cmd[0]).name not in ("cat", "ckptctl") and first.cpu_s > ref_cpu_s)):
                continue
            if cold:
                evict(files)
                res = resident_bytes(files)
                left_cached = max(left_cached, res or 0)
            exe = Path(cmd[0]).name
            r = measure(cmd, capture=exe in CAPTURE)
            if exe == "ckptctl" and "OK" not in r.stdout + r.stderr:
                raise RuntimeError(f"{name}: unexpected output {r.stdout!r} {r.stderr!r}")
            series[name].runs.append(r)
        log(f"  {'cold' if cold else 'warm'} round {rep + 1}/{reps}: " + ", ".join(
            f"{n} {s.runs[-1].wall_s:.2f}s" for n, s in series.items() if len(s.runs) == rep + 1))
    return series, left_cached


def rows_for(series: dict[str, Series], nbytes: int, ref: str = "cat") -> list[list]:
    ref_s = next((s for n, s in series.items() if n.startswith(ref)), None)
    rows = []
    for name, s in series.items():
        best = min(r.wall_s for r in s.runs)
        if "structure" in name or not ref_s:  # reads metadata only: no throughput
            gbs_s, ratio, ratio_best = "-", "-", "-"
        else:
            gbs_s = f"{nbytes / GB / s.wall_s:.2f}"
            ratio = f"{ref_s.wall_s / s.wall_s:.2f}"
            ratio_best = f"{min(r.wall_s for r in ref_s.runs) / best:.2f}"
        rows.append([name, len(s.runs), f"{s.wall_s:.2f}", s.spread, f"{s.cpu_s:.2f}", gbs_s,
                     ratio, ratio_best, f"{s.peak_rss_mb:.0f}"])
    return rows


SMALL = "small: "
HEADERS = ["command", "runs", "wall s (median)", "min-max", "CPU s", "GB/s", "x cat",
           "x cat (best)", "peak RSS MB"]


def _load1(text: str) -> float:
    """The number in :func:`load_average`'s text (0 when unknown)."""
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return 0.0


def wait_idle(limit_s: float, log) -> None:
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= 1.0 and time.monotonic() < deadline:
        log(f"waiting for the machine to go idle (load {os.getloadavg()[0]:.2f}) ...")
        time.sleep(15)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="checkpoint size (default 4)")
    ap.add_argument("--files", type=int, default=4, help=".distcp files (default 4)")
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoints here and keep them; "
                    "reused by the next run when size and file count match")
    ap.add_argument("--reps", type=int, default=3, help="runs per command (median; default 3)")
    ap.add_argument("--workers", default="1,2,4", help="ckptctl --workers values (default 1,2,4)")
    ap.add_argument("--scale-gb", type=float, default=None,
                    help="size of the second, smaller checkpoint for the memory and fixed-cost "
                         "check (default: 1, or a quarter of --size-gb if smaller; 0: skip)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold runs")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for the 1-minute load average to fall "
                         "below 1 (other work on the machine skews the timings)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    workers = [int(w) for w in a.workers.split(",") if w]
    if a.scale_gb is None:
        a.scale_gb = min(1.0, a.size_gb / 4)
    if a.scale_gb >= a.size_gb:
        ap.error("--scale-gb must be smaller than --size-gb (or 0 to skip the scaling check)")
    log = lambda m: print(m, flush=True)  # noqa: E731
    t_start = time.monotonic()
    if a.wait_idle:
        wait_idle(a.wait_idle, log)
    load_before = load_average()
    ck = ckptctl_exe()
    have_xxhsum = shutil.which("xxhsum") is not None
    base = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="verify-bench-"))
    try:
        setup = prepare(base, a.size_gb, a.files, ck, log)
        xdir, sdir = base / "xxh3", base / "sha256"
        files = checkpoint_files(xdir)
        nbytes = sum(p.stat().st_size for p in files)
        sfiles = [str(p) for p in files]

        def ckv(d, w, level="full"):
            return [ck, "verify", "--level", level, "--workers", str(w), str(d)]

        warm_cmds = {"cat > /dev/null": ["cat", *sfiles], "sha256sum": ["sha256sum", *sfiles]}
        if have_xxhsum:
            warm_cmds["xxhsum -H2"] = ["xxhsum", "-H2", *sfiles]
        if shutil.which("openssl"):
            warm_cmds["openssl dgst -sha256"] = ["openssl", "dgst", "-sha256", *sfiles]
        for w in workers:
            warm_cmds[f"ckptctl verify full xxh3 w{w}"] = ckv(xdir, w)
        ends = sorted({min(workers), max(workers)})  # the sweep's ends where time is short
        for w in ends:
            warm_cmds[f"ckptctl verify full sha256 w{w}"] = ckv(sdir, w)
        warm_cmds["ckptctl verify structure"] = ckv(xdir, 4, "structure")
        cold_cmds = {k: v for k, v in warm_cmds.items()
                     if "structure" not in k and "openssl" not in k
                     and not (" w" in k and int(k.rsplit("w", 1)[1]) != max(workers))}

        scale_cmds, sfiles2, nbytes2 = {}, [], 0
        if a.scale_gb:
            # a smaller checkpoint, measured in the same round-robin as the big one
            sx = base / f"scale-{a.scale_gb:g}gb" / "xxh3"
            if not (sx / MANIFEST).exists():
                shutil.rmtree(sx.parent, ignore_errors=True)
                sx.parent.mkdir(parents=True)
                log(f"writing a {a.scale_gb:g} GB checkpoint for the scaling check ...")
                generate_dcp(sx, int(a.scale_gb * GB), a.files)
                measure([ck, "seal", "--quiet", str(sx)])
            sfiles2 = checkpoint_files(sx)
            nbytes2 = sum(p.stat().st_size for p in sfiles2)
            scale_cmds = {"cat > /dev/null": ["cat", *map(str, sfiles2)]}
            scale_cmds |= {f"ckptctl verify full xxh3 w{w}": ckv(sx, w)
                           for w in sorted({1, max(workers)})}
            scale_cmds["ckptctl verify structure"] = ckv(sx, 4, "structure")

        log(f"warm: {nbytes / GB:.2f} GB in {len(files)} files, {a.reps} rounds")
        warm(files + sfiles2)
        res = resident_bytes(files)
        warm_res = f"{res / nbytes:.0%}" if res is not None else "unknown"
        both, _ = run_series(warm_cmds | {SMALL + k: v for k, v in scale_cmds.items()}, a.reps,
                             files, False, log)
        warm_series = {k: v for k, v in both.items() if not k.startswith(SMALL)}
        scale_series = {k[len(SMALL):]: v for k, v in both.items() if k.startswith(SMALL)}
        notes = cross_check(warm_series, sdir, xdir)
        for n in notes:
            log("  " + n)

        cold_series, first_cold, left = None, None, None
        if not a.no_cold:
            evict(files)
            first_cold = measure(["cat", *sfiles])
            log(f"cold: first cold read (cat) {nbytes / GB / first_cold.wall_s:.2f} GB/s")
            cold_series, left = run_series(cold_cmds, a.reps, files, True, log)

        scale = (nbytes2, scale_series) if scale_series else None

        # ------------------------------------------------------------ report
        facts = machine_facts()
        load_after = load_average()
        out = []
        out.append("## verify --level full vs cat / sha256sum / xxhsum\n")
        out.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, "
                   f"kernel {facts['kernel']}, Python {facts['python']}; "
                   f"{tool_version(['sha256sum', '--version'])}"
                   + (f"; {tool_version(['xxhsum', '--version'])}" if have_xxhsum else "") + ".")
        out.append("\nCommand:\n\n```\n" + " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
             else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]]) + "\n```\n")
        gen = setup.get("generate")
        out.append(f"Checkpoint: DCP written by `torch.distributed.checkpoint.save` "
                   f"(`FileSystemWriter(thread_count={a.files})`), {nbytes / GB:.2f} GB in "
                   f"{len(files)} files (`.metadata` + {a.files} `.distcp`): bf16 weights, fp32 "
                   f"master weights, Adam exp_avg and exp_avg_sq. "
                   + ("Reused from an earlier run. " if setup.get("reused") else "")
                   + (f"Writing it took {gen.wall_s:.1f} s (peak RSS {gen.peak_rss_mb:.0f} MB). "
                      if gen else "")
                   + (f"`ckptctl seal` took {setup['seal_xxh3'].wall_s:.2f} s (xxh3-128) and "
                      f"{setup['seal_sha256'].wall_s:.2f} s (`--hash sha256`, a hard-linked "
                      f"copy), page cache warm. " if "seal_xxh3" in setup else "")
                   + " ".join(n[0].upper() + n[1:] + "." for n in notes))
        busy = max(_load1(load_before), _load1(load_after))
        out.append(("\n**The machine was busy with other work during this run: wall times are "
                    "inflated and scattered; trust `CPU s`, `x cat (best)` and ratios more than "
                    "absolute times.**\n" if busy >= 1.0 else "")
                   + f"\nLoad average {load_before} before the run, {load_after} after: other "
                   f"work on the machine inflates and scatters the timings (`min-max`).")
        out.append(f"\nMedians of {a.reps} runs, round-robin (a command using over 5 CPU seconds, "
                   f"or a reference hasher over 2, runs once); `wN` is `--workers N` (default 4); "
                   f"wall time is process start to exit, so ckptctl's includes its start-up and "
                   f"the structure checks (`verify structure` row); `CPU s` is user + system time "
                   f"of the process tree (median; above wall time when it runs in parallel); "
                   f"`x cat` is cat's median wall time over the command's, `x cat (best)` the "
                   f"same with the fastest runs (less sensitive to other jobs on the machine).\n")
        out.append(f"### Warm (page cache; {warm_res} of the bytes resident before the runs)\n")
        out.append(table(HEADERS, rows_for(warm_series, nbytes)))
        if cold_series:
            out.append("\n### Cold (guest page cache dropped per file before every run)\n")
            out.append(f"`posix_fadvise(POSIX_FADV_DONTNEED)` on each file; `fincore` found at "
                       f"most "
                       f"{left} bytes still cached before a run. Dropping all caches "
                       f"(`/proc/sys/vm/drop_caches`) is not possible here, and the VM host "
                       f"caches the disk too: the first cold read after writing ran at "
                       f"{nbytes / GB / first_cold.wall_s:.2f} GB/s, later cold reads come "
                       f"partly from the host's cache.\n")
            out.append(table(HEADERS, rows_for(cold_series, nbytes)))
        if scale:
            nbytes2, ss = scale
            out.append(f"\n### Scaling: {nbytes2 / GB:.2f} GB vs {nbytes / GB:.2f} GB (warm)\n")
            rows = []
            dgb = (nbytes - nbytes2) / GB

            def best(series):
                return min(r.wall_s for r in series.runs)

            cat_big = warm_series.get("cat > /dev/null")
            cat_gbs = nbytes / GB / best(cat_big) if cat_big else None
            for name, s in ss.items():
                big = warm_series.get(name)
                m = cpu_per_gb = None
                if big and "structure" not in name:
                    if best(big) > best(s):
                        m = dgb / (best(big) - best(s))
                    cpu_per_gb = (big.cpu_s - s.cpu_s) / dgb
                rows.append([name, f"{s.wall_s:.2f}", f"{big.wall_s:.2f}" if big else "-",
                             f"{s.peak_rss_mb:.0f}", f"{big.peak_rss_mb:.0f}" if big else "-",
                             f"{s.cpu_s:.2f}", f"{big.cpu_s:.2f}" if big else "-",
                             f"{cpu_per_gb:.2f}" if cpu_per_gb is not None else "-",
                             f"{m:.2f}" if m else "-",
                             f"{m / cat_gbs:.2f}" if m and cat_gbs else "-"])
            sg, bg = f"{nbytes2 / GB:.2g} GB", f"{nbytes / GB:.2g} GB"
            out.append(table(["command", f"wall s {sg}", f"wall s {bg}", f"peak RSS MB {sg}",
                              f"peak RSS MB {bg}", f"CPU s {sg}", f"CPU s {bg}",
                              "CPU s per extra GB", "marginal GB/s", "marginal x cat"], rows))
            out.append("\nThe difference between the two sizes isolates the streaming from the "
                       "fixed costs (interpreter start, imports, metadata checks: the `verify "
                       "structure` row). `CPU s per extra GB`: the extra CPU time (medians) per "
                       "extra GB, robust to other jobs on the machine; `marginal GB/s`: the extra "
                       "bytes over the extra wall time (fastest runs); `marginal x cat`: that "
                       f"over cat's throughput on the {bg} checkpoint (fastest run; cat has no "
                       "fixed cost to speak of).")
        text = "\n".join(out) + "\n"
        print("\n" + text)
        if not a.no_write:
            path = write_section("verify", text, Path(a.md))
            log(f"wrote the verify section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
