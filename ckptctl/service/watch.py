"""``watch``: drain new checkpoints down the tiers of a config and trim each tier.

The tiers' listings are the state (DESIGN.md, "watch"): a checkpoint committed in tier i
and not committed in tier i+1 needs that hop, and promote's own journal resumes a
half-done one. A pass (:meth:`Watcher.run_once`):

1. lists the first tier; a checkpoint there is ready when ``ls`` calls it ``complete`` or
   ``sealed`` and its listing (bytes, files, marker time) has not changed for ``settle``
   seconds; a ready one is sealed at the source;
2. promotes, hop by hop down the tiers, one checkpoint at a time per tier pair (oldest
   first), with the destination tier's ``pack`` and ``bwlimit``;
3. applies each tier's ``keep`` (gc) with a rail: in every tier but the last, a checkpoint
   not yet committed in the next tier is kept ("not yet in TIER"); when the next tier
   cannot be listed, everything is kept;
4. records errors with their next retry time (exponential backoff across passes; an edit
   of the config of the tiers involved is tried at once, its backoff started afresh); an
   error never turns into a deletion.

What it keeps beside that, under ``$XDG_CACHE_HOME/ckptctl/watch/<hash of the config
path>/``: ``events.jsonl`` (one JSON line per action) and ``status.json`` (queued, in
flight, done, failed, rates). Its lock is keyed on what it acts on, the first tier
(:func:`lock_path`, in ``ckptctl/watch-locks/``): one watch per node and first tier,
whatever config file names it.

>>> w = Watcher(config, settle=0)                    # doctest: +SKIP
>>> p = w.run_once(); p.drained, [h.name for h in p.promoted]   # doctest: +SKIP
(True, ['step-100', 'step-100'])
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field, replace

from ..tiering.config import Config, Tier
from ..errors import CkptError, Finding, NotFoundError, StorageError, UsageError
from ..tiering.policy import COMMITTED

#: Backoff of a failing step: BASE, 2*BASE, 4*BASE... up to MAX seconds.
BACKOFF_BASE = 30.0
BACKOFF_MAX = 3600.0
#: How many finished hops status.json remembers.
DONE_KEPT = 50
#: How many first-tier arrivals (name, bytes, time) status.json remembers: the interval
#: ``--status`` reports is the median gap between them.
ARRIVALS_KEPT = 20


@dataclass
class Hop:
    """One promotion: ``name`` from tier ``src`` to tier ``dst``."""

    name: str
    src: str
    dst: str
    action: str  # promoted | up-to-date
    bytes: int
    bytes_sent: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Failure:
    """A step that failed: ``what`` is ``list``, ``seal``, ``promote`` or ``gc``."""

    key: str
    what: str
    tier: str
    name: str | None
    code: str
    message: str
    attempts: int
    next_retry: float


@dataclass
class WatchPass:
    """What one pass found and did. ``pending``: (tier, name, why) of what still waits."""

    started: float
    seconds: float = 0.0
    found: list[str] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)
    promoted: list[Hop] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    removed: dict[str, list[str]] = field(default_factory=dict)
    pending: list[dict] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    #: tier -> age in seconds of the newest checkpoint not yet committed there (0: none)
    behind: dict[str, float] = field(default_factory=dict)
    #: name -> seconds the listing of a ``settling`` one has been unchanged, as watch saw
    #: it (it is taken at ``settle`` seconds)
    unchanged: dict[str, float] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        """Nothing pending and nothing failed."""
        return not self.pending and not self.failed

    @property
    def ok(self) -> bool:
        """Nothing failed, and whatever is pending is on its way (:func:`on_its_way`):
        ``--once`` exits 0.

        >>> WatchPass(0.0, pending=[{"tier": "hot", "name": "s-1", "why": "settling"}]).ok
        True
        >>> WatchPass(0.0, pending=[{"tier": "hot", "name": "s-1", "why": "incomplete"}]).ok
        False
        """
        return not self.failed and all(on_its_way(x["why"]) for x in self.pending)

    def to_dict(self) -> dict:
        return {
            "started": iso_time(self.started), "seconds": round(self.seconds, 3),
            "drained": self.drained, "ok": self.ok, "found": list(self.found),
            "sealed": list(self.sealed),
            "promoted": [{**asdict(h), "bytes_per_second": round(h.rate)}
                         for h in self.promoted],
            "kept": {k: list(v) for k, v in self.kept.items()},
            "removed": {k: list(v) for k, v in self.removed.items()},
            "pending": [dict(p) for p in self.pending],
            "failed": [{**asdict(f), "next_retry": iso_time(f.next_retry)} for f in self.failed],
            "newest_pending_age_seconds": {k: round(v, 3) for k, v in self.behind.items()},
            "unchanged_seconds": dict(self.unchanged),
        }

    def queued(self, tiers: list[str]) -> dict[str, int]:
        """How many checkpoints wait in each tier (every tier named, 0 included)."""
        out = dict.fromkeys(tiers, 0)
        for x in self.pending:
            out[x["tier"]] = out.get(x["tier"], 0) + 1
        return out


def on_its_way(why: str) -> bool:
    """Is a pending checkpoint's reason (``why``) one that time alone resolves, not a
    problem: ``settling`` (complete, its listing not yet unchanged for ``--settle``
    seconds), or ``waiting for`` the next tier or the other nodes? An ``incomplete`` or
    ``corrupt`` one is not: a save that died stays so.

    >>> on_its_way("settling"), on_its_way("waiting for warm"), on_its_way("incomplete")
    (True, True, False)
    """
    return why == "settling" or why.startswith("waiting for ")


def drain_rate(nbytes: int, bytes_sent: int, seconds: float, *, pack: bool) -> float | None:
    """The rate a hop measured, in bytes of the checkpoint drained per second: what it
    sent (a resumed copy sends only what was missing) over its time; into a pack tier the
    checkpoint's bytes (a pack sends fewer, compressed or a delta, and S over that rate is
    the drain time ``--status`` reports). None when it sent nothing.

    >>> drain_rate(100, 40, 2.0, pack=False), drain_rate(100, 10, 2.0, pack=True)
    (20.0, 50.0)
    >>> drain_rate(100, 0, 0.1, pack=False) is None
    True
    """
    if not bytes_sent or seconds <= 0:
        return None
    return (nbytes if pack else bytes_sent) / seconds


def iso_time(ts: float | None) -> str | None:
    from ..catalog.ls import iso_utc

    return iso_utc(ts)


def arrival_time(arrival: dict) -> float:
    """When a first-tier checkpoint arrived (seconds since the epoch), from an entry of
    the status's ``arrivals``: ``modified`` (ISO-8601 UTC, as ``ls``), or ``time`` (a
    number: the status files of ckptctl before 2026-12).

    >>> arrival_time({"modified": "1970-01-01T00:16:40Z"}), arrival_time({"time": 5.0})
    (1000.0, 5.0)
    """
    import calendar

    if "modified" in arrival:
        return float(calendar.timegm(time.strptime(arrival["modified"], "%Y-%m-%dT%H:%M:%SZ")))
    return float(arrival["time"])


def state_dir(config_path: str, node_rank: int | None = None) -> str:
    """Where watch keeps its log, status and lock for the config at ``config_path``:
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/ckptctl/watch/<16 hex digits>``, with
    ``-node<N>`` for ``--node-rank N`` (a home directory shared by the nodes).

    >>> d = state_dir("/etc/ckptctl.toml")
    >>> d.split(os.sep)[-3:-1], len(os.path.basename(d))
    (['ckptctl', 'watch'], 16)
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(os.path.abspath(config_path).encode()).hexdigest()[:16]
    return os.path.join(base, "ckptctl", "watch", digest
                        + ("" if node_rank is None else f"-node{node_rank}"))


