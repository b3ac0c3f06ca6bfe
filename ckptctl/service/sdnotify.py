"""The systemd notify protocol (``sd_notify(3)``) for ``watch`` under ``Type=notify``.

A service manager that wants to hear from its service passes ``NOTIFY_SOCKET`` (a datagram
socket: a path, or ``@name`` in the abstract namespace) and, with ``WatchdogSec=``,
``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). The service sends newline-separated
``KEY=VALUE`` datagrams: ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``.
Without ``NOTIFY_SOCKET`` every call here does nothing, so the same code runs under a
shell, cron, Slurm or Kubernetes.

>>> n = Notifier({})
>>> n.enabled, n.watchdog_seconds, n.send(READY=1)
(False, None, False)
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping


class Notifier:
    """Sends ``sd_notify`` messages to ``NOTIFY_SOCKET`` of ``environ`` (default
    ``os.environ``). ``watchdog_seconds``: ``WATCHDOG_USEC`` in seconds when the watchdog
    is meant for this process (``WATCHDOG_PID`` unset or this pid), else None.

    >>> Notifier({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "20000000"}).watchdog_seconds
    20.0
    >>> Notifier({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}).watchdog_seconds is None
    True
    """

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") or ""
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_seconds: float | None = None
        pid = env.get("WATCHDOG_PID")
        usec = env.get("WATCHDOG_USEC")
        if usec and (not pid or pid == str(os.getpid())):
            try:
                self.watchdog_seconds = int(usec) / 1e6 or None
            except ValueError:
                self.watchdog_seconds = None
        self._sock: socket.socket | None = None
        self._mutex = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; True when it was sent. A manager that
        has gone away is not an error of the service (False).

        >>> Notifier({}).send(STATUS="idle")
        False
        """
        if not self.address:
            return False
        data = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        with self._mutex:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                self._sock.sendto(data, self.address)
                return True
            except OSError:
                return False

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.send(STATUS=text.replace("\n", " "))

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def close(self) -> None:
        with self._mutex:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class Heartbeat:
    """A daemon thread that sends ``WATCHDOG=1`` every half of the watchdog period while
    ``alive()`` says the service makes progress; when it stops saying so, the pings stop
    and the manager restarts the service at the end of the period. Nothing without a
    watchdog.

    >>> hb = Heartbeat(Notifier({}), alive=lambda: True); hb.start(); hb.stop()
    """

    def __init__(self, notifier: Notifier, alive: Callable[[], bool]):
        self.notifier = notifier
        self.alive = alive
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.notifier.enabled or not self.notifier.watchdog_seconds:
            return
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        half = self.notifier.watchdog_seconds / 2
        while not self._stop.is_set():
            if self.alive():
                self.notifier.send(WATCHDOG=1)
            self._stop.wait(half)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

