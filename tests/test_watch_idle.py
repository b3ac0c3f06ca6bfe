"""An idle ``watch`` sleeps: its own reads of the first tier (listings, manifests,
``.metadata``) wake nothing, so a drained watch makes no pass until its interval ends or
something is written, created, moved or deleted there (issue 34). And a watch never seals
a first-tier checkpoint together with a file its format does not name.

CPU is measured as the kernel counts it for the watch's process (``/proc/PID/stat``), and
passes from its JSON log: neither depends on how busy the machine is. Only the upper
bounds of waits are generous; no assertion needs anything to be fast.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_watch import _config, _events, _names, _step, _wait_for

from ckptctl.tiering.config import load_config
from ckptctl.formats.manifest import MANIFEST
from ckptctl.service.wakes import wakes
from ckptctl.service.watch import Watcher

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="inotify and /proc are Linux's")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Watch:
    """A real ``ckptctl watch`` with a JSON log; ``passes`` counts its ``pass`` events as
    they are read off its stderr."""

    def __init__(self, cfg: Path, env: dict, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch", "--no-nice",
             "--log-format", "json", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.events: list[dict] = []
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))

    @property
    def passes(self) -> int:
        return sum(e["event"] == "pass" for e in list(self.events))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)


def test_reads_wake_nothing_writes_do():
    from watchdog.events import (DirModifiedEvent, FileClosedEvent, FileClosedNoWriteEvent,
                                 FileCreatedEvent, FileDeletedEvent, FileModifiedEvent,
                                 FileMovedEvent, FileOpenedEvent)

    for quiet in (FileOpenedEvent("/hot/s/.metadata"), FileClosedNoWriteEvent("/hot/s/x"),
                  FileModifiedEvent("/hot/s/x"), DirModifiedEvent("/hot/s")):
        assert not wakes(quiet), quiet
    for loud in (FileClosedEvent("/hot/s/x"), FileCreatedEvent("/hot/s/x"),
                 FileDeletedEvent("/hot/s/x"), FileMovedEvent("/hot/s/.m.tmp", "/hot/s/.m")):
        assert wakes(loud), loud
    own = ("/hot/watch.prom",)  # the metrics file watch rewrites after every pass
    assert not wakes(FileMovedEvent("/hot/watch.prom.7.8", "/hot/watch.prom"), own)
    assert not wakes(FileCreatedEvent("/hot/watch.prom.7.8"), own)
    assert wakes(FileMovedEvent("/hot/watch.prom.7.8", "/hot/step-1/x"), own)


def test_an_idle_watch_sleeps_and_a_new_checkpoint_still_wakes_it(tmp_path):
    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    _step(hot, 100)
    assert run_cli("--config", str(cfg), "watch", "--once", "--settle", "0")[0] == 0
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # the metrics file inside the first tier: rewritten after every pass, it must not
    # wake the next one
    w = _Watch(cfg, env, "--interval", "600", "--settle", "0",
               "--metrics-file", str(hot / "watch.prom"))
    try:
        assert _wait_for(lambda: w.passes >= 1, timeout=120), w.lines
        time.sleep(1.0)  # the first pass's own writes (status, metrics) have landed
        passes, cpu, t0 = w.passes, _cpu_seconds(w.proc.pid), time.monotonic()
        time.sleep(5.0)
        window = time.monotonic() - t0
        passes, cpu = w.passes - passes, _cpu_seconds(w.proc.pid) - cpu
        # at most one pass per interval (600 s), under 1% of a core (+ 2 clock ticks of
        # measurement slack); before the fix: ~45 passes/s and ~30% of a core here
        assert passes <= 1, (passes, w.lines[-5:])
        assert cpu < 0.01 * window + 0.02, (cpu, window, passes)
        # inotify still wakes it at once for a new checkpoint (no interval ends in time)
        _step(hot, 200)
        assert _wait_for(lambda: _names(str(warm)).get("step-200") == "sealed",
                         timeout=120), w.lines[-5:]
    finally:
        w.close()
    assert w.proc.returncode == 0, w.lines[-5:]


def test_a_settling_checkpoint_is_taken_when_it_settles_not_at_the_interval(tmp_path):
    # no file event comes when a settle time ends: the loop wakes itself for it (an idle
    # watch no longer spins through it on its own reads)
    cfg = _config(tmp_path, hot_keep=5, warm_keep=5)
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    w = _Watch(cfg, env, "--interval", "600", "--settle", "1")
    try:
        assert _wait_for(lambda: w.passes >= 1, timeout=120), w.lines
        _step(hot, 100)
        assert _wait_for(lambda: (warm / "step-100" / MANIFEST).exists(),
                         timeout=120), w.lines[-5:]
    finally:
        w.close()
    settling = [e for e in w.events if e.get("event") == "pass" and e["queued"]["hot"]]
    assert settling, "it was seen settling first"


def test_watch_never_seals_a_users_file_into_a_checkpoint(tmp_path):
    cfg = _config(tmp_path, hot_keep=1, warm_keep=5)
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    _step(hot, 100)
    mine = _step(hot, 200)
    (mine / "NOTES.md").write_text("the loss spiked at step 180\n")
    _step(hot, 300)
    code, out, _ = run_cli("--config", str(cfg), "watch", "--once", "--settle", "0", "--json")
    assert code == 1, out
    doc = json.loads(out)
    assert [(f["what"], f["name"], f["code"]) for f in doc["failed"]] == [
        ("seal", "step-200", "FOREIGN_FILES")]
    message = doc["failed"][0]["message"]
    assert "NOTES.md" in message and "seal it by hand" in message, message
    # the others went on; step-200 stays unsealed in the first tier, never promoted, never
    # trimmed (hot keeps 1: step-300; step-200 is "not yet in warm")
    assert _names(str(warm)) == {"step-100": "sealed", "step-300": "sealed"}
    assert _names(str(hot)) == {"step-200": "complete", "step-300": "sealed"}
    assert (mine / "NOTES.md").read_text() == "the loss spiked at step 180\n"
    assert not (mine / MANIFEST).exists()
    failed = [e for e in _events(cfg) if e["event"] == "failed"]
    assert failed and "NOTES.md" in failed[0]["message"]
    # sealed by hand, the note is the checkpoint's: the next pass takes it
    assert run_cli("seal", str(mine))[0] == 0
    p = Watcher(load_config(str(cfg)), settle=0).run_once()
    assert p.drained, p.to_dict()
    assert (warm / "step-200" / "NOTES.md").exists()
