"""``ckptctl watch`` end to end: a real training process (torch, CPU) saves DCP checkpoints
into a hot directory while ``watch`` runs beside it in loop mode and drains them to warm
(local) and cold (a loopback rclone S3 server, as packs). At the end every checkpoint the
tiers' keep tables (with the "not yet in TIER" rail) keep is present and verifies in each
tier, and nothing else is there; then the same with faults: watch SIGKILLed and restarted
several times, the S3 server crashed and restarted on a new port (the config rewritten)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3server import fresh_fs, make_bucket, start_rclone

from ckptctl.catalog.ls import iso_utc, ls
from ckptctl.integrity.verify import verify
from ckptctl.service.status import read_status


ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "fixtures" / "train_loop.py"
STEPS, EVERY = 200, 40
ALL = [f"step-{s}" for s in range(EVERY, STEPS + 1, EVERY)]
# hot keeps the last 2, warm the last 3, cold everything; after the drain nothing is
# "not yet in" the next tier, so the rail keeps nothing more
EXPECTED = {"hot": ALL[-2:], "warm": ALL[-3:], "cold": ALL}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_gc_keeps_what_appeared_after_the_callers_listing(tmp_path):
    """The race this file's first run found: watch computed its "not yet in warm" rail
    from a listing of hot taken before a long pass, gc listed hot again and removed two
    checkpoints written meanwhile that had never reached warm. ``listed`` keeps them."""
    from conftest import dcp_save

    from ckptctl.tiering.gc import gc
    from ckptctl.tiering.policy import Policy

    hot = tmp_path / "hot"
    for s in (100, 200, 300, 400):
        dcp_save(hot / f"step-{s}", {"w": torch_full(s), "step": s})
    r = gc(str(hot), Policy(last=1), protect={"step-100": "not yet in warm"},
           listed={"step-100", "step-400"})
    assert r.decision.keep == {"step-400": ["last 1", "newest committed"],
                               "step-300": ["appeared after the listing"],
                               "step-200": ["appeared after the listing"],
                               "step-100": ["not yet in warm"]}
    assert r.decision.remove == [] and not r.removed
    assert sorted(os.listdir(hot)) == ["step-100", "step-200", "step-300", "step-400"]
    r = gc(str(hot), Policy(last=1), listed={"step-100", "step-200", "step-300", "step-400"})
    assert sorted(os.listdir(hot)) == ["step-400"]


def torch_full(v):
    import torch

    return torch.full((4,), float(v))


def _write_config(tmp_path: Path, srv, bucket: str, warm: Path | None = None) -> Path:
    """hot (keep last 2) -> warm (keep last 3; ``warm`` or TMP/warm) -> cold (S3, packs,
    keep everything); written again (atomically) when the S3 server comes back on another
    port."""
    opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in srv.storage_options.items()
                     if not isinstance(v, dict))
    text = (f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\nkeep = {{ last = 2 }}\n'
            f'[[tier]]\nname = "warm"\nurl = "{warm or tmp_path / "warm"}"\n'
            'keep = { last = 3 }\n'
            f'[[tier]]\nname = "cold"\nurl = "s3://{bucket}/run1"\npack = true\n'
            f'storage_options = {{ {opts} }}\n')
    path = tmp_path / "ckptctl.toml"
    tmp = tmp_path / "ckptctl.toml.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


class _Watch:
    """``ckptctl watch`` in loop mode as a subprocess (stderr kept per start)."""

    def __init__(self, cfg: Path, env: dict, logdir: Path):
        self.cfg, self.env, self.logdir = cfg, env, logdir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.err = self.logdir / f"watch-{self.starts}.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptctl", "--config", str(self.cfg), "watch",
                 "--interval", "0.2", "--settle", "0.5", "--no-nice"],
                stdout=subprocess.DEVNULL, stderr=err, env=self.env, cwd=ROOT)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no chance to clean up
        self.proc.wait(10)

    def term(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _train(hot: Path, sleep: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(TRAIN), str(hot), "--steps", str(STEPS), "--every", str(EVERY),
         "--sleep", str(sleep)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _wait_drained(cfg: Path, env: dict, after: float, timeout: float) -> dict:
    """Poll ``watch --status --json`` until a pass that started at or after ``after``
    (whole seconds) ended drained; the status document."""
    since = iso_utc(after + 1)
    end = time.monotonic() + timeout
    doc = None
    while time.monotonic() < end:
        r = subprocess.run([sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch",
                            "--status", "--json"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)["status"]
        last = (doc or {}).get("last_pass") or {}
        if last.get("drained") and last["started"] >= since and not doc.get("failed"):
            return doc
        time.sleep(0.5)
    pytest.fail(f"watch did not drain within {timeout:.0f} s; status: "
                f"{json.dumps(doc, indent=1)}")


def _check_tiers(tmp_path: Path, srv, bucket: str, warm: Path | None = None) -> None:
    """Each tier holds exactly the expected checkpoints, all sealed, each verifying at
    level full, and nothing else (no staging folder, journal or stray object)."""
    opts = srv.storage_options
    warm = warm or tmp_path / "warm"
    urls = {"hot": str(tmp_path / "hot"), "warm": str(warm), "cold": f"s3://{bucket}/run1"}
    for tier, url in urls.items():
        o = opts if tier == "cold" else None
        states = {r.name: r.state for r in ls(url, o).checkpoints}
        assert states == {n: "sealed" for n in EXPECTED[tier]}, (tier, states)
        for name in EXPECTED[tier]:
            r = verify(f"{url}/{name}", o, level="full")
            assert r.ok, (tier, name, r)
    assert sorted(os.listdir(tmp_path / "hot")) == sorted(EXPECTED["hot"])
    assert sorted(os.listdir(warm)) == sorted(EXPECTED["warm"])
    fs = fresh_fs(srv)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/run1")) == sorted(ALL)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(bucket)) == ["run1"]


def _finish(tmp_path, cfg, env, watch: _Watch, train_end: float, srv, bucket, timeout,
            warm: Path | None = None):
    doc = _wait_drained(cfg, env, train_end, timeout)
    assert doc["in_flight"] is None and doc["queued"] == []
    assert watch.term() == 0, watch.err.read_text()  # SIGTERM: exit 0
    # a last pass by hand has nothing to do
    r = subprocess.run([sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch",
                        "--once", "--settle", "0", "--no-nice", "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    assert p["drained"] and not p["promoted"] and not p["sealed"], p
    assert not any(p["removed"].values()), p
    _check_tiers(tmp_path, srv, bucket, warm)
    _removed_only_after_promoted(_events(tmp_path))


def _removed_only_after_promoted(events: list[dict]) -> None:
    """The rail, read from the event log: a checkpoint is removed from hot or warm only
    after an earlier event says it was promoted to the next tier (never because of an
    error)."""
    nxt = {"hot": "warm", "warm": "cold"}
    promoted: set[tuple[str, str]] = set()
    for e in events:
        if e["event"] == "promoted":
            promoted.add((e["name"], e["dst"]))
        elif e["event"] == "removed":
            assert (e["name"], nxt[e["tier"]]) in promoted, e


def _events(tmp_path: Path) -> list[dict]:
    """watch's event log so far (the one config of the test); [] before the first."""
    root = tmp_path / "cache" / "ckptctl" / "watch"
    if not root.exists() or not os.listdir(root):
        return []
    path = root / os.listdir(root)[0] / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    # a line being appended right now has no newline yet
    return [json.loads(x) for x in lines if x.endswith("\n")]


