"""Local S3 servers for the tests: ``rclone serve s3`` and ``moto_server``, on loopback.

Each server is started on a free port and fronted by a small counting reverse proxy
(stdlib ``http.server`` in a daemon thread of the calling process).  ``endpoint_url``,
``storage_options`` and ``env`` point at the proxy, so every request a client makes -- this
process or a subprocess such as the CLI -- is recorded as ``Request(method, path, range)``
before it is forwarded byte for byte (headers, bodies, chunked encoding, ranges) to the
server.  ``direct_endpoint_url`` bypasses the proxy (for throughput measurements).

    srv = start_rclone(tmpdir)          # or start_moto()
    make_bucket(srv, "b"); upload_dir(srv, "ckpt/", "b/run1/step10")
    srv.reset_log(); ...; gets = [r for r in srv.request_log() if r.op == "GET"]
    srv.stop()

rclone: fast (~0.1 s start), buckets are top-level folders of ``root``, ignores
``If-None-Match``, multipart ETag = MD5 of the whole file.  moto: ~1 s start, in memory,
enforces ``If-None-Match: *`` (412 -> ``FileExistsError`` in s3fs), AWS-style multipart
ETags, slow.  Never pass ``region_name`` to s3fs for moto (bucket creation fails).
rclone quirk: a ranged GET returns the whole object's ``x-amz-checksum-crc32``, so botocore's
default response checksum validation must be off (``storage_options``/``env`` do that).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

KEY = "ckptctl-test-key"  # rclone rejects very short keys ("K") as InvalidAccessKeyId
SECRET = "ckptctl-test-secret"
_COPY = 1 << 20
_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "transfer-encoding", "te", "upgrade"}


class Request(NamedTuple):
    """One request as the client sent it. ``path`` is the raw request target (with query)."""

    method: str
    path: str
    range: str | None
    #: ``x-amz-content-sha256``: the body's SHA-256, or ``UNSIGNED-PAYLOAD``
    payload_hash: str | None = None

    @property
    def key(self) -> str:
        """``bucket/key`` (URL-decoded, no query), ``bucket`` or ``""``."""
        return unquote(urlsplit(self.path).path).lstrip("/")

    @property
    def op(self) -> str:
        """``GET`` (object read), ``LIST`` (GET on a bucket or the service), else the method."""
        if self.method == "GET" and "/" not in self.key.rstrip("/"):
            return "LIST"
        return self.method


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream_port = upstream_port
        self.log: list[Request] = []
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.fault = None  # called with each Request before it is relayed (S3Server.fault_on)
        self.released = threading.Event()  # ends the wait of requests a "hold" fault keeps

    def process_request(self, request, client_address):
        with self.lock:
            self.conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self.lock:
            self.conns.discard(request)
        super().shutdown_request(request)

    def close(self) -> None:
        """Stop accepting, then cut the client connections still open (keep-alive)."""
        self.released.set()
        self.shutdown()
        self.server_close()
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address):  # client went away: not our business
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _ProxyHandler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # else each small answer waits ~40 ms for its ACK
    protocol_version = "HTTP/1.1"  # keep-alive towards the client; 100-continue handled here
    server: _Proxy

    def log_message(self, *args):
        pass

    def _relay(self):
        srv, h = self.server, self.headers
        req = Request(self.command, self.path, h.get("Range"), h.get("x-amz-content-sha256"))
        with srv.lock:
            srv.log.append(req)
            fault = srv.fault
        if fault is not None and fault(req) == "hold":
            srv.released.wait()  # never relayed, never answered; then the connection is cut
            self.close_connection = True
            return
        up = http.client.HTTPConnection("127.0.0.1", srv.upstream_port, timeout=900)
        try:
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in h.items():
                if k.lower() not in _HOP:
                    up.putheader(k, v)
            chunked = "chunked" in h.get("Transfer-Encoding", "").lower()
            if chunked:
                up.putheader("Transfer-Encoding", h["Transfer-Encoding"])
            up.putheader("Connection", "close")  # one upstream connection per request
            up.endheaders()
            if chunked:
                self._copy_chunked_request(up)
            else:
                self._copy(self.rfile, up.sock, int(h.get("Content-Length") or 0))
            resp = up.getresponse()
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            bodyless = self.command == "HEAD" or resp.status in (204, 304) or resp.status < 200
            rechunk = not bodyless and resp.length is None  # chunked or close-delimited upstream
            if rechunk:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if rechunk:
                while data := resp.read1(_COPY):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")
            elif not bodyless:
                while data := resp.read(_COPY):
                    self.wfile.write(data)
            self.wfile.flush()
        finally:
            up.close()

    def _copy(self, src, sock, n: int):
        while n > 0:
            data = src.read(min(n, _COPY))
            if not data:
                raise ConnectionError("client closed mid-body")
            sock.sendall(data)
            n -= len(data)

    def _copy_chunked_request(self, up):
        while True:
            line = self.rfile.readline(65537)
            up.sock.sendall(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:  # trailers, then the blank line
                while (line := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                    up.sock.sendall(line)
                up.sock.sendall(b"\r\n")
                return
            self._copy(self.rfile, up.sock, size + 2)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _relay


@dataclass
class S3Server:
    """A running S3 server (``kind`` ``"rclone"`` or ``"moto"``) behind a counting proxy."""

    endpoint_url: str
    key: str
    secret: str
    pid: int
    kind: str
    root: Path | None  # rclone: the directory served (buckets = its top-level folders)
    direct_endpoint_url: str = ""
    log_path: Path | None = None  # the server's stdout+stderr
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _proxy: _Proxy | None = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict:
        """kwargs for ``s3fs.S3FileSystem`` / ``fsspec`` (no ``region_name``: moto rejects it).

        ``response_checksum_validation="when_required"``: rclone answers a *ranged* GET of an
        object PUT with a checksum (botocore's default) with the whole object's
        ``x-amz-checksum-crc32``, which botocore then rejects (``FlexibleChecksumError``).
        """
        return {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": self.endpoint_url,
            "config_kwargs": {"read_timeout": 300, "response_checksum_validation": "when_required"},
        }

    @property
    def env(self) -> dict:
        """Environment for subprocesses (standard AWS variables); merge into ``os.environ``."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe 169.254.169.254
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",  # see storage_options
        }

    def request_log(self) -> list[Request]:
        """Requests received since the last ``reset_log()``, in arrival order."""
        with self._proxy.lock:
            return list(self._proxy.log)

    def reset_log(self) -> None:
        with self._proxy.lock:
            self._proxy.log.clear()

    def kill(self) -> None:
        """Die like a crashed server: stop listening (proxy and server), SIGKILL the server
        by pid. Requests in flight are cut; new connections are refused."""
        if self._proxy is not None:
            self._proxy.close()
        if self._proc is not None and self._proc.poll() is None:
            self.thaw()
            os.kill(self.pid, signal.SIGKILL)
            self._proc.wait()

    def freeze(self) -> None:
        """SIGSTOP the server: connections are still accepted (by the kernel), nothing is
        answered. Always :meth:`thaw` it (``with srv.frozen():`` does)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def frozen(self):
        self.freeze()
        try:
            yield self
        finally:
            self.thaw()

    def fault_on(self, when, action: str) -> threading.Event:
        """Once a request for which ``when(Request)`` is true reaches the proxy, ``kill``
        or ``freeze`` the server before relaying it (the request then fails or hangs), or
        ``hold`` it and every request after it (retries included): they never reach the
        server and are never answered (a frozen server would still act on them once thawed,
        a race with what a test looks at next).
        Returns an event set when that happened. ``fault_on(None, "")`` clears it and cuts
        the held request's connection."""
        fired = threading.Event()

        def hook(req: Request) -> str | None:
            if fired.is_set() and action == "hold":
                return "hold"
            if fired.is_set() or not when(req):
                return None
            fired.set()
            if action == "hold":
                return "hold"
            if action == "kill":
                self.kill()  # this request's own connection is cut too
            elif action == "freeze":
                self.freeze()
            else:
                raise ValueError(f"unknown fault action {action!r}")

        with self._proxy.lock:
            self._proxy.fault = hook if when is not None else None
            if when is None:
                self._proxy.released.set()
            else:
                self._proxy.released.clear()
        return fired

    def stop(self) -> None:
        """Kill the server by pid (TERM, then KILL after 10 s), wait for it, close the proxy."""
        if self._proxy is not None:
            self._proxy.close()
        if self._proc is not None and self._proc.poll() is None:
            self.thaw()  # a stopped process would not act on TERM
            os.kill(self.pid, 15)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, 9)
                self._proc.wait()
        if self in _RUNNING:
            _RUNNING.remove(self)
            if self.log_path is not None:
                shutil.rmtree(self.log_path.parent, ignore_errors=True)


