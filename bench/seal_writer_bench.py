"""``dcp.save`` with :class:`ckptctl.dcp.SealingWriter` against a plain ``FileSystemWriter``
save and a plain save followed by ``ckptctl seal`` (issue 21 part 2's goal: the sealing
writer costs under 5% of the plain save).

Each run is a subprocess that builds a training-like state (fp32 weights and two Adam
moments, a step) of ``--size-mb``, then times ``dcp.save`` alone (state building and
``import torch`` are not counted); the ``plain+seal`` run adds the wall time of
``ckptctl seal`` run right after (its files still in the page cache: seal's best case).
DCP's defaults otherwise: ``sync_files=True`` (an fsync per file), ``thread_count``
``--threads`` (``--no-sync``: no fsync, to see the CPU cost apart from the disk's
noise). The modes run round-robin ``--reps`` times; medians are reported with
overhead over the plain save, and the peak RSS of each save process.

    .venv/bin/python bench/seal_writer_bench.py [--size-mb 300] [--reps 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_output_args, ckptctl_exe, load_average, machine_facts,  # noqa: E402
                    measure, median, table, work_dir, write_section)

MODES = ("plain", "sealing", "plain+seal")


def build_state(size_mb: int) -> dict:
    import torch

    torch.manual_seed(0)
    n = size_mb * 10**6 // (3 * 4 * 16)  # 16 tensors, each with two Adam moments, fp32
    model = {f"layers.{i}.w": torch.randn(n) for i in range(16)}
    optim = {k: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)} for k in model}
    return {"model": model, "optim": optim, "step": 100}


def in_process(out: str, size_mb: int, threads: int, sync: bool, reps: int) -> None:
    """Plain and sealing saves of one state, alternating in this process (no process
    start, no state building between them: the least noisy comparison); prints
    ``{"plain": [s, ...], "sealing": [...]}``."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptctl.dcp import SealingWriter

    sd = build_state(size_mb)
    kw = {"thread_count": threads, "sync_files": sync}
    got: dict[str, list[float]] = {"plain": [], "sealing": []}
    for _ in range(reps):
        for mode, make in (("plain", FileSystemWriter), ("sealing", SealingWriter)):
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=make(out, **kw))
            got[mode].append(time.perf_counter() - t0)
    print(json.dumps(got))


def child(out: str, mode: str, size_mb: int, threads: int, sync: bool) -> None:
    """One save of a fresh state to ``out``; prints ``{"save_s": ..., "cpu_s": ...}``
    (wall and CPU seconds of ``dcp.save``, every thread of the process)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptctl.dcp import SealingWriter

    sd = build_state(size_mb)
    kw = {"thread_count": threads, "sync_files": sync}
    writer = SealingWriter(out, **kw) if mode == "sealing" else FileSystemWriter(out, **kw)
    t0, c0 = time.perf_counter(), time.process_time()
    dcp.save(sd, storage_writer=writer)
    print(json.dumps({"save_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}))


def one(mode: str, out: Path, a, ck: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # the last run's write-back is not this one's
    r = measure([sys.executable, __file__, "_child", str(out), mode, str(a.size_mb),
                 str(a.threads), "1" if a.sync else "0"], capture=True)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    got = {"save_s": doc["save_s"], "cpu_s": doc["cpu_s"], "rss_mb": r.peak_rss_mb,
           "seal_s": 0.0, "seal_cpu_s": 0.0, "seal_rss_mb": 0.0}
    if mode == "plain+seal":
        s = measure([ck, "seal", str(out)], capture=True)
        got.update(seal_s=s.wall_s, seal_cpu_s=s.cpu_s, seal_rss_mb=s.peak_rss_mb)
    if mode != "plain" and not (out / "ckptctl.manifest.json").exists():
        raise RuntimeError(f"{mode}: no manifest in {out}")
    got["bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.name != "ckptctl.manifest.json")
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="sync_files=False: no fsync, the writes end in the page cache")
    add_output_args(ap)
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                     sys.argv[6] == "1")
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_inproc":
        return in_process(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1",
                          int(sys.argv[6]))
    a = ap.parse_args(argv)
    work = work_dir(a.keep, "seal-writer-bench-")
    ck = ckptctl_exe()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    load0 = load_average()
    for rep in range(a.reps):
        for mode in MODES:
            runs[mode].append(one(mode, work / mode / "step-100", a, ck))
        print(f"round {rep + 1}/{a.reps}: " + ", ".join(
            f"{m} {runs[m][-1]['save_s'] + runs[m][-1]['seal_s']:.2f}s" for m in MODES),
            file=sys.stderr)
    r = measure([sys.executable, __file__, "_inproc", str(work / "inproc" / "step-100"),
                 str(a.size_mb), str(a.threads), "1" if a.sync else "0", str(2 * a.reps + 1)],
                capture=True)
    inproc = json.loads(r.stdout.strip().splitlines()[-1])
    plain = median([r["save_s"] for r in runs["plain"]])
    plain_cpu = median([r["cpu_s"] for r in runs["plain"]])
    rows = []
    for mode in MODES:
        walls = [r["save_s"] + r["seal_s"] for r in runs[mode]]
        cpu = median([r["cpu_s"] + r["seal_cpu_s"] for r in runs[mode]])
        rows.append([mode, f"{median(walls):.3f}", f"{(median(walls) / plain - 1) * 100:+.1f}%",
                     f"{min(walls):.3f}", f"{max(walls):.3f}", f"{cpu:.3f}",
                     f"{(cpu / plain_cpu - 1) * 100:+.1f}%",
                     f"{median([max(r['rss_mb'], r['seal_rss_mb']) for r in runs[mode]]):.0f}"])
    size = runs["plain"][0]["bytes"]
    p_med, p_min = median(inproc["plain"]), min(inproc["plain"])
    rows2 = [[mode, f"{median(xs):.3f}", f"{(median(xs) / p_med - 1) * 100:+.1f}%",
              f"{min(xs):.3f}", f"{(min(xs) / p_min - 1) * 100:+.1f}%"]
             for mode, xs in inproc.items()]
    facts = machine_facts()
    body = "\n".join([
        "## Sealed while saved: `SealingWriter` vs a plain DCP save",
        "",
        f"{size / 1e6:.0f} MB checkpoint (fp32 weights + Adam moments), "
        f"`thread_count={a.threads}`, "
        f"`sync_files={a.sync}`, median of {a.reps} round-robin runs (`sync` before each); "
        "wall and CPU time of `dcp.save` alone (plus the `ckptctl seal` process for "
        "plain+seal); peak RSS of the save process (or of seal's, whichever is larger).",
        "",
        table(["mode", "median s", "vs plain", "min s", "max s", "CPU s", "CPU vs plain",
               "peak RSS MiB"], rows),
        "",
        f"The same two saves alternating {2 * a.reps + 1} times in one process (one state, "
        "no process start between them):",
        "",
        table(["mode", "median s", "vs plain", "min s", "min vs plain"], rows2),
        "",
        f"Machine: {facts['cpu']}, {facts.get('memory', '?')}, {facts['date']}; "
        f"load average {load0} → {load_average()}.",
        f"Command: `.venv/bin/python bench/seal_writer_bench.py --size-mb {a.size_mb} "
        f"--reps {a.reps} --threads {a.threads}{'' if a.sync else ' --no-sync'}`",
    ])
    print(body)
    if not a.no_write:
        write_section(f"seal-writer-{a.size_mb}mb{'' if a.sync else '-nosync'}", body,
                      Path(a.md))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
