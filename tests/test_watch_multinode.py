"""``watch --node-rank``: two nodes' hot tiers each hold part of ONE real DCP checkpoint;
two watchers promote their parts into one shared tier, which is sealed exactly once, only
after both parts arrived, and verifies; no hot tier loses its part before that commit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptctl.tiering.config import load_config
from ckptctl.formats.manifest import MANIFEST
from ckptctl.catalog.ls import ls
from ckptctl.service.multinode import node_rank_from_env
from ckptctl.integrity.verify import verify
from ckptctl.service.status import state_dir
from ckptctl.service.watch import Watcher


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


#: What these tests give every S3 request, over the loopback server's own options: a
#: budget (3 tries of up to 300 s) that no loaded machine reaches. They test the nodes'
#: protocol, not timeouts (tests/test_s3_faults.py does); with ckptctl's default budget
#: (60 s) a busy CI box (load 9-16 on 2 cores) failed them.
PATIENT = {"connect_timeout": 60, "read_timeout": 300}


def _patient(opts: dict) -> dict:
    """``opts`` with :data:`PATIENT` timeouts."""
    from ckptctl.tiering.config import merge_options

    return merge_options(opts, {"config_kwargs": PATIENT})


def _toml_options(opts: dict) -> str:
    """A tier's ``storage_options`` line for ``opts`` (nested tables inline), patient."""
    def value(v):
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)

    return f"storage_options = {value(_patient(opts))}\n"


