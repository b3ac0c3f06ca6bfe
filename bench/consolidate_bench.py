"""``ckptctl consolidate`` against torch's ``dcp_to_torch`` and ``cp -r``, same bytes, one run.

The goal (issue): on a checkpoint at least 4x ``--max-memory``, ckptctl's peak RSS stays
within ``--max-memory`` + 300 MB while ``dcp_to_torch``'s grows with the checkpoint, and its
wall time is within 1.2x of ``cp -r`` of the same files (the physical limit for moving
these bytes: read them all, write them all).

What it does:

1. writes two real FSDP2-sharded DCP checkpoints with ``bench/make_dcp.py`` (``torchrun``,
   4 CPU ranks, ``fully_shard`` over big fp32 ``nn.Linear`` layers with uneven dims, one
   Adam step, ``dcp.save``): ``--small-gb`` and ``--size-gb``; not timed;
2. for each size, round-robin ``--reps`` times, **cold** (every input file dropped from the
   guest page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each run, checked
   with ``fincore``), then ``--warm-reps`` times **warm** (inputs read once before):

   * ``cp -r SRC DST``
   * ``python -m torch.distributed.checkpoint.format_utils dcp_to_torch SRC OUT.pt``
   * ``ckptctl consolidate SRC OUT.pt --to torch --max-memory M``
   * ``ckptctl consolidate SRC DIR --to safetensors --max-memory M``

   wall time is process start to exit (outputs are in the page cache then, not on disk);
   after each run the outputs are ``fdatasync``-ed and that time is reported apart
   (``+flush``) so writeback never leaks into the next run; peak RSS is ``ru_maxrss`` of the
   process tree (``os.wait4``): the largest resident set of any one process, file-backed
   pages it maps included (none of these tools maps its input: all read with ``read``);
3. checks once per size that ckptctl's torch output equals ``dcp_to_torch``'s, tensor by
   tensor (both loaded with ``torch.load(mmap=True)``, keys flattened, ``torch.equal``), and
   that the safetensors output holds the same tensors;
4. prints a table and writes it into ``BENCHMARKS.md`` between
   ``<!-- bench:consolidate -->`` markers.

    .venv/bin/python bench/consolidate_bench.py [--size-gb 2.5] [--small-gb 1.2]
        [--max-memory 256MiB] [--reps 2] [--warm-reps 1] [--keep DIR] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GB, ROOT, Series, ckptctl_exe, load_average, machine_facts,  # noqa: E402
                    measure, median, remove, run_rounds, table, tool_version, write_section)
from ckptctl.convert.reshard import parse_size  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
RSS_SLACK_MB = 300  # the goal's "+ 300 MB", taken as MiB like ru_maxrss
WALL_GOAL = 1.2  # issue 20: consolidate within 1.2x of cp -r cold


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def tree_bytes(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in files_under(p))


# --------------------------------------------------------------------------- checkpoints
def prepare(base: Path, size_gb: float, log) -> tuple[Path, dict]:
    """``base/dcp-<size>gb``: reused when its size is within 5 %, else written anew."""
    d = base / f"dcp-{size_gb:g}gb"
    want = size_gb * GB
    if (d / ".metadata").exists() and abs(tree_bytes(d) - want) < 0.05 * want:
        log(f"reusing {d}")
        return d, {"reused": True}
    remove(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing a {size_gb:g} GB FSDP2 DCP checkpoint to {d} (torchrun, 4 ranks) ...")
    r = measure([sys.executable, str(HERE / "make_dcp.py"), str(d), "--size-gb", str(size_gb)],
                capture=True)
    desc = next((ln for ln in r.stdout.splitlines() if ln.startswith(str(d))), "").strip()
    log("  " + desc + f" ({r.wall_s:.0f} s)")
    return d, {"generate": r, "desc": desc[len(str(d)) + 2:]}


# --------------------------------------------------------------------------- correctness
def compare_main(ref: str, ck_pt: str, st_dir: str | None) -> None:
    """Subprocess: compare the torch outputs tensor by tensor; print a JSON verdict."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    def flat(obj, prefix=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from flat(v, f"{prefix}{k}.")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from flat(v, f"{prefix}{i}.")
        else:
            yield prefix[:-1], obj

    a = dict(flat(torch.load(ref, mmap=True, weights_only=True, map_location="cpu")))
    b = dict(flat(torch.load(ck_pt, mmap=True, weights_only=True, map_location="cpu")))
    out = {"ref_entries": len(a), "ckptctl_entries": len(b), "tensors_equal": 0,
           "tensor_bytes": 0, "objects_equal": 0, "mismatch": [], "missing": [], "extra": []}
    out["missing"] = sorted(set(a) - set(b))[:10]
    out["extra"] = sorted(set(b) - set(a))[:10]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            ok = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                  and torch.equal(x, y))
            out["tensors_equal"] += ok
            out["tensor_bytes"] += x.numel() * x.element_size() if ok else 0
        else:
            ok = x == y
            out["objects_equal"] += ok
        if not ok:
            out["mismatch"].append(k)
    if st_dir:
        from safetensors import safe_open

        st_files = sorted(Path(st_dir).glob("*.safetensors"))
        n_st = same = 0
        for f in st_files:
            with safe_open(str(f), framework="pt") as s:
                for k in s.keys():
                    n_st += 1
                    x = a.get(k)
                    same += isinstance(x, torch.Tensor) and torch.equal(x, s.get_tensor(k))
        out["safetensors_tensors"] = n_st
        out["safetensors_equal"] = same
        out["ref_tensors"] = sum(isinstance(v, torch.Tensor) for v in a.values())
    print(json.dumps(out))


