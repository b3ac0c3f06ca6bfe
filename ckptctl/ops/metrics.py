"""Prometheus metrics of ``watch``: a text file for node_exporter's textfile collector
(``--metrics-file``, written whole to a temporary file and renamed over the old one) and an
optional HTTP ``/metrics`` endpoint (``--metrics-addr``), both from one registry of
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

from collections.abc import Callable

#: Hop durations are seconds to hours: histogram buckets spread over that range.
HOP_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, float("inf"))


def parse_addr(addr: str) -> tuple[str, int]:
    """``--metrics-addr``'s ``HOST:PORT`` (``:PORT`` listens on every address).

    >>> parse_addr(":9400"), parse_addr("127.0.0.1:9400"), parse_addr("[::1]:9400")
    (('0.0.0.0', 9400), ('127.0.0.1', 9400), ('::1', 9400))
    """
    from ..errors import UsageError

    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"--metrics-addr {addr!r}: expected HOST:PORT or :PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _refuse_foreign_file(path: str) -> None:
    """``--metrics-file`` replaces its file whole: one that holds something else (a typo
    naming the tier config) is refused, never overwritten.

    >>> _refuse_foreign_file("/no/such/file.prom")
    """
    from ..errors import UsageError

    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"--metrics-file {path}: cannot read it ({e.strerror})") from None
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
        if addr:
            from prometheus_client import start_http_server

            host, port = parse_addr(addr)
            try:
                start_http_server(port, host, registry=r)
            except OSError as e:
                from ..errors import UsageError

                raise UsageError(f"--metrics-addr {addr}: cannot listen ({e.strerror})") \
                    from None

    def observe(self, doc: dict) -> None:
        """Count one watch event (the documents of ``events.jsonl``, and the ``pass``
        summary :meth:`ckptctl.ops.watch.Watcher.run_once` announces).

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