def _start_s3(root: Path, bucket: str):
    srv = start_rclone(root)
    if not (root / bucket).exists():
        make_bucket(srv, bucket)
    return srv


class _Run:
    """Hot, an S3 server with its bucket, the config, and a watcher (not started); as a
    context, it stops training, the watcher and the server at the end, however it ends."""

    def __init__(self, tmp_path: Path, warm: Path | None = None, bucket: str = "e2e"):
        self.tmp, self.bucket, self.warm = tmp_path, bucket, warm
        self.srv = _start_s3(tmp_path / "s3root", bucket)
        (tmp_path / "hot").mkdir()
        self.cfg = _write_config(tmp_path, self.srv, bucket, warm)
        self.env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        self.watch = _Watch(self.cfg, self.env, tmp_path)
        self.train: subprocess.Popen | None = None

    def start_training(self, sleep: float) -> subprocess.Popen:
        self.train = _train(self.tmp / "hot", sleep=sleep)
        return self.train

    def restart_s3(self) -> None:
        """The server comes back on the same data under another port; the config follows."""
        self.srv.stop()
        self.srv = _start_s3(self.tmp / "s3root", self.bucket)
        self.cfg = _write_config(self.tmp, self.srv, self.bucket, self.warm)

    def finish(self, train_end: float, timeout: float) -> None:
        _finish(self.tmp, self.cfg, self.env, self.watch, train_end, self.srv, self.bucket,
                timeout=timeout, warm=self.warm)

    def __enter__(self) -> "_Run":
        return self

    def __exit__(self, *exc) -> None:
        if self.train is not None and self.train.poll() is None:
            self.train.kill()
            self.train.wait(10)
        self.watch.cleanup()
        self.srv.stop()


@pytest.mark.slow
def test_training_with_watch_beside_it_drains_and_trims(tmp_path):
    with _Run(tmp_path) as run:
        run.watch.start()
        train = run.start_training(sleep=0.02)
        out, err = train.communicate(timeout=120)
        assert train.returncode == 0, err
        assert out.split() == [w for n in ALL for w in ("saved", n)]
        train_end = time.time()
        assert run.watch.proc.poll() is None, run.watch.err.read_text()
        run.finish(train_end, timeout=90)


