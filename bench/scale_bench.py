"""Scale benchmark: ckptctl against PyTorch on DCP checkpoints of 1,000 to 10,000 ranks.

    .venv/bin/python bench/scale_bench.py [--ranks 1000,3000,10000] [--no-write]

For each size, ``bench/make_scale_dcp.py`` writes (or takes from its cache) two checkpoints
with the same content (30 FSDP-sharded tensors x N ranks + 9 replicated, a real ``.metadata``
and real ``torch.save`` chunk zips), then every command below runs in its own subprocess
and is timed with its peak RSS (``os.wait4``):

* torch ``FileSystemReader(d).read_metadata()`` (the process, and the call alone);
* torch's default load planning at a new world size, in one process: for every rank of a
  ``--target-world`` (4096) FSDP job and every tensor, the local dim-0 chunk
  (``torch.chunk`` split) and ``planner_helpers.create_read_items_for_chunk_list`` (what
  ``DefaultLoadPlanner.create_local_plan`` calls per tensor). It stops after
  ``--torch-plan-limit`` seconds; the rest is extrapolated from the ranks it finished and
  labelled so;
* ckptctl ``inspect``, ``verify --level structure``, ``reshard --dry-run --world-size 4096
  --json``, ``reshard --dry-run --mesh dp=512,tp=8 --rules llama --json``, ``ls`` of the
  folder holding both checkpoints and ``diff`` of the two, each under ``--timeout``
  (a command that runs out is reported as such).

The table gives seconds, peak RSS, the ratio to torch's ``read_metadata`` (the whole process
and the call alone) and the growth exponent between sizes, ``log(t2/t1) / log(n2/n1)``
(1 is linear, 2 quadratic; n log n reads about 1.1 here). It is written into the "scale"
section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_scale_dcp as gen
from common import (
    ROOT,
    add_output_args,
    load_average,
    machine_facts,
    table,
    work_dir,
    write_section,
)

PY = sys.executable
CKPTCTL = str(Path(PY).with_name("ckptctl"))
MIB = 1 << 20

TORCH_READ = r"""
import json, sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint import FileSystemReader
t1 = time.perf_counter()
md = FileSystemReader(sys.argv[1]).read_metadata()
t2 = time.perf_counter()
n = sum(len(getattr(v, "chunks", ())) for v in md.state_dict_metadata.values())
print(json.dumps({"import_s": t1 - t0, "read_s": t2 - t1, "chunks": n}))
"""

TORCH_PLAN = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
path, world, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.perf_counter()
md = FileSystemReader(path).read_metadata()
t1 = time.perf_counter()
c1 = time.process_time()
tensors = [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

def local_chunk(size, rank):
    # FSDP2 Shard(0): torch.chunk split of dim 0 over the target world
    n = size[0]
    cs = -(-n // world)
    off = min(rank * cs, n)
    rows = max(0, min(cs, n - off))
    return ChunkStorageMetadata(offsets=torch.Size([off] + [0] * (len(size) - 1)),
                                sizes=torch.Size([rows] + list(size[1:])))

done = items = 0
for rank in range(world):
    for fqn, tmd in tensors:
        items += len(create_read_items_for_chunk_list(fqn, tmd, [local_chunk(tmd.size, rank)]))
    done += 1
    if time.perf_counter() - t1 > limit:
        break
t2 = time.perf_counter()
print(json.dumps({"read_s": t1 - t0, "plan_s": t2 - t1, "plan_cpu_s": time.process_time() - c1,
                  "ranks_done": done, "world": world,
                  "read_items": items, "tensors": len(tensors)}))
"""


@dataclass
class Result:
    """One measured subprocess."""
    wall_s: float
    rss_mib: float
    rc: int | None          # None: killed at the timeout
    cpu_s: float = 0.0      # user + system seconds of the process tree
    out: str = ""
    err: str = ""

    @property
    def timed_out(self) -> bool:
        return self.rc is None


def run_limited(cmd: list[str], timeout: float, *, cwd=None) -> Result:
    """Run ``cmd`` with a wall-clock limit; peak RSS of its process tree from ``os.wait4``.

    stdout and stderr go to temporary files (no pipe to drain, no deadlock on big output).
    """
    import tempfile

    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=cwd, start_new_session=True,
                             env=dict(os.environ, PYTHONWARNINGS="ignore"))
        status = ru = None
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                os.killpg(p.pid, signal.SIGKILL)
                _, status, ru = os.wait4(p.pid, 0)
                status = None
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        p.returncode = 0 if status is None else os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        return Result(wall, ru.ru_maxrss / 1024, None if status is None
                      else os.waitstatus_to_exitcode(status), ru.ru_utime + ru.ru_stime,
                      fo.read().decode(errors="replace"), fe.read().decode(errors="replace"))


