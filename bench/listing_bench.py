"""``ckptctl ls`` / ``latest`` / ``gc`` over thousands of checkpoints on S3: wall time and
the requests each sends, beside ``rclone lsf -R`` (and ``s5cmd ls`` when installed) over
the same bucket.

Issue 12, item 3: a root of 10,000 checkpoints is listed with about one LIST request per
1,000 keys, each checkpoint's state comes from that listing (no HEAD or GET per
checkpoint), and gc deletes with DeleteObjects batches of up to 1,000 keys.

What it does, in one run:

1. writes one small real template checkpoint (``torch.distributed.checkpoint.save`` in a
   subprocess, two ``.distcp`` files), seals it and packs it (``ckptctl seal``/``pack``);
2. :func:`make_tree` copies the template N times straight into the folder that
   ``rclone serve s3`` serves (far faster than N PUTs), as ``run/step-{n}``: mostly sealed
   DCP, some complete (no manifest), some incomplete (a ``.ckptctl-writing`` marker, no
   ``.metadata``), a few pinned, a few packs; each sealed copy gets its own manifest
   (step and creation time; the content id is the template's, which neither ``ls`` nor
   ``gc --keep-last`` reads) and files dated by step, 30 days back;
3. runs each command as a subprocess twice on one ``rclone serve s3`` (started here,
   stopped by its pid): timed against the server directly, then through the counting
   proxy of ``tests/s3server.py``, which counts the requests by kind; the real ``gc``
   runs last, on two more copies of the tree.

    .venv/bin/python bench/listing_bench.py [--n 10000] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

DAY = 86400.0
#: Pinned checkpoints and packs: a fixed few in any tree (see :func:`plan_tree`).
PINNED, PACKS = 5, 3

_TEMPLATE_SCRIPT = r"""
import sys, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
out = Path(sys.argv[1])
g = torch.Generator().manual_seed(0)
sd = {"model": {"emb.weight": torch.randn(16, 8, generator=g),
                "norm.weight": torch.ones(8, dtype=torch.bfloat16),
                "head.bias": torch.arange(5, dtype=torch.int64)},
      "optim": {"param_groups": [{"lr": 0.01}]}}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out / "dcp"), thread_count=2))
