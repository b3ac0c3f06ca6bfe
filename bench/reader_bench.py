"""``dcp.load`` through :class:`ckptctl.dcp.Reader` against the offline route (``ckptctl
reshard`` to the new mesh, then ``dcp.load`` with torch's ``FileSystemReader``), one run.

What it measures, for each rank count N of ``--ranks``, on one DCP checkpoint of about
``--size-gb`` saved at another layout (``bench/make_dcp.py``: FSDP2 ``fully_shard`` on
``--src-ranks`` gloo ranks, fp32 ``nn.Linear`` weights + Adam moments, uneven dim 0; then
``ckptctl seal``-ed, so the Reader verifies by default):

* **(a) Reader** -- ``dcp.load(sd, storage_reader=ckptctl.dcp.Reader(SRC))``: resharded
  at load time, each file the load reads hashed whole against the manifest first (the
  default ``verify`` on a sealed source), once, by one of the ranks that read from it,
  the verdicts exchanged over the process group before anything loads;
* **(a) Reader, unsealed source** -- the same on SRC's files hard-linked without the
  manifest: the default ``verify`` then reads them through the format's checks (shared
  out the same way);
* **(a) Reader, verify=False** -- no checks;
* **(b) FileSystemReader, resharded copy** -- ``dcp.load`` with torch's ``FileSystemReader``
  from ``ckptctl reshard SRC DST_N --mesh dp=N`` (DST_N written beforehand, not timed here);
* **(c) reshard + (b)** -- the whole offline route: ``ckptctl reshard``'s wall time (a
  process, timed in the same cache state) plus (b)'s load;
* **FileSystemReader, source** -- torch's own load-time resharding from SRC (DCP's
  ``FileSystemReader`` reshards too): the no-copy baseline without ckptctl, and a
  reference for the checksums that no ckptctl code wrote.

Each load is one ``torch.distributed.run`` launch of N processes (gloo, CPU,
``OMP_NUM_THREADS=1``). Every worker builds the state dict from the checkpoint's metadata:
a DTensor ``Shard(0)`` over a 1-D ``dp`` mesh of N per tensor (0-dim tensors plain), its
local shard filled with NaN (a sentinel: a box no route fills is caught) before the clock
starts; then ``barrier; dcp.load; barrier`` is timed. Per rank it records: its share
(local tensor bytes), the Reader's ``bytes_read`` and ``bytes_checked``, the ``rchar`` and
``read_bytes`` deltas of ``/proc/self/io`` over the load (bytes through ``read``/``pread``
syscalls: page-cache hits and the checks included), ``ru_maxrss`` before and
after, and an xxh3-64 checksum of its local tensors (fqn order). Every route's checksums
must equal (b)'s rank by rank, and no NaN may be left, else the run exits 1 (so does a
``ckptctl/dcp/reader.py`` edited during the run: its numbers would mix two versions).

Page cache, as in the other benches: **warm** = the files the route reads are read once
right before it; **cold** = they are dropped from the guest page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``) before it. Routes run round-robin, ``--reps``
times, medians reported.

    .venv/bin/python bench/reader_bench.py --size-gb 2 --ranks 2 4 [--cache warm cold]
        [--reps 1] [--src-ranks 2] [--out DIR] [--keep DIR] [--no-write]

The table goes to the terminal and into ``BENCHMARKS.md`` (``<!-- bench:reader -->``);
all numbers, per rank, into ``DIR/reader_bench.json`` (``--out``; default a new temp dir).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    GB,
    ROOT,
    ckptctl_exe,
    evict,
    files_of,
    load_average,
    machine_facts,
    measure,
    remove,
    resident_bytes,
    table,
    warm,
    write_section,
)

HERE = Path(__file__).resolve().parent
MiB = 1 << 20

READER, READER_UNSEALED, READER_NV = (
    "(a) Reader", "(a) Reader, unsealed source", "(a) Reader, verify=False")
FS_RESHARDED, OFFLINE, FS_SRC = (
    "(b) FileSystemReader, resharded copy", "(c) reshard + (b)", "FileSystemReader, source")
READERS = [READER, READER_UNSEALED, READER_NV]
LOADS = [*READERS, FS_RESHARDED, FS_SRC]  # the routes that launch a load
ROWS = [*READERS, FS_RESHARDED, OFFLINE, FS_SRC]
READER_PY = ROOT / "ckptctl" / "dcp" / "reader.py"


# =========================================================================== worker side
def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (all its threads)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def empty_state_dict(ckpt: str, mesh) -> dict:
    """One destination per tensor entry of ``ckpt``'s metadata: a DTensor ``Shard(0)`` over
    ``mesh`` (a plain tensor when 0-dim), NaN-filled. Object entries are left out."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    sd = {}
    for fqn, m in sorted(meta.items()):
        if not isinstance(m, TensorStorageMetadata):
            continue
        dtype = m.properties.dtype
        if len(m.size) == 0:
            t = torch.empty((), dtype=dtype)
            local = t
        else:
            t = dtensor_empty(m.size, dtype=dtype, device_mesh=mesh, placements=[Shard(0)])
            local = t.to_local()
        local.fill_(float("nan") if dtype.is_floating_point else -1)
        sd[fqn] = t
    return sd


