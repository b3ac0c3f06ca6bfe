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
(:func:`~.status.lock_path`, in ``ckptctl/watch-locks/``): one watch per node and first
tier, whatever config file names it.

Here lives :class:`Watcher`, the loop and the state (status, events, lock, failures and
their backoff); the pieces of a pass are beside it: the decisions of a pass
(:mod:`.passes`), its hops (:mod:`.hops`), its trims (:mod:`.trims`), the rates and
backlog it measures (:mod:`.drains`), what it returns (:mod:`.results`), what wakes the
loop (:mod:`.wakes`), and the state files and lock as other processes read them
(:mod:`.status`).

>>> w = Watcher(config, settle=0)                    # doctest: +SKIP
>>> p = w.run_once(); p.drained, [h.name for h in p.promoted]   # doctest: +SKIP
(True, ['step-100', 'step-100'])
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from dataclasses import asdict

from ..errors import CkptError, NotFoundError, UsageError
from ..tiering.config import Config, Tier
from . import drains
from .passes import pre_empt, run_pass, settling_ages
from .results import Failure, WatchPass, iso_time
from .status import state_dir, take_lock
from .wakes import observe

#: Backoff of a failing step: BASE, 2*BASE, 4*BASE... up to MAX seconds.
BACKOFF_BASE = 30.0
BACKOFF_MAX = 3600.0