_RUNNING: list[S3Server] = []
atexit.register(lambda: [s.stop() for s in list(_RUNNING)])


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _start(kind: str, argv_for_port, root: Path | None, timeout: float) -> S3Server:
    logdir = Path(tempfile.mkdtemp(prefix=f"s3server-{kind}-"))
    for attempt in range(5):
        port = free_port()
        log_path = logdir / f"server-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv_for_port(port), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/")
                c.getresponse().read()
                c.close()
                break
            except OSError:
                time.sleep(0.02)
        if proc.poll() is None and time.monotonic() < deadline:
            proxy = _Proxy(port)
            threading.Thread(target=proxy.serve_forever, args=(0.05,), name=f"s3proxy-{kind}", daemon=True).start()
            srv = S3Server(
                endpoint_url=f"http://127.0.0.1:{proxy.server_address[1]}",
                key=KEY, secret=SECRET, pid=proc.pid, kind=kind, root=root,
                direct_endpoint_url=f"http://127.0.0.1:{port}", log_path=log_path,
                _proc=proc, _proxy=proxy,
            )
            _RUNNING.append(srv)
            return srv
        if proc.poll() is None:  # timed out: kill it and report
            proc.kill()
            proc.wait()
            error = f"did not answer on 127.0.0.1:{port} within {timeout:.0f} s; log tail:\n{_tail(log_path)}"
            break
        error = f"exited with {proc.returncode}; log tail:\n{_tail(log_path)}"
        if "in use" not in error.lower():  # only a port collision is worth a retry
            break
    shutil.rmtree(logdir, ignore_errors=True)
    raise RuntimeError(f"{kind} S3 server failed to start: {error}")