def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def checksum(sd: dict) -> tuple[str, int, int]:
    """(xxh3-64 of every local tensor's bytes in fqn order, local bytes, NaNs left)."""
    import torch
    import xxhash

    h, nbytes, nans = xxhash.xxh3_64(), 0, 0
    for fqn in sorted(sd):
        loc = local_of(sd[fqn]).contiguous()
        h.update(fqn.encode())
        if loc.numel():
            h.update(loc.reshape(-1).view(torch.uint8).numpy().data)
        nbytes += loc.numel() * loc.element_size()
        if loc.dtype.is_floating_point:
            nans += int(torch.isnan(loc).sum())
    return h.hexdigest(), nbytes, nans


def storage_reader(route: str, ckpt: str):
    from torch.distributed.checkpoint import FileSystemReader

    if route in (READER, READER_UNSEALED):  # the default verify: what the source carries
        from ckptctl.dcp import Reader
        return Reader(ckpt)
    if route == READER_NV:
        from ckptctl.dcp import Reader
        return Reader(ckpt, verify=False)
    return FileSystemReader(ckpt)


def worker(route: str, ckpt: str, result_dir: str) -> None:
    """One rank: build the destinations, time ``dcp.load``, write ``rank<r>.json``."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sd = empty_state_dict(ckpt, mesh)
    reader = storage_reader(route, ckpt)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    io0 = proc_io()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(sd, storage_reader=reader)
    mine = time.perf_counter() - t0
    dist.barrier()
    wall = time.perf_counter() - t0
    io1 = proc_io()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest, share, nans = checksum(sd)
    out = {"rank": rank, "world": world, "route": route, "load_s": wall, "own_load_s": mine,
           "share_bytes": share, "bytes_read": getattr(reader, "bytes_read", None),
           "bytes_checked": getattr(reader, "bytes_checked", None),
           "rchar": io1["rchar"] - io0["rchar"],
           "read_bytes": io1["read_bytes"] - io0["read_bytes"],
           "syscr": io1["syscr"] - io0["syscr"],
           "maxrss_before_mib": rss0 / 1024, "maxrss_mib": rss1 / 1024,
           "checksum": digest, "nans_left": nans}
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# =========================================================================== driver side
def log(msg: str) -> None:
    print(msg, flush=True)


def tree_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in files_of(d))


def prepare_source(base: Path, size_gb: float, src_ranks: int, ck: str) -> tuple[Path, str]:
    """``base/src-<size>gb-<ranks>r``, sealed: reused when sealed and within 5 % of the size."""
    src = base / f"src-{size_gb:g}gb-{src_ranks}r"
    note = base / f"{src.name}.txt"  # make_dcp.py's description, kept for a reuse
    want = size_gb * GB
    if (src / "ckptctl.manifest.json").exists() and abs(tree_bytes(src) - want) < 0.05 * want:
        log(f"reusing {src}")
        return src, note.read_text() if note.exists() else "reused"
    remove(src)
    log(f"writing a {size_gb:g} GB FSDP2 DCP checkpoint on {src_ranks} ranks to {src} ...")
    r = measure([sys.executable, str(HERE / "make_dcp.py"), str(src), "--size-gb",
                 str(size_gb), "--ranks", str(src_ranks)], capture=True)
    desc = next((ln for ln in r.stdout.splitlines() if ln.startswith(str(src))), "")
    desc = desc[len(str(src)) + 2:].strip()
    measure([ck, "seal", str(src)])
    note.write_text(desc)
    log(f"  {desc}; sealed ({r.wall_s:.0f} s)")
    return src, desc


def dcp_files(src: Path) -> list[Path]:
    """The source's tensor files (``*.distcp``): what the checks read."""
    return [f for f in files_of(src) if f.suffix == ".distcp"]


