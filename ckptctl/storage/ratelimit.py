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

import threading
import time
from typing import Callable

from ..errors import UsageError
from ..units import parse_rate

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