def read_status(config_path: str, node_rank: int | None = None) -> dict | None:
    """The status file of the watch of ``config_path``; None when no watch has run.

    >>> read_status("/no/such/config.toml") is None
    True
    """
    path = os.path.join(state_dir(config_path, node_rank), "status.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorageError(path,
                           f"cannot read the watch status ({e})") from None


def lock_path(config: Config, node_rank: int | None = None) -> str:
    """The lock of a watch of ``config``: ``$XDG_CACHE_HOME/ckptctl/watch-locks/<16 hex
    digits>.lock`` (``-node<N>`` for ``--node-rank N``), the digits a hash of the first
    tier (the tier a watch seals, drains and trims, and the node's own) with its URL
    normalised: a local path resolved (symlinks too), a remote URL with its endpoint. Any
    copy of a config names the same lock; so does any config with the same first tier.

    >>> a = lock_path(Config("a.toml", (Tier("hot", "/nvme/run1"), Tier("warm", "/lustre/r"))))
    >>> a == lock_path(Config("/etc/copy.toml", (Tier("nvme", "/nvme/run1/"),)))
    True
    >>> a == lock_path(Config("a.toml", (Tier("hot", "/nvme/run2"),)))
    False
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(_tier_identity(config.tiers[0]).encode()).hexdigest()[:16]
    return os.path.join(base, "ckptctl", "watch-locks", digest
                        + ("" if node_rank is None else f"-node{node_rank}") + ".lock")


def _tier_identity(tier: Tier) -> str:
    url = tier.url
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return "file://" + os.path.realpath(url)
    scheme, rest = url.split("://", 1)
    opts = tier.storage_options or {}
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or "")
    scheme = "s3" if scheme in ("s3", "s3a") else scheme
    return f"{scheme}://{rest.strip('/')} at {str(endpoint).rstrip('/')}"


def lock_holder(config: Config, node_rank: int | None = None) -> dict | None:
    """The watch that holds, or last held, the lock of ``config``'s first tier
    (:func:`lock_path`): ``{"pid", "config", "tier", "url"}`` as it wrote them when it took
    the lock (``{}`` before it has); None when no watch ever took it. Read without locking
    (a probe by lock would make a starting watch see it held); whether that watch still
    runs is the lock's to say (:meth:`Watcher.lock`).

    >>> lock_holder(Config("c.toml", (Tier("hot", "/no/such/tier"),))) is None
    True
    """
    path = lock_path(config, node_rank)
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 10)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(path, f"cannot read the watch lock ({e.strerror})") from None
    try:
        doc = json.loads(data or b"{}")
    except ValueError:
        return {}  # torn, or written by an older ckptctl (a bare pid)
    return doc if isinstance(doc, dict) else {}


def watch_status(config: Config, node_rank: int | None = None) -> tuple[Config, dict | None]:
    """What ``watch --status`` shows: the status of the watch that holds, or last held,
    the lock of ``config``'s first tier (:func:`lock_holder`), even when it was started
    from a copy of this config file, with the config it ran (this one when that file
    cannot be read); else the status of the last watch of this config file (None: none
    has run).

    >>> watch_status(Config("/no/such.toml", (Tier("hot", "/no/such/tier"),)))[1] is None
    True
    """
    from ..tiering.config import load_config

    held = lock_holder(config, node_rank) or {}
    other = held.get("config")
    if isinstance(other, str) and other != os.path.abspath(config.path):
        doc = read_status(other, node_rank)
        if doc is not None:
            try:
                return load_config(other), doc
            except CkptError:
                return Config(other, config.tiers), doc
    return config, read_status(config.path, node_rank)


@dataclass
class MeasuredPlan:
    """``plan``'s figures from what watch measured (``watch --status``): S the newest
    first-tier checkpoint's bytes (in multi-node, this node's part: the figures are then
    per node), tau the median gap between the last first-tier arrivals, each tier's rates
    from its newest hops, each labelled by the hop it was measured on (``measured on hot
    -> warm``: warm's write and hot's read; a tier nothing is read from yet is recovered
    at its write rate, "(a write)"). No save time or MTBF is known here: the optimal
    interval is ``ckptctl plan``'s."""

    checkpoint_name: str
    checkpoint_bytes: int
    interval_seconds: float | None
    gaps: int
    node_bandwidth_bytes_per_second: float | None
    local_capacity_bytes: int
    hops: list = field(default_factory=list)
    recovery: list = field(default_factory=list)

    @property
    def all_fit(self) -> bool | None:
        """False when a hop does not fit, True when every one does, None when one is
        unknown or there is no hop (nothing was checked)."""
        fits = [h.fits for h in self.hops]
        return False if False in fits else None if None in fits or not fits else True

    def to_dict(self) -> dict:
        from ..tiering.plan import whole_rate

        def whole(d: dict) -> dict:
            return {**d, "bytes_per_second": whole_rate(d["bytes_per_second"])}

        doc = {k: v for k, v in asdict(self).items() if k not in ("hops", "recovery")}
        doc["node_bandwidth_bytes_per_second"] = whole_rate(
            self.node_bandwidth_bytes_per_second)
        return {**doc, "all_fit": self.all_fit,
                "hops": [whole(asdict(h)) for h in self.hops],
                "recovery": [whole({**asdict(r), "rate_kind": r.rate_kind})
                             for r in self.recovery]}