def growth(t1: float, t2: float, n1: int, n2: int) -> str:
    if t1 <= 0 or t2 <= 0:
        return "-"
    return f"{math.log(t2 / t1) / math.log(n2 / n1):.2f}"


def goals(rows: dict, sizes: list[int], base: dict, torch_call: dict) -> str:
    """The issue's goals for reshard planning at the largest size: within 2x torch's
    read_metadata time, under 4 GB, growth no worse than n log n."""
    n = sizes[-1]
    out = [(f"\nGoals at {n} ranks (reshard planning within 2x torch's `read_metadata` time, "
            "peak RSS under 4 GB, growth no worse than n log n, i.e. exponent about 1.1):")]
    for name, per in rows.items():
        if not name.startswith("reshard") or n not in per:
            continue
        r: Result = per[n]["res"]
        if r.rc != 0:
            out.append(f"- `{name}`: **not met** ({'timed out' if r.timed_out else f'exit {r.rc}'})")
            continue
        parts = []
        if n in base:
            parts.append(f"{r.wall_s / base[n].wall_s:.2f}x the torch process's wall time")
        if n in torch_call:
            parts.append(f"{r.wall_s / torch_call[n]:.2f}x the `read_metadata()` call alone")
        parts.append(f"{r.rss_mib / 1024:.2f} GiB peak RSS")
        done = [m for m in sizes if m in per and per[m]["res"].rc == 0]
        if len(done) > 1:
            lo = done[0]
            parts.append(f"CPU growth {growth(per[lo]['res'].cpu_s, r.cpu_s, lo, n)} "
                         f"from {lo} to {n} ranks")
        out.append(f"- `{name}`: " + ", ".join(parts) + ".")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1000,3000,10000",
                    help="source world sizes, comma-separated (default 1000,3000,10000)")
    ap.add_argument("--tensors", type=int, default=30, help="sharded tensors (default 30)")
    ap.add_argument("--target-world", type=int, default=4096,
                    help="world size to plan for (default 4096)")
    ap.add_argument("--target-mesh", default="dp=512,tp=8",
                    help="2-D mesh to plan for with --rules llama (default dp=512,tp=8)")
    ap.add_argument("--torch-plan-limit", type=float, default=120.0,
                    help="seconds of torch load planning before extrapolating (default 120)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="limit for each ckptctl command, s (default 600)")
    ap.add_argument("--only", default="",
                    help="comma-separated subset of rows to run (e.g. torch-read,inspect)")
    add_output_args(ap)
    a = ap.parse_args(argv)
    sizes = sorted(int(x) for x in a.ranks.split(",") if x.strip())
    log = lambda m: print(m, flush=True)
    load_before = load_average()
    work = work_dir(a.keep, "scale-bench-")
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    want = lambda name: not only or name in only

    rows: dict[str, dict[int, dict]] = {}
    gen_notes = []
    torch_call: dict[int, float] = {}
    plan_info: dict[int, dict] = {}
    chunks: dict[int, int] = {}

    def record(name: str, n: int, r: Result, load: float):
        rows.setdefault(name, {})[n] = {"res": r, "load": load}
        state = ("TIMEOUT" if r.timed_out else f"rc {r.rc}")
        log(f"  {name:<28} {r.wall_s:8.2f} s {r.rss_mib:8.0f} MiB  {state}")
        if r.rc not in (0, None):
            log("    stderr: " + r.err.strip()[-600:])

    try:
        for n in sizes:
            log(f"== {n} ranks")
            paths = []
            for name in ("ckpt", "ckpt2"):
                g = run_limited([PY, str(Path(gen.__file__)), "--ranks", str(n), "--tensors",
                                 str(a.tensors), "--name", name], 3600)
                if g.rc != 0:
                    raise RuntimeError(f"generator failed: {g.err[-2000:]}")
                paths.append(Path(g.out.strip().splitlines()[-1]))
                stats = paths[-1].parent / f"{name}.txt"
                if name == "ckpt":
                    gen_notes.append((stats.read_text().strip() if stats.exists()
                                      else f"{n} ranks: ?") + " to generate (first time)")
                log(f"  {name}: {paths[-1]} (ready in {g.wall_s:.1f} s)")
            src, src2 = paths
            chunks[n] = sum(1 if s.kind == "rep" else n for s in gen.specs(n, a.tensors))
            if want("torch-read"):
                load = os.getloadavg()[0]
                r = run_limited([PY, "-c", TORCH_READ, str(src)], a.timeout)
                record("torch read_metadata", n, r, load)
                if r.rc == 0:
                    torch_call[n] = json.loads(r.out.strip().splitlines()[-1])["read_s"]
            if want("torch-plan"):
                load = os.getloadavg()[0]
                r = run_limited([PY, "-c", TORCH_PLAN, str(src), str(a.target_world),
                                 str(a.torch_plan_limit)], a.torch_plan_limit + a.timeout)
                if r.rc == 0:
                    info = json.loads(r.out.strip().splitlines()[-1])
                    plan_info[n] = info
                    log(f"    torch plan: {info['ranks_done']}/{info['world']} target ranks in "
                        f"{info['plan_s']:.1f} s (+ read {info['read_s']:.1f} s)")
                record(f"torch plan -> {a.target_world}", n, r, load)
            cmds = {
                "inspect": [CKPTCTL, "inspect", str(src)],
                "verify --level structure": [CKPTCTL, "verify", "--level", "structure", str(src)],
                f"reshard -> {a.target_world}": [
                    CKPTCTL, "reshard", str(src), str(work / f"dst-{n}-w"), "--dry-run",
                    "--world-size", str(a.target_world), "--json"],
                f"reshard -> {a.target_mesh}": [
                    CKPTCTL, "reshard", str(src), str(work / f"dst-{n}-m"), "--dry-run",
                    "--mesh", a.target_mesh, "--rules", "llama", "--json"],
                "ls (2 checkpoints)": [CKPTCTL, "ls", str(src.parent)],
                "diff (identical)": [CKPTCTL, "diff", str(src), str(src2)],
            }
            keys = {"inspect": "inspect", "verify --level structure": "verify",
                    f"reshard -> {a.target_world}": "reshard-world",
                    f"reshard -> {a.target_mesh}": "reshard-mesh",
                    "ls (2 checkpoints)": "ls", "diff (identical)": "diff"}
            for name, cmd in cmds.items():
                if want(keys[name]):
                    load = os.getloadavg()[0]
                    record(name, n, run_limited(cmd, a.timeout, cwd=work), load)
    finally:
        if not a.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)

    # ------------------------------------------------------------------ report
    facts = machine_facts()
    load_after = load_average()
    base = {n: d["res"] for n, d in rows.get("torch read_metadata", {}).items()
            if d["res"].rc == 0}
    hdr = ["command", "ranks", "chunks", "wall s", "CPU s", "peak RSS MiB",
           "/ torch read (process)", "CPU / torch read CPU", "/ torch read (call)",
           "growth (wall)", "growth (CPU)",
           "load", "status"]
    trows = []
    for name, per in rows.items():
        prev = None
        for n in sizes:
            if n not in per:
                continue
            r: Result = per[n]["res"]
            wall, cpu = r.wall_s, r.cpu_s
            status = "ok" if r.rc == 0 else ("TIMEOUT" if r.timed_out else f"exit {r.rc}")
            extrapolated = False
            if name.startswith("torch plan") and n in plan_info:
                info = plan_info[n]
                if info["ranks_done"] < info["world"]:
                    # the process as measured, with its planning stretched to every rank
                    scale = info["world"] / info["ranks_done"]
                    wall = r.wall_s - info["plan_s"] + info["plan_s"] * scale
                    cpu = r.cpu_s - info["plan_cpu_s"] + info["plan_cpu_s"] * scale
                    extrapolated = True
                    status = (f"EXTRAPOLATED ({info['ranks_done']}/{info['world']} ranks "
                              f"in {r.wall_s:.0f} s)")
            if name == "diff (identical)" and r.rc == 1:
                status = "exit 1 (differences reported)"
            ok = r.rc == 0
            if r.timed_out:
                t, c = f">{r.wall_s:.0f}", f">{r.cpu_s:.0f}"
            elif extrapolated:
                t, c = f"~{wall:.0f}", f"~{cpu:.0f}"
            else:
                t, c = f"{wall:.2f}", f"{cpu:.2f}"
            rel = f"{wall / base[n].wall_s:.2f}x" if ok and n in base else "-"
            relc = f"{wall / torch_call[n]:.2f}x" if ok and n in torch_call else "-"
            relcpu = f"{cpu / base[n].cpu_s:.2f}x" if ok and n in base else "-"
            gw = growth(prev[1], wall, prev[0], n) if (prev and ok) else "-"
            gc = growth(prev[2], cpu, prev[0], n) if (prev and ok) else "-"
            trows.append([name, n, chunks[n], t, c, f"{r.rss_mib:.0f}", rel, relcpu, relc, gw, gc,
                          f"{per[n]['load']:.1f}", status])
            if ok:
                prev = (n, wall, cpu)
    o = ["## scale: 1,000 to 10,000 ranks\n"]
    o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, kernel "
             f"{facts['kernel']}, Python {facts['python']}. Load average {load_before} before, "
             f"{load_after} after (the 2 cores are shared with other jobs: compare ratios).")
    o.append("\nCommand:\n\n```\n" + " ".join(
        [os.path.relpath(PY, ROOT) if PY.startswith(str(ROOT)) else PY,
         os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
        + "\n```\n")
    o.append("Checkpoints: `bench/make_scale_dcp.py --ranks N` (real DCP: `.metadata` pickled "
             "from torch's own classes, every chunk a real `torch.save` zip; llama names, "
             f"{a.tensors} tensors FSDP-sharded on dim 0 with an uneven last shard, 9 replicated "
             "norms stored once, a `step` entry):\n")
    o += [f"- {x}" for x in gen_notes]
    o.append("")
    o.append(table(hdr, trows, align="lrrrrrrrrrrrl"))
    o.append("")
    for name, per in rows.items():
        for n in sizes:
            r = per.get(n, {}).get("res")
            if r is not None and r.rc not in (0, None):
                msg = (r.err.strip().splitlines() or ["(no message)"])[-1]
                o.append(f"- `{name}` at {n} ranks, exit {r.rc}: `{msg[:300]}`")
            elif r is not None and r.timed_out:
                o.append(f"- `{name}` at {n} ranks: killed at the {a.timeout:.0f} s limit")
    o.append("")
    o.append("`/ torch read (process)`: wall time over that of the torch `read_metadata` "
             "process (`python -c`: import torch + `FileSystemReader(d).read_metadata()`); "
             "`CPU / torch read CPU`: the same with CPU seconds; `(call)`: wall time over the "
             "`read_metadata()` call alone ("
             + ", ".join(f"{torch_call[n]:.2f} s at {n}" for n in sizes if n in torch_call)
             + "). `growth`: log(t2/t1)/log(n2/n1) against the previous size, of wall and of "
             "CPU seconds (1: linear; n log n about 1.1; 2: quadratic); CPU seconds (user + "
             "system of the process tree) are the steadier measure when other jobs share the "
             "cores. `load`: the 1-minute load average when the command started. Every command "
             "is one process from start to exit (imports included), output to /dev/null; "
             "status `exit 3` is an error, the first line of its message below.")
    o.append(f"\n`torch plan -> {a.target_world}`: torch's default load planning for a "
             f"{a.target_world}-rank FSDP job in one process: for every target rank and tensor, "
             "`planner_helpers.create_read_items_for_chunk_list` with that rank's dim-0 chunk "
             "(what `DefaultLoadPlanner.create_local_plan` calls), after `read_metadata`. Each "
             "call sorts all saved chunks of the tensor, so the whole plan is "
             "O(target ranks x saved chunks). It stops after "
             f"{a.torch_plan_limit:.0f} s; an EXTRAPOLATED time is the process's wall time with "
             "its planning time scaled by target ranks / ranks finished (one rank of a real "
             "job does 1/"
             f"{a.target_world} of it, but every rank does its share).")
    for n, info in plan_info.items():
        per_rank = info["plan_s"] / info["ranks_done"]
        o.append(f"- {n} ranks: {info['ranks_done']}/{info['world']} target ranks planned in "
                 f"{info['plan_s']:.1f} s ({per_rank * 1000:.0f} ms per target rank, "
                 f"{info['read_items']} read items), read_metadata {info['read_s']:.1f} s.")
    o.append(goals(rows, sizes, base, torch_call))
    text = "\n".join(o) + "\n"
    print("\n" + text)
    if not a.no_write:
        path = write_section("scale", text, Path(a.md))
        log(f"wrote the scale section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
