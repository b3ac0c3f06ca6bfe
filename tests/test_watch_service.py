"""watch as a service: Prometheus metrics (text file and /metrics), JSON-lines logs as
events happen, the systemd notify protocol (a socket that records what watch sends, as
systemd's would), the pre-emption signal, liveness in --status, a sealed first-tier
checkpoint taken without settle time, and the shipped template unit.

The subprocess tests run the real ``ckptctl watch`` beside a real training loop
(``tests/fixtures/train_loop.py``: DCP saves); no assertion depends on how fast anything runs.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli
from prometheus_client.parser import text_string_to_metric_families
from test_watch import _config, _names, _step, _wait_for

from ckptctl.cli.watch_service import json_logger, systemd_unit
from ckptctl.tiering.config import load_config
from ckptctl.service.metrics import WatchMetrics
from ckptctl.service.status import watch_alive
from ckptctl.service.watch import Watcher

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "fixtures" / "train_loop.py"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus exposition text."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_file_and_json_log_follow_each_event(tmp_path):
    cfg = _config(tmp_path, hot_keep=1, warm_keep=5)
    for s in (100, 200):
        _step(tmp_path / "hot", s)
    prom = tmp_path / "ckptctl.prom"
    m = WatchMetrics(["hot", "warm"], path=str(prom))
    log = io.StringIO()
    w = Watcher(load_config(str(cfg)), settle=0)
    seen_after_first_hop = []

    def spy(doc):  # file and log are written as each event happens, not at the pass's end
        if doc["event"] == "promoted" and doc["name"] == "step-100":
            seen_after_first_hop.append(_samples(prom.read_text()))
            assert '"event": "promoted"' in log.getvalue().splitlines()[-1]

    w.listeners += [m.observe, json_logger(log), spy]
    p = w.run_once()
    assert p.drained, p.to_dict()
    first = seen_after_first_hop[0]
    assert first[("ckptctl_watch_checkpoints_promoted_total",
                  (("dst", "warm"), ("src", "hot")))] == 1
    got = _samples(prom.read_text())
    hop = (("dst", "warm"), ("src", "hot"))
    assert got[("ckptctl_watch_checkpoints_found_total", (("tier", "hot"),))] == 2
    assert got[("ckptctl_watch_checkpoints_promoted_total", hop)] == 2
    assert got[("ckptctl_watch_moved_bytes_total", hop)] == sum(h.bytes_sent for h in p.promoted)
    assert got[("ckptctl_watch_hop_seconds_count", hop)] == 2
    assert got[("ckptctl_watch_checkpoints_removed_total", (("tier", "hot"),))] == 1
    assert got[("ckptctl_watch_queue_depth", (("tier", "hot"),))] == 0
    assert got[("ckptctl_watch_newest_pending_age_seconds", (("tier", "warm"),))] == 0
    assert got[("ckptctl_watch_last_success_timestamp_seconds", ())] > 0
    assert not [k for k in got if k[0] == "ckptctl_watch_checkpoints_failed_total"]
    assert not list(tmp_path.glob("ckptctl.prom.*")), "the temporary file was renamed"
    lines = [json.loads(x) for x in log.getvalue().splitlines()]
    assert [x["event"] for x in lines if x["event"] != "recovered"][:2] == ["found", "found"]
    promoted = [x for x in lines if x["event"] == "promoted"]
    assert [(x["name"], x["step"], x["src"], x["dst"]) for x in promoted] == [
        ("step-100", 100, "hot", "warm"), ("step-200", 200, "hot", "warm")]
    assert all(list(x)[:3] == ["time", "level", "event"] for x in lines)
    assert all(x["bytes"] > 0 and x["seconds"] >= 0 for x in promoted)
    assert lines[-1]["event"] == "pass" and lines[-1]["drained"] is True


def test_an_unwritable_metrics_file_is_reported_once_and_watch_goes_on(tmp_path):
    cfg = _config(tmp_path)
    _step(tmp_path / "hot", 100)
    warnings = []
    m = WatchMetrics(["hot", "warm"], path=str(tmp_path / "no" / "such" / "x.prom"),
                     warn=warnings.append)
    w = Watcher(load_config(str(cfg)), settle=0)
    w.listeners.append(m.observe)
    assert w.run_once().drained
    assert len(warnings) == 1 and "cannot write the metrics file" in warnings[0]


def test_a_sealed_first_tier_checkpoint_needs_no_settle_time(tmp_path):
    cfg = _config(tmp_path, hot_keep=5)
    hot = tmp_path / "hot"
    _step(hot, 100)
    _step(hot, 200)
    assert run_cli("seal", str(hot / "step-200"))[0] == 0  # sealed as it was saved
    p = Watcher(load_config(str(cfg)), settle=3600).run_once()
    assert [h.name for h in p.promoted] == ["step-200"]
    assert p.pending == [{"tier": "hot", "name": "step-100", "why": "settling"}]


def test_status_says_whether_the_watcher_is_alive(tmp_path):
    cfg = _config(tmp_path)
    config = load_config(str(cfg))
    w = Watcher(config, settle=0)
    assert watch_alive(config) is None
    w.lock()
    try:
        assert watch_alive(config) == os.getpid()
        w.status["in_flight"] = {"name": "step-100", "src": "hot", "dst": "warm",
                                 "since": "2026-12-04T00:00:00Z"}
        w.save()
        code, out, _ = run_cli("--config", str(cfg), "watch", "--status")
        assert code == 0 and f"running (pid {os.getpid()})" in out
        assert "in flight: step-100 hot -> warm" in out
    finally:
        w.unlock()
    # the lock went with its holder (a SIGKILLed watch's too): what it had in flight was
    # interrupted, and --status says so instead of "in flight"
    assert watch_alive(config) is None
    code, out, _ = run_cli("--config", str(cfg), "watch", "--status")
    assert code == 0 and "not running" in out and "interrupted: step-100 hot -> warm" in out
    code, out, _ = run_cli("--config", str(cfg), "watch", "--status", "--json")
    doc = json.loads(out)
    assert doc["alive"] is False and doc["pid"] is None


class NotifySocket:
    """What systemd listens on for ``sd_notify``: a datagram socket that records every
    message (a short path: AF_UNIX paths are limited to 108 bytes)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="sd", dir="/tmp")
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[dict] = []
        self._stop = threading.Event()
        # read at once, as systemd does: a datagram queue holds only a few messages
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            self.messages.append(dict(line.split("=", 1) for line in data.decode().split("\n")))

    def has(self, key: str, value: str | None = None) -> bool:
        return any(key in m and (value is None or value in m[key]) for m in list(self.messages))

    def close(self) -> None:
        self._stop.set()
        self._reader.join(5)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _watch(cfg: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch", "--interval", "0.3",
         "--no-nice", "--log-format", "json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _scrape(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return _samples(r.read().decode())
    except OSError:
        return {}


def test_watch_under_a_notify_socket_scraped_while_training_saves(tmp_path):
    from s3server import free_port

    cfg = _config(tmp_path, hot_keep=2, warm_keep=10)
    port = free_port()
    prom = tmp_path / "watch.prom"
    sd = NotifySocket()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "NOTIFY_SOCKET": sd.path,
           "WATCHDOG_USEC": "2000000"}
    proc = _watch(cfg, env, "--settle", "0", "--metrics-addr", f"127.0.0.1:{port}",
                  "--metrics-file", str(prom))
    train = None
    try:
        assert _wait_for(lambda: sd.has("READY", "1"), timeout=120), sd.messages
        # the readiness probe agrees (Kubernetes: readinessProbe exec)
        assert _wait_for(lambda: run_cli("--config", str(cfg), "watch", "--ready")[0] == 0)
        train = subprocess.Popen([sys.executable, str(TRAIN), str(tmp_path / "hot"),
                                  "--steps", "100", "--every", "25"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hop = (("dst", "warm"), ("src", "hot"))
        key = ("ckptctl_watch_checkpoints_promoted_total", hop)
        scraped = []  # the endpoint answers while training saves and watch drains

        def four_promoted():
            got = _scrape(port)
            scraped.append(got.get(key))
            return got.get(key) == 4

        assert _wait_for(four_promoted, timeout=180), (scraped, train.poll())
        assert train.wait(120) == 0, train.stderr.read()
        assert _wait_for(lambda: set(_names(str(tmp_path / "warm")).values()) == {"sealed"}
                         and len(_names(str(tmp_path / "warm"))) == 4, timeout=60)
        # the hot tier keeps 2: trimmed as each hop is committed
        assert _wait_for(lambda: len(_names(str(tmp_path / "hot"))) == 2, timeout=60)
        assert _samples(prom.read_text())[key] == 4
        assert sd.has("WATCHDOG", "1") and sd.has("STATUS", "promoting step-")
        assert _wait_for(lambda: sd.has("STATUS", "idle: 0 queued"), timeout=60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert _wait_for(lambda: sd.has("STOPPING", "1"), timeout=10)
    finally:
        for p in (proc, train):
            if p is not None and p.poll() is None:
                p.kill()
        sd.close()
    assert proc.returncode == 0, err
    assert run_cli("--config", str(cfg), "watch", "--ready") == (1, "", "")
    assert sd.messages[-1].get("STOPPING") == "1"
    ready = next(i for i, m in enumerate(sd.messages) if m.get("READY") == "1")
    assert ready < next(i for i, m in enumerate(sd.messages)
                        if m.get("STATUS", "").startswith("promoting"))
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    promoted = [e for e in events if e["event"] == "promoted"]
    assert sorted(e["step"] for e in promoted) == [25, 50, 75, 100]


def _drain_when(tmp_path: Path, cfg: Path, ready, *args: str) -> tuple[str, str]:
    """Start watch, send the drain signal once ``ready(status)``; it must exit 0 by
    itself: (stdout, stderr)."""
    from ckptctl.service.status import read_status

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = _watch(cfg, env, *args)
    try:
        assert _wait_for(lambda: ready(read_status(str(cfg)) or {}), timeout=120)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return out, err


def test_drain_signal_during_a_backlog_commits_the_newest_and_exits_0(tmp_path):
    # a backlog the loop will not touch for an hour: complete, unsealed, settling
    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    for s in (100, 200, 300):
        _step(hot, s)
    out, err = _drain_when(tmp_path, cfg, lambda st: len(st.get("queued") or []) == 3,
                           "--settle", "3600")
    assert _names(str(warm)) == {"step-300": "sealed"}  # the newest, ahead of the backlog
    assert out == ""  # --log-format json: the JSON log alone, no text copy on stdout
    drained = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert any(e["event"] == "promoted" and e["name"] == "step-300" for e in drained)


def test_drain_signal_in_the_middle_of_a_hop_still_drains_the_newest(tmp_path):
    # a slow next tier: the signal lands while an older checkpoint is on its way (4 MiB
    # at 1 MiB/s, past the limiter's 1 MiB burst: in flight for 3 s at least). Sent once
    # the first hop started, or (a machine too busy to look in time) ended: either way the
    # newest must be drained
    import torch
    from conftest import dcp_save

    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    cfg.write_text(cfg.read_text().replace('name = "warm"', 'name = "warm"\nbwlimit = "1MiB/s"'))
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    for s in (100, 200):
        dcp_save(hot / f"step-{s}", {"w": torch.full((1 << 20,), float(s)), "step": s})
    out, err = _drain_when(tmp_path, cfg, lambda st: st.get("in_flight") or st.get("done"),
                           "--settle", "0")
    assert _names(str(warm)).get("step-200") == "sealed", out
    assert run_cli("verify", str(warm / "step-200"), "--level", "full")[0] == 0


def test_the_template_unit_is_what_systemd_accepts(tmp_path):
    unit = systemd_unit(shutil.which("ckptctl") or sys.executable)
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "NotifyAccess=main" in unit
    code, out, _ = run_cli("watch", "--print-unit")
    assert code == 0 and out.startswith("# ckptctl watch as a systemd service")
    # every option ExecStart passes exists
    exec_line = " ".join(line.rstrip("\\") for line in unit.splitlines()
                         if line.startswith("ExecStart=") or line.startswith("    --"))
    code, help_text, _ = run_cli("watch", "--help")
    for flag in [w for w in exec_line.split() if w.startswith("--")]:
        assert flag in help_text or flag == "--config", flag
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    path = tmp_path / "ckptctl-watch@run1.service"
    path.write_text(unit)
    man = tmp_path / "man" / "man1"
    man.mkdir(parents=True)
    shutil.copy(ROOT / "man" / "ckptctl.1", man / "ckptctl.1")
    r = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True,
                       env={**os.environ, "MANPATH": str(tmp_path / "man")})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_heartbeat_pings_only_while_watch_makes_progress():
    from ckptctl.service.sdnotify import Heartbeat, Notifier

    sd = NotifySocket()
    try:
        env = {"NOTIFY_SOCKET": sd.path, "WATCHDOG_USEC": "100000"}
        stuck = Heartbeat(Notifier(env), alive=lambda: False)
        stuck.start()
        stuck.stop()
        n = Notifier(env)
        n.send(STATUS="probe")  # datagrams arrive in order: after this, nothing from `stuck`
        assert _wait_for(lambda: sd.has("STATUS", "probe"))
        assert not sd.has("WATCHDOG")
        well = Heartbeat(Notifier(env), alive=lambda: True)
        well.start()
        assert _wait_for(lambda: sd.has("WATCHDOG", "1"))
        well.stop()
    finally:
        sd.close()


def test_notify_reaches_an_abstract_socket_and_ignores_a_watchdog_for_another_pid():
    from ckptctl.service.sdnotify import Notifier

    name = f"ckptctl-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(30)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "5000000",
                      "WATCHDOG_PID": str(os.getpid() + 1)})
        assert n.ready("listed hot") and n.watchdog_seconds is None
        assert s.recv(4096) == b"READY=1\nSTATUS=listed hot"
    finally:
        s.close()
    assert not Notifier({"NOTIFY_SOCKET": "/nonexistent/socket"}).send(READY=1)


def test_a_metrics_file_that_holds_something_else_is_refused(tmp_path):
    cfg = _config(tmp_path)
    before = cfg.read_bytes()
    code, out, err = run_cli("--config", str(cfg), "watch", "--once", "--metrics-file", str(cfg))
    assert code == 2 and "refusing to overwrite" in err and len(err.strip().splitlines()) == 1
    assert cfg.read_bytes() == before  # the config it named is untouched
    prom = tmp_path / "w.prom"
    WatchMetrics(["hot", "warm"], path=str(prom)).write()
    WatchMetrics(["hot", "warm"], path=str(prom))  # its own earlier file: fine