def measured_plan(config: Config, doc: dict | None) -> MeasuredPlan | None:
    """The plan figures of :class:`MeasuredPlan` from a watch status document (see
    :func:`read_status`); None before the first arrival. The arithmetic is
    :mod:`.plan`'s.

    >>> measured_plan(Config("c.toml", ()), {}) is None
    True
    """
    import itertools
    import statistics

    from ..tiering.plan import (Measurement, TierInput, drain_seconds, drains, local_capacity,
                       node_bandwidth)

    arrivals = (doc or {}).get("arrivals") or []
    if not arrivals or not config.tiers:
        return None
    newest = max(arrivals, key=arrival_time)
    times = sorted(map(arrival_time, arrivals))
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    tau = statistics.median(gaps) if gaps else None
    last: dict[tuple[str, str], float] = {}  # (src, dst) -> the rate its newest hop measured
    for d in (doc or {}).get("done") or []:
        rate = _done_rate(d)
        if rate:
            last[(d["src"], d["dst"])] = rate
    names = [t.name for t in config.tiers]
    tiers = []
    for i, t in enumerate(config.tiers):
        into = last.get((names[i - 1], t.name)) if i > 0 else None
        out = last.get((t.name, names[i + 1])) if i + 1 < len(names) else None
        # one rate per hop: the write into dst and the read out of src are the same figure
        m = None if not (into or out) else Measurement(
            t.name, t.url, into or 0, 1.0 if into else 0.0, out or 0, 1.0 if out else 0.0,
            write_source=f"measured on {names[i - 1]} -> {t.name}" if into else "",
            read_source=f"measured on {t.name} -> {names[i + 1]}" if out else "")
        tiers.append(TierInput(t.name, t.url, t.bwlimit, m))
    size = int(newest["bytes"])
    hops, recovery = drains(size, tiers, interval_seconds=tau)
    for r, t in zip(recovery, tiers):
        write = t.measured.write_bytes_per_second if t.measured else None
        if r.bytes_per_second is None and write:
            r.bytes_per_second, r.rate_source = write, t.measured.source("write") + " (a write)"
            r.seconds = drain_seconds(r.bytes, write)
    return MeasuredPlan(newest["name"], size, tau, len(gaps),
                        None if tau is None else node_bandwidth(size, 1, tau),
                        local_capacity(size, 1), hops, recovery)


def _done_rate(d: dict) -> float | None:
    """The rate a ``done`` entry of the status measured: its ``bytes_per_second`` (None:
    it moved nothing); an entry an older ckptctl wrote, without one: its bytes over
    its seconds, unless it was up to date.

    >>> _done_rate({"bytes": 10, "seconds": 2.0, "bytes_per_second": None})
    >>> _done_rate({"bytes": 10, "seconds": 2.0, "action": "promoted"})
    5.0
    """
    if "bytes_per_second" in d:
        return d["bytes_per_second"]
    if d.get("action") != "up-to-date" and d.get("seconds") and d.get("bytes"):
        return d["bytes"] / d["seconds"]
    return None


