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

from ckptctl.config import load_config
from ckptctl.formats.manifest import MANIFEST
from ckptctl.formats.pack import is_pack
from ckptctl.ops.gc import protect_decision
from ckptctl.ops.ls import ls
from ckptctl.ops.policy import Decision
from ckptctl.ops.verify import verify
from ckptctl.ops.watch import Watcher, read_status, state_dir

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


def test_protect_decision_is_pure_and_keeps_order():
    d = Decision({"step-4": ["last 1", "newest committed"]}, ["step-3", "step-2", "step-1"])
    order = ["step-4", "step-3", "step-2", "step-1"]
    out = protect_decision(d, {"step-2": "not yet in warm", "step-4": "not yet in warm",
                               "gone": "x"}, order)
    assert out.keep == {"step-4": ["last 1", "newest committed", "not yet in warm"],
                        "step-2": ["not yet in warm"]}
    assert out.remove == ["step-3", "step-1"]
    assert d.remove == ["step-3", "step-2", "step-1"]  # the input is not changed
    assert protect_decision(d, {}, order) == d


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
    assert p.removed == {"hot": ["step-200", "step-100"], "warm": ["step-100"]}
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
