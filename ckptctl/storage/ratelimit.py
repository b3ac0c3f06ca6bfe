"""One bandwidth limit shared by every worker thread of a transfer (``--bwlimit``).

A token bucket that runs into debt: :meth:`RateLimiter.acquire` takes the bytes at once
(even more than the bucket holds) and sleeps until the debt is paid back at ``rate``, so a
part larger than the burst still goes, and the long-run rate is exact. Over any window of
``T`` seconds at most ``rate * T + burst`` bytes are granted (``burst`` defaults to a quarter
of a second's worth, 2.5% of a 10 s window for rates from 4 MiB/s up), plus the one request
whose debt was paid just before the window began: keep requests (parts) well under a
window's bytes, e.g. 64 MiB parts at 200 MiB/s are 3% of 10 s.

>>> clock = [0.0]
>>> lim = RateLimiter(100.0, burst=100, clock=lambda: clock[0],
...                   sleep=lambda s: clock.__setitem__(0, clock[0] + s))
>>> for _ in range(5):
...     lim.acquire(100)
>>> clock[0]  # 500 bytes at 100 B/s, the first 100 from the full bucket
4.0
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable

from ..errors import UsageError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_RATE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)(?:e(?P<exp>[+-]?\d+))?\s*"
                   r"(?P<unit>[kmgt]i?)?(?P<b>b)?(?P<per>/s)?", re.I)


def parse_rate(text: str | float | int | None) -> float | None:
    """A bandwidth in bytes per second, or None for no limit (``0``, ``off``, empty).

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of
    1024; a bare ``K``/``M``/``G``/``T`` means the binary unit, as in rclone's ``--bwlimit``.
    ``/s`` is optional. Only bytes: there is no bits unit.

    >>> parse_rate("200MiB/s"), parse_rate("1.5GB/s"), parse_rate("100M"), parse_rate("100MiB")
    (209715200.0, 1500000000.0, 104857600.0, 104857600.0)
    >>> parse_rate("0"), parse_rate("off"), parse_rate(""), parse_rate(None), parse_rate(1e6)
    (None, None, None, None, 1000000.0)
    >>> parse_rate("fast")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: bad rate 'fast' (examples: 200MiB/s, 1.5GB/s, 100M, off)
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        t = str(text).strip()
        if t.lower() in ("", "0", "off", "none", "unlimited"):
            return None
        m = _RATE.fullmatch(t)
        if m is None:
            raise UsageError(f"bad rate {str(text)[:40]!r} (examples: 200MiB/s, 1.5GB/s, 100M, off)")
        unit = (m["unit"] or "").lower()
        if len(unit) == 1 and not m["b"]:  # bare K/M/G/T: binary, like rclone
            unit += "i"
        value = float(m["num"]) * 10 ** int(m["exp"] or 0) * _UNITS[unit]
    if value != value or value < 0 or value == float("inf"):
        raise UsageError(f"rate must be a positive number of bytes per second, got {text!r}")
    return value or None


class RateLimiter:
    """A token bucket shared by threads: :meth:`acquire` ``n`` bytes before sending them.

    ``rate`` in bytes/s (None: no limit, :meth:`acquire` returns at once); ``burst`` the
    bucket's size in bytes (default a quarter second of ``rate``, at least 1 MiB). The
    bucket starts full. ``clock``/``sleep`` are for tests.

    >>> RateLimiter(None).acquire(1 << 40)  # no limit: no wait
    >>> RateLimiter(8 << 20).burst
    2097152.0
    """

    def __init__(self, rate: float | None, burst: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate is not None and not rate > 0:
            raise UsageError(f"rate must be positive, got {rate!r}")
        self.rate = None if rate is None else float(rate)
        self.burst = float(burst) if burst is not None else (
            max(self.rate * 0.25, float(1 << 20)) if self.rate else 0.0)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = self.burst
        self._last = clock()

    def acquire(self, n: int) -> None:
        """Block until ``n`` bytes may go. The bytes are taken at once (the bucket may go
        into debt), then the caller sleeps until the debt is paid: callers are served in
        the order they asked, and none waits longer than the bytes ahead of it need.

        >>> t = [0.0]
        >>> lim = RateLimiter(1000.0, burst=1000, clock=lambda: t[0],
        ...                   sleep=lambda s: t.__setitem__(0, t[0] + s))
        >>> lim.acquire(5000); t[0]  # bigger than the burst: passes, after paying 4000 B
        4.0
        """
        if self.rate is None or n <= 0:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
