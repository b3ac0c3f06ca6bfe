"""Prometheus metrics of ``watch``: a text file for node_exporter's textfile collector
(``--metrics-file``, written whole to a temporary file and renamed over the old one) and an
optional HTTP ``/metrics`` endpoint (``--metrics-addr``: loopback unless an address is
named; one thread, bounded connections, :class:`MetricsServer`), both from one registry of
``prometheus_client``, fed by the watcher's events as they happen.

Names carry their unit (``_bytes``, ``_seconds``) and counters end in ``_total``:

======================================================== =====================================
``ckptctl_watch_checkpoints_found_total{tier}``          first-tier checkpoints seen
``ckptctl_watch_checkpoints_sealed_total{tier}``         sealed by watch in that tier
``ckptctl_watch_checkpoints_promoted_total{src,dst}``    hops committed in ``dst``
``ckptctl_watch_checkpoints_failed_total{tier,what}``    failed steps (list, seal, promote, gc)
``ckptctl_watch_checkpoints_removed_total{tier}``        removed by the tier's keep
``ckptctl_watch_moved_bytes_total{src,dst}``             bytes sent by hops
``ckptctl_watch_hop_seconds{src,dst}``                   histogram of hop durations
``ckptctl_watch_queue_depth{tier}``                      checkpoints of the tier still waiting
``ckptctl_watch_newest_pending_age_seconds{tier}``       age of the newest first-tier checkpoint
                                                         not yet committed in the tier (0: none)
``ckptctl_watch_last_pass_timestamp_seconds``            end of the last pass (Unix time)
``ckptctl_watch_last_success_timestamp_seconds``         end of the last pass without a failure
``ckptctl_watch_last_pass_duration_seconds``             how long the last pass took
======================================================== =====================================

>>> m = WatchMetrics(["hot", "warm"])
>>> m.observe({"event": "promoted", "src": "hot", "dst": "warm", "action": "promoted",
...            "bytes": 10, "bytes_sent": 10, "seconds": 0.5})
>>> 'ckptctl_watch_moved_bytes_total{dst="warm",src="hot"} 10.0' in m.text()
True
"""
from __future__ import annotations

import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable

#: Hop durations are seconds to hours: histogram buckets spread over that range.
HOP_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, float("inf"))

#: The HTTP endpoint's bounds (:class:`MetricsServer`): a connection that has not sent a
#: whole request this many seconds after it opened is closed (a scraper sends its request
#: at once); a request head longer than MAX_REQUEST_BYTES is refused; past
#: MAX_CONNECTIONS open connections the oldest is closed to make room for the newest.
CONNECTION_SECONDS = 5.0
MAX_REQUEST_BYTES = 16 << 10
MAX_CONNECTIONS = 1024


def parse_addr(addr: str) -> tuple[str, int]:
    """``--metrics-addr``'s ``HOST:PORT``; ``:PORT`` is the loopback address (every
    interface must be named: ``0.0.0.0:PORT``, ``[::]:PORT``).

    >>> parse_addr(":9400"), parse_addr("0.0.0.0:9400"), parse_addr("[::1]:9400")
    (('127.0.0.1', 9400), ('0.0.0.0', 9400), ('::1', 9400))
    """
    from ..errors import UsageError

    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"--metrics-addr {addr!r}: expected HOST:PORT or :PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