@pytest.mark.slow
def test_watch_killed_and_s3_restarted_during_training(tmp_path):
    with _Run(tmp_path) as run:
        watch = run.watch
        watch.start()
        train = run.start_training(sleep=0.06)  # ~12 s of training
        # watch SIGKILLed three times, restarted at once (a stale lock must not block)
        for delay in (1.3, 0.9, 1.7):
            time.sleep(delay)
            assert watch.proc.poll() is None, watch.err.read_text()
            watch.kill()
            watch.start()
        # the S3 server crashes; watch meets it down, then is killed; the server comes
        # back on the same data under another port, the config follows, watch restarts
        time.sleep(1.0)
        run.srv.kill()
        end = time.monotonic() + 180  # a bound for a loaded machine, not an expectation
        while not any(e["event"] == "failed" and e["tier"] == "cold"
                      for e in _events(tmp_path)):
            assert time.monotonic() < end, "watch never met the S3 server down"
            assert watch.proc.poll() is None, watch.err.read_text()
            time.sleep(0.2)
        watch.kill()
        run.restart_s3()
        watch.start()
        # one more SIGKILL while the backlog drains
        time.sleep(1.5)
        watch.kill()
        watch.start()
        out, err = train.communicate(timeout=120)
        assert train.returncode == 0, err
        assert out.split() == [w for n in ALL for w in ("saved", n)]
        train_end = time.time()
        # failures met while S3 was down are retried after their backoff (30 s); the
        # bound leaves room for a loaded machine (this run failed once beside four test sessions)
        run.finish(train_end, timeout=300)
        events = _events(tmp_path)
        assert watch.starts == 6
        assert any(e["event"] == "failed" and e["tier"] == "cold" for e in events), events
        assert any(e["event"] == "recovered" for e in events), events
        promoted = {(e["name"], e["dst"]) for e in events if e["event"] == "promoted"}
        assert promoted == {(n, t) for n in ALL for t in ("warm", "cold")}
        assert read_status(str(run.cfg))["in_flight"] is None


def _fill(mnt: Path) -> Path:
    """Fill the file system at ``mnt``: a ballast file beside the tier grows until ENOSPC."""
    import errno

    ballast = mnt / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return ballast


def _wait_event(tmp_path: Path, watch: _Watch, what, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while True:
        found = [e for e in _events(tmp_path) if what(e)]
        if found:
            return found[0]
        assert time.monotonic() < end, f"no such event within {timeout:.0f} s"
        assert watch.proc.poll() is None, watch.err.read_text()
        time.sleep(0.2)


@pytest.mark.slow
def test_warm_tier_full_during_training(tmp_path, small_tmpfs):
    """warm on a size-capped tmpfs, filled up after its first checkpoint arrived: watch
    reports ENOSPC (event, status), keeps everything warm lacks in hot, shows nothing
    half-written in warm, and drains the backlog once the space is freed (after its
    backoff); at the end every tier holds what its keep says, and it verifies."""
    mnt = small_tmpfs("4m")
    warm = mnt / "warm"
    with _Run(tmp_path, warm) as run:
        watch, cfg = run.watch, run.cfg
        watch.start()
        train = run.start_training(sleep=0.06)
        _wait_event(tmp_path, watch, lambda e: e["event"] == "promoted" and e["dst"] == "warm")
        ballast = _fill(mnt)
        e = _wait_event(tmp_path, watch, lambda e: e["event"] == "failed" and e["tier"] == "warm")
        assert "no space left" in e["message"].lower(), e
        # the status file is saved at the end of the pass that met it
        end = time.monotonic() + 60
        while not any(k.startswith("promote hot->warm:")
                      for k in (read_status(str(cfg)) or {}).get("failed", {})):
            assert time.monotonic() < end, read_status(str(cfg))
            time.sleep(0.2)
        # while full: nothing half-visible in warm, and hot keeps what warm lacks
        assert {r.state for r in ls(str(warm)).checkpoints} == {"sealed"}
        in_warm = {r.name for r in ls(str(warm)).checkpoints}
        hot_now = {r.name for r in ls(str(tmp_path / "hot")).checkpoints}
        assert e["name"] in hot_now and e["name"] not in in_warm
        time.sleep(2)  # a few more checkpoints meet the full tier
        ballast.unlink()
        _, err = train.communicate(timeout=120)
        assert train.returncode == 0, err
        train_end = time.time()
        # the failed hop is retried after its backoff (30 s), then the backlog drains
        run.finish(train_end, timeout=150)
        events = _events(tmp_path)
        assert any(e["event"] == "recovered" for e in events), events
        promoted = {(e["name"], e["dst"]) for e in events if e["event"] == "promoted"}
        assert promoted == {(n, t) for n in ALL for t in ("warm", "cold")}