def _split(tmp_path: Path, step: int = 100, rows: int = 64) -> dict[str, int]:
    """One real DCP checkpoint (3 data files; six ROWSx32 fp32 tensors), split: node 0
    gets .metadata + __0_0, node 1 the rest. Returns the whole checkpoint's file sizes."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(step)
    sd = {"model": {f"w{i}": torch.randn(rows, 32, generator=g) for i in range(6)},
          "step": step}
    whole = tmp_path / "whole" / f"step-{step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(whole), thread_count=3))
    files = {p.name: p.stat().st_size for p in whole.iterdir()}
    assert len([f for f in files if f.endswith(".distcp")]) >= 2, files
    for node in (0, 1):
        (tmp_path / f"hot{node}" / f"step-{step}").mkdir(parents=True)
    for f in files:
        node = 0 if f in (".metadata", "__0_0.distcp") else 1
        shutil.copy(whole / f, tmp_path / f"hot{node}" / f"step-{step}" / f)
    return files


def _watchers(tmp_path: Path, s3=None) -> tuple[list[Watcher], str, dict | None]:
    if s3 is None:
        warm, opts, extra = str(tmp_path / "warm"), None, ""
    else:
        warm, opts = s3.url("shared"), _patient(s3.storage_options)
        extra = _toml_options(opts)
    ws = []
    for node in (0, 1):
        cfg = tmp_path / f"node{node}.toml"
        cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / f"hot{node}"}"\n'
                       'keep = { last = 1 }\n'
                       f'[[tier]]\nname = "warm"\nurl = "{warm}"\n{extra}')
        ws.append(Watcher(load_config(str(cfg)), settle=0, node_rank=node))
    return ws, warm, (opts if s3 is not None else None)


def _state(warm: str, opts) -> str | None:
    rows = {r.name: r.state for r in ls(warm, opts).checkpoints}
    return rows.get("step-100")


def _check_done(ws, warm, opts, tmp_path, files):
    url = warm.rstrip("/") + "/step-100"
    assert _state(warm, opts) in ("sealed", "complete")
    r = verify(url, opts, level="full")
    assert not [x for x in r.problems if x.severity == "error"], r.problems
    from ckptctl.storage import open_store

    there = open_store(url, opts).list_files()
    assert {k: v for k, v in there.items() if k != MANIFEST} == files
    # both agree it is done: another pass of each is drained, and sealing happened once
    for w in ws:
        assert w.run_once().drained
    sealed = [e for w in ws for e in map(json.loads, open(w.events_path)) if e["event"] == "sealed"]
    assert len({e["manifest_id"] for e in sealed}) == 1  # one commit (a racing sealer agrees)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_nodes_interleaved_local(tmp_path, order):
    files = _split(tmp_path)
    ws, warm, opts = _watchers(tmp_path)
    first, second = ws[order[0]], ws[order[1]]
    p = first.run_once()
    assert not p.drained and not p.sealed
    assert _state(warm, opts) == "incomplete"  # only one part arrived
    assert (tmp_path / f"hot{order[0]}" / "step-100").is_dir()  # part kept
    p = second.run_once()
    assert p.sealed == ["step-100"]
    _check_done(ws, warm, opts, tmp_path, files)
    # each node's part copy is timed: --status's plan figures are per node (S = its part)
    from ckptctl.service.drains import measured_plan
    from ckptctl.service.status import read_status

    for w in ws:
        st = read_status(w.config.path, w.node_rank)
        (d,) = st["done"]
        assert (d["action"], d["src"], d["dst"]) == ("part", "hot", "warm")
        mp = measured_plan(w.config, st)
        assert (mp.checkpoint_name, mp.checkpoint_bytes) == ("step-100", d["bytes"])
        assert mp.hops[0].bytes_per_second == d["bytes_per_second"]  # the part's own rate
    for node in (0, 1):  # keep last 1: the only checkpoint stays
        assert (tmp_path / f"hot{node}" / "step-100").is_dir()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_nodes_concurrent(tmp_path, where, request):
    """Both watchers' passes at once (threads), several times: whoever completes it seals
    it; when both do, the second sealer finds the same id."""
    files = _split(tmp_path)
    s3 = request.getfixturevalue("s3_bucket") if where == "s3" else None
    ws, warm, opts = _watchers(tmp_path, s3)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(w):
        try:
            start.wait(300)
            for _ in range(2):  # the node whose copy ends last sees it complete
                w.run_once()
        except BaseException as e:  # re-raised in the main thread below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(w,)) for w in ws]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    failed = [e for w in ws for e in map(json.loads, open(w.events_path)) if e["event"] == "failed"]
    assert not failed, failed
    _check_done(ws, warm, opts, tmp_path, files)


def test_two_nodes_shared_tier_on_s3(tmp_path, s3_bucket):
    files = _split(tmp_path)
    ws, warm, opts = _watchers(tmp_path, s3_bucket)
    assert not ws[1].run_once().sealed
    assert _state(warm, opts) == "incomplete"
    assert ws[0].run_once().sealed == ["step-100"]
    _check_done(ws, warm, opts, tmp_path, files)


def test_node_rank_from_env():
    assert node_rank_from_env({"GROUP_RANK": "1", "SLURM_NODEID": "5"}) == 1
    assert node_rank_from_env({"NODE_RANK": "0"}) == 0
    assert node_rank_from_env({}) is None


def test_hot_parts_kept_until_committed_with_this_nodes_hashes(tmp_path):
    """keep last 1 in each hot tier: step-100 would go by the policy once step-200 is
    there, but neither node drops its part of a checkpoint before the shared tier holds it
    committed; afterwards the older part goes."""
    _split(tmp_path, 100)
    _split(tmp_path, 200)
    ws, warm, opts = _watchers(tmp_path)
    hot = [tmp_path / "hot0", tmp_path / "hot1"]
    ws[1].run_once()
    assert sorted(p.name for p in hot[1].iterdir()) == ["step-100", "step-200"]
    assert _state(warm, opts) == "incomplete"
    p = ws[0].run_once()
    assert sorted(p.sealed) == ["step-100", "step-200"]
    assert [x.name for x in hot[0].iterdir()] == ["step-200"]  # committed with its hashes
    ws[1].run_once()
    assert [x.name for x in hot[1].iterdir()] == ["step-200"]
    for name in ("step-100", "step-200"):
        r = verify(f"{warm}/{name}", None, level="full")
        assert not [x for x in r.problems if x.severity == "error"], r.problems


def test_env_fallback_and_cli_flag(tmp_path, monkeypatch):
    """A one-node Slurm job stays single-node; ``--node-rank`` reaches the Watcher (a
    one-tier config has no shared tier: exit 2)."""
    from conftest import run_cli

    assert node_rank_from_env({"SLURM_NODEID": "0", "SLURM_NNODES": "1"}) is None
    assert node_rank_from_env({"SLURM_NODEID": "1", "SLURM_NNODES": "2"}) == 1
    cfg = tmp_path / "one.toml"
    cfg.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n')
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice",
                             "--node-rank", "1")
    assert code == 2 and "--node-rank needs" in err, (code, out, err)


# ----------------------------------------------------------------- faults, two processes

ROOT = Path(__file__).resolve().parent.parent


def _node_configs(tmp_path: Path, srv, bucket: str) -> list[Path]:
    """node N: hot = TMP/hotN (keep last 1) -> the shared tier on S3 at 1 MiB/s (a part
    takes a couple of seconds: time to kill its watcher mid-copy); written again
    (atomically) when the server comes back on another port."""
    opts = _toml_options(srv.storage_options)
    paths = []
    for node in (0, 1):
        path, tmp = tmp_path / f"node{node}.toml", tmp_path / f"node{node}.toml.tmp"
        tmp.write_text(f'[[tier]]\nname = "hot"\nurl = "{tmp_path / f"hot{node}"}"\n'
                       'keep = { last = 1 }\n'
                       f'[[tier]]\nname = "warm"\nurl = "s3://{bucket}/shared"\n'
                       f'bwlimit = "1MiB/s"\n{opts}')
        os.replace(tmp, path)
        paths.append(path)
    return paths


class _NodeWatch:
    """``ckptctl watch --node-rank N`` in loop mode, as a subprocess."""

    def __init__(self, node: int, cfg: Path, env: dict, logdir: Path):
        self.node, self.cfg, self.env, self.logdir = node, cfg, env, logdir
        self.proc = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.err = self.logdir / f"node{self.node}-{self.starts}.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptctl", "--config", str(self.cfg), "watch",
                 "--node-rank", str(self.node), "--interval", "0.2", "--settle", "0",
                 "--no-nice"], stdout=subprocess.DEVNULL, stderr=err, env=self.env, cwd=ROOT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)

    def alive(self) -> None:
        assert self.proc.poll() is None, self.err.read_text()

    def events(self) -> list[dict]:
        path = Path(state_dir(str(self.cfg), self.node)) / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines(keepends=True)
                if x.endswith("\n")]

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.mark.slow
def test_two_nodes_with_watcher_killed_mid_copy_and_s3_restarted(tmp_path):
    """Two watcher processes, a shared tier on a loopback S3 server. Node 1's watcher is
    SIGKILLed while it uploads its part, then the server is killed mid-upload and comes back
    on another port (the configs follow: the edited tier is retried at once). Throughout,
    no hot tier loses a part before the shared tier holds that checkpoint committed; at the
    end both checkpoints are committed there exactly once, only after both parts, and
    verify at level full; the older one's parts are trimmed from both hot tiers."""
    from s3server import make_bucket, start_rclone

    from ckptctl.service.status import read_status

    files = {s: _split(tmp_path, s, rows=8192) for s in (100, 200)}  # ~1 MiB per tensor
    bucket, root = "nodes", tmp_path / "s3root"
    srv = start_rclone(root)
    make_bucket(srv, bucket)
    cfgs = _node_configs(tmp_path, srv, bucket)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    nodes = [_NodeWatch(n, cfgs[n], env, tmp_path) for n in (0, 1)]
    shared = f"s3://{bucket}/shared"
    hot = [tmp_path / "hot0", tmp_path / "hot1"]

    def opts():
        return _patient(srv.storage_options)

    def committed() -> set[str]:
        try:
            return {r.name for r in ls(shared, opts()).checkpoints
                    if r.state in ("sealed", "complete")}
        except Exception:  # the server is down right now: nothing to check against
            return None

    def check_rail() -> None:
        """A part missing from a hot tier must be committed in the shared tier."""
        gone = {f"step-{s}" for s in (100, 200) for h in hot if not (h / f"step-{s}").exists()}
        if gone:
            done = committed()
            assert done is None or gone <= done, (gone, done)

    def upload_seen(part: str) -> bool:
        return any(r.method in ("PUT", "POST") and part in r.key for r in srv.request_log())

    def wait(cond, what: str, timeout: float = 900) -> None:  # a bound, not a speed
        end = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            for w in nodes:
                if w.proc is not None:
                    w.alive()
            check_rail()
            time.sleep(0.1)

    try:
        # node 1 alone: killed while it uploads its part of step-100
        srv.reset_log()
        nodes[1].start()
        wait(lambda: upload_seen("step-100/__0_1.distcp"), "node 1's first upload")
        time.sleep(0.5)
        nodes[1].kill()
        assert committed() == set()  # one part is not a checkpoint
        assert (hot[1] / "step-100").is_dir()
        # restarted; the server dies under its next upload
        srv.reset_log()
        nodes[1].start()
        wait(lambda: upload_seen("shared/step-"), "node 1's upload after its restart")
        srv.kill()
        wait(lambda: any(e["event"] == "failed" for e in nodes[1].events()),
             "node 1 to meet the server down")
        assert all((h / f"step-{s}").is_dir() for h in hot for s in (100, 200))
        # the server comes back (same data, another port); the configs follow
        nodes[1].kill()
        srv.stop()
        srv = start_rclone(root)
        cfgs = _node_configs(tmp_path, srv, bucket)
        nodes[1].start()
        nodes[0].start()

        def drained() -> bool:
            docs = [read_status(str(c), n) for n, c in enumerate(cfgs)]
            return committed() == {"step-100", "step-200"} and all(
                d and (d.get("last_pass") or {}).get("drained") and not d.get("failed")
                for d in docs)

        wait(drained, "both checkpoints committed and both nodes drained")
        wait(lambda: not any((h / "step-100").exists() for h in hot), "hot trimmed")
        for w in nodes:
            w.proc.send_signal(signal.SIGTERM)
            assert w.proc.wait(300) == 0, w.err.read_text()
        events = [e for w in nodes for e in w.events()]
        assert any(e["event"] == "config-changed" for e in events), events
        for s in (100, 200):
            name = f"step-{s}"
            sealed = [e for e in events if e["event"] == "sealed" and e["name"] == name]
            assert sealed and len({e["manifest_id"] for e in sealed}) == 1, sealed
            url = f"{shared}/{name}"
            r = verify(url, opts(), level="full")
            assert r.ok, r
            from ckptctl.storage import open_store

            there = open_store(url, opts()).list_files()
            assert {k: v for k, v in there.items() if k != MANIFEST} == files[s]
        for h in hot:
            assert sorted(x.name for x in h.iterdir()) == ["step-200"]
    finally:
        for w in nodes:
            w.cleanup()
        srv.stop()


def test_drain_on_pre_emption_takes_each_nodes_part_of_the_newest(tmp_path):
    # Slurm signals every node of the job: each node's watch drains its part of the
    # newest checkpoint at once (no settle), and the node that completes it seals it
    _split(tmp_path, 100)
    files = _split(tmp_path, 200)
    ws, warm, opts = _watchers(tmp_path)
    for w in ws:
        w.settle = 3600.0
    results = [w.drain_newest() for w in ws]
    assert [name for _, name in results] == ["step-200", "step-200"]
    assert all(not p.failed for p, _ in results)
    rows = {r.name: r.state for r in ls(warm, opts).checkpoints}
    assert rows == {"step-200": "sealed"}  # the older one waits for its settle time
    r = verify(warm + "/step-200", opts, level="full")
    assert not [x for x in r.problems if x.severity == "error"], r.problems
    from ckptctl.storage import open_store

    there = open_store(warm + "/step-200", opts).list_files()
    assert {k: v for k, v in there.items() if k != MANIFEST} == files
