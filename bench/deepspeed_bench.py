"""``ckptctl consolidate`` of a real DeepSpeed ZeRO-3 checkpoint beside DeepSpeed's own
``zero_to_fp32`` and ``cp -r``, same files, one run.

The goal (issue): consolidating a ZeRO-3 checkpoint of at least 1 GB (fp32 master weights)
holds at most ``--max-memory`` + 300 MB, beside ``zero_to_fp32``'s peak RSS and wall time on
the same checkpoint.

What it does:

1. writes a real ZeRO-3 checkpoint with DeepSpeed itself (not timed): ``torchrun``, 2 CPU
   ranks (``DS_ACCELERATOR=cpu``, ``deepspeed.init_distributed(dist_backend="gloo")``), a
   stack of big ``nn.Linear(4099, d)`` layers with odd ``d`` (``bench/make_dcp.py``'s
   :func:`layer_dims`: every numel is odd, so every ZeRO-3 partition is padded and cut
   mid-row) built under ``deepspeed.zero.Init``, a client ``torch.optim.AdamW``
   (``"zero_allow_untested_optimizer": true``), one training step, then
   ``engine.save_checkpoint(SAVE, tag="global_step1")``. The optimizer files hold the fp32
   master weights (``--weights-gb``, default 1.1) and both Adam moments: ~3x that;
2. round-robin, ``--reps`` times **cold** (every input file dropped from the guest page
   cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, checked with ``fincore``), then
   ``--warm-reps`` times **warm** (inputs read once right before):

   * ``cp -r SAVE/global_step1 OUT`` (every rank file: the baseline for moving bytes),
   * ``python -c`` calling ``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_
     state_dict(SAVE, OUT, safe_serialization=True)`` (what the ``zero_to_fp32.py`` copied
     into the save folder runs),
   * ``ckptctl consolidate SAVE OUT --only model --to safetensors --strip-prefix model.
     --max-memory M``;

   wall time, CPU seconds (user + system) and peak RSS (``ru_maxrss`` via ``os.wait4``:
   the largest resident set in the process tree, file-backed mapped pages included -- what
   ``zero_to_fp32``'s ``torch.load(mmap=True)`` maps counts once touched); the outputs are
   ``fdatasync``-ed after each run, apart from the wall time;
3. checks once that ckptctl's ``model.safetensors`` equals ``zero_to_fp32``'s tensor by
   tensor (same names, dtypes, shapes, ``torch.equal``);
4. prints the table and writes it into ``BENCHMARKS.md`` between
   ``<!-- bench:deepspeed -->`` markers.

    .venv/bin/python bench/deepspeed_bench.py [--weights-gb 1.1] [--max-memory 256MiB]
        [--reps 3] [--warm-reps 2] [--keep DIR] [--no-write]

``--keep DIR`` writes the checkpoint there and reuses it on the next run when its size
matches. ``--rss-trace`` also runs ckptctl once warm under a sampler of
``/proc/PID/status`` (VmRSS, RssAnon, RssFile) and prints the highest samples.
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
                    measure, median, remove, run_rounds, table, tool_version, warm,
                    write_section)
from consolidate_bench import RSS_SLACK_MB, _torch_version, files_under, tree_bytes  # noqa: E402
from make_dcp import IN_FEATURES, layer_dims  # noqa: E402

from ckptctl.convert.reshard import parse_size  # noqa: E402

MiB = 1 << 20
TAG = "global_step1"
MICRO_BATCH = 2
ZERO_TO_FP32 = ("import sys; from deepspeed.utils.zero_to_fp32 import "
                "convert_zero_checkpoint_to_fp32_state_dict as c; "
                "c(sys.argv[1], sys.argv[2], safe_serialization=True)")


# --------------------------------------------------------------------------- writing
def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        # small buckets: the defaults (5e8 elements, 2 GB of fp32 per bucket) are sized
        # for GPUs; on CPU every rank's buckets sit in the same RAM
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000,
                              "stage3_prefetch_bucket_size": 50_000_000,
                              "allgather_bucket_size": 50_000_000},
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def worker(a) -> None:
    """One rank under torchrun: build, one step, save."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dims = layer_dims(int(a.weights_gb * GB), int(a.tensor_mb * 1e6), adam=False)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(IN_FEATURES, d) for d in dims)

        def forward(self, x):
            return sum(layer(x).square().mean() for layer in self.layers)

    cfg = ds_config()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    t1 = time.perf_counter()
    x = torch.randn(MICRO_BATCH, IN_FEATURES, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x))
    engine.step()
    t2 = time.perf_counter()
    engine.save_checkpoint(a.out, tag=TAG)
    dist.barrier()
    if rank == 0:
        numel = sum(d * IN_FEATURES + d for d in dims)
        total = tree_bytes(Path(a.out) / TAG)
        print(json.dumps({"dims": dims, "in_features": IN_FEATURES, "params": 2 * len(dims),
                          "numel": numel, "fp32_bytes": 4 * numel, "tag_bytes": total,
                          "world": world, "build_s": round(t1 - t0, 1),
                          "step_s": round(t2 - t1, 1),
                          "save_s": round(time.perf_counter() - t2, 1)}), flush=True)