def start_rclone(root_dir, timeout: float = 30, *, read_only: bool = False) -> S3Server:
    """``rclone serve s3`` over ``root_dir`` (created if missing). ``read_only``: the server
    refuses every write (``--read-only``: PUT and DELETE answer 500 InternalError), like a
    bucket behind read-only keys; serve the root of a writable server to see its data."""
    root = Path(root_dir)
    root.mkdir(parents=True, exist_ok=True)
    rclone = _binary("rclone")
    # read-only: another server writes the data, so nothing may be served from a cached
    # listing (rclone's VFS keeps folder listings 5 minutes by default)
    flags = ["--read-only", "--dir-cache-time", "0s"] if read_only else []
    return _start("rclone", lambda port: [
        rclone, "serve", "s3", *flags, "--addr", f"127.0.0.1:{port}", "--auth-key",
        f"{KEY},{SECRET}", "--config", "/dev/null", str(root)], root, timeout)


def start_moto(timeout: float = 60) -> S3Server:
    """``moto_server`` (in-memory; accepts any credentials)."""
    moto = _binary("moto_server")
    return _start("moto", lambda port: [moto, "-H", "127.0.0.1", "-p", str(port)], None, timeout)


class SilentServer:
    """A loopback port that accepts TCP connections and never answers: it reads nothing
    and sends nothing until :meth:`stop` (a hung server, a black-holing middlebox).

        with SilentServer() as silent:
            ... AWS_ENDPOINT_URL=silent.endpoint_url ...
    """

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="s3-silent", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.conns.append(conn)
            self.accepted += 1

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        for c in self.conns + [self.sock]:
            try:
                c.close()
            except OSError:
                pass

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def fresh_fs(server: S3Server):
    """A new, uncached ``s3fs.S3FileSystem`` for ``server`` (no instance or listings cache)."""
    import s3fs

    return s3fs.S3FileSystem(**server.storage_options, skip_instance_cache=True, use_listings_cache=False)


def make_bucket(server: S3Server, name: str) -> None:
    fresh_fs(server).mkdir(name)


def upload_dir(server: S3Server, local_dir, dest: str) -> list[str]:
    """Upload every file under ``local_dir`` (dotfiles included) to ``"bucket/prefix"``,
    keeping relative paths; returns the object paths written."""
    local_dir = Path(local_dir)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    remote = [f"{dest.rstrip('/')}/{p.relative_to(local_dir).as_posix()}" for p in files]
    if files:
        fresh_fs(server).put([str(p) for p in files], remote)
    return remote