def unsealed_twin(src: Path, work: Path) -> Path:
    """``src`` without its manifest: hard links to its files (same inodes, same page cache)."""
    twin = work / (src.name + "-unsealed")
    remove(twin)
    twin.mkdir()
    for f in files_of(src):
        if f.name != "ckptctl.manifest.json":
            os.link(f, twin / f.name)
    return twin


def fingerprint(path: Path) -> str:
    """sha256 of a file: to tell whether the code measured changed during the run."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def set_cache(files: list[Path], cache: str) -> int:
    """Warm (read once) or evict ``files``; returns the bytes still cached after an evict."""
    if cache == "warm":
        warm(files)
        return 0
    evict(files)
    return resident_bytes(files) or 0


def reshard(ck: str, src: Path, dst: Path, n: int, cache: str) -> tuple[float, int]:
    """``ckptctl reshard SRC DST --mesh dp=N`` timed (a process, source in ``cache``
    state); returns (wall s, peak RSS MiB)."""
    remove(dst)
    set_cache(files_of(src), cache)
    r = measure([ck, "reshard", str(src), str(dst), "--mesh", f"dp={n}", "-q"], capture=True)
    return r.wall_s, r.peak_rss_mb


def launch(route: str, ckpt: Path, n: int, cache: str, scratch: Path) -> dict:
    """One ``torch.distributed.run`` of ``n`` workers loading ``ckpt`` by ``route``;
    returns the launch's wall time, the uncached bytes and the ranks' records."""
    res = scratch / "ranks"
    remove(res)
    res.mkdir(parents=True)
    left = set_cache(files_of(ckpt), cache)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", str(Path(__file__).resolve()), "--worker", route,
           str(ckpt), str(res)]
    r = measure(cmd, capture=True, env=env, check=False)
    if r.returncode:
        raise RuntimeError(f"{route} at {n} ranks exited {r.returncode}:\n{r.stderr[-4000:]}")
    ranks = [json.loads((res / f"rank{i}.json").read_text()) for i in range(n)]
    return {"launch_s": r.wall_s, "left_cached": left, "ranks": ranks}


def check(runs: dict[str, list[dict]]) -> list[str]:
    """Problems: a rank whose checksum differs from (b)'s, or with NaN left."""
    ref = [rk["checksum"] for rk in runs[FS_RESHARDED][0]["ranks"]]
    bad = []
    for route, reps in runs.items():
        for run in reps:
            for rk in run["ranks"]:
                if rk["checksum"] != ref[rk["rank"]]:
                    bad.append(f"{route} rank {rk['rank']}: checksum {rk['checksum']} != "
                               f"(b)'s {ref[rk['rank']]}")
                if rk["nans_left"]:
                    bad.append(f"{route} rank {rk['rank']}: {rk['nans_left']} NaN left")
    return bad