def write_checkpoint(save: Path, a, log) -> dict:
    """``save``: a DeepSpeed save folder written by torchrun (2 ranks); its description."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.ranks}", os.path.abspath(__file__), "--worker", str(save),
           "--weights-gb", str(a.weights_gb), "--tensor-mb", str(a.tensor_mb)]
    r = measure(cmd, capture=True, env=env, check=False)
    if r.returncode:
        raise RuntimeError(f"writing the checkpoint failed ({r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    info = json.loads(next(ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")))
    info.update(write_s=round(r.wall_s, 1), write_peak_rss_mb=round(r.peak_rss_mb))
    return info


def prepare(base: Path, a, log) -> tuple[Path, dict]:
    """``base/ds-<size>gb``: reused when it holds the same sizes, else written anew."""
    save = base / f"ds-{a.weights_gb:g}gb"
    desc = base / f"ds-{a.weights_gb:g}gb.json"
    want = layer_dims(int(a.weights_gb * GB), int(a.tensor_mb * 1e6), adam=False)
    if desc.exists() and (save / "latest").exists():
        info = json.loads(desc.read_text())
        if info.get("dims") == want and info.get("world") == a.ranks \
                and tree_bytes(save / TAG) == info.get("tag_bytes"):
            log(f"reusing {save}")
            return save, dict(info, reused=True)
    remove(save)
    remove(desc)
    base.mkdir(parents=True, exist_ok=True)
    log(f"writing a ZeRO-3 checkpoint ({a.weights_gb:g} GB of fp32 weights, torchrun, "
        f"{a.ranks} ranks) to {save} ...")
    info = write_checkpoint(save, a, log)
    desc.write_text(json.dumps(info))
    log(f"  {len(info['dims'])} Linear({IN_FEATURES}, d) layers, d = {info['dims']}: "
        f"{info['numel']:,} parameters, tag folder {info['tag_bytes'] / GB:.2f} GB; written in "
        f"{info['write_s']:.0f} s, peak RSS {info['write_peak_rss_mb']} MiB")
    return save, info


# --------------------------------------------------------------------------- correctness
def compare_main(ref_dir: str, ck_dir: str) -> None:
    """Subprocess: zero_to_fp32's safetensors against ckptctl's, tensor by tensor."""
    import torch  # noqa: F401  (safetensors' torch frame)
    from safetensors import safe_open

    def files(d):
        return sorted(p for p in Path(d).glob("*.safetensors"))

    out = {"ref_files": [p.name for p in files(ref_dir)],
           "ckptctl_files": [p.name for p in files(ck_dir)],
           "equal": 0, "bytes": 0, "mismatch": [], "missing": [], "extra": []}
    ref, ck = {}, {}
    for d, keys in ((ref_dir, ref), (ck_dir, ck)):
        for p in files(d):
            with safe_open(str(p), framework="pt") as s:
                keys.update({k: str(p) for k in s.keys()})
    out["missing"] = sorted(set(ref) - set(ck))
    out["extra"] = sorted(set(ck) - set(ref))
    for k in sorted(set(ref) & set(ck)):
        with safe_open(ref[k], framework="pt") as s:
            x = s.get_tensor(k)
        with safe_open(ck[k], framework="pt") as s:
            y = s.get_tensor(k)
        ok = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        out["equal"] += ok
        out["bytes"] += x.numel() * x.element_size() if ok else 0
        if not ok:
            out["mismatch"].append(f"{k}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
        del x, y
    out["tensors"] = len(ref)
    print(json.dumps(out))


def compare(ref: Path, ck: Path) -> tuple[bool, str]:
    r = subprocess.run([sys.executable, __file__, "--compare", str(ref), str(ck)],
                       capture_output=True, text=True)
    if r.returncode:
        return False, f"comparison failed: {r.stderr[-1500:]}"
    c = json.loads(r.stdout.strip().splitlines()[-1])
    ok = not c["mismatch"] and not c["missing"] and not c["extra"] and c["tensors"] > 0
    text = (f"ckptctl's `{', '.join(c['ckptctl_files'])}` equals zero_to_fp32's "
            f"`{', '.join(c['ref_files'])}` on {c['equal']} of {c['tensors']} tensors "
            f"({c['bytes'] / GB:.2f} GB; same names, dtypes and shapes, `torch.equal`)")
    if not ok:
        text += (f" -- MISMATCH {c['mismatch'][:5]} missing {c['missing'][:5]} "
                 f"extra {c['extra'][:5]}")
    return ok, text


# --------------------------------------------------------------------------- runs
def tools(ck: str, save: Path, out: Path, max_memory: str) -> dict[str, tuple[list[str], Path]]:
    return {
        "cp -r (tag folder)": (["cp", "-r", str(save / TAG), str(out / "cp")], out / "cp"),
        "zero_to_fp32": ([sys.executable, "-c", ZERO_TO_FP32, str(save), str(out / "z2f")],
                         out / "z2f"),
        "ckptctl consolidate": ([ck, "consolidate", str(save), str(out / "ckptctl"), "--only",
                                 "model", "--to", "safetensors", "--strip-prefix", "model.",
                                 "--max-memory", max_memory], out / "ckptctl"),
    }


def has_files(out: Path) -> str | None:
    """An ``output_ok`` for :func:`common.run_rounds`: the output folder holds a file."""
    return None if files_under(out) else "no files in the output"


def rss_trace(cmd: list[str], env: dict, interval: float = 0.02) -> dict:
    """Run ``cmd`` once, sampling ``/proc/PID/status`` every ``interval`` s: the samples
    with the highest VmRSS (RssAnon = heap, RssFile = mapped files), and VmHWM at the end."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    samples, hwm = [], 0
    t0 = time.perf_counter()

    def status() -> dict | None:
        try:
            text = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            return None
        got = {}
        for line in text.splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM", "Threads"):
                got[k] = int(v.split()[0])
        return got

    while p.poll() is None:
        s = status()
        if s and "VmRSS" in s:
            samples.append((round(time.perf_counter() - t0, 2), s))
            hwm = max(hwm, s.get("VmHWM", 0))
        time.sleep(interval)
    top = sorted(samples, key=lambda x: -x[1]["VmRSS"])[:5]
    return {"returncode": p.returncode, "samples": len(samples), "hwm_mib": hwm / 1024,
            "top": [{"t": t, **{k: round(v / 1024) if k != "Threads" else v
                                for k, v in s.items()}} for t, s in top]}


