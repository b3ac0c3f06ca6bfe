"""What exactness costs (issue 7): ``verify --level full`` that checks the CRC-32 of every zip
record of an unsealed checkpoint, and ``--check-finite`` from the same pass, against ``cat``
of the same files; zstd-compressed and strided (transposed) DCP chunks against plain ones
in ``consolidate``.

What it does, in one run (warm page cache; median of ``--reps`` round-robin runs):

1. writes a ~``--size-gb`` DCP checkpoint (bf16 weights, fp32 master and Adam moments, 4
   files) and a hard-linked copy sealed with ``ckptctl seal``;
2. times ``cat FILES``, and ``ckptctl verify --level full`` unsealed (CRC), unsealed with
   ``--check-finite``, sealed (xxh3 hashes) and sealed with ``--check-finite``;
3. writes one 128 MiB fp32 tensor three ways with ``dcp.save``: plain, zstd (DCP's
   ``stream.zstd/1``) and transposed (a strided view, as a transposed parameter is saved),
   and times ``consolidate --to safetensors --max-memory 64MiB`` of each.

Peak RSS is ``ru_maxrss`` of the child. Ratios, not bare times, are what to compare.

    .venv/bin/python bench/exact_bench.py [--size-gb 1] [--reps 3] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GB, Series, ckptctl_exe, generate_dcp, load_average, machine_facts,  # noqa: E402
                    measure, table, warm, write_section)

TENSOR = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
warnings.simplefilter("ignore")
g = torch.Generator().manual_seed(0)
w = torch.randn(4096, 8192, generator=g)  # 128 MiB fp32
out = sys.argv[1]
dcp.save({"w": w}, checkpoint_id=out + "/plain")
dcp.save({"w": w}, storage_writer=dcp.FileSystemWriter(out + "/zstd", _extensions=[ZStandard()]))
dcp.save({"w": w.t().contiguous().t()}, checkpoint_id=out + "/strided")  # strides (1, 4096)
"""


def series(name: str, cmds: dict[str, list[str]], reps: int) -> dict[str, Series]:
    out = {k: Series(k) for k in cmds}
    for _ in range(reps):
        for k, cmd in cmds.items():
            out[k].runs.append(measure(cmd))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    a = ap.parse_args(argv)
    exe = ckptctl_exe()
    work = Path(tempfile.mkdtemp(prefix="exact-bench-"))
    try:
        ck, sealed = work / "ck", work / "sealed"
        generate_dcp(ck, int(a.size_gb * GB))
        shutil.copytree(ck, sealed, copy_function=os.link)
        measure([exe, "seal", str(sealed), "-q"])
        files = sorted(str(p) for p in ck.iterdir() if p.suffix == ".distcp")
        total = sum(p.stat().st_size for p in ck.iterdir())
        warm(files)
        v = [exe, "verify", "--level", "full", "-q"]
        runs = series("verify", {
            "cat": ["cat", *files],
            "verify unsealed (crc)": [*v, str(ck)],
            "verify unsealed + check-finite": [*v, "--check-finite", str(ck)],
            "verify sealed (xxh3)": [*v, str(sealed)],
            "verify sealed + check-finite": [*v, "--check-finite", str(sealed)],
        }, a.reps)
        base = runs["cat"].wall_s
        rows = [[k, f"{s.wall_s:.2f}", s.spread, f"{s.wall_s / base:.1f}x",
                 f"{total / s.wall_s / 1e9:.2f}", f"{s.peak_rss_mb:.0f}"] for k, s in runs.items()]
        body = [f"Checkpoint: {total / 1e9:.2f} GB DCP in 4 files; warm page cache; "
                f"median of {a.reps}; load {load_average()}.", "",
                table(["command", "wall s", "spread", "x cat", "GB/s", "peak RSS MB"], rows)]

        subprocess.run([sys.executable, "-c", TENSOR, str(work / "t")], check=True)
        conv = {}
        for kind in ("plain", "zstd", "strided"):
            src = work / "t" / kind
            warm([str(p) for p in src.iterdir()])
            s = conv[kind] = Series(kind)
            for i in range(a.reps):
                dst = work / f"out-{kind}-{i}"
                s.runs.append(measure([exe, "consolidate", str(src), str(dst), "--to",
                                       "safetensors", "--max-memory", "64MiB", "-q"]))
                shutil.rmtree(dst)
        plain = conv["plain"].wall_s
        rows = [[k, f"{sum(p.stat().st_size for p in (work / 't' / k).iterdir()) / 2**20:.0f}",
                 f"{s.wall_s:.2f}", s.spread, f"{s.wall_s / plain:.2f}x", f"{s.peak_rss_mb:.0f}"]
                for k, s in conv.items()]
        body += ["", "`consolidate --to safetensors --max-memory 64MiB` of one 128 MiB fp32 "
                 "tensor saved by `dcp.save` plain, with zstd, and as a transposed view:", "",
                 table(["source", "on disk MiB", "wall s", "spread", "x plain", "peak RSS MB"],
                       rows)]
        facts = machine_facts()
        body += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items())]
        text = "\n".join(body)
        print(text)
        if not a.no_write:
            write_section("exact", "## What exactness costs (verify CRCs, check-finite, "
                          "zstd and strided chunks)\n\n" + text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