#: What ``--metrics-file`` may name besides a regular file, by kind, to say what it is.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def _refuse_foreign_file(path: str) -> None:
    """``--metrics-file`` replaces its file whole: it must be a regular file or not exist
    yet. Anything else (a FIFO, a device node, a socket, a directory, a symbolic link) is
    refused without being opened (opening a FIFO would block, a device may act on it), and
    so is a file that holds something else (a typo naming the tier config).

    >>> _refuse_foreign_file("/no/such/file.prom")
    >>> _refuse_foreign_file("/dev/null")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --metrics-file /dev/null: is a character device, not a regular file; name a *.prom file (a new one, or watch's own)
    """
    from ..errors import UsageError

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"--metrics-file {path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise UsageError(f"--metrics-file {path}: is {kind}, not a regular file; name a "
                         "*.prom file (a new one, or watch's own)")
    try:  # O_NONBLOCK and a second look: whatever was swapped in since, never a hang
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"--metrics-file {path}: cannot read it ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"--metrics-file {path}: is not a regular file")
        head = os.read(fd, 64)
    finally:
        os.close(fd)
    if head and not head.startswith(b"# HELP ckptctl_watch_"):
        raise UsageError(f"--metrics-file {path}: holds something other than watch's "
                         "metrics; refusing to overwrite it (name a new *.prom file)")