def measure_mesh(ck: str, src: Path, n: int, caches: list[str], reps: int, work: Path) -> dict:
    """Every route at ``n`` ranks, per cache state, ``reps`` rounds round-robin."""
    dst = work / f"resharded-dp{n}"
    unsealed = unsealed_twin(src, work)
    reads = {FS_RESHARDED: dst, READER_UNSEALED: unsealed}
    out: dict = {"n": n, "cache": {}}
    for cache in caches:
        runs: dict[str, list[dict]] = {r: [] for r in LOADS}
        reshards = []
        for rep in range(reps):
            reshards.append(reshard(ck, src, dst, n, cache))
            for route in LOADS:
                runs[route].append(launch(route, reads.get(route, src), n, cache, work))
            log(f"  dp={n} {cache} round {rep + 1}/{reps}: reshard {reshards[-1][0]:.2f}s, "
                + ", ".join(f"{r} {v[-1]['ranks'][0]['load_s']:.2f}s" for r, v in runs.items()))
        out["cache"][cache] = {"reshard": reshards, "runs": runs, "problems": check(runs)}
        out["resharded_bytes"] = tree_bytes(dst)
    remove(dst)
    remove(unsealed)
    return out


# =========================================================================== report
def med(xs) -> float:
    return statistics.median(xs)


def summarize(route: str, runs: list[dict]) -> dict:
    """Medians over the reps of the slowest rank's load, and per-rank maxima of the rest."""
    def per_rank(key):
        return [rk[key] for run in runs for rk in run["ranks"]]
    shares = per_rank("share_bytes")
    reads = per_rank("rchar")
    checked = per_rank("bytes_checked") if route in READERS else None
    return {"load_s": med(max(rk["load_s"] for rk in run["ranks"]) for run in runs),
            "launch_s": med(run["launch_s"] for run in runs),
            "share_max": max(shares),
            "bytes_read_max": max(per_rank("bytes_read")) if route in READERS else None,
            "checked_max": max(checked) if checked else None,
            "checked_min": min(checked) if checked else None,
            # all ranks together, per load (the largest over the reps)
            "checked_sum": max(sum(rk["bytes_checked"] for rk in run["ranks"])
                               for run in runs) if checked else None,
            # rank by rank, per rep: [[rank 0, rank 1, ...], ...]
            "checked_by_rank": [[rk["bytes_checked"] for rk in sorted(
                run["ranks"], key=lambda rk: rk["rank"])] for run in runs] if checked else None,
            "rchar_max": max(reads),
            "rchar_x_share": max(r / s for r, s in zip(reads, shares)),
            "rss_max": max(per_rank("maxrss_mib")),
            "rss_over": max(rk["maxrss_mib"] - rk["maxrss_before_mib"]
                            for run in runs for rk in run["ranks"]),
            "left_cached": max(run["left_cached"] for run in runs)}


HEADERS = ["ranks", "cache", "route", "load s", "x (b)", "launch s", "share/rank GB",
           "bytes_read/rank GB", "bytes_checked/rank GB", "rchar/rank GB", "rchar / share", "peak RSS/rank MiB",
           "RSS over dest MiB", "checksum = (b)"]


def gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.3f}"


