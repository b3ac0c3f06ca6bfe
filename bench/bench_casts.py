"""``consolidate --dtype`` and bare casts, timed side by side (issue 35 item 10).

    .venv/bin/python bench/bench_casts.py SRC_DCP [--out /tmp/castbench] [--repeat 3]

Runs ``ckptctl consolidate SRC OUT/<case>`` for fp32 (no ``--dtype``) and ``--dtype bf16``
/ ``fp16`` into a torch.save file, a safetensors file (``--only model``) and DCP, each a
fresh process under ``/usr/bin/time`` (wall time and peak RSS), then times the block
converters alone (``copier.dtype_converter``) against the torch path they replace
(``torch.frombuffer(bytearray(block)).to(dtype)``) on a 4 MiB block. Make SRC with
``bench/make_dcp.py SRC --size-gb 0.5``. Run it from an older checkout's root for the
"before" numbers (``-m ckptctl`` takes the checkout in the working directory). Prints
medians; compare ratios, not bare times.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def run_case(src: str, dst: str, extra: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS KiB) of one ``ckptctl consolidate`` in a fresh process."""
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    elif os.path.exists(dst):
        os.remove(dst)
    cmd = ["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "ckptctl", "consolidate",
           src, dst, "--force", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr)
    wall, rss = p.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss)


def time_block(fn, block, repeat: int = 20) -> float:
    """GB/s of ``fn(block)`` over input bytes (best of ``repeat``)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(block)
        best = min(best, time.perf_counter() - t)
    return len(block) / best / 1e9


def bare_casts() -> None:
    """Converter throughput per pair on a 4 MiB block, next to the torch path it replaced
    (whose speed swings with whether malloc hands it fresh pages: best of 20 shown)."""
    import numpy as np

    from ckptctl.convert.copier import dtype_converter

    rng = np.random.default_rng(0)
    names = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
    pairs = [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
             ("float16", "float32"), ("bfloat16", "float16"), ("float64", "float32")]
    import torch

    for s, d in pairs:
        n = (4 << 20) // (2 if s in ("bfloat16", "float16") else names[s]().itemsize)
        x = rng.standard_normal(n).astype(np.float32)
        raw = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() if s == "bfloat16" \
            else x.astype(names[s]).tobytes()
        conv = dtype_converter(s, d)
        buf = bytearray(raw)
        size = getattr(conv, "out_size", lambda nbytes: 4 * nbytes)  # 4x: any pair fits
        out = np.empty(max(len(raw), size(len(raw))), dtype=np.uint8)
        try:
            conv(memoryview(buf), out)
            ours = time_block(lambda b: conv(memoryview(b), out), buf)
        except TypeError:  # the converter before issue 35 took no output buffer
            ours = time_block(lambda b: conv(memoryview(b)), buf)
        ts, td = getattr(torch, s), getattr(torch, d)
        theirs = time_block(lambda b: torch.frombuffer(bytearray(b), dtype=ts).to(td)
                            .view(torch.uint8).numpy().tobytes(), raw)
        print(f"  {s:>8} -> {d:<8}  ckptctl {ours:5.2f} GB/s   torch(old path) {theirs:5.2f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--out", default="/tmp/castbench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-bare", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases = [("fp32 -> torch.save", "m.pt", []),
             ("bf16 -> torch.save", "m.pt", ["--dtype", "bf16"]),
             ("fp16 -> torch.save", "m.pt", ["--dtype", "fp16"]),
             ("fp32 -> safetensors", "m.safetensors", ["--only", "model"]),
             ("bf16 -> safetensors", "m.safetensors", ["--only", "model", "--dtype", "bf16"]),
             ("fp32 -> dcp", "dcp", ["--to", "dcp"]),
             ("bf16 -> dcp", "dcp", ["--to", "dcp", "--dtype", "bf16"])]
    for label, name, extra in cases:
        runs = [run_case(a.src, os.path.join(a.out, name), extra) for _ in range(a.repeat)]
        wall = statistics.median(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        print(f"{label:<22} {wall:6.2f} s  (runs {[r[0] for r in runs]})  "
              f"peak RSS {rss / 1024:.0f} MB")
    shutil.rmtree(a.out, ignore_errors=True)
    if not a.no_bare:
        bare_casts()


if __name__ == "__main__":
    main()
