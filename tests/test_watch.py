"""``ckptctl watch``: checkpoints written into a hot directory drain to warm (local) and
cold (loopback S3, as packs), each tier trimmed by its keep, with the "not yet in TIER"
rail, retries with backoff, the event log, the status file, the lock, and the loop's
SIGTERM/SIGKILL behaviour."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import dcp_save, run_cli

from ckptctl.tiering.config import load_config
from ckptctl.formats.manifest import MANIFEST
from ckptctl.formats.pack import is_pack
from ckptctl.tiering.policy import Item, Policy, apply_policy
from ckptctl.catalog.ls import ls
from ckptctl.integrity.verify import verify
from ckptctl.service.status import read_status, state_dir
from ckptctl.service.watch import Watcher

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _step(hot: Path, step: int) -> Path:
    """A small real DCP checkpoint step-STEP in ``hot`` (values depend on the step)."""
    import torch

    g = torch.Generator().manual_seed(step)
    sd = {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.full((8,), float(step))},
          "step": step}
    p = hot / f"step-{step}"
    dcp_save(p, sd)
    return p


def _config(tmp_path: Path, s3=None, *, warm: str | None = None, hot_keep=1,
            warm_keep=2) -> Path:
    """hot (keep last ``hot_keep``) -> warm (keep last ``warm_keep``) [-> cold on S3, as
    packs, keep everything]."""
    text = (f'[[tier]]\nname = "hot"\nurl = "{tmp_path / "hot"}"\n'
            f'keep = {{ last = {hot_keep} }}\n'
            f'[[tier]]\nname = "warm"\nurl = "{warm or tmp_path / "warm"}"\n'
            f'keep = {{ last = {warm_keep} }}\n')
    if s3 is not None:
        opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s3.storage_options.items()
                         if not isinstance(v, dict))
        text += (f'[[tier]]\nname = "cold"\nurl = "{s3.url("run1")}"\npack = true\n'
                 f'storage_options = {{ {opts} }}\n')
    (tmp_path / "hot").mkdir(exist_ok=True)
    path = tmp_path / "ckptctl.toml"
    path.write_text(text)
    return path


def _names(url: str, options=None) -> dict[str, str]:
    return {r.name: r.state for r in ls(url, options).checkpoints}


def _events(cfg: Path) -> list[dict]:
    with open(os.path.join(state_dir(str(cfg)), "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_protection_keeps_a_checkpoint_and_its_base():
    """What watch protects ("not yet in warm") stays, and so does the base it needs."""
    items = [Item("step-1", 1, 1.0, "sealed", id="id-1"),
             Item("step-2", 2, 2.0, "sealed", id="id-2", base="id-1"),
             Item("step-3", 3, 3.0, "sealed", id="id-3")]
    d = apply_policy(items, Policy(last=1), now=10.0,
                     protect={"step-2": "not yet in warm", "gone": "x"})
    assert d.keep == {"step-3": ["last 1", "newest committed"],
                      "step-2": ["not yet in warm"], "step-1": ["base of kept step-2"]}
    assert d.remove == []
    assert apply_policy(items, Policy(last=1), now=10.0, protect={}) == \
        apply_policy(items, Policy(last=1), now=10.0)


def test_three_tiers_drain_pack_and_trim(tmp_path, s3_bucket):
    cfg = _config(tmp_path, s3_bucket)
    config = load_config(str(cfg))
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    cold, opts = s3_bucket.url("run1"), s3_bucket.storage_options
    for s in (100, 200, 300):
        _step(hot, s)
    w = Watcher(config, settle=0)
    p = w.run_once()
    assert p.drained, p.to_dict()
    assert sorted(p.found) == ["step-100", "step-200", "step-300"]
    assert sorted(p.sealed) == ["step-100", "step-200", "step-300"]
    assert [(h.name, h.src, h.dst) for h in p.promoted] == [
        ("step-100", "hot", "warm"), ("step-200", "hot", "warm"), ("step-300", "hot", "warm"),
        ("step-100", "warm", "cold"), ("step-200", "warm", "cold"),
        ("step-300", "warm", "cold")]
    # each tier's keep, after the promotions
    assert _names(str(hot)) == {"step-300": "sealed"}
    assert _names(str(warm)) == {"step-200": "sealed", "step-300": "sealed"}
    assert _names(cold, opts) == {f"step-{s}": "sealed" for s in (100, 200, 300)}
    assert p.removed == {"hot": ["step-100", "step-200"], "warm": ["step-100"]}
    # a tier is trimmed as soon as a hop out of it is committed, not at the pass's end
    log = [(e["event"], e.get("tier") or e.get("src"), e["name"]) for e in _events(cfg)
           if e["event"] in ("promoted", "removed")]
    assert log.index(("removed", "hot", "step-100")) < log.index(("promoted", "hot", "step-200"))
    assert log.index(("removed", "hot", "step-200")) < log.index(("promoted", "hot", "step-300"))
    # cold holds packs, and they verify (content hashes)
    fs = s3_bucket.fs()
    for s in (100, 200, 300):
        assert is_pack({k.rsplit("/", 1)[1]: 0 for k in fs.ls(s3_bucket.path(f"run1/step-{s}"))})
    assert not is_pack({x.name: 0 for x in (warm / "step-300").iterdir()})
    for s in (100, 200, 300):
        r = verify(f"{cold}/step-{s}", opts, level="full")
        assert r.ok, r
    assert verify(str(warm / "step-300"), level="full").ok
    # idempotent: a rerun has nothing to do
    p2 = Watcher(config, settle=0).run_once()
    assert p2.drained and not p2.promoted and not p2.sealed and not any(p2.removed.values())
    kinds = [e["event"] for e in _events(cfg)]
    assert kinds.count("found") == 3 and kinds.count("sealed") == 3
    assert kinds.count("promoted") == 6 and kinds.count("removed") == 3
    st = read_status(str(cfg))
    assert st["in_flight"] is None and st["queued"] == [] and st["last_pass"]["drained"]
    assert [d["name"] for d in st["done"]][:3] == ["step-100", "step-200", "step-300"]


def test_incomplete_checkpoint_is_not_touched_until_complete(tmp_path):
    cfg = _config(tmp_path, hot_keep=1)
    hot = tmp_path / "hot"
    _step(hot, 100)
    p = _step(hot, 200)
    meta = (p / ".metadata").read_bytes()
    (p / ".metadata").unlink()  # being written: no commit marker yet
    before = sorted(x.name for x in p.iterdir())
    w = Watcher(load_config(str(cfg)), settle=0)
    r = w.run_once()
    assert not r.drained and {"tier": "hot", "name": "step-200", "why": "incomplete"} \
        in r.pending
    assert sorted(x.name for x in p.iterdir()) == before  # not sealed, not removed
    assert _names(str(tmp_path / "warm")) == {"step-100": "sealed"}
    (p / ".metadata").write_bytes(meta)
    r = w.run_once()
    assert r.drained and [h.name for h in r.promoted] == ["step-200"]
    assert _names(str(hot)) == {"step-200": "sealed"}


def test_a_hop_committed_just_before_a_kill_is_logged_by_the_next_watcher(tmp_path):
    """SIGKILL between a hop's commit and its "promoted" event: the status still names
    the hop in flight; the next watcher finds it committed and logs it, so the event log
    explains the removal from hot that follows (the e2e kill test's rail check)."""
    from ckptctl.tiering.promote import promote

    cfg = _config(tmp_path, hot_keep=1)
    hot = tmp_path / "hot"
    _step(hot, 100)
    _step(hot, 200)
    w = Watcher(load_config(str(cfg)), settle=0)
    w.status["in_flight"] = {"name": "step-100", "src": "hot", "dst": "warm", "since": "x"}
    w.save()
    promote(str(hot / "step-100"), str(tmp_path / "warm" / "step-100"))  # then killed
    w2 = Watcher(load_config(str(cfg)), settle=0)
    r = w2.run_once()
    assert r.drained and [h.name for h in r.promoted] == ["step-200"]
    ev = [(e["event"], e["name"], e.get("action")) for e in _events(cfg)
          if e["event"] in ("promoted", "removed")]
    assert ev[0] == ("promoted", "step-100", "committed-before-restart"), ev
    assert ("removed", "step-100", None) in ev
    assert read_status(str(cfg))["in_flight"] is None
    # logged once: a later pass (or watcher) does not log it again
    w2.run_once()
    assert Watcher(load_config(str(cfg)), settle=0).run_once().drained
    assert [e.get("action") for e in _events(cfg)].count("committed-before-restart") == 1


def test_settle_waits_for_an_unchanged_listing(tmp_path):
    cfg = _config(tmp_path)
    _step(tmp_path / "hot", 100)
    now = [1000.0]
    w = Watcher(load_config(str(cfg)), settle=30, clock=lambda: now[0])
    r = w.run_once()
    assert r.pending == [{"tier": "hot", "name": "step-100", "why": "settling"}]
    assert not (tmp_path / "warm").exists()
    now[0] += 31
    r = w.run_once()
    assert r.drained and [h.name for h in r.promoted] == ["step-100"]


def test_rail_keeps_what_the_next_tier_lacks_and_retries_with_backoff(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where warm's parent should be")
    cfg = _config(tmp_path, warm=str(blocker / "warm"), hot_keep=1)
    hot = tmp_path / "hot"
    for s in (100, 200, 300):
        _step(hot, s)
    now = [1000.0]
    w = Watcher(load_config(str(cfg)), settle=0, backoff=10, clock=lambda: now[0])
    r = w.run_once()
    assert not r.drained and not r.promoted
    assert len(r.failed) == 1, r.to_dict()["failed"]
    (f,) = r.failed
    assert (f.what, f.tier, f.name, f.attempts, f.next_retry) == \
        ("promote", "warm", "step-100", 1, 1010.0)
    # hot's keep is last 1, but nothing reached warm: everything stays
    assert _names(str(hot)) == {f"step-{s}": "sealed" for s in (100, 200, 300)}
    assert r.kept["hot"] == ["step-300", "step-200", "step-100"] and r.removed["hot"] == []
    assert {"tier": "hot", "name": "step-200", "why": "waiting for warm"} in r.pending
    # before the retry time: not tried again, still reported
    now[0] += 5
    r = w.run_once()
    assert [x.attempts for x in r.failed] == [1]
    # after it: tried again, the delay doubles
    now[0] += 10
    r = w.run_once()
    assert [(x.attempts, x.next_retry) for x in r.failed] == [(2, 1035.0)]
    assert _names(str(hot)) == {f"step-{s}": "sealed" for s in (100, 200, 300)}
    st = read_status(str(cfg))
    assert st["failed"]["promote hot->warm:step-100"]["attempts"] == 2
    assert [e["event"] for e in _events(cfg)].count("failed") == 2
    # the way is clear again: it drains, and only then is hot trimmed
    blocker.unlink()
    now[0] += 100
    r = w.run_once()
    assert r.drained, r.to_dict()
    assert _names(str(hot)) == {"step-300": "sealed"}
    assert "recovered" in [e["event"] for e in _events(cfg)]


def test_cli_once_json_status_and_lock(tmp_path):
    cfg = _config(tmp_path)
    _step(tmp_path / "hot", 100)
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--settle", "0",
                             "--no-nice", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["drained"] is True and doc["promoted"][0]["name"] == "step-100"
    code, out, err = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0 and "last pass drained" in out and "done: step-100 hot -> warm" in out
    # a second watch on the same config: exit 2, one line
    w = Watcher(load_config(str(cfg)))
    w.lock()
    try:
        code, _, err = run_cli("--config", str(cfg), "watch", "--once", "--no-nice")
    finally:
        w.unlock()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "another watch" in err
    # something pending: exit 1
    p = _step(tmp_path / "hot", 200)
    (p / ".metadata").unlink()
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--settle", "0",
                             "--no-nice")
    assert code == 1 and "1 pending" in out


def test_cli_without_tiers_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTCTL_CONFIG", raising=False)
    code, _, err = run_cli("watch", "--once")
    assert code == 2 and "no tier config" in err


def _spawn(cfg: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch", "--interval", "0.2",
         "--settle", "0", "--no-nice", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_loop_sigterm_exits_0_and_sigkill_resumes(tmp_path):
    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    _step(hot, 100)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = _spawn(cfg, env)
    try:
        assert _wait_for(lambda: (warm / "step-100" / MANIFEST).exists())
        _step(hot, 200)  # inotify (or the next poll) wakes the loop
        assert _wait_for(lambda: _names(str(warm)).get("step-200") == "sealed")
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    _step(hot, 300)
    proc = _spawn(cfg, env)  # the stale lock of a killed process does not block
    try:
        # sealed, not just its manifest there: the promote's last step (the marker's
        # removal) may still be running when the manifest appears
        assert _wait_for(lambda: _names(str(warm)).get("step-300") == "sealed")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 20  # a few seconds; generous for a loaded CI box
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert _names(str(warm)) == {f"step-{s}": "sealed" for s in (100, 200, 300)}
    assert read_status(str(cfg))["in_flight"] is None


def test_a_copy_of_the_config_does_not_run_a_second_watch(tmp_path):
    """The lock is the first tier's, not the config file's: a copy of the config elsewhere
    (naming hot through a symlink, with a trailing slash) is refused while a watch of the
    original runs (exit 2, one line naming its pid and config); --status of the copy shows
    the running watch; once that has stopped, the copy runs, and --status of either config
    shows the last watch of these tiers."""
    from ckptctl.service.status import lock_holder

    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    _step(tmp_path / "hot", 100)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "hot-link").symlink_to(tmp_path / "hot")
    copy = other / "copy.toml"
    copy.write_text(cfg.read_text().replace(f'"{tmp_path / "hot"}"',
                                            f'"{other / "hot-link"}/"'))
    assert load_config(str(copy)).tiers[0].url != load_config(str(cfg)).tiers[0].url
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch", "--interval", "600",
         "--settle", "0", "--no-nice"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        # ready: it holds the lock and has saved the status of its first pass
        assert _wait_for(lambda: proc.poll() is not None or (
            (lock_holder(load_config(str(copy))) or {}).get("pid") == proc.pid
            and (read_status(str(cfg)) or {}).get("pid") == proc.pid
            and (read_status(str(cfg)) or {}).get("last_pass")), timeout=600)
        assert proc.poll() is None, proc.stderr.read()
        code, out, err = run_cli("--config", str(copy), "watch", "--once", "--settle", "0",
                                 "--no-nice")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
        assert f"another watch (pid {proc.pid}, config {cfg})" in err, err
        assert str(copy) in err and "tier 'hot'" in err, err
        code, out, err = run_cli("--config", str(copy), "watch", "--status")
        assert code == 0 and f"watch of {cfg}: " in out and f"pid {proc.pid}" in out, out + err
        code, out, err = run_cli("--config", str(copy), "watch", "--status", "--json")
        doc = json.loads(out)
        assert code == 0 and doc["config"] == str(cfg) and doc["status"]["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read()
    code, out, err = run_cli("--config", str(copy), "watch", "--once", "--settle", "0",
                             "--no-nice")
    assert code == 0, out + err
    assert lock_holder(load_config(str(cfg)))["config"] == str(copy)  # the lock is the tier's
    code, out, err = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0 and f"watch of {copy}: " in out, out  # the last watch of these tiers


def _fill(mnt: Path) -> Path:
    """Fill the file system at ``mnt``: a ballast file beside the tier grows until ENOSPC."""
    import errno

    ballast = mnt / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        block = b"\0" * 4096
        while True:
            os.write(fd, block)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return ballast


def test_warm_full_is_reported_retried_deletes_nothing_and_drains_when_freed(
        tmp_path, small_tmpfs):
    """The warm tier on a size-capped tmpfs, filled: the hop fails with ENOSPC (event,
    status, --status text), is retried with a doubling backoff, hot keeps what warm lacks
    (nothing deleted because of it), nothing half-visible appears in warm; once space is
    freed the next retry drains it and only then is hot trimmed."""
    mnt = small_tmpfs("1m")
    warm = mnt / "warm"
    cfg = _config(tmp_path, warm=str(warm), hot_keep=1, warm_keep=2)
    hot = tmp_path / "hot"
    _step(hot, 100)
    now = [1000.0]
    w = Watcher(load_config(str(cfg)), settle=0, backoff=10, clock=lambda: now[0])
    assert w.run_once().drained
    ballast = _fill(mnt)
    for s in (200, 300):
        _step(hot, s)
    r = w.run_once()
    assert not r.drained and not r.promoted
    (f,) = r.failed
    assert (f.what, f.tier, f.name, f.attempts, f.next_retry) == \
        ("promote", "warm", "step-200", 1, 1010.0)
    assert "no space left" in f.message.lower(), f.message
    assert {"tier": "hot", "name": "step-300", "why": "waiting for warm"} in r.pending
    # keep last 1 in hot: step-100 (in warm) goes, the two warm lacks stay
    assert _names(str(hot)) == {"step-200": "sealed", "step-300": "sealed"}
    assert r.removed == {"hot": ["step-100"], "warm": []}
    # nothing half-visible in warm: only step-100 is a checkpoint there
    assert _names(str(warm)) == {"step-100": "sealed"}
    assert [x for x in os.listdir(warm) if not x.startswith(".")] == ["step-100"]
    st = read_status(str(cfg))
    assert st["failed"]["promote hot->warm:step-200"]["code"] and not st["last_pass"]["drained"]
    code, out, _ = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0 and "failed: promote hot->warm:step-200" in out \
        and "no space left" in out.lower(), out
    # before the retry time: not tried; after it, still full: tried, the delay doubles
    now[0] += 5
    assert [x.attempts for x in w.run_once().failed] == [1]
    now[0] += 10
    r = w.run_once()
    assert [(x.attempts, x.next_retry) for x in r.failed] == [(2, 1035.0)]
    assert _names(str(hot)) == {"step-200": "sealed", "step-300": "sealed"}
    assert not any(r.removed.values())
    # space freed: the next retry drains; then hot and warm are trimmed by their keep
    ballast.unlink()
    now[0] += 20
    r = w.run_once()
    assert r.drained, r.to_dict()
    assert [h.name for h in r.promoted] == ["step-200", "step-300"]
    assert _names(str(hot)) == {"step-300": "sealed"}
    assert _names(str(warm)) == {"step-200": "sealed", "step-300": "sealed"}
    assert sorted(os.listdir(warm)) == ["step-200", "step-300"]  # no work folder left
    for s in (200, 300):
        assert verify(str(warm / f"step-{s}"), level="full").ok
    events = _events(cfg)
    assert [e["event"] for e in events].count("failed") == 2
    assert any(e["event"] == "recovered" for e in events)
    removed = [e["name"] for e in events if e["event"] == "removed" and e["tier"] == "hot"]
    assert sorted(removed) == ["step-100", "step-200"]


def test_config_change_of_the_tiers_retries_at_once(tmp_path):
    """A failure's backoff is kept across restarts under the same config, but an edit of
    the tiers involved (warm moved to a place that works) is tried at once, its attempts
    counted afresh; an edit of an uninvolved tier changes nothing."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where warm's parent should be")
    cfg = _config(tmp_path, warm=str(blocker / "warm"))
    _step(tmp_path / "hot", 100)
    now = [1000.0]

    def clock():
        return now[0]

    r = Watcher(load_config(str(cfg)), settle=0, backoff=60, clock=clock).run_once()
    assert [(f.what, f.attempts, f.next_retry) for f in r.failed] == [("promote", 1, 1060.0)]
    now[0] += 10
    # a restart under the same config waits for the retry time
    r = Watcher(load_config(str(cfg)), settle=0, backoff=60, clock=clock).run_once()
    assert [(f.attempts, f.next_retry) for f in r.failed] == [(1, 1060.0)]
    # hot's keep edited: a hop hot->warm involves hot, so it is tried again, and fails
    # again at attempt 1 (the new config's first)
    text = cfg.read_text()
    cfg.write_text(text.replace("keep = { last = 1 }", "keep = { last = 3 }", 1))
    r = Watcher(load_config(str(cfg)), settle=0, backoff=60, clock=clock).run_once()
    assert [(f.attempts, f.next_retry) for f in r.failed] == [(1, 1070.0)]
    # warm moved to a place that works: tried at once, drained
    cfg.write_text(cfg.read_text().replace(str(blocker / "warm"), str(tmp_path / "warm")))
    r = Watcher(load_config(str(cfg)), settle=0, backoff=60, clock=clock).run_once()
    assert r.drained and [h.name for h in r.promoted] == ["step-100"], r.to_dict()
    kinds = [e["event"] for e in _events(cfg)]
    assert kinds.count("config-changed") == 2 and kinds.count("recovered") == 1
    assert read_status(str(cfg))["failed"] == {}


def test_status_shows_plan_figures_from_what_watch_measured(tmp_path):
    """--status (text and --json) reports plan's figures from the hops watch timed and
    the checkpoints' arrival times: checked against plan's own arithmetic on the same
    numbers."""
    from ckptctl.tiering.plan import drain_seconds, local_capacity, node_bandwidth
    from ckptctl.service.drains import measured_plan

    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    hot = tmp_path / "hot"
    w = Watcher(load_config(str(cfg)), settle=0)
    code, out, _ = run_cli("--config", str(cfg), "watch", "--status", "--json")
    assert code == 0 and json.loads(out)["plan"] is None  # no watch has run
    for s, when in ((100, 1000.0), (200, 1100.0), (300, 1300.0)):
        p = _step(hot, s)
        for f in p.iterdir():
            os.utime(f, (when, when))  # the commit marker's time is the arrival time
        w.run_once()
    st = read_status(str(cfg))
    assert [(a["name"], a["modified"]) for a in st["arrivals"]] == [
        ("step-100", "1970-01-01T00:16:40Z"), ("step-200", "1970-01-01T00:18:20Z"),
        ("step-300", "1970-01-01T00:21:40Z")]
    size = st["arrivals"][-1]["bytes"]
    hop = [d for d in st["done"] if d["name"] == "step-300"][-1]
    rate = hop["bytes"] / hop["seconds"]
    code, out, err = run_cli("--config", str(cfg), "watch", "--status", "--json")
    assert code == 0, err
    doc = json.loads(out)["plan"]
    assert doc == measured_plan(load_config(str(cfg)), st).to_dict()
    assert (doc["checkpoint_name"], doc["checkpoint_bytes"]) == ("step-300", size)
    assert (doc["interval_seconds"], doc["gaps"]) == (150.0, 2)  # median of 100 and 200
    assert doc["node_bandwidth_bytes_per_second"] == round(node_bandwidth(size, 1, 150.0))
    assert doc["local_capacity_bytes"] == local_capacity(size, 1)
    (h,) = doc["hops"]
    assert (h["src"], h["dst"], h["bytes"]) == ("hot", "warm", size)
    assert h["bytes_per_second"] == round(rate)  # whole bytes per second, as every verb
    # the plan drains at the rate as stored (whole bytes per second over the hop's
    # seconds as recorded): within rounding of the exact quotient, whatever the hop took
    assert h["drain_seconds"] == pytest.approx(drain_seconds(size, rate), rel=1e-3)
    assert h["fits"] is True and doc["all_fit"] is True
    rec = {r["tier"]: r for r in doc["recovery"]}
    # each rate is labelled by the hop it was measured on
    assert h["rate_source"] == "measured on hot -> warm" and h["rate_kind"] == "measured"
    assert rec["hot"]["rate_source"] == "measured on hot -> warm"  # the hop out of hot
    assert rec["warm"]["rate_source"] == "measured on hot -> warm (a write)"  # none read yet
    assert rec["warm"]["rate_kind"] == "measured"
    assert rec["warm"]["seconds"] == pytest.approx(drain_seconds(size, rate))
    code, out, err = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0, err
    assert "plan from what watch measured" in out and "interval tau = 150.0 s" in out
    assert "B >= S/(P tau)" in out and "hot -> warm" in out and "recover from" in out


def test_a_gc_retry_falling_due_mid_question_reports_no_empty_failure(tmp_path):
    """The trim asks once whether its gc is backing off: a clock that passes the retry time
    between two questions never puts a None among the pass's failures."""
    from ckptctl.service.results import WatchPass
    from ckptctl.service.trims import retain_rows

    cfg = _config(tmp_path, hot_keep=1)
    now = [1000.0]

    def clock():  # each question a second later: the retry below falls due in between
        now[0] += 1.0
        return now[0]

    w = Watcher(load_config(str(cfg)), settle=0, backoff=10, clock=clock)
    w.status.setdefault("failed", {})["gc hot"] = {
        "what": "gc", "tier": "hot", "name": None, "code": "STORAGE", "message": "m",
        "attempts": 1, "next_retry": 1001.5, "config": w._config_digest("gc hot")}
    p = WatchPass(started=now[0])
    retain_rows(w, p, 0, {"step-1": None}, None)
    assert None not in p.failed and [f.what for f in p.failed] == ["gc"]