class WatchMetrics:
    """The registry of the metrics above for the tiers named ``tiers``; ``path``: the text
    file written after each event and pass; ``addr``: serve ``/metrics`` there (a daemon
    thread). A text file that cannot be written is reported once through ``warn(message)``
    and never stops the watch.

    >>> WatchMetrics(["hot"]).text().count("ckptctl_watch_queue_depth{tier=\\"hot\\"}")
    1
    """

    def __init__(self, tiers: list[str], *, path: str | None = None, addr: str | None = None,
                 warn: Callable[[str], None] | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        if path:
            _refuse_foreign_file(path)
        self.path = path
        self.warn = warn
        self._warned = False
        r = self.registry = CollectorRegistry()
        pre = "ckptctl_watch_"
        self.found = Counter(pre + "checkpoints_found", "First-tier checkpoints seen",
                             ["tier"], registry=r)
        self.sealed = Counter(pre + "checkpoints_sealed", "Checkpoints sealed by watch",
                              ["tier"], registry=r)
        self.promoted = Counter(pre + "checkpoints_promoted",
                                "Checkpoints committed in dst by a hop", ["src", "dst"],
                                registry=r)
        self.failed = Counter(pre + "checkpoints_failed",
                              "Failed steps (what: list, seal, promote, gc)",
                              ["tier", "what"], registry=r)
        self.removed = Counter(pre + "checkpoints_removed",
                               "Checkpoints removed by the tier's keep", ["tier"], registry=r)
        self.moved = Counter(pre + "moved_bytes", "Bytes sent by hops", ["src", "dst"],
                             registry=r)
        self.hop = Histogram(pre + "hop_seconds", "Duration of hops that sent bytes",
                             ["src", "dst"], buckets=HOP_BUCKETS, registry=r)
        self.queue = Gauge(pre + "queue_depth", "Checkpoints of the tier still waiting",
                           ["tier"], registry=r)
        self.behind = Gauge(pre + "newest_pending_age_seconds",
                            "Age of the newest first-tier checkpoint not yet committed in "
                            "the tier (0: none waits)", ["tier"], registry=r)
        self.last_pass = Gauge(pre + "last_pass_timestamp_seconds",
                               "End of the last pass (Unix time)", registry=r)
        self.last_success = Gauge(pre + "last_success_timestamp_seconds",
                                  "End of the last pass without a failure (Unix time)",
                                  registry=r)
        self.pass_seconds = Gauge(pre + "last_pass_duration_seconds",
                                  "How long the last pass took", registry=r)
        for i, t in enumerate(tiers):  # every series exists from the start, at 0
            self.queue.labels(t)
            self.removed.labels(t)
            if i == 0:
                self.found.labels(t)
                self.sealed.labels(t)
            else:
                self.behind.labels(t)
                self.promoted.labels(tiers[i - 1], t)
                self.moved.labels(tiers[i - 1], t)
        #: the HTTP endpoint (None without ``addr``): its ``address`` is where it listens
        self.server: MetricsServer | None = None
        if addr:
            host, port = parse_addr(addr)
            try:
                self.server = MetricsServer(r, host, port)
            except OSError as e:
                from ..errors import UsageError

                raise UsageError(f"--metrics-addr {addr}: cannot listen ({e.strerror})") \
                    from None

    def observe(self, doc: dict) -> None:
        """Count one watch event (the documents of ``events.jsonl``, and the ``pass``
        summary :meth:`ckptctl.service.watch.Watcher.run_once` announces).

        >>> WatchMetrics(["hot"]).observe({"event": "found", "tier": "hot"})
        """
        ev = doc.get("event")
        if ev == "found":
            self.found.labels(doc["tier"]).inc()
        elif ev == "sealed":
            self.sealed.labels(doc["tier"]).inc()
        elif ev in ("promoted", "part-promoted"):
            src, dst = doc["src"], doc["dst"]
            if doc.get("action") != "up-to-date":
                if ev == "promoted":
                    self.promoted.labels(src, dst).inc()
                self.moved.labels(src, dst).inc(doc.get("bytes_sent") or 0)
                if doc.get("bytes_sent") and doc.get("seconds"):
                    self.hop.labels(src, dst).observe(doc["seconds"])
        elif ev == "failed":
            self.failed.labels(doc["tier"], doc["what"]).inc()
        elif ev == "removed":
            self.removed.labels(doc["tier"]).inc()
        elif ev == "pass":
            for tier, n in (doc.get("queued") or {}).items():
                self.queue.labels(tier).set(n)
            for tier, age in (doc.get("newest_pending_age_seconds") or {}).items():
                self.behind.labels(tier).set(age or 0)
            self.last_pass.set(doc["ended"])
            self.pass_seconds.set(doc["seconds"])
            if not doc.get("failed"):
                self.last_success.set(doc["ended"])
        else:
            return
        self.write()

    def text(self) -> str:
        """The exposition text (what ``/metrics`` serves)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Stop serving ``/metrics`` (nothing without an endpoint).

        >>> WatchMetrics(["hot"], addr="127.0.0.1:0").close()
        """
        if self.server is not None:
            self.server.close()

    def write(self) -> None:
        """Write the text file (temporary file, rename): a scrape never sees half of it."""
        if not self.path:
            return
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(self.path, self.registry)
        except OSError as e:
            if not self._warned and self.warn is not None:
                self._warned = True
                self.warn(f"cannot write the metrics file {self.path} ({e.strerror}); "
                          "the watch goes on")


class _Conn:
    """One connection of :class:`MetricsServer`: what it has sent so far, what is left to
    send it back, and when it is closed whatever it does."""

    __slots__ = ("sock", "deadline", "request", "reply", "answered")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.request = bytearray()
        self.reply: memoryview | None = None
        self.answered = False  # the reply is sent: what comes in is read and dropped


class MetricsServer:
    """``GET /metrics`` (and ``HEAD``) of ``registry`` over HTTP at ``host:port`` (port 0:
    any free one, read back from :attr:`address`), from one thread whatever the number
    of connections: a selector, never a thread per connection. Every other path is 404;
    each connection gets one answer (then the server's end is shut), and is closed
    :data:`CONNECTION_SECONDS` after it opened whatever it does; past
    :data:`MAX_CONNECTIONS` the oldest is closed, so a scrape always gets in.

    >>> from prometheus_client import CollectorRegistry
    >>> srv = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    >>> srv.address[0]
    '127.0.0.1'
    >>> srv.close()
    """

    def __init__(self, registry, host: str, port: int, *,
                 timeout: float = CONNECTION_SECONDS, max_connections: int = MAX_CONNECTIONS):
        self.registry = registry
        self.timeout = timeout
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=256)
        self._listener.setblocking(False)
        self.address: tuple = self._listener.getsockname()
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wakeup_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # in the order they opened
        self._paused_until = 0.0  # out of file descriptors: accept again then
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckptctl-metrics",
                                        daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """How many connections are open now."""
        return len(self._conns)

    def close(self) -> None:
        """Stop the thread and close every connection and the listening socket."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wakeup_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)
        for sock in list(self._conns):
            self._drop(sock)
        for s in (self._listener, self._wakeup_r, self._wakeup_w):
            s.close()
        self._sel.close()

    # -- the serving thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            for key, events in self._sel.select(self._next_timeout()):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is not self._wakeup_r:
                    try:
                        self._serve(key.fileobj, events)
                    except Exception:  # one connection's trouble never stops the endpoint
                        self._drop(key.fileobj)
            self._expire()

    def _next_timeout(self) -> float | None:
        """Seconds until the oldest connection's deadline or the end of a pause; None
        (sleep until something happens) when neither is due."""
        now = time.monotonic()
        due = [next(iter(self._conns.values())).deadline] if self._conns else []
        if self._paused_until:
            due.append(self._paused_until)
        return max(0.0, min(due) - now) if due else None

    def _expire(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)
        # every connection has the same time to live: the oldest are first
        while self._conns:
            sock, conn = next(iter(self._conns.items()))
            if conn.deadline > now:
                break
            self._drop(sock)

    def _accept(self) -> None:
        import errno

        for _ in range(64):  # a burst of connections does not starve those open
            try:
                sock, _addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._conns:  # out of descriptors: the oldest makes room
                        self._drop(next(iter(self._conns)))
                        continue
                    self._sel.unregister(self._listener)
                    self._paused_until = time.monotonic() + 1.0
                return
            if len(self._conns) >= self.max_connections:
                self._drop(next(iter(self._conns)))
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic() + self.timeout)
            self._sel.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _serve(self, sock: socket.socket, events: int) -> None:
        conn = self._conns[sock]
        if conn.reply is None:
            data = sock.recv(4096)
            if not data:
                self._drop(sock)
                return
            if conn.answered:
                return
            conn.request += data
            end = conn.request.find(b"\r\n\r\n")
            if end < 0 and len(conn.request) <= MAX_REQUEST_BYTES:
                return
            head = bytes(conn.request[:end]) if end >= 0 else None
            conn.reply = memoryview(self._reply(head))
            self._sel.modify(sock, selectors.EVENT_WRITE)
        try:
            sent = sock.send(conn.reply)
        except BlockingIOError:
            return  # its send buffer is full: the selector says when it drains
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            # closed once the client has read the reply and closed its end: a close with
            # unread bytes (the rest of a request too long) would reset the connection and
            # could lose the reply on its way
            sock.shutdown(socket.SHUT_WR)
            conn.reply, conn.answered = None, True
            self._sel.modify(sock, selectors.EVENT_READ)

    def _reply(self, head: bytes | None) -> bytes:
        """The whole HTTP response to a request head (None: too long)."""
        if head is None:
            return _response(431, "Request Header Fields Too Large")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "Bad Request")
        method, target = parts[0], parts[1]
        from urllib.parse import urlsplit

        if urlsplit(target).path != "/metrics":
            return _response(404, "Not Found", b"only /metrics is served here\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", headers={"Allow": "GET, HEAD"})
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (line.partition(":") for line in lines[1:])}
        from prometheus_client.exposition import choose_encoder

        encoder, ctype = choose_encoder(fields.get("accept", ""))
        body = encoder(self.registry)
        headers = {"Content-Type": ctype}
        if "gzip" in fields.get("accept-encoding", ""):
            import gzip

            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return _response(200, "OK", body, headers=headers, head_only=method == "HEAD")


def _response(code: int, reason: str, body: bytes = b"", *, headers: dict | None = None,
              head_only: bool = False) -> bytes:
    """An HTTP/1.1 response that closes its connection.

    >>> _response(404, "Not Found", b"no\\n").split(b"\\r\\n")[0]
    b'HTTP/1.1 404 Not Found'
    """
    headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {}),
               "Content-Length": str(len(body)), "Connection": "close"}
    head = f"HTTP/1.1 {code} {reason}\r\n" + "".join(f"{k}: {v}\r\n"
                                                      for k, v in headers.items())
    return (head + "\r\n").encode("latin-1") + (b"" if head_only else body)