class Watcher:
    """Drains the tiers of ``config`` (see the module docstring). ``settle``: seconds a
    first-tier checkpoint's listing must stay unchanged before it is taken (0: at once);
    ``backoff``: the first retry delay of a failed step (doubled per failure, at most
    ``max_backoff``); ``clock``: the time source (tests); ``node_rank``: multi-node, this
    node's part of each checkpoint goes to the second tier (:mod:`.multinode`).

    The steps of a pass (:mod:`.passes`, :mod:`.hops`, :mod:`.trims`, :mod:`.multinode`)
    record through it: :meth:`event` and :meth:`tell` (the event log and listeners),
    :meth:`fail`, :meth:`succeed` and :meth:`backing_off` (failures and their backoff),
    :meth:`list_tier` and :meth:`record_done`.

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
        self.interrupted: dict | None = self.status.get("in_flight")

    # -- lock, status, events ----------------------------------------------------------

    def lock(self) -> None:
        """Take the lock of this watch's first tier (:func:`~.status.take_lock`; flock,
        released when the process ends or :meth:`unlock`) and write who holds it; a
        UsageError (exit 2) naming the running watch (pid, config) when another holds it,
        whatever config file it was started with.

        >>> w.lock()                                      # doctest: +SKIP
        """
        if self._lock_fd is None:
            self._lock_fd = take_lock(self.config, self.node_rank)

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

    def event(self, event: str, **fields) -> None:
        """Log an action: one JSON line in ``events.jsonl``, handed to the listeners too
        (:meth:`tell`)."""
        os.makedirs(self.dir, exist_ok=True)
        doc = {"time": iso_time(self.clock()), "event": event, **fields}
        line = json.dumps(doc, sort_keys=False, default=str)
        with open(self.events_path, "a") as f:
            f.write(line + "\n")
        self.tell(doc)

    def tell(self, doc: dict) -> None:
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

    def backing_off(self, key: str, now: float) -> Failure | None:
        """The failure of the step ``key`` when its next retry is still to come, else
        None. A failure recorded under another config of its tiers (the endpoint moved,
        the destination changed) is not waited for: the new config is tried at once."""
        f = self.status.get("failed", {}).get(key)
        if not f or f["next_retry"] <= now or self.urgent:
            return None
        if f.get("config") != self._config_digest(key):
            if not f.get("config_changed"):
                f["config_changed"] = True
                self.event("config-changed", key=key, was_waiting_until=iso_time(f["next_retry"]))
            return None
        return Failure(key, f["what"], f["tier"], f.get("name"), f["code"], f["message"],
                       f["attempts"], f["next_retry"])

    def fail(self, p: WatchPass, key: str, what: str, tier: str, name: str | None,
             e: BaseException) -> Failure:
        """Record that the step ``key`` (``what``: list, seal, promote, gc) failed with
        ``e``: in ``p``, in the status (saved at once) with its next retry, and as an
        event."""
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
        self.event("failed", what=what, tier=tier, name=name, code=code, message=message,
                   attempts=attempts, next_retry=iso_time(f.next_retry))
        # kept at once, not at the pass's end: a watcher killed before then would forget
        # the failure (its backoff, and the "recovered" its next success reports)
        self.save()
        return f

    def succeed(self, key: str) -> None:
        """Record that the step ``key`` succeeded: a failure of it is forgotten, with a
        ``recovered`` event."""
        if self.status.get("failed", {}).pop(key, None) is not None:
            self.event("recovered", key=key)

    # -- what a pass reads and records ---------------------------------------------------

    def list_tier(self, p: WatchPass, tier: Tier) -> dict | None:
        """The rows of ``tier``'s listing by name; None (and a failure) when it cannot be
        listed or its retry is not due."""
        from ..catalog.ls import ls

        key = f"list {tier.name}"
        waiting = self.backing_off(key, self.clock())
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
                self.fail(p, key, "list", tier.name, None, e)
                return None
        self.succeed(key)
        if tier is self.config.tiers[0] and self.status.get("ready_pid") != os.getpid():
            self.status["ready_pid"] = os.getpid()  # this watch has listed its first tier
            self.save()
        self.tell({"event": "listed", "tier": tier.name, "checkpoints": len(rows)})
        return {r.name: r for r in rows}

    def record_done(self, name: str, src: str, dst: str, action: str, nbytes: int,
                    seconds: float, *, rate: float | None) -> None:
        """A finished hop (or multi-node part) in the status: ``done`` (the last
        :data:`~.drains.DONE_KEPT`), each with the rate measured on it
        (``bytes_per_second``, None when it moved nothing: up to date, or resumed with
        every byte already there), and ``rates``, the newest of each hop: the one rate
        ``watch --status`` and its plan figures show for that hop
        (:func:`~.drains.record_done`).

        >>> w.record_done("step-20", "hot", "warm", "promoted", 10, 0.5,  # doctest: +SKIP
        ...               rate=20.0)
        """
        drains.record_done(self.status, name, src, dst, action, nbytes, seconds, rate=rate,
                           finished=self.clock())

    # -- one pass ---------------------------------------------------------------------

    def run_once(self) -> WatchPass:
        """One pass over the tiers (see the module docstring, :func:`~.passes.run_pass`);
        the status file is saved at the end, and also when the pass is interrupted
        (KeyboardInterrupt).

        >>> w.run_once().drained                           # doctest: +SKIP
        True
        """
        p = WatchPass(self.clock())
        t0 = time.monotonic()
        try:
            run_pass(self, p)
        finally:
            p.unchanged.update(settling_ages(p.pending, self.status.get("seen") or {},
                                             self.clock()))
            self.status["in_flight"] = None
            self.status["queued"] = [dict(x) for x in p.pending]
            self.status["last_pass"] = {"started": iso_time(p.started),
                                        "seconds": round(time.monotonic() - t0, 3),
                                        "drained": p.drained}
            p.seconds = time.monotonic() - t0
            self.save()
            self.tell({"event": "pass", "ended": self.clock(), "seconds": round(p.seconds, 3),
                       "drained": p.drained, "promoted": len(p.promoted),
                       "removed": sum(map(len, p.removed.values())), "failed": len(p.failed),
                       "queued": p.queued([t.name for t in self.config.tiers]),
                       "newest_pending_age_seconds": dict(p.behind)})
        return p

    def drain_newest(self) -> tuple[WatchPass, str | None]:
        """Pre-emption (``watch``'s drain signal): promote the newest committed checkpoint
        of the first tier to the second at once, ahead of any backlog, with no settle
        time and no backoff wait, sealed first when it is not (multi-node: this node's
        part of it; :func:`~.passes.pre_empt`). Returns the pass and that checkpoint's
        name (None: the first tier holds none committed); it is committed in the next tier
        when nothing failed.

        >>> p, name = w.drain_newest(); p.failed, name     # doctest: +SKIP
        ([], 'step-300')
        """
        p = WatchPass(self.clock())
        t0 = time.monotonic()
        self.urgent = True
        try:
            return p, pre_empt(self, p)
        finally:
            self.urgent = False
            self.status["in_flight"] = None
            p.seconds = time.monotonic() - t0
            self.save()

    # -- loop -------------------------------------------------------------------------

    def loop(self, *, interval: float = 60.0, jitter: float = 0.0, on_pass=None,
             wake: threading.Event | None = None, stop: threading.Event | None = None,
             own_files: tuple[str, ...] = ()) -> None:
        """Run passes forever: after each, wait ``interval`` (+ up to ``jitter``) seconds,
        or less when the first tier changes (watchdog's inotify on a local first tier,
        :func:`~.wakes.wakes`; polling elsewhere or without watchdog), a checkpoint
        settles or a failed step's retry falls due. ``on_pass(WatchPass)`` is
        called after each pass. ``own_files``: files this process rewrites (the metrics
        file), whose changes wake nothing even inside the first tier. Ends when ``stop`` is
        set (checked after each wait: a SIGTERM between passes sets it and ``wake``), or
        by an exception (KeyboardInterrupt: a signal in the middle of a pass), the status
        saved. ``self.waiting`` is True while it waits.

        >>> w.loop(interval=30, jitter=5)                 # doctest: +SKIP
        """
        wake = wake or threading.Event()
        stop = stop or threading.Event()
        # never woken by this watch's own files: its state folder, ``own_files``
        observer = observe(self.config.tiers[0].url, wake, (self.dir, *own_files))
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