class Watcher:
    """Drains the tiers of ``config`` (see the module docstring). ``settle``: seconds a
    first-tier checkpoint's listing must stay unchanged before it is taken (0: at once);
    ``backoff``: the first retry delay of a failed step (doubled per failure, at most
    ``max_backoff``); ``clock``: the time source (tests); ``node_rank``: multi-node, this
    node's part of each checkpoint goes to the second tier (:mod:`.multinode`).

    >>> Watcher(Config("c.toml", ()))
    Traceback (most recent call last):
    ckptctl.errors.UsageError: c.toml: no tiers to watch (define [[tier]] tables)
    """

    def __init__(self, config: Config, *, settle: float = 30.0, backoff: float = BACKOFF_BASE,
                 max_backoff: float = BACKOFF_MAX, clock=time.time,
                 node_rank: int | None = None):
        if config.path is None:
            raise UsageError("no tier config to watch (pass --config FILE, set "
                             "CKPTCTL_CONFIG or create ./ckptctl.toml)")
        if not config.tiers:
            raise UsageError("no tiers to watch (define [[tier]] tables)", config.path)
        if node_rank is not None and (node_rank < 0 or len(config.tiers) < 2):
            raise UsageError("--node-rank needs a rank >= 0 and a shared tier after the "
                             "first (a second [[tier]])", config.path)
        #: multi-node: this node's part of each first-tier checkpoint goes to the shared
        #: (second) tier, sealed there by whichever node completes it; None: single node
        self.node_rank = node_rank
        self.waiting = False  # True while loop() waits between passes
        self.config = config
        self.settle = float(settle)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.clock = clock
        self.dir = state_dir(config.path, node_rank)
        self.events_path = os.path.join(self.dir, "events.jsonl")
        self.status_path = os.path.join(self.dir, "status.json")
        self._lock_fd: int | None = None
        #: called with every event document as it happens (events.jsonl's, and the
        #: transient ``listed``, ``hop-started`` and ``pass``): logs, metrics, sd_notify
        self.listeners: list = []
        #: time.monotonic() of the last sign of progress (an event, bytes sent, a wait)
        self.progress = time.monotonic()
        #: pre-emption: failures' backoff is not waited for
        self.urgent = False
        self.status = self._load()
        #: the hop a watcher killed mid-way was doing (its status still names it): if it
        #: committed before the kill, its "promoted" event was never written
        self._interrupted = self.status.get("in_flight")

    # -- lock, status, events ----------------------------------------------------------

    def lock(self) -> None:
        """Take the lock of this watch's first tier (:func:`lock_path`; flock, released
        when the process ends or :meth:`unlock`) and write who holds it; a UsageError
        (exit 2) naming the running watch (pid, config) when another holds it, whatever
        config file it was started with.

        >>> w.lock()                                      # doctest: +SKIP
        """
        import fcntl

        if self._lock_fd is not None:
            return
        path = lock_path(self.config, self.node_rank)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(path, f"cannot create the watch lock ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                held = lock_holder(self.config, self.node_rank) or {}
                tier = self.config.tiers[0]
                raise UsageError(
                    f"another watch (pid {held.get('pid', '?')}, config "
                    f"{held.get('config', '?')}) is draining tier {tier.name!r} "
                    f"({tier.url}): one watch per node and first tier (lock {path} is held)",
                    self.config.path) from None
            raise StorageError(path, f"cannot lock ({e.strerror})") from None
        tier = self.config.tiers[0]
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "config": os.path.abspath(
            self.config.path), "tier": tier.name, "url": tier.url}) + "\n").encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load(self) -> dict:
        try:
            with open(self.status_path) as f:
                doc = json.load(f)
            if isinstance(doc, dict):
                return doc
        except (OSError, ValueError):
            pass  # none yet, or torn by a crash: the listings are the state anyway
        return {}

    def save(self) -> None:
        """Write ``status.json`` atomically (temp file, rename)."""
        os.makedirs(self.dir, exist_ok=True)
        self.status["config"] = os.path.abspath(self.config.path)
        self.status["updated"] = iso_time(self.clock())
        self.status["pid"] = os.getpid()
        tmp = f"{self.status_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.status, f, indent=1, sort_keys=True)
        os.replace(tmp, self.status_path)

    def _event(self, event: str, **fields) -> None:
        os.makedirs(self.dir, exist_ok=True)
        doc = {"time": iso_time(self.clock()), "event": event, **fields}
        line = json.dumps(doc, sort_keys=False, default=str)
        with open(self.events_path, "a") as f:
            f.write(line + "\n")
        self._tell(doc)

    def _tell(self, doc: dict) -> None:
        """Hand an event to :attr:`listeners` as it happens; ``doc`` without a time gets
        one (transient events, not kept in events.jsonl)."""
        self.progress = time.monotonic()
        doc.setdefault("time", iso_time(self.clock()))
        for listen in self.listeners:
            listen(doc)

    def touch(self, *_args) -> None:
        """A sign of progress (bytes sent, a wait): for the service watchdog."""
        self.progress = time.monotonic()

    # -- failures and backoff -----------------------------------------------------------

    def _config_digest(self, key: str) -> str:
        """A digest of the config of the tiers that the step ``key`` involves (``list
        TIER``, ``promote SRC->DST:NAME``...): everything of those tiers (url, options,
        keep, bwlimit, pack), so an edit of them is seen across restarts."""
        involved = key.split(" ", 1)[-1].split(":", 1)[0].split("->")
        doc = [asdict(t) for t in self.config.tiers if t.name in involved]
        raw = json.dumps(doc, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    def _waiting(self, key: str, now: float) -> Failure | None:
        """The failure of ``key`` when its next retry is still to come, else None. A
        failure recorded under another config of its tiers (the endpoint moved, the
        destination changed) is not waited for: the new config is tried at once."""
        f = self.status.get("failed", {}).get(key)
        if not f or f["next_retry"] <= now or self.urgent:
            return None
        if f.get("config") != self._config_digest(key):
            if not f.get("config_changed"):
                f["config_changed"] = True
                self._event("config-changed", key=key, was_waiting_until=iso_time(f["next_retry"]))
            return None
        return Failure(key, f["what"], f["tier"], f.get("name"), f["code"], f["message"],
                       f["attempts"], f["next_retry"])

    def _fail(self, p: WatchPass, key: str, what: str, tier: str, name: str | None,
              e: BaseException) -> Failure:
        failed = self.status.setdefault("failed", {})
        digest = self._config_digest(key)
        old = failed.get(key, {})
        # a new config of the tiers is a new situation: its backoff starts again
        attempts = (old.get("attempts", 0) if old.get("config") == digest else 0) + 1
        now = self.clock()
        delay = min(self.backoff * 2 ** (attempts - 1), self.max_backoff)
        code = str(getattr(e, "code", None) or type(e).__name__)
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        f = Failure(key, what, tier, name, code, message, attempts, now + delay)
        failed[key] = {**{k: v for k, v in asdict(f).items() if k != "key"},
                       "config": digest}
        p.failed.append(f)
        self._event("failed", what=what, tier=tier, name=name, code=code, message=message,
                    attempts=attempts, next_retry=iso_time(f.next_retry))
        # kept at once, not at the pass's end: a watcher killed before then would forget
        # the failure (its backoff, and the "recovered" its next success reports)
        self.save()
        return f

    def _ok(self, key: str) -> None:
        if self.status.get("failed", {}).pop(key, None) is not None:
            self._event("recovered", key=key)

    def _arrived(self, name: str, row, now: float) -> None:
        """Remember a first-tier checkpoint's size and time (its commit marker's, else
        now) for the interval and size ``--status`` reports."""
        arrivals = self.status.setdefault("arrivals", [])
        arrivals.append({"name": name, "bytes": row.bytes,
                         "modified": iso_time(row.modified if row.modified else now)})
        del arrivals[:-ARRIVALS_KEPT]

    # -- one pass ---------------------------------------------------------------------

    def run_once(self) -> WatchPass:
        """One pass over the tiers (see the module docstring); the status file is saved
        at the end, and also when the pass is interrupted (KeyboardInterrupt).

        >>> w.run_once().drained                           # doctest: +SKIP
        True
        """
        p = WatchPass(self.clock())
        t0 = time.monotonic()
        try:
            self._pass(p)
        finally:
            self._settling_ages(p)
            self.status["in_flight"] = None
            self.status["queued"] = [dict(x) for x in p.pending]
            self.status["last_pass"] = {"started": iso_time(p.started),
                                        "seconds": round(time.monotonic() - t0, 3),
                                        "drained": p.drained}
            p.seconds = time.monotonic() - t0
            self.save()
            self._tell({"event": "pass", "ended": self.clock(), "seconds": round(p.seconds, 3),
                        "drained": p.drained, "promoted": len(p.promoted),
                        "removed": sum(map(len, p.removed.values())), "failed": len(p.failed),
                        "queued": p.queued([t.name for t in self.config.tiers]),
                        "newest_pending_age_seconds": dict(p.behind)})
        return p

    def _settling_ages(self, p: WatchPass) -> None:
        """Fill ``p.unchanged``: how long the listing of each ``settling`` checkpoint has
        been unchanged as watch saw it, so a report can say how far along it is."""
        seen, now = self.status.get("seen") or {}, self.clock()
        for x in p.pending:
            if x.get("why") == "settling" and x.get("name") in seen:
                p.unchanged[x["name"]] = round(max(0.0, now - seen[x["name"]]["since"]), 3)

    def drain_newest(self) -> tuple[WatchPass, str | None]:
        """Pre-emption (``watch``'s drain signal): promote the newest committed checkpoint
        of the first tier to the second at once, ahead of any backlog, with no settle
        time and no backoff wait, sealed first when it is not (multi-node: this node's
        part of it). Returns the pass and that checkpoint's name (None: the first tier
        holds none committed); it is committed in the next tier when nothing failed.

        >>> p, name = w.drain_newest(); p.failed, name     # doctest: +SKIP
        ([], 'step-300')
        """
        p = WatchPass(self.clock())
        t0 = time.monotonic()
        self.urgent = True
        tiers = self.config.tiers
        name = None
        try:
            if len(tiers) < 2:
                return p, None
            if self.node_rank is not None:
                from .multinode import node_pass

                hot = self._list(p, tiers[0]) or {}
                name = self._newest_part(hot)
                if name is not None:
                    node_pass(self, p, only=name)
                return p, name
            first = self._list(p, tiers[0])
            after = self._list(p, tiers[1])
            name = _newest(first or {})
            if name is None or after is None:
                return p, name
            if name in after and after[name].state in COMMITTED:
                return p, name  # already there
            row = first[name]
            if self._seal(p, row):
                self._hop(p, tiers[0], tiers[1], row, name)
            return p, name
        finally:
            self.urgent = False
            self.status["in_flight"] = None
            p.seconds = time.monotonic() - t0
            self.save()

    def _newest_part(self, hot: dict) -> str | None:
        """Multi-node pre-emption: this node's newest part whose listing has settled
        (unchanged for ``settle`` seconds as last seen), else its newest part."""
        seen, now = self.status.get("seen") or {}, self.clock()
        settled = [n for n, r in hot.items() if n in seen
                   and seen[n]["sig"] == r.signature
                   and now - seen[n]["since"] >= self.settle]
        return settled[-1] if settled else (list(hot)[-1] if hot else None)

    def _list(self, p: WatchPass, tier: Tier):
        """The rows of ``tier``'s listing by name; None (and a failure) when it cannot be
        listed or its retry is not due."""
        from ..catalog.ls import ls

        key = f"list {tier.name}"
        waiting = self._waiting(key, self.clock())
        if waiting is not None:
            p.failed.append(waiting)
            return None
        try:
            rows = ls(tier.url, tier.storage_options).checkpoints
        except (CkptError, OSError) as e:
            if isinstance(e, NotFoundError):
                # a tier not made yet (a folder, an S3 prefix): empty; safe for the rail,
                # which then keeps everything of the tier before it
                rows = []
            else:
                self._fail(p, key, "list", tier.name, None, e)
                return None
        self._ok(key)
        if tier is self.config.tiers[0] and self.status.get("ready_pid") != os.getpid():
            self.status["ready_pid"] = os.getpid()  # this watch has listed its first tier
            self.save()
        self._tell({"event": "listed", "tier": tier.name, "checkpoints": len(rows)})
        return {r.name: r for r in rows}

    def _ready(self, p: WatchPass, tier: Tier, rows: dict) -> list[str]:
        """First-tier names that are committed and settled, oldest first."""
        now = self.clock()
        seen = self.status.setdefault("seen", {})
        ready = []
        for name, r in rows.items():
            sig = r.signature
            old = seen.get(name)
            if old is None:
                p.found.append(name)
                self._event("found", tier=tier.name, name=name, state=r.state, bytes=r.bytes)
                self._arrived(name, r, now)
            if old is None or old["sig"] != sig:
                seen[name] = old = {"sig": sig, "since": now}
            if r.state not in COMMITTED:
                p.pending.append({"tier": tier.name, "name": name, "why": r.state})
            elif r.state != "sealed" and now - old["since"] < self.settle:
                # sealed: its manifest was committed last, nothing more will be written
                p.pending.append({"tier": tier.name, "name": name, "why": "settling"})
            else:
                ready.append(name)
        for name in [n for n in seen if n not in rows]:
            del seen[name]  # gone from the first tier (trimmed, or removed by hand)
        return ready

    def _pass(self, p: WatchPass) -> None:
        tiers = self.config.tiers
        if self.node_rank is not None:
            from .multinode import node_pass, retain_node

            listings = node_pass(self, p)
            if self.node_rank == 0:  # one node drains the shared tier further
                self._hops(p, listings, set(), start=1)
                for i in range(1, len(tiers)):
                    self._retain(p, i, listings)
            retain_node(self, p, listings)
            return
        listings = [self._list(p, tiers[0])]
        first = listings[0]
        ready = self._ready(p, tiers[0], first) if first is not None else []
        for name in ready:
            self._seal(p, first[name])
        if first is not None and p.sealed:
            listings[0] = first = self._list(p, tiers[0])
        # one that holds a user's file stays where it is: promote would adopt the file too
        held = {f.name for f in p.failed if f.what == "seal" and f.code == "FOREIGN_FILES"}
        self._hops(p, listings, set(ready) - held)
        for i, tier in enumerate(tiers):
            self._retain(p, i, listings)
        p.behind = self._behind(listings)

    def _behind(self, listings: list) -> dict[str, float]:
        """For each tier after the first that could be listed: the age of the newest
        checkpoint committed in a tier before it and not yet in it (by its first-tier
        arrival time, else its commit marker's), 0.0 when none waits."""
        arrived = {a["name"]: arrival_time(a) for a in self.status.get("arrivals") or []}
        now, out, before = self.clock(), {}, {}
        for tier, rows in zip(self.config.tiers, listings):
            if before and rows is not None:
                times = [arrived.get(n, r.modified or now) for n, r in before.items()
                         if not (n in rows and rows[n].state in COMMITTED)]
                out[tier.name] = max(0.0, now - max(times)) if times else 0.0
            for n, r in (rows or {}).items():
                if r.state in COMMITTED:
                    before.setdefault(n, r)
        return out

    def _seal(self, p: WatchPass, row) -> bool:
        """Seal a first-tier checkpoint where it is (nothing to do when it is sealed);
        False when it failed or its retry is not due (a failure recorded)."""
        from ..integrity.seal import seal

        tier = self.config.tiers[0]
        if row.state == "sealed":
            return True
        key = f"seal {tier.name}:{row.name}"
        waiting = self._waiting(key, self.clock())
        if waiting is not None:
            p.failed.append(waiting)
            return False
        try:
            refuse_adopting(row.url, tier.storage_options, row.located)
            seal(row.url, tier.storage_options)
        except (CkptError, OSError) as e:
            self._fail(p, key, "seal", tier.name, row.name, e)
            return False
        self._ok(key)
        p.sealed.append(row.name)
        self._event("sealed", tier=tier.name, name=row.name, url=row.url)
        return True

    def _hops(self, p: WatchPass, listings: list, movable: set, start: int = 0) -> None:
        """Promote hop by hop from tier ``start`` on, appending each next tier's listing
        to ``listings``; from the first tier only the names in ``movable``, never a
        re-root's staged copy (gc's, beside the pack it replaces)."""
        from ..formats.pack import reroot_target

        tiers = self.config.tiers
        for i in range(start, len(tiers) - 1):
            src, dst = tiers[i], tiers[i + 1]
            rows = listings[i]
            after = self._list(p, dst)
            if rows is not None and after is not None:
                self._adopt_interrupted(src, dst, after)
                todo = [n for n, r in rows.items() if r.state in COMMITTED
                        and (i > 0 or n in movable) and reroot_target(n) is None
                        and not (n in after and after[n].state in COMMITTED)]
                for name in todo:
                    if not self._hop(p, src, dst, rows[name], name):
                        done = {h.name for h in p.promoted if h.dst == dst.name}
                        for rest in todo[todo.index(name) + 1:]:
                            if rest not in done:
                                p.pending.append({"tier": src.name, "name": rest,
                                                  "why": f"waiting for {dst.name}"})
                        break
                    # committed in dst (promote commits last): the source tier is trimmed
                    # now, not at the end of the pass, so a slow next tier does not let
                    # the source fill up with what it already holds
                    after[name] = replace(rows[name], url=dst.url.rstrip("/") + "/" + name)
                    self._retain_rows(p, i, rows, after)
                if any(h.dst == dst.name for h in p.promoted):
                    after = self._list(p, dst)
            listings.append(after)

    def _adopt_interrupted(self, src: Tier, dst: Tier, after: dict) -> None:
        """Log the hop of a killed watcher that committed before it died (its event was
        never written): a "promoted" event with action ``committed-before-restart``, so
        the event log explains every later removal from ``src``."""
        hop = self._interrupted
        if not hop or (hop.get("src"), hop.get("dst")) != (src.name, dst.name):
            return
        self._interrupted = None
        row = after.get(hop.get("name"))
        if row is not None and row.state in COMMITTED:
            self._event("promoted", name=row.name, src=src.name, dst=dst.name,
                        action="committed-before-restart", bytes=row.bytes, pack=dst.pack)

    def _hop(self, p: WatchPass, src: Tier, dst: Tier, row, name: str) -> bool:
        """Promote one checkpoint; False when it failed in a way that stops this tier
        pair for the pass (the destination or the network, not this checkpoint)."""
        from ..tiering.promote import promote

        key = f"promote {src.name}->{dst.name}:{name}"
        waiting = self._waiting(key, self.clock())
        if waiting is not None:
            p.failed.append(waiting)
            return False
        url = dst.url.rstrip("/") + "/" + name
        self.status["in_flight"] = {"name": name, "src": src.name, "dst": dst.name,
                                    "since": iso_time(self.clock())}
        self.save()
        self._tell({"event": "hop-started", "name": name, "src": src.name, "dst": dst.name,
                    "bytes": row.bytes})
        try:
            r = promote(row.url, url, src.storage_options, dst.storage_options,
                        bwlimit=dst.bwlimit, pack=dst.pack, on_bytes=self.touch,
                        max_chain=dst.max_chain)
        except (CkptError, OSError) as e:
            self._fail(p, key, "promote", dst.name, name, e)
            # a finding is about this checkpoint: the others may still go
            return isinstance(e, Finding) and not isinstance(e, StorageError)
        finally:
            self.status["in_flight"] = None
        self._ok(key)
        hop = Hop(name, src.name, dst.name, r.action, r.bytes, r.bytes_sent, r.seconds)
        p.promoted.append(hop)
        self.record_done(name, src.name, dst.name, r.action, r.bytes, r.seconds,
                         rate=drain_rate(r.bytes, r.bytes_sent, r.seconds, pack=dst.pack))
        self._event("promoted", name=name, src=src.name, dst=dst.name, action=r.action,
                    bytes=r.bytes, bytes_sent=r.bytes_sent, seconds=r.seconds,
                    bytes_per_second=round(hop.rate), pack=dst.pack)
        return True

    def record_done(self, name: str, src: str, dst: str, action: str, nbytes: int,
                    seconds: float, *, rate: float | None) -> None:
        """A finished hop (or multi-node part) in the status: ``done`` (the last
        :data:`DONE_KEPT`), each with the rate measured on it (``bytes_per_second``, None
        when it moved nothing: up to date, or resumed with every byte already there), and
        ``rates``, the newest of each hop: the one rate ``watch --status`` and its plan
        figures show for that hop.

        >>> w.record_done("step-20", "hot", "warm", "promoted", 10, 0.5, rate=20.0)  # doctest: +SKIP
        """
        rate = round(rate) if rate else None
        if rate:
            self.status.setdefault("rates", {})[f"{src}->{dst}"] = rate
        done = self.status.setdefault("done", [])
        done.append({"name": name, "src": src, "dst": dst, "action": action,
                     "bytes": nbytes, "seconds": seconds, "bytes_per_second": rate,
                     "finished": iso_time(self.clock())})
        del done[:-DONE_KEPT]

    def _retain(self, p: WatchPass, i: int, listings: list) -> None:
        """Apply tier i's keep, with the "not yet in NEXT" rail."""
        last = i + 1 >= len(self.config.tiers)
        self._retain_rows(p, i, listings[i], None if last else listings[i + 1])

    def _retain_rows(self, p: WatchPass, i: int, rows: dict | None, after: dict | None) -> None:
        """Apply tier i's keep to its listing ``rows``, with the rail from ``after``, the
        next tier's listing (None: it could not be listed); what is removed leaves
        ``rows``."""
        tier = self.config.tiers[i]
        if not tier.keep or not rows:
            return  # nothing kept to apply, nothing listed (or not listable) to trim
        key = f"gc {tier.name}"
        if self._waiting(key, self.clock()):
            p.failed.append(self._waiting(key, self.clock()))
            return
        protect: dict[str, str] = {}
        if i + 1 < len(self.config.tiers):
            nxt = self.config.tiers[i + 1]
            for name in rows:
                if after is None:
                    protect[name] = f"{nxt.name} cannot be listed"
                elif not (name in after and after[name].state in COMMITTED):
                    protect[name] = f"not yet in {nxt.name}"
        for name in self._trim(p, key, tier, protect, set(rows)):
            rows.pop(name, None)

    def _trim(self, p: WatchPass, key: str, tier, protect: dict[str, str], listed: set[str],
              policy=None, **gc_kw) -> list[str]:
        """gc one tier with its keep table (or ``policy``), the ``protect`` rail, and
        ``listed``: what this pass saw there, so a checkpoint written since (not judged by
        the rail yet) is kept until the next pass. Returns the names removed."""
        from ..tiering.gc import gc
        from ..tiering.policy import Policy

        try:
            policy = policy or Policy.from_dict(tier.keep, where=f"tier {tier.name}")
            r = gc(tier.url, policy, tier.storage_options, protect=protect, listed=listed,
                   reroot=tier.pack, max_chain=tier.max_chain, **gc_kw)
        except (CkptError, OSError) as e:
            self._fail(p, key, "gc", tier.name, None, e)
            return []
        self._ok(key)
        p.kept[tier.name] = list(r.decision.keep)
        p.removed.setdefault(tier.name, []).extend(c.name for c in r.removed)
        for c in r.removed:
            self._event("removed", tier=tier.name, name=c.name, bytes=c.bytes)
        return [c.name for c in r.removed]

    # -- loop -------------------------------------------------------------------------

    def loop(self, *, interval: float = 60.0, jitter: float = 0.0, on_pass=None,
             wake: threading.Event | None = None, stop: threading.Event | None = None,
             own_files: tuple[str, ...] = ()) -> None:
        """Run passes forever: after each, wait ``interval`` (+ up to ``jitter``) seconds,
        or less when the first tier changes (watchdog's inotify on a local first tier,
        :func:`wakes`; polling elsewhere or without watchdog), a checkpoint settles or a
        failed step's retry falls due. ``on_pass(WatchPass)`` is
        called after each pass. ``own_files``: files this process rewrites (the metrics
        file), whose changes wake nothing even inside the first tier. Ends when ``stop`` is
        set (checked after each wait: a SIGTERM between passes sets it and ``wake``), or
        by an exception (KeyboardInterrupt: a signal in the middle of a pass), the status
        saved. ``self.waiting`` is True while it waits.

        >>> w.loop(interval=30, jitter=5)                 # doctest: +SKIP
        """
        wake = wake or threading.Event()
        stop = stop or threading.Event()
        observer = self._observe(wake, own_files)
        try:
            while not stop.is_set():
                wake.clear()
                p = self.run_once()
                if on_pass is not None:
                    on_pass(p)
                if stop.is_set():
                    break
                self.waiting = True
                try:
                    wake.wait(self._next_wait(p, interval, jitter))
                finally:
                    self.waiting = False
        finally:
            if observer is not None:
                observer.stop()
            self.save()

    def _next_wait(self, p: WatchPass, interval: float, jitter: float) -> float:
        """Seconds to wait after the pass ``p``: ``interval`` (+ up to ``jitter``), or less
        when a checkpoint it left settling has settled, or a failure's retry falls due,
        before then: no file event announces either."""
        wait = interval + (random.uniform(0, jitter) if jitter > 0 else 0.0)
        now, seen = self.clock(), self.status.get("seen") or {}
        due = [seen[x["name"]]["since"] + self.settle for x in p.pending
               if x.get("why") == "settling" and x.get("name") in seen]
        due += [f.next_retry for f in p.failed]
        return min([wait, *(max(0.0, t - now) for t in due)])

    def _observe(self, wake: threading.Event, own_files: tuple[str, ...] = ()):
        """A watchdog observer that sets ``wake`` when something changes under a local
        first tier (:func:`wakes`), never for this watch's own files (its state folder,
        ``own_files``); None (polling) for a remote tier or without watchdog."""
        root = self.config.tiers[0].url
        if "://" in root and not root.startswith("file://"):
            return None
        try:
            from watchdog.observers import Observer
        except ImportError:
            return None
        root = os.path.realpath(root.removeprefix("file://"))
        own = tuple(os.path.realpath(f) for f in (self.dir, *own_files))
        os.makedirs(root, exist_ok=True)
        observer = Observer()
        observer.daemon = True
        handler = _Wake(wake, own)
        try:  # the filter also narrows the kernel's inotify mask: reads are never delivered
            observer.schedule(handler, root, recursive=True, event_filter=_wake_events())
        except TypeError:  # a watchdog without event_filter: the handler filters alone
            observer.schedule(handler, root, recursive=True)
        observer.start()
        return observer


def _wake_events() -> list[type]:
    """The watchdog events that can change what a pass decides: a file written and
    closed, anything created, moved or deleted, and lost events (the kernel's queue
    overflowed). Never a read: opened and closed-without-writing come from watch's own
    listing and verification, and waking on them made an idle watch spin. Nor a bare
    modification: a file still being written is closed later.

    >>> sorted(c.__name__ for c in _wake_events())[:3]
    ['DirCreatedEvent', 'DirDeletedEvent', 'DirMovedEvent']
    """
    from watchdog import events

    names = ("FileClosedEvent", "FileCreatedEvent", "DirCreatedEvent", "FileMovedEvent",
             "DirMovedEvent", "FileDeletedEvent", "DirDeletedEvent",
             "EventsLostEvent")  # watchdog >= 6
    return [getattr(events, n) for n in names if hasattr(events, n)]


def wakes(event, own: tuple[str, ...] = ()) -> bool:
    """Does watchdog's ``event`` wake the loop: one of :func:`_wake_events` about a path
    that is not one of ``own`` (a file, its temporary ``FILE.<suffix>``, or what lies
    under a folder), the files the watch itself rewrites every pass.

    >>> from watchdog.events import FileClosedEvent, FileClosedNoWriteEvent
    >>> wakes(FileClosedEvent("/hot/step-1/.metadata")), wakes(FileClosedNoWriteEvent("/hot/x"))
    (True, False)
    >>> wakes(FileClosedEvent("/hot/w.prom.12.34"), own=("/hot/w.prom",))
    False
    """
    if not isinstance(event, tuple(_wake_events())):
        return False
    paths = [os.fsdecode(p) for p in (event.src_path, getattr(event, "dest_path", ""))
             if p]
    return not paths or not all(_is_own(p, own) for p in paths)


def _is_own(path: str, own: tuple[str, ...]) -> bool:
    return any(path == o or path.startswith((o + ".", o + os.sep)) for o in own)


class _Wake:
    """The watchdog handler of :meth:`Watcher._observe`: sets ``wake`` on an event that
    :func:`wakes` it."""

    def __init__(self, wake: threading.Event, own: tuple[str, ...]):
        self.wake = wake
        self.own = own

    def dispatch(self, event) -> None:
        if wakes(event, self.own):
            self.wake.set()


def refuse_adopting(url: str, storage_options: dict | None = None,
                    located: tuple | None = None) -> None:
    """A seal by watch adopts nothing its checkpoint's format does not name: a
    :class:`~ckptctl.errors.Finding` (``FOREIGN_FILES``) naming the other files of the
    checkpoint at ``url`` (the check ``rm`` makes, :func:`~.ownership.refuse_foreign`),
    whose manifest would otherwise own them, and whose
    trims would take them from every tier. ``located``: its listing, when ``ls`` has it.

    >>> refuse_adopting("hot/step-1", None, (None, {".metadata": 1, "NOTES.md": 3}, None))
    Traceback (most recent call last):
    ckptctl.errors.Finding: hot/step-1: holds files that are not the checkpoint's (NOTES.md); seal it by hand to adopt them (ckptctl seal hot/step-1), or move them away
    """
    from ..formats.detect import locate
    from ..catalog.ownership import refuse_foreign

    _store, files, single = located or locate(url, storage_options)
    refuse_foreign(url, files, single=single, advice=f"seal it by hand to adopt them "
                   f"(ckptctl seal {url}), or move them away")


def _newest(rows: dict) -> str | None:
    """The newest committed checkpoint of a listing (``ls`` order: by step, then name),
    the one ``latest`` would name."""
    names = [n for n, r in rows.items() if r.state in COMMITTED]
    return names[-1] if names else None


def watch_alive(config: Config, node_rank: int | None = None) -> int | None:
    """The pid of the watch that holds the lock of ``config``'s first tier now, None
    when none does (a SIGKILLed watch's lock went with it). Read from ``/proc/locks``
    (which names the holder of a flock without taking it, so a watch starting meanwhile
    is not turned away); elsewhere, whether the pid the lock file names still runs.

    >>> watch_alive(Config("c.toml", (Tier("hot", "/no/such/tier"),))) is None
    True
    """
    path = lock_path(config, node_rank)
    try:
        st = os.stat(path)
    except OSError:
        return None
    pid = (lock_holder(config, node_rank) or {}).get("pid")
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF" (a blocked waiter: "->");
                # an overlay file system may show another device: then the pid must match
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[0] != "->" \
                        and fields[5].rsplit(":", 1)[-1] == str(st.st_ino) \
                        and (fields[5] == device or fields[4] == str(pid)):
                    return int(fields[4]) if fields[4].isdigit() else -1
        return None
    except OSError:
        if not isinstance(pid, int):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid


def watch_ready(config: Config, node_rank: int | None = None) -> bool:
    """A readiness probe: does a watch of ``config``'s first tier run now
    (:func:`watch_alive`) and has it listed that tier since it started?

    >>> watch_ready(Config("c.toml", (Tier("hot", "/no/such/tier"),)))
    False
    """
    pid = watch_alive(config, node_rank)
    if pid is None:
        return False
    ran, doc = watch_status(config, node_rank)
    return bool(doc) and doc.get("ready_pid") == pid


def lower_priority() -> list[str]:
    """Make this process nice (``os.nice(10)``) and, on Linux, of the idle I/O class
    (``ioprio_set``); returns what was done.

    >>> isinstance(lower_priority(), list)            # doctest: +SKIP
    True
    """
    done = []
    try:
        os.nice(10)
        done.append("nice 10")
    except OSError:
        pass
    import ctypes
    import platform

    number = {"x86_64": 251, "aarch64": 30, "arm64": 30}.get(platform.machine())
    if number is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # IOPRIO_WHO_PROCESS = 1, this process; IOPRIO_CLASS_IDLE = 3 << 13
            if libc.syscall(number, 1, 0, 3 << 13) == 0:
                done.append("io idle")
        except (OSError, AttributeError):
            pass
    return done