def rows_for(mesh: dict) -> tuple[list[list], dict]:
    rows, ratios = [], {}
    n = mesh["n"]
    for cache, c in mesh["cache"].items():
        s = {r: summarize(r, v) for r, v in c["runs"].items()}
        b = s[FS_RESHARDED]["load_s"]
        rs_wall = med(w for w, _ in c["reshard"])
        rs_rss = max(m for _, m in c["reshard"])
        bad_routes = {p.split(" rank ")[0] for p in c["problems"]}
        offline = rs_wall + b
        ratios[f"dp={n} {cache}"] = {
            "reader_over_b": s[READER]["load_s"] / b,
            "reader_uns_over_b": s[READER_UNSEALED]["load_s"] / b,
            "reader_nv_over_b": s[READER_NV]["load_s"] / b,
            "reader_over_c": s[READER]["load_s"] / offline,
            "reader_uns_over_c": s[READER_UNSEALED]["load_s"] / offline,
            "reader_nv_over_c": s[READER_NV]["load_s"] / offline,
            "fs_src_over_b": s[FS_SRC]["load_s"] / b,
            "reshard_s": rs_wall, "offline_s": offline}
        for route in ROWS:
            if route == OFFLINE:
                x = s[FS_RESHARDED]
                rows.append([n, cache, route, f"{offline:.2f}", f"{offline / b:.2f}",
                             f"{rs_wall:.2f} + {x['launch_s']:.2f}", "", "", "", "", "",
                             f"reshard {rs_rss:.0f}", "", ""])
                continue
            x = s[route]
            rows.append([n, cache, route, f"{x['load_s']:.2f}", f"{x['load_s'] / b:.2f}",
                         f"{x['launch_s']:.2f}", f"{x['share_max'] / GB:.3f}",
                         gb(x["bytes_read_max"]), gb(x["checked_max"]),
                         f"{x['rchar_max'] / GB:.3f}", f"{x['rchar_x_share']:.2f}",
                         f"{x['rss_max']:.0f}", f"{x['rss_over']:.0f}",
                         "NO" if route in bad_routes else "yes"])
    return rows, ratios


def reading(ratios: dict, meshes: list[dict], data_files: list | None = None) -> str:
    """The two-line reading: time ratios, then bytes and memory."""
    def span(key, cache):
        xs = [q[key] for k, q in ratios.items() if k.endswith(cache)]
        lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
        return f"{lo}-{hi}x" if lo != hi else f"{lo}x"

    caches = [c for c in ("warm", "cold") if any(k.endswith(c) for k in ratios)]
    t = "; ".join(f"{c}: {span('reader_over_b', c)} (b)'s load and {span('reader_over_c', c)} "
                  f"the whole offline route (c) (unsealed {span('reader_uns_over_b', c)} / "
                  f"{span('reader_uns_over_c', c)}, verify=False "
                  f"{span('reader_nv_over_b', c)} / {span('reader_nv_over_c', c)})"
                  for c in caches)
    per = {r: [summarize(r, v) for m in meshes for c in m["cache"].values()
               for rr, v in c["runs"].items() if rr == r] for r in LOADS}

    def most(route, key):
        return max(x[key] for x in per[route])

    rss_r = max(most(r, "rss_over") for r in READERS)

    def checked_per_mesh(route):
        """'dp=N: a / b / ... GB' per mesh: bytes_checked rank by rank, each distinct
        split over the cache states and reps once, and the total per load."""
        splits: list[tuple[int, list[int]]] = []
        for m in meshes:
            for c in m["cache"].values():
                for r in summarize(route, c["runs"][route])["checked_by_rank"]:
                    if (m["n"], r) not in splits:
                        splits.append((m["n"], r))
        return "; ".join(f"dp={n}: " + " / ".join(f"{b / GB:.3f}" for b in r)
                         + f" GB, together {sum(r) / GB:.3f} GB" for n, r in splits)

    def x_share(route):
        return ", ".join(
            f"dp={m['n']} {max(summarize(route, c['runs'][route])['rchar_x_share'] for c in m['cache'].values()):.2f}x"
            for m in meshes)

    file_bytes = data_files
    return (f"**Reading.** Time, over the rank counts ((a) over (b) / over (c)): {t}.\n\n"
            f"Bytes and memory: with verify=False each rank reads its share and no more "
            f"(`rchar / share` up to {most(READER_NV, 'rchar_x_share'):.2f}). By default "
            f"each source file the load reads is first read whole once, by one of the ranks "
            f"that read from it (sealed: hashed against the manifest; unsealed: the "
            f"format's checks), and the ranks exchange their verdicts before anything "
            f"loads; a rank that reads from a file may thus check it or not, and a rank may "
            f"check a whole file of which it loads only a 0-dim `step` tensor (DCP's save "
            f"spreads the replicated entries over the ranks' files). `bytes_checked` rank "
            f"by rank"
            + (f" (the source's {file_bytes[0]} tensor files hold {file_bytes[1] / GB:.3f} "
               f"GB)" if file_bytes else "")
            + (f", sealed and unsealed alike: {checked_per_mesh(READER)}"
               if checked_per_mesh(READER) == checked_per_mesh(READER_UNSEALED) else
               f", sealed: {checked_per_mesh(READER)}; unsealed: "
               f"{checked_per_mesh(READER_UNSEALED)}")
            + f". So the most a rank reads, `rchar / share`: sealed {x_share(READER)}, "
            f"unsealed {x_share(READER_UNSEALED)}; the Reader's RSS grows "
            f"at most {rss_r:.0f} MiB during the load, FileSystemReader's "
            f"{most(FS_RESHARDED, 'rss_over'):.0f} MiB.")