"""


def make_template(out: Path) -> Path:
    """``out/dcp`` (a sealed two-file DCP checkpoint without a ``step`` entry: steps come
    from names and manifests), ``out/pack`` (a pack of it) and ``out/pin`` (a pin file's
    bytes). Returns ``out``."""
    from ckptctl.packs.pack import pack
    from ckptctl.tiering.pins import pin
    from ckptctl.integrity.seal import seal

    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _TEMPLATE_SCRIPT, str(out)], check=True)
    seal(str(out / "dcp"))
    pack(str(out / "dcp"), str(out / "pack"))
    pinned = out / "pinned"
    shutil.copytree(out / "dcp", pinned)
    pin(str(pinned), "bench")
    (out / "pin").write_bytes((pinned / ".ckptctl-pinned").read_bytes())
    shutil.rmtree(pinned)
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def plan_tree(n: int, step0: int = 100) -> list[tuple[str, int, str]]:
    """(name, step, kind) of the N checkpoints of :func:`make_tree`: the oldest few are
    packs, a few pinned spread over the run, one in 20 complete (no manifest), one in 50
    incomplete, the rest (the newest always) sealed.

    >>> [k for _, _, k in plan_tree(6)]
    ['pack', 'pack', 'pack', 'pinned', 'pinned', 'sealed']
    >>> from collections import Counter; Counter(k for _, _, k in plan_tree(1000))
    Counter({'sealed': 922, 'complete': 50, 'incomplete': 20, 'pinned': 5, 'pack': 3})
    """
    kinds = ["sealed"] * n

    def put(i: int, kind: str) -> None:
        if 0 <= i < n - 1 and kinds[i] == "sealed":
            kinds[i] = kind

    for i in range(PACKS):
        put(i, "pack")
    for j in range(1, PINNED + 1):
        put(round(j * (n - 1) / (PINNED + 1)), "pinned")
    for i in range(n):
        if i % 20 == 10:
            put(i, "complete")
        if i % 50 == 25:
            put(i, "incomplete")
    return [(f"run/step-{step0 * (k + 1)}", step0 * (k + 1), kinds[k]) for k in range(n)]


def make_tree(root: Path, n: int, template: Path, *, now: float | None = None,
              young_incomplete: int = 2) -> list[tuple[str, int, str]]:
    """Write N checkpoints under ``root`` (see :func:`plan_tree`) from :func:`make_template`'s
    files. Every file is dated by its step, from 30 days ago to 1 day ago, except the
    last ``young_incomplete`` incomplete ones, dated now (a write in progress). Returns
    the plan."""
    from ckptctl.formats.manifest import MANIFEST, WRITING_MARKER, serialize

    now = time.time() if now is None else now
    dcp_files = _files(template / "dcp")
    pack_files = _files(template / "pack")
    pin_bytes = (template / "pin").read_bytes()
    man = json.loads(dcp_files[MANIFEST])
    pman = json.loads(pack_files[MANIFEST])
    plan = plan_tree(n)
    incompletes = [name for name, _, kind in plan if kind == "incomplete"]
    young = set(incompletes[-young_incomplete:]) if young_incomplete else set()
    t0, t1 = now - 30 * DAY, now - DAY
    for k, (name, step, kind) in enumerate(plan):
        t = t0 + (t1 - t0) * k / max(1, n - 1)
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        if kind == "pack":
            files = dict(pack_files)
            files[MANIFEST] = serialize(dict(pman, step=step, created=created))
        else:
            files = dict(dcp_files)
            if kind in ("sealed", "pinned"):
                files[MANIFEST] = serialize(dict(man, step=step, created=created))
            else:
                del files[MANIFEST]
            if kind == "pinned":
                files[".ckptctl-pinned"] = pin_bytes
            if kind == "incomplete":
                del files[".metadata"]
                files[WRITING_MARKER] = b'{"command": "reshard", "pid": 1}\n'
                if name in young:
                    t = now
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for rel, data in files.items():
            p = folder / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            os.utime(p, (t, t))
    return plan


def count(log) -> dict[str, int]:
    """Requests by kind: LIST, GET, HEAD, PUT, DELETE (one object), BATCH (DeleteObjects),
    other POSTs; plus the keys of the biggest DeleteObjects batch is not visible here."""
    c = Counter()
    for r in log:
        if r.method == "POST" and "delete" in r.path.split("?", 1)[-1]:
            c["BATCH"] += 1
        else:
            c[r.op] += 1
    return dict(c)


#: Measured before issue 12 (every checkpoint read with ``verify --level quick``, one
#: delete round per checkpoint), same tree and server, in-process through the counting
#: proxy: requests by kind (wall seconds in brackets, on the shared 2-core machine).
BEFORE = {
    1000: {"ls": "4 LIST, 1,916 GET (8.6 s)",
           "latest": "4 LIST, 1,916 GET (8.7 s)",
           "latest --verified": "4 LIST, 1,920 GET (9.4 s)",
           "gc --keep-last 10 --dry-run": "5 LIST, 1,916 GET, 54 HEAD (9.3 s)",
           "gc --keep-last 10": "5 LIST, 1,916 GET, 54 HEAD, 983 PUT, 2,860 DeleteObjects, "
                                "983 DELETE (36.5 s)"},
    10000: {"ls": "40 LIST, 19,106 GET (281 s)"},
}


def binary(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _kinds(c: dict) -> str:
    order = ["LIST", "GET", "HEAD", "PUT", "BATCH", "DELETE"]
    names = {"BATCH": "DeleteObjects"}
    parts = [f"{c[k]:,} {names.get(k, k)}" for k in order if c.get(k)]
    parts += [f"{v:,} {k}" for k, v in sorted(c.items()) if k not in order]
    return ", ".join(parts) or "none"


def main(argv=None) -> None:
    from common import (add_output_args, ckptctl_exe, load_average, machine_facts, measure,
                        table, tool_version, work_dir, write_section)
    from s3server import start_rclone

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="checkpoints in the tree")
    ap.add_argument("--keep-last", type=int, default=10)
    add_output_args(ap)
    a = ap.parse_args(argv)
    work = work_dir(a.keep, "listing-bench-")
    ck, rclone, s5cmd = ckptctl_exe(), binary("rclone"), binary("s5cmd")
    print(f"work dir {work}", flush=True)
    template = make_template(work / "template")
    served = work / "served"
    now = time.time()
    t0 = time.perf_counter()
    plan = make_tree(served / "bench", a.n, template, now=now)
    for b in ("bench-gc", "bench-gc2"):  # the real gc: one timed, one counted
        make_tree(served / b, a.n, template, now=now)
    print(f"three trees of {a.n} checkpoints in {time.perf_counter() - t0:.1f} s", flush=True)
    keys = sum(1 for p in (served / "bench").rglob("*") if p.is_file())
    srv = start_rclone(served)  # after the trees: rclone caches folder listings
    rows = []
    try:
        def envs(endpoint: str) -> tuple[dict, dict]:
            env = dict(os.environ, **srv.env)
            env["AWS_ENDPOINT_URL"] = endpoint
            return env, dict(env, RCLONE_CONFIG_BENCHS3_TYPE="s3",
                             RCLONE_CONFIG_BENCHS3_PROVIDER="Other",
                             RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=srv.key,
                             RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=srv.secret,
                             RCLONE_CONFIG_BENCHS3_ENDPOINT=endpoint)

        url = "s3://bench/run"
        keep = ["--keep-last", str(a.keep_last)]

        def cmds(endpoint: str, gc_bucket: str) -> list[tuple[str, list[str], dict]]:
            env, renv = envs(endpoint)
            out = [("ckptctl ls", [ck, "ls", url, "--json"], env),
                   ("ckptctl latest", [ck, "latest", url], env),
                   ("ckptctl latest --verified", [ck, "latest", "--verified", url], env),
                   (f"ckptctl gc --keep-last {a.keep_last} --dry-run",
                    [ck, "gc", url, *keep, "--dry-run", "--json"], env)]
            if rclone:
                out.append(("rclone lsf -R", [rclone, "lsf", "-R", "--files-only", "--config",
                                              "/dev/null", "BENCHS3:bench/run"], renv))
            if s5cmd:
                out.append(("s5cmd ls", [s5cmd, "--endpoint-url", endpoint, "ls",
                                         "s3://bench/run/*"], env))
            out.append((f"ckptctl gc --keep-last {a.keep_last} (real)",
                        [ck, "gc", f"s3://{gc_bucket}/run", *keep, "--json"], env))
            return out

        timed = cmds(srv.direct_endpoint_url, "bench-gc")
        counted = cmds(srv.endpoint_url, "bench-gc2")
        for (name, cmd, e), (_, ccmd, ce) in zip(timed, counted):
            run = measure(cmd, capture=True, env=e)
            srv.reset_log()
            measure(ccmd, capture=True, env=ce)
            c = count(srv.request_log())
            out = run.stdout
            if name == "ckptctl ls":
                states = Counter(r["state"] for r in json.loads(out)["checkpoints"])
                what = ", ".join(f"{v:,} {k}" for k, v in sorted(states.items()))
            elif name.startswith("ckptctl latest"):
                what = out.strip().rsplit("/", 1)[-1]
            elif name.startswith("ckptctl gc"):
                doc = json.loads(out)
                what = f"keep {len(doc['keep'])}, remove {len(doc['remove']):,}"
            else:
                what = f"{len(out.splitlines()):,} keys"
            rows.append([name, f"{run.wall_s:.2f}", f"{run.peak_rss_mb:.0f}", _kinds(c), what])
            print(f"{name}: {run.wall_s:.2f} s, {_kinds(c)}; {what}", flush=True)
        left = [sum(1 for _ in (served / b / "run").iterdir()) for b in ("bench-gc", "bench-gc2")]
        rows[-1][-1] += f" ({left[0]} and {left[1]} left)"
    finally:
        srv.stop()
    kinds = Counter(k for _, _, k in plan)
    facts = machine_facts()
    o = ["## listing at scale: ls / latest / gc over thousands of checkpoints on S3\n",
         f"`.venv/bin/python bench/listing_bench.py --n {a.n}` on {facts['date']}: "
         f"{facts['cpu']}, load average {load_average()} at the end; "
         f"{tool_version([rclone, 'version']) if rclone else 'rclone ?'} serving a folder on "
         f"loopback"
         + (f", s5cmd {tool_version([s5cmd, 'version'])}" if s5cmd else "") + ".\n",
         f"The tree: {a.n:,} checkpoints `run/step-N` ({keys:,} objects): "
         + ", ".join(f"{v:,} {k}" for k, v in sorted(kinds.items()))
         + " (copies of one small sealed DCP checkpoint with two `.distcp` files, each with "
         "its own manifest; incomplete = a `.ckptctl-writing` marker and no `.metadata`), "
         "written straight into the served folder. Each command runs twice as a subprocess: "
         "timed against the server directly, then through the counting proxy of "
         "`tests/s3server.py`, which counts its requests by kind (LIST = ListObjectsV2 pages "
         "and ListMultipartUploads; DeleteObjects = batches of up to 1,000 keys). The real "
         "gc runs on two more copies of the tree (timed, counted).\n",
         table(["command", "wall s", "peak RSS MB", "requests", "result"], rows, "lrrll"),
         "",
         "Before this change (each checkpoint read as `verify --level quick` does, gc "
         "removing one checkpoint at a time; measured in-process through the counting "
         "proxy on the same trees, load average 5-9):\n",
         table(["checkpoints", "command", "requests (wall)"],
               [[f"{n:,}", cmd, v] for n, d in BEFORE.items() for cmd, v in d.items()], "rll"),
         "",
         "How: `ls` classifies each checkpoint from the one recursive listing (manifest "
         "present: sealed; DCP `.metadata` or safetensors files: complete; a "
         "`.ckptctl-writing` marker: incomplete; the step from the name), reading only "
         "packs, names without a step and folders missing their commit marker. `latest` "
         "reads the newest two candidates (and walks back if one is damaged); `gc` reads "
         "the checkpoints its decision rests on (kept for being committed) and removes the "
         "rest in phases across checkpoints: a `.ckptctl-writing` PUT only where the "
         "checkpoint has no `.metadata`/index of its own to delete first and more than one data "
         "file (S3 has no batch PUT; here: the incomplete ones), then DeleteObjects batches of every manifest, every `.metadata`, all data, "
         "all markers. Up to 100 checkpoints, a remote root is still read in full (the "
         "step entry of a DCP checkpoint wins over its name there, as `inspect` reports). "
         "The listing itself is ListObjectsV2 pages read one after the other "
         "(`Store.list_files`); s3fs's `find` took ~20 s more for 10,000 folders under one "
         "prefix (it checks each new folder against a list of its siblings). A writing "
         "marker PUT for every removed checkpoint (9,983 PUTs) made the real gc take 73 s."]
    body = "\n".join(o)
    print(body)
    if not a.no_write:
        write_section("listing", body, Path(a.md))


if __name__ == "__main__":
    main()