HEADERS = ["tool", "cache", "runs", "wall s", "min-max", "x cp", "+flush s", "CPU s",
           "peak RSS MiB", "RSS / (max-memory + 300 MiB)"]


def rows_for(series: dict[str, Series], flushes, cache: str, limit_mib: float):
    cp = series["cp -r (tag folder)"].wall_s
    rows = []
    for name, s in series.items():
        rows.append([name, cache, len(s.runs), f"{s.wall_s:.2f}", s.spread,
                     f"{s.wall_s / cp:.2f}", f"{median(flushes[name]):.2f}", f"{s.cpu_s:.1f}",
                     f"{s.peak_rss_mb:.0f}",
                     f"{s.peak_rss_mb / limit_mib:.2f}" if name.startswith("ckptctl") else "-"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights-gb", type=float, default=1.1,
                    help="fp32 master weights in the checkpoint, GB (default 1.1; the "
                    "optimizer files hold ~3x that with the Adam moments)")
    ap.add_argument("--tensor-mb", type=float, default=200.0,
                    help="about this many MB per weight matrix (default 200)")
    ap.add_argument("--ranks", type=int, default=2, help="ZeRO-3 ranks (default 2)")
    ap.add_argument("--max-memory", default="256MiB", help="ckptctl --max-memory (default 256MiB)")
    ap.add_argument("--reps", type=int, default=3, help="cold runs per tool (default 3)")
    ap.add_argument("--warm-reps", type=int, default=2, help="warm runs per tool (default 2)")
    ap.add_argument("--rss-trace", action="store_true",
                    help="also sample ckptctl's /proc/PID/status once (warm) and print it")
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it "
                    "(reused by the next run when the sizes match)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    ap.add_argument("--compare", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare:
        compare_main(*a.compare)
        return 0
    if a.worker:
        a.out = a.worker
        worker(a)
        return 0
    log = lambda m: print(m, flush=True)  # noqa: E731
    t_start = time.monotonic()
    load_before = load_average()
    ck = ckptctl_exe()
    max_mem_b = parse_size(a.max_memory)  # ckptctl's own parser: the flag's meaning
    limit = max_mem_b / MiB + RSS_SLACK_MB
    base = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="ds-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    try:
        save, info = prepare(base, a, log)
        inputs = files_under(save)
        nbytes = sum(p.stat().st_size for p in inputs)
        tag_files = files_under(save / TAG)
        out = base / "out"
        remove(out)
        out.mkdir()
        cmds = tools(ck, save, out, a.max_memory)
        log(f"cold runs ({a.reps} per tool) ...")
        cold, cflush, left = run_rounds(cmds, a.reps, inputs, True,
                                        {"zero_to_fp32", "ckptctl consolidate"}, log, env=env,
                                        output_ok=has_files)
        log("comparing the outputs ...")
        ok, check = compare(cmds["zero_to_fp32"][1], cmds["ckptctl consolidate"][1])
        log("  " + check)
        out_bytes = {n: tree_bytes(o) for n, (_, o) in cmds.items() if o.exists()}
        for _, o in cmds.values():
            remove(o)
        warm_s, wflush = {}, {}
        if a.warm_reps:
            log(f"warm runs ({a.warm_reps} per tool) ...")
            warm_s, wflush, _ = run_rounds(cmds, a.warm_reps, inputs, False, set(), log,
                                           env=env, output_ok=has_files)
        traces = {}
        if a.rss_trace:
            for name in ("zero_to_fp32", "ckptctl consolidate"):
                warm(inputs)
                traces[name] = rss_trace(cmds[name][0], env)
                remove(cmds[name][1])
                log(f"rss trace of {name}: " + json.dumps(traces[name]))
        remove(out)
        fixed = {"python -c 'import deepspeed.utils.zero_to_fp32'":
                 measure([sys.executable, "-c", "import deepspeed.utils.zero_to_fp32"], env=env),
                 "ckptctl --help": measure([ck, "--help"], env=env)}

        # ------------------------------------------------------------ report
        facts = machine_facts()
        rows = rows_for(cold, cflush, "cold", limit)
        if warm_s:
            rows += rows_for(warm_s, wflush, "warm", limit)
        ck_peak = max(s.peak_rss_mb for s in [cold["ckptctl consolidate"]]
                      + ([warm_s["ckptctl consolidate"]] if warm_s else []))
        z_peak = max(s.peak_rss_mb for s in [cold["zero_to_fp32"]]
                     + ([warm_s["zero_to_fp32"]] if warm_s else []))
        goal_ok = ck_peak <= limit
        load_after = load_average()
        ds_version = tool_version([sys.executable, "-c",
                                   "import importlib.metadata as m; print(m.version('deepspeed'))"])
        cmdline = " ".join([os.path.relpath(sys.executable, ROOT)
                            if sys.executable.startswith(str(ROOT)) else sys.executable,
                            os.path.relpath(__file__, ROOT),
                            *(argv if argv is not None else sys.argv[1:])])
        fp32 = info["fp32_bytes"]
        o = ["## consolidate a DeepSpeed ZeRO-3 checkpoint vs zero_to_fp32 vs cp -r\n"]
        o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, "
                 f"kernel {facts['kernel']}, Python {facts['python']}, torch {_torch_version()}, "
                 f"DeepSpeed {ds_version}; {tool_version(['cp', '--version'])}; ckptctl at "
                 f"{_git_rev()}. Load average "
                 f"{load_before} before, {load_after} after.")
        o.append(f"\nCommand:\n\n```\n{cmdline}\n```\n")
        o.append(f"Checkpoint: written by DeepSpeed itself (`bench/deepspeed_bench.py`, not "
                 f"timed{'; reused' if info.get('reused') else ''}): torchrun, "
                 f"{info['world']} CPU ranks (gloo), ZeRO-3 with the model built under "
                 f"`deepspeed.zero.Init`, {len(info['dims'])} `nn.Linear({IN_FEATURES}, d)` "
                 f"layers with d = {', '.join(map(str, info['dims']))} ({info['params']} "
                 f"parameters, {info['numel']:,} numbers, every numel odd: each rank's piece "
                 f"padded and cut mid-row), fp32, client `torch.optim.AdamW`, one step, "
                 f"`engine.save_checkpoint`"
                 + (f" (written in {info['write_s']:.0f} s, peak RSS "
                    f"{info['write_peak_rss_mb']} MiB, the largest rank)" if "write_s" in info else "")
                 + f". fp32 master weights {fp32 / GB:.2f} GB "
                 f"({fp32 / max_mem_b:.1f}x `--max-memory {a.max_memory}`); the tag folder "
                 f"`{TAG}/` holds {len(tag_files)} files, {tree_bytes(save / TAG) / GB:.2f} GB "
                 f"(fp32 partitions and both Adam moments in the "
                 f"`zero_pp_rank_*_optim_states.pt` files). {check}.\n")
        o.append("Tools, each one process from start to exit (imports included), output to a "
                 "fresh folder: `cp -r` of the tag folder (all of its bytes: the cost of moving "
                 "the checkpoint); `zero_to_fp32`: `python -c` calling "
                 "`deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(SAVE, "
                 "OUT, safe_serialization=True)` (the function the `zero_to_fp32.py` in the save "
                 "folder runs; it `torch.load`s each optimizer file with `mmap=True` and writes "
                 "one `model.safetensors`); `ckptctl consolidate SAVE OUT --only model --to "
                 f"safetensors --strip-prefix model. --max-memory {a.max_memory}` (reads the "
                 "fp32 byte ranges of the rank files, no torch, writes `model.safetensors` and "
                 "its manifest). Outputs: "
                 + ", ".join(f"{n} {b / GB:.2f} GB" for n, b in out_bytes.items()) + ".\n")
        o.append(f"Cold: before every run each input file ({len(inputs)} files, "
                 f"{nbytes / GB:.2f} GB) is dropped from the guest page cache "
                 f"(`posix_fadvise(POSIX_FADV_DONTNEED)`); `fincore` found at most {left} bytes "
                 f"still cached before a cold run (the VM's host may still cache the disk). "
                 f"Warm: inputs read once right before each run. Medians of {a.reps} cold and "
                 f"{a.warm_reps} warm runs per tool, round-robin.\n")
        o.append("`wall s`: process start to exit (outputs then in the page cache); `x cp`: "
                 "over `cp -r`'s median in the same cache state; `+flush s`: `fdatasync` of the "
                 "outputs right after, not in `wall s` (0.00 for ckptctl: it `fsync`s its "
                 "files itself before sealing them, inside its `wall s`); `CPU s`: user + system; `peak RSS`: "
                 "`ru_maxrss` (MiB) of the largest process of the tree (`os.wait4`), "
                 "file-backed mapped pages included (zero_to_fp32 maps the optimizer files; "
                 "ckptctl and cp map nothing), the highest of the runs; the last column: "
                 f"ckptctl's peak over `--max-memory` + {RSS_SLACK_MB} MiB = {limit:.0f} MiB "
                 "(the goal: at most 1.00).\n")
        o.append(table(HEADERS, rows))
        o.append(f"\nGoal: ckptctl's peak RSS {ck_peak:.0f} MiB "
                 f"{'<=' if goal_ok else '>'} {limit:.0f} MiB (`--max-memory {a.max_memory}` + "
                 f"{RSS_SLACK_MB} MiB): {'met' if goal_ok else 'NOT met'} "
                 f"({ck_peak / limit:.2f}); zero_to_fp32 peaked at {z_peak:.0f} MiB "
                 f"({z_peak / ck_peak:.1f}x ckptctl's) on the same checkpoint.")
        o.append("\nFixed costs (warm, one run each): " + "; ".join(
            f"`{k}` {v.wall_s:.2f} s, {v.peak_rss_mb:.0f} MiB" for k, v in fixed.items())
            + ". zero_to_fp32 imports torch and DeepSpeed; ckptctl's safetensors path "
            "imports neither.")
        if traces:
            parts = []
            for name, tr in traces.items():
                top = tr["top"][0] if tr["top"] else {}
                parts.append(f"{name}: VmHWM {tr['hwm_mib']:.0f} MiB; at its highest sample "
                             f"(t = {top.get('t')} s) VmRSS {top.get('VmRSS')} MiB = RssAnon "
                             f"{top.get('RssAnon')} (heap) + RssFile {top.get('RssFile')} "
                             f"(mapped files) MiB, {top.get('Threads')} threads")
            o.append("\nWhere the memory is (one more warm run of each, `/proc/PID/status` "
                     "sampled every 20 ms): " + "; ".join(parts) + ".")
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            path = write_section("deepspeed", text, Path(a.md))
            log(f"wrote the deepspeed section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0 if ok and goal_ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


def _git_rev() -> str:
    """The commit ckptctl ran from, marked when the work tree's ckptctl/ has changes."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "ckptctl"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return f"`{rev}`" + (" with uncommitted changes in `ckptctl/`" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