def report(run: dict) -> str:
    """The BENCHMARKS.md section, from the JSON record of a run (see :func:`main`)."""
    meshes, env, a = run["meshes"], run["env"], run["args"]
    facts = env["facts"]
    rows, ratios = [], {}
    for m in meshes:
        r, q = rows_for(m)
        rows += r
        ratios.update(q)
    cmdline = " ".join([".venv/bin/python", "bench/reader_bench.py", *run["argv"]])
    left = max((summarize(r, v)["left_cached"] for m in meshes for c in m["cache"].values()
                for r, v in c["runs"].items()), default=0)
    machine = (
        f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, kernel "
        f"{facts['kernel']}, Python {facts['python']}, torch {env['torch']}. Load "
        f"average {env['load_before']} before, {env['load_after']} after (the bench's own "
        f"ranks included; other jobs may share the cores, and "
        f"{max(m['n'] for m in meshes)} ranks on 2 cores are CPU-bound: compare ratios "
        f"within a row group, not absolute seconds).")
    source = (
        f"Source: {run['source_bytes'] / GB:.2f} GB in {run['source_files']} files, "
        f"`bench/make_dcp.py` (FSDP2 `fully_shard` on {a['src_ranks']} gloo ranks, "
        f"{run['source_desc']}), then `ckptctl seal`; `unsealed source`: the same files "
        f"hard-linked without the manifest. "
        f"Each load: one `torch.distributed.run` of N gloo CPU processes "
        f"(`OMP_NUM_THREADS=1`), each loading every tensor entry as a DTensor `Shard(0)` "
        f"over `dp=N` (0-dim `step` tensors plain; object entries not loaded), its "
        f"destination allocated and NaN-filled before the clock starts.\n")
    legend = (
        "`load s`: `barrier; dcp.load; barrier`, the slowest rank, median of "
        f"{a['reps']} run(s); `x (b)`: over (b)'s in the same row group; `launch s`: the "
        "whole `torchrun` (interpreter, torch import, process group, state dict, load, "
        "checksum); (c) = `ckptctl reshard SRC DST --mesh dp=N` wall (a process, source in "
        "the same cache state, median) + (b)'s `load s` (its `launch s` column: the reshard "
        "+ (b)'s launch). Per rank, the largest over ranks: `share` = its local tensor "
        "bytes; `bytes_read` / `bytes_checked` = the Reader's counters (tensor bytes into "
        "destinations / bytes read to check files first: each file by one rank, so ranks "
        "differ; all ranks' below the table); `rchar` = `/proc/self/io` `rchar` "
        "over the load (bytes through `read`/`pread`, page-cache hits and checks included); `peak RSS` = `ru_maxrss` after the load, `RSS over dest` = its growth "
        "during the load (the destination is resident before). `checksum = (b)`: each "
        "rank's xxh3-64 of its local tensors equals (b)'s for that rank, and no NaN "
        "sentinel is left. Warm: the files a route reads are read once right before it; "
        "cold: dropped from the guest page cache (`posix_fadvise`) before it (`fincore`: at "
        f"most {left} bytes left), the VM's host may still cache the disk. `FileSystemReader, "
        "source` is torch's own load-time resharding from the source: the no-copy baseline "
        "without ckptctl.\n")
    o = ["## dcp.load through the Reader\n", machine,
         f"\nCommand:\n\n```\n{cmdline}\n```\n", source, legend,
         table(HEADERS, rows), "", reading(ratios, meshes, run.get("data_files"))]
    lines = []
    for k, q in ratios.items():
        lines.append(f"- {k}: (a) Reader {q['reader_over_b']:.2f}x (b)'s load "
                     f"(unsealed {q['reader_uns_over_b']:.2f}x, verify=False "
                     f"{q['reader_nv_over_b']:.2f}x), {q['reader_over_c']:.2f}x the offline "
                     f"route's {q['offline_s']:.2f} s (unsealed {q['reader_uns_over_c']:.2f}x, "
                     f"verify=False {q['reader_nv_over_c']:.2f}x; reshard alone "
                     f"{q['reshard_s']:.2f} s); torch's FileSystemReader from the source "
                     f"{q['fs_src_over_b']:.2f}x (b).")
    o.append("\nPer row group (load s):\n\n" + "\n".join(lines))
    return "\n".join(o) + "\n"


