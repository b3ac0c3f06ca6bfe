"""``watch`` as a service: JSON-lines logs, systemd notify messages and the pre-emption
signal, wired onto a :class:`~ckptctl.service.watch.Watcher`'s event listeners.

>>> import io; out = io.StringIO()
>>> json_logger(out)({"time": "2026-01-01T00:00:00Z", "event": "failed", "what": "promote",
...                   "tier": "warm", "name": "step-20", "message": "disk full"})
>>> out.getvalue().strip()
'{"time": "2026-01-01T00:00:00Z", "level": "error", "event": "failed", "tier": "warm", \
"name": "step-20", "step": 20, "reason": "disk full", "what": "promote"}'
"""
from __future__ import annotations

import json
import signal
import sys
import threading

#: Events only the service manager hears (one per tier per pass: too many for a log).
QUIET_EVENTS = {"listed"}
#: The keys every JSON log line leads with, in this order (absent ones left out).
LEADING = ("time", "level", "event", "tier", "src", "dst", "name", "step", "bytes",
           "seconds", "reason")


def json_logger(stream=None):
    """A listener that writes each watch event as one JSON line on ``stream`` (stderr) as
    it happens: time, level, event, tier, name, step, bytes, seconds, reason, then the
    event's own fields."""
    from ..formats.detect import step_from_name

    def log(doc: dict) -> None:
        ev = doc.get("event")
        if ev in QUIET_EVENTS:
            return
        line = dict(doc)
        line["level"] = "error" if ev == "failed" else "info"
        if line.get("name") and "step" not in line:
            line["step"] = step_from_name(str(line["name"]))
        for key in ("message", "why"):
            if key in line and "reason" not in line:
                line["reason"] = line.pop(key)
        ordered = {k: line.pop(k) for k in LEADING if k in line}
        out = stream or sys.stderr
        out.write(json.dumps({**ordered, **line}, default=str) + "\n")
        out.flush()

    return log


def notify_listener(notifier, tiers: list[str]):
    """A listener that tells the service manager: ``READY=1`` once the first tier has
    been listed (or the first pass ended), ``STATUS=`` what watch does now.

    >>> from ckptctl.service.sdnotify import Notifier
    >>> notify_listener(Notifier({}), ["hot"])({"event": "listed", "tier": "hot"})
    """
    ready = threading.Event()

    def tell(doc: dict) -> None:
        ev = doc.get("event")
        if not ready.is_set() and (ev == "pass" or (ev == "listed" and doc["tier"] == tiers[0])):
            ready.set()
            notifier.ready(f"listed {tiers[0]}")
        if ev == "hop-started":
            notifier.status(f"promoting {doc['name']} {doc['src']} -> {doc['dst']}")
        elif ev == "failed":
            notifier.status(f"failed {doc['what']} {doc['tier']}"
                            + (f":{doc['name']}" if doc.get("name") else "")
                            + f": {doc['message']}")
        elif ev == "pass":
            queued = sum(doc["queued"].values())
            notifier.status(f"idle: {queued} queued, {doc['failed']} failed, last pass "
                            + ("drained" if doc["drained"] else "not drained"))

    return tell


def parse_signal(name: str) -> int | None:
    """``--drain-signal``'s value: a signal name with or without ``SIG`` (``USR1``,
    ``SIGUSR2``), or ``none``.

    >>> parse_signal("USR1") == signal.SIGUSR1, parse_signal("sigusr2") == signal.SIGUSR2
    (True, True)
    >>> parse_signal("none") is None
    True
    """
    from ..errors import UsageError

    if name.lower() == "none":
        return None
    upper = name.upper()
    upper = upper if upper.startswith("SIG") else "SIG" + upper
    if upper in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT"):
        raise UsageError(f"--drain-signal {name}: {upper} cannot be the drain signal "
                         "(SIGTERM and SIGINT stop watch; KILL and STOP cannot be caught)")
    try:
        return int(getattr(signal.Signals, upper))
    except AttributeError:
        raise UsageError(f"--drain-signal {name}: not a signal name (e.g. USR1, USR2, "
                         "HUP, or none)") from None


class Drain:
    """The pre-emption signal: when it arrives, ``requested`` is set and the loop ends —
    at once when it waits between passes, else by interrupting the pass the way Ctrl-C
    does (promote leaves resumable state); the command then drains the newest checkpoint.
    A second signal while draining is ignored. Nothing is installed off the main thread
    or for ``signum`` None."""

    def __init__(self, watcher, signum: int | None, wake: threading.Event,
                 stop: threading.Event):
        self.requested = False
        self.signum = signum
        self._previous = None
        if signum is None or threading.current_thread() is not threading.main_thread():
            self.signum = None
            return

        def on_signal(num, frame):
            if self.requested:
                return
            self.requested = True
            stop.set()
            wake.set()
            if not getattr(watcher, "waiting", False):
                raise KeyboardInterrupt

        self._previous = signal.signal(signum, on_signal)

    def restore(self) -> None:
        if self.signum is not None:
            signal.signal(self.signum, self._previous or signal.SIG_DFL)
            self.signum = None


def systemd_unit(executable: str | None = None) -> str:
    """The template unit ``ckptctl-watch@.service`` shipped in ``ckptctl/contrib/``, its
    ExecStart naming ``executable`` (default: the ckptctl running now).

    >>> "Type=notify" in systemd_unit("/opt/venv/bin/ckptctl")
    True
    """
    import os
    import shutil
    from importlib.resources import files

    text = (files("ckptctl") / "contrib" / "ckptctl-watch@.service").read_text()
    if executable is None:
        argv0 = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "ckptctl" else ""
        executable = (os.path.abspath(argv0) if argv0 else shutil.which("ckptctl")
                      or f"{sys.executable} -m ckptctl")
    return text.replace("/usr/local/bin/ckptctl", executable)
