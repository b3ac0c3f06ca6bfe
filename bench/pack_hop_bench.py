"""Seconds and requests of each pack hop into a loopback S3 pack tier, by chain depth.

Issue 20: a hop of a small checkpoint (77 KiB, DCP, 9 steps of one run) into a pack tier
(``ckptctl promote --pack``, ``--base auto``) should cost no more with a chain of 8 than
with a chain of 1. Two rounds on one ``rclone serve s3`` (started here, stopped by pid):
with the plain copies left in the hot folder (the base's content is read from there) and
with ``--delete-source`` (the base is read through its chain), ``--rounds`` times each
(a fresh chain in a new folder every round; the object cache in a folder of its own, so
the first hop of every level finds it cold). Wall time is the CLI's, start-up included;
requests are counted by the proxy of ``tests/s3server.py``.

    .venv/bin/python bench/pack_hop_bench.py [--rounds 3] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import (add_output_args, ckptctl_exe, load_average, machine_facts,  # noqa: E402
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


def hops(ck: str, hot: Path, srv, bucket: str, extra: list[str], cache: Path) -> list[dict]:
    env = dict(os.environ, **srv.env, XDG_CACHE_HOME=str(cache))
    rows = []
    for step in range(1, 10):
        srv.reset_log()
        t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([ck, "promote", "--json", "--pack", *extra, str(hot / f"step-{step}"),
                            f"s3://{bucket}/step-{step}"], env=env, capture_output=True,
                           text=True)
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
        if r.returncode:
            raise RuntimeError(f"hop {step} exited {r.returncode}: {r.stderr[-500:]}")
        pack = json.loads(r.stdout)["pack"]
        rows.append({"step": step, "depth": pack["depth"], "wall": wall, "cpu": cpu,
                     "requests": len(srv.request_log()),
                     "plain": bool(pack.get("base_read_from"))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    add_output_args(ap)
    a = ap.parse_args(argv)
    work = work_dir(a.keep, "pack-hop-bench-")
    load_before = load_average()
    srv = None
    try:
        ck = ckptctl_exe()
        rounds: dict[str, list[list[dict]]] = {}
        (work / "s3root" / "bench").mkdir(parents=True)
        srv = start_rclone(work / "s3root")
        for r in range(a.rounds):
            for name, extra in (("plain copies kept", []),
                                ("--delete-source", ["--delete-source"])):
                n = sum(len(v) for v in rounds.values())
                hot = work / f"hot-{n}"
                subprocess.run([sys.executable, "-c", GEN, str(hot)], check=True)
                bucket = f"bench/run{n}"  # rclone lists its buckets once, at start
                got = hops(ck, hot, srv, bucket, extra, work / f"cache-{n}")
                rounds.setdefault(name, []).append(got)
                print(name, r, [f"{x['wall']:.2f}" for x in got], flush=True)
        facts = machine_facts()
        o = ["## pack hops into a loopback S3 pack tier, by chain depth\n",
             f"Run {facts['date']} on {facts['cpu']}, Python {facts['python']}. Load average "
             f"{load_before} before, {load_average()} after.\n",
             "Command:\n\n```\n.venv/bin/python bench/pack_hop_bench.py\n```\n",
             "Nine 77 KiB DCP checkpoints of one run, each promoted with `--pack` (`--base "
             "auto`) right after the one before; depth 0 is the first (full) pack. "
             f"{a.rounds} rounds of each way, a fresh chain (and a cold object cache) each "
             "round; wall times are medians over the rounds (noisy here: compare depths "
             "within a column), request counts are the same in every round.\n"]

        def med(name, i, what="wall"):
            return statistics.median(rnd[i][what] for rnd in rounds[name])

        first = next(iter(rounds))
        rows = [[x["step"], x["depth"]] + [f"{med(n, i):.2f}" for n in rounds]
                + [f"{med(n, i, 'cpu'):.2f}" for n in rounds]
                + [rounds[n][0][i]["requests"] for n in rounds]
                for i, x in enumerate(rounds[first][0])]
        o.append(table(["step", "depth", *(f"s ({n})" for n in rounds),
                        *(f"CPU s ({n})" for n in rounds),
                        *(f"requests ({n})" for n in rounds)], rows))
        o.append("`CPU s`: user + system time of the hop's process (less disturbed by other "
                 "jobs than wall time).\n")
        for n in rounds:
            d1, d8 = med(n, 1), med(n, 8)
            c1, c8 = med(n, 1, "cpu"), med(n, 8, "cpu")
            o.append(f"- {n}: depth 8 / depth 1 = {d8:.2f} / {d1:.2f} s wall (ratio "
                     f"{d8 / d1:.2f}), {c8:.2f} / {c1:.2f} CPU s (ratio {c8 / c1:.2f}); "
                     f"requests {rounds[n][0][8]['requests']} / "
                     f"{rounds[n][0][1]['requests']}.")
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