def _torch_version() -> str:
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                    help="rank counts to load at (default 2 4)")
    ap.add_argument("--src-ranks", type=int, default=2, help="ranks that save the source")
    ap.add_argument("--cache", nargs="+", choices=["warm", "cold"], default=["warm", "cold"],
                    help="page-cache states to measure (default: warm cold)")
    ap.add_argument("--reps", type=int, default=1, help="runs per route (median; default 1)")
    ap.add_argument("--out", help="write reader_bench.json here (default: a new temp dir)")
    ap.add_argument("--keep", metavar="DIR", help="work here and keep the source checkpoint "
                    "(reused by the next run when the size matches)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    ap.add_argument("--render", metavar="JSON", help="only print (and write) the section of "
                    "a saved reader_bench.json")
    ap.add_argument("--worker", nargs=3, metavar=("ROUTE", "CKPT", "RESULTS"),
                    help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    if a.render:
        run = json.loads(Path(a.render).read_text())
        return finish(run, a, Path(a.render).parent, time.monotonic())
    t_start = time.monotonic()
    load_before = load_average()
    ck = ckptctl_exe()
    work = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="reader-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(a.out).resolve() if a.out else Path(tempfile.mkdtemp(prefix="reader-bench-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    code = fingerprint(READER_PY)
    try:
        src, desc = prepare_source(work, a.size_gb, a.src_ranks, ck)
        meshes = [measure_mesh(ck, src, n, a.cache, a.reps, work) for n in a.ranks]
        changed = fingerprint(READER_PY) != code
        run = {"argv": argv, "args": {"src_ranks": a.src_ranks, "reps": a.reps},
               "env": {"facts": machine_facts(), "torch": _torch_version(),
                       "load_before": load_before, "load_after": load_average()},
               "source": str(src), "source_bytes": tree_bytes(src),
               "source_files": len(files_of(src)), "source_desc": desc, "meshes": meshes,
               "data_files": [len(dcp_files(src)), sum(f.stat().st_size
                                                       for f in dcp_files(src))],
               "reader_py": code,
               "problems": [p for m in meshes for c in m["cache"].values()
                            for p in c["problems"]]
               + ([f"{READER_PY.relative_to(ROOT)} changed during the run"] if changed else [])}
        (out_dir / "reader_bench.json").write_text(json.dumps(run, indent=1))
        log(f"wrote {out_dir / 'reader_bench.json'}")
        return finish(run, a, out_dir, t_start)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def finish(run: dict, a, out_dir: Path, t_start: float) -> int:
    """Print the section, write it into BENCHMARKS.md (unless ``--no-write`` or a mismatch)."""
    text = report(run)
    print("\n" + text)
    for p in run["problems"]:
        log("MISMATCH: " + p)
    if not a.no_write and not run["problems"]:
        log(f"wrote the reader section of {write_section('reader', text, Path(a.md))}")
    log(f"total {time.monotonic() - t_start:.0f} s")
    return 1 if run["problems"] else 0

if __name__ == "__main__":
    sys.exit(main())
