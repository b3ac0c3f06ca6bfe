"""watch's ``/metrics`` endpoint and ``--metrics-file`` (issue 34): one thread whatever the
number of connections, idle ones closed after a while and past a cap, ``/metrics`` only,
loopback unless every interface is named; a metrics file that is not a regular file is
refused at start without being opened.

Ports are chosen by the kernel (port 0, read back); no assertion depends on how fast
anything runs, only the waits have (generous) upper bounds.
"""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_watch import _config, _wait_for

from ckptctl.errors import UsageError
from ckptctl.service.metrics import MetricsServer, WatchMetrics, parse_addr

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def descriptors():
    """Room for 1,000 connections at both ends in this one process."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if want < 2300:
        pytest.skip(f"too few file descriptors allowed ({hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _closed_by_server(sock: socket.socket) -> bool:
    """Wait (60 s at most) for the other end to close ``sock``."""
    sock.settimeout(60)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_thousand_idle_connections_hold_one_thread_and_a_scrape_still_answers(descriptors):
    m = WatchMetrics(["hot", "warm"])
    before = threading.active_count()
    srv = MetricsServer(m.registry, "127.0.0.1", 0, timeout=600)
    port = srv.address[1]
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=60))
        assert _wait_for(lambda: srv.connections == 1000, timeout=60), srv.connections
        # before: one thread per connection (1,003 here)
        assert threading.active_count() <= before + 1
        m.observe({"event": "found", "tier": "hot"})
        code, body = _get(port, "/metrics")
        assert code == 200
        assert b'ckptctl_watch_checkpoints_found_total{tier="hot"} 1.0' in body
        assert _get(port, "/metrics", "HEAD") == (200, b"")
        assert _get(port, "/metrics?name[]=x")[0] == 200
        for path in ("/", "/other", "/metrics/", "/../etc/passwd"):
            assert _get(port, path)[0] == 404, path
        assert _get(port, "/metrics", "POST")[0] == 405
        assert srv.connections >= 1000  # the idle ones are still held
    finally:
        for s in idle:
            s.close()
        srv.close()
    assert threading.active_count() <= before


def test_an_idle_connection_is_closed_after_the_timeout():
    srv = MetricsServer(WatchMetrics(["hot"]).registry, "127.0.0.1", 0, timeout=0.5)
    try:
        quiet = socket.create_connection(srv.address, timeout=60)
        half = socket.create_connection(srv.address, timeout=60)
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its request
        assert _closed_by_server(quiet) and _closed_by_server(half)
        assert _wait_for(lambda: srv.connections == 0, timeout=60)
        assert _get(srv.address[1], "/metrics")[0] == 200  # the endpoint goes on
    finally:
        quiet.close()
        half.close()
        srv.close()


def test_past_the_cap_the_oldest_connection_makes_room():
    srv = MetricsServer(WatchMetrics(["hot"]).registry, "127.0.0.1", 0, timeout=600,
                        max_connections=4)
    idle = []
    try:
        for _ in range(10):
            idle.append(socket.create_connection(srv.address, timeout=60))
        assert _closed_by_server(idle[0])
        assert _get(srv.address[1], "/metrics")[0] == 200
        assert srv.connections <= 4
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_an_oversized_request_is_refused():
    srv = MetricsServer(WatchMetrics(["hot"]).registry, "127.0.0.1", 0)
    try:
        with socket.create_connection(srv.address, timeout=60) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (64 << 10))
            head = s.recv(64)
        assert head.startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(srv.address, timeout=60) as s:
            s.sendall(b"nonsense\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400 ")
    finally:
        srv.close()


def test_port_alone_binds_loopback_every_interface_is_named():
    assert parse_addr(":9400") == ("127.0.0.1", 9400)
    assert parse_addr("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_addr("[::]:9400") == ("::", 9400)
    m = WatchMetrics(["hot"], addr=":0")
    try:
        assert m.server.address[0] == "127.0.0.1"
        assert _get(m.server.address[1], "/metrics")[0] == 200
    finally:
        m.close()
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_addr("9400")


def test_a_metrics_file_that_is_not_a_regular_file_is_refused(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    short = Path(os.environ.get("TMPDIR", "/tmp")) / f"m{os.getpid()}.sock"
    sock.bind(str(short))
    (tmp_path / "real.prom").write_text("# HELP ckptctl_watch_x\n")
    os.symlink(tmp_path / "real.prom", tmp_path / "link.prom")
    try:
        for path, kind in (("/dev/null", "a character device"), (str(tmp_path), "a directory"),
                           (str(short), "a socket"),
                           (str(tmp_path / "link.prom"), "a symbolic link")):
            with pytest.raises(UsageError, match=f"is {kind}, not a regular file"):
                WatchMetrics(["hot"], path=path)
    finally:
        sock.close()
        short.unlink()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # never replaced by a regular file
    assert (tmp_path / "link.prom").is_symlink()


def test_watch_refuses_a_fifo_at_once_instead_of_hanging(tmp_path):
    cfg = _config(tmp_path)
    fifo = tmp_path / "metrics.prom"
    os.mkfifo(fifo)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # before: open() of a FIFO with no writer blocked watch forever at start
    r = subprocess.run([sys.executable, "-m", "ckptctl", "--config", str(cfg), "watch",
                        "--once", "--no-nice", "--metrics-file", str(fifo)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "is a FIFO, not a regular file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