def compare(ref: Path, ck_pt: Path, st_dir: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--compare", str(ref), str(ck_pt)]
    if st_dir:
        cmd.append(str(st_dir))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr[-1500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def verdict(c: dict) -> tuple[bool, str]:
    if "error" in c:
        return False, f"comparison failed: {c['error']}"
    ok = (not c["mismatch"] and not c["missing"] and not c["extra"]
          and c.get("safetensors_equal", 0) == c.get("ref_tensors", 0)
          == c.get("safetensors_tensors", 0))
    text = (f"ckptctl `--to torch` equals `dcp_to_torch` on {c['tensors_equal']} tensors "
            f"({c['tensor_bytes'] / GB:.2f} GB, `torch.equal`) and {c['objects_equal']} "
            f"non-tensor entries; `--to safetensors` holds {c.get('safetensors_equal')} of "
            f"{c.get('ref_tensors')} tensors, equal")
    if not ok:
        text += (f" -- MISMATCH {c['mismatch'][:5]} missing {c['missing'][:5]} "
                 f"extra {c['extra'][:5]}")
    return ok, text


# --------------------------------------------------------------------------- runs
def tools(ck: str, src: Path, out: Path, max_memory: str) -> dict[str, tuple[list[str], Path]]:
    return {
        "cp -r": (["cp", "-r", str(src), str(out / "cp")], out / "cp"),
        "torch dcp_to_torch": ([sys.executable, "-m",
                                "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                                str(src), str(out / "torch.pt")], out / "torch.pt"),
        "ckptctl --to torch": ([ck, "consolidate", str(src), str(out / "ckptctl.pt"), "--to",
                                "torch", "--max-memory", max_memory], out / "ckptctl.pt"),
        "ckptctl --to safetensors": ([ck, "consolidate", str(src), str(out / "st"), "--to",
                                      "safetensors", "--max-memory", max_memory,
                                      "--drop", "optim.param_groups.*", "--drop", "step"],
                                     out / "st"),
    }


def at_least(nbytes: float):
    """An ``output_ok`` for :func:`common.run_rounds`: outputs of fewer than ``nbytes``
    bytes are incomplete (every tool here writes about as many bytes as it reads)."""
    def ok(out: Path) -> str | None:
        got = tree_bytes(out)
        return None if got >= nbytes else f"no complete output, {got} of {nbytes:.0f} bytes"
    return ok


HEADERS = ["size", "tool", "cache", "runs", "wall s", "min-max", "GB/s", "x cp", "x cp (best)",
           "+flush s", "CPU s", "peak RSS MiB"]


def rows_for(label: str, series: dict[str, Series], flushes, nbytes: int, cache: str):
    cp = series["cp -r"].wall_s
    cp_best = min(r.wall_s for r in series["cp -r"].runs)
    rows = []
    for name, s in series.items():
        best = min(r.wall_s for r in s.runs)
        rows.append([label, name, cache, len(s.runs), f"{s.wall_s:.2f}", s.spread,
                     f"{nbytes / GB / s.wall_s:.2f}", f"{s.wall_s / cp:.2f}",
                     f"{best / cp_best:.2f}",
                     f"{median(flushes[name]):.2f}", f"{s.cpu_s:.1f}", f"{s.peak_rss_mb:.0f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.5, help="large checkpoint (default 2.5)")
    ap.add_argument("--small-gb", type=float, default=1.2,
                    help="second, smaller checkpoint for the growth check (0: skip; default 1.2)")
    ap.add_argument("--max-memory", default="256MiB", help="ckptctl --max-memory (default 256MiB)")
    ap.add_argument("--reps", type=int, default=2, help="cold runs per tool (median; default 2)")
    ap.add_argument("--warm-reps", type=int, default=1,
                    help="warm runs per tool, on the largest checkpoint only (default 1)")
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoints here and keep them "
                    "(reused by the next run when the size matches)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    ap.add_argument("--compare", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare:
        compare_main(a.compare[0], a.compare[1], a.compare[2] if len(a.compare) > 2 else None)
        return 0
    log = lambda m: print(m, flush=True)  # noqa: E731
    t_start = time.monotonic()
    load_before = load_average()
    ck = ckptctl_exe()
    max_mem_b = parse_size(a.max_memory)  # ckptctl's own parser: same meaning as the flag
    base = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="consolidate-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    sizes = sorted({s for s in (a.small_gb, a.size_gb) if s})
    results = []
    try:
        for size in sizes:
            src, setup = prepare(base, size, log)
            inputs = files_under(src)
            nbytes = sum(p.stat().st_size for p in inputs)
            label = f"{nbytes / GB:.2f} GB"
            out = base / f"out-{size:g}gb"
            remove(out)
            out.mkdir()
            cmds = tools(ck, src, out, a.max_memory)
            keep = {"torch dcp_to_torch", "ckptctl --to torch", "ckptctl --to safetensors"}
            complete = at_least(0.9 * nbytes)
            cold, cflush, left = run_rounds(cmds, a.reps, inputs, True, keep, log,
                                            output_ok=complete, tag=label)
            log("  comparing the outputs ...")
            ok, check = verdict(compare(cmds["torch dcp_to_torch"][1],
                                        cmds["ckptctl --to torch"][1],
                                        cmds["ckptctl --to safetensors"][1]))
            log("  " + check)
            for _, o in cmds.values():
                remove(o)
            warm_s, wflush = {}, {}
            if a.warm_reps and size == sizes[-1]:
                warm_s, wflush, _ = run_rounds(cmds, a.warm_reps, inputs, False, set(), log,
                                               output_ok=complete, tag=label)
            remove(out)
            results.append(dict(size=size, src=src, nbytes=nbytes, label=label, setup=setup,
                                cold=cold, cflush=cflush, left=left, warm=warm_s,
                                wflush=wflush, ok=ok, check=check, files=len(inputs)))

        # fixed costs: what a run pays before it moves a byte
        fixed = {"python -c 'import torch'": measure([sys.executable, "-c", "import torch"]),
                 "ckptctl --help": measure([ck, "--help"])}

        # ------------------------------------------------------------ report
        facts = machine_facts()
        limit = max_mem_b / MiB + RSS_SLACK_MB
        rows = []
        for r in results:
            rows += rows_for(r["label"], r["cold"], r["cflush"], r["nbytes"], "cold")
            if r["warm"]:
                rows += rows_for(r["label"], r["warm"], r["wflush"], r["nbytes"], "warm")
        goals = []
        for r in results:
            ratio_mem = r["nbytes"] / max_mem_b
            cp = r["cold"]["cp -r"].wall_s
            cp_best = min(x.wall_s for x in r["cold"]["cp -r"].runs)
            # as durable as consolidate's output: cp's bytes on disk too (its flush added)
            cp_durable = cp + median(r["cflush"]["cp -r"])
            for name in ("ckptctl --to torch", "ckptctl --to safetensors"):
                s = r["cold"][name]
                best = min(x.wall_s for x in s.runs)
                durable = s.wall_s + median(r["cflush"][name])
                rss_ok = s.peak_rss_mb <= limit
                wall_ok = s.wall_s <= WALL_GOAL * cp
                goals.append([r["label"], f"{ratio_mem:.1f}x", name,
                              f"{s.peak_rss_mb:.0f} <= {limit:.0f}: {'yes' if rss_ok else 'NO'}",
                              f"{s.wall_s / cp:.2f} (best {best / cp_best:.2f}) <= {WALL_GOAL}: "
                              f"{'yes' if wall_ok else 'NO'}",
                              f"{durable / cp_durable:.2f} <= {WALL_GOAL}: "
                              f"{'yes' if durable <= WALL_GOAL * cp_durable else 'NO'}"])
        torch_rss = [(r["label"], r["cold"]["torch dcp_to_torch"].peak_rss_mb) for r in results]
        ck_rss = [(r["label"], max(r["cold"][n].peak_rss_mb for n in
                                   ("ckptctl --to torch", "ckptctl --to safetensors")))
                  for r in results]
        load_after = load_average()
        cmdline = " ".join([os.path.relpath(sys.executable, ROOT)
                            if sys.executable.startswith(str(ROOT)) else sys.executable,
                            os.path.relpath(__file__, ROOT), *(argv if argv is not None
                                                                else sys.argv[1:])])
        o = ["## consolidate vs torch dcp_to_torch vs cp -r\n"]
        o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, kernel "
                 f"{facts['kernel']}, Python {facts['python']}, torch "
                 f"{_torch_version()}; {tool_version(['cp', '--version'])}. Load average "
                 f"{load_before} before, {load_after} after.")
        o.append(f"\nCommand:\n\n```\n{cmdline}\n```\n")
        for r in results:
            g = r["setup"].get("generate")
            o.append(f"- **{r['label']}** ({r['files']} files, {r['nbytes'] / max_mem_b:.1f}x "
                     f"`--max-memory {a.max_memory}`): `bench/make_dcp.py`, FSDP2 `fully_shard` "
                     f"on 4 gloo ranks, {r['setup'].get('desc') or 'reused'}"
                     + (f"; written in {g.wall_s:.0f} s, not timed" if g else "") + ". "
                     + r["check"] + ".")
        o.append(f"\nCold: before every run each input file is dropped from the guest page cache "
                 f"(`posix_fadvise(POSIX_FADV_DONTNEED)`; dropping all caches needs root "
                 f"privileges this VM does not give); `fincore` found at most "
                 f"{max(r['left'] for r in results)} bytes still cached before a cold run. The "
                 f"VM's host may still cache the disk, so cold reads run faster than the "
                 f"disk's ~0.6 GB/s. Warm: inputs read once right before each run. Medians of "
                 f"{a.reps} cold runs per tool (and {a.warm_reps} warm on the largest), "
                 f"round-robin.\n")
        o.append("`wall s`: process start to exit (imports included; the outputs are then in "
                 "the page cache); `+flush s`: `fdatasync` of the outputs right after, not "
                 "included in `wall s`; `x cp`: median wall over `cp -r`'s in the same cache "
                 "state, `x cp (best)` the same with each tool's fastest run (less sensitive "
                 "to other jobs on the machine); "
                 "`GB/s`: checkpoint bytes over wall; `CPU s`: user + system of the process; "
                 "`peak RSS`: `ru_maxrss` (MiB) of the process tree's largest process, "
                 "file-backed mapped pages included (none of these tools maps its inputs), the "
                 "highest of the runs. `cp` (coreutils 9 on ext4) copies with "
                 "`copy_file_range`: one in-kernel copy, no user-space buffer. `ckptctl --to "
                 "safetensors` does the same for every tensor stored as it goes out (FSDP's "
                 "raw dim-0 shards, no cast) and hashes the output (xxh3-128, for the "
                 "manifest) from the page cache on a second thread right behind the copies; "
                 "`--to torch` and `dcp_to_torch` `read` into user memory and `write` back "
                 "(two copies), ckptctl also hashing (xxh3-128, and CRC-32 for the zip).\n")
        o.append(table(HEADERS, rows))
        o.append("\nFixed costs on this machine (warm, one run each): " + "; ".join(
            f"`{k}` {v.wall_s:.2f} s, {v.peak_rss_mb:.0f} MiB" for k, v in fixed.items())
            + ". Both torch tools import torch; `ckptctl --to torch` does too (to pickle "
            "`data.pkl` and decode DCP's bytes entries), `--to safetensors` does not.")
        o.append(f"\n### Goals (cold runs; RSS limit `--max-memory` + {RSS_SLACK_MB} MiB = "
                 f"{limit:.0f} MiB; wall within {WALL_GOAL}x `cp -r`, issue 20)\n")
        o.append(table(["size", "x max-memory", "tool", "peak RSS MiB within limit",
                        f"median wall / cp within {WALL_GOAL}x",
                        f"durable: (wall + flush) / cp's within {WALL_GOAL}x"], goals))
        o.append("\n`durable`: both outputs on disk, as a restart needs them: cp's `+flush` "
                 "added to its wall (ckptctl's own outputs are fsynced before it exits, its "
                 "`+flush` is ~0). `cp -r` alone leaves its copy in the page cache, dirty.")
        o.append("\nPeak RSS as the checkpoint grows: `dcp_to_torch` "
                 + " -> ".join(f"{m:.0f} MiB ({lab})" for lab, m in torch_rss)
                 + "; ckptctl " + " -> ".join(f"{m:.0f} MiB ({lab})" for lab, m in ck_rss) + ".")
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            path = write_section("consolidate", text, Path(a.md))
            log(f"wrote the consolidate section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0 if all(r["ok"] for r in results) else 1
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


def _torch_version() -> str:
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
