"""Seconds and requests of each pack hop into a loopback S3 pack tier, by chain depth.

Issue 20: a hop of a small checkpoint (77 KiB, DCP, 9 steps of one run) into a pack tier
(``ckptctl promote --pack``, ``--base auto``) should cost no more with a chain of 8 than
with a chain of 1. Two rounds on one ``rclone serve s3`` (started here, stopped by pid):
with the plain copies left in the hot folder (the base's content is read from there) and
with ``--delete-source`` (the base is read through its chain). Wall time is the CLI's,
start-up included; requests are counted by the proxy of ``tests/s3server.py``.

    .venv/bin/python bench/pack_hop_bench.py [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import (ROOT, add_output_args, ckptctl_exe, load_average, machine_facts,  # noqa: E402
                    table, work_dir, write_section)
from s3server import start_rclone  # noqa: E402

GEN = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.simplefilter("ignore")
g = torch.Generator().manual_seed(0)
w = {f"l{i}.weight": torch.randn(48, 64, generator=g) for i in range(6)}
for step in range(1, 10):
    for t in w.values():
        t[: step % 48] += 0.01
    dcp.save({"model": w, "step": step}, checkpoint_id=f"{sys.argv[1]}/step-{step}")
"""


def hops(ck: str, hot: Path, srv, bucket: str, extra: list[str]) -> list[dict]:
    env = dict(os.environ, **srv.env)
    rows = []
    for step in range(1, 10):
        srv.reset_log()
        t0 = time.perf_counter()
        r = subprocess.run([ck, "promote", "--json", "--pack", *extra, str(hot / f"step-{step}"),
                            f"s3://{bucket}/step-{step}"], env=env, capture_output=True,
                           text=True)
        wall = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"hop {step} exited {r.returncode}: {r.stderr[-500:]}")
        pack = json.loads(r.stdout)["pack"]
        rows.append({"step": step, "depth": pack["depth"], "wall": wall,
                     "requests": len(srv.request_log()),
                     "plain": bool(pack.get("base_read_from"))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    a = ap.parse_args(argv)
    work = work_dir(a.keep, "pack-hop-bench-")
    load_before = load_average()
    srv = None
    try:
        ck = ckptctl_exe()
        rounds = {}
        (work / "s3root" / "bench").mkdir(parents=True)
        srv = start_rclone(work / "s3root")
        for name, extra in (("plain copies kept", []), ("--delete-source", ["--delete-source"])):
            hot = work / f"hot-{len(rounds)}"
            subprocess.run([sys.executable, "-c", GEN, str(hot)], check=True)
            bucket = f"bench/run{len(rounds)}"  # rclone lists its buckets once, at start
            rounds[name] = hops(ck, hot, srv, bucket, extra)
            print(name, [f"{r['wall']:.2f}" for r in rounds[name]], flush=True)
        facts = machine_facts()
        o = ["## pack hops into a loopback S3 pack tier, by chain depth\n",
             f"Run {facts['date']} on {facts['cpu']}, Python {facts['python']}. Load average "
             f"{load_before} before, {load_average()} after.\n",
             "Command:\n\n```\n.venv/bin/python bench/pack_hop_bench.py\n```\n",
             "Nine 77 KiB DCP checkpoints of one run, each promoted with `--pack` (`--base "
             "auto`) right after the one before; depth 0 is the first (full) pack. One run "
             "each: wall times are noisy here, the request counts are not.\n"]
        rows = [[r["step"], r["depth"]] + [f"{rounds[n][i]['wall']:.2f}" for n in rounds]
                + [rounds[n][i]["requests"] for n in rounds]
                for i, r in enumerate(rounds["plain copies kept"])]
        o.append(table(["step", "depth", *(f"s ({n})" for n in rounds),
                        *(f"requests ({n})" for n in rounds)], rows))
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            write_section("pack-hops", text, Path(a.md))
        return 0
    finally:
        if srv is not None:
            srv.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
