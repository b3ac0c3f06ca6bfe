"""Retries with exponential backoff and full jitter, for transient storage failures only.

botocore already retries each S3 request a few times inside the request budget
(``store.BOTO_ATTEMPTS``); :func:`with_retries` is the outer loop of a transfer step (one
part, one file) for what still gets through: a 5xx, throttling, a connection reset or a
body cut mid-transfer. Anything else (not found, access denied, disk full, a bad request)
is raised at once: retrying it only delays the one-line error.

>>> calls = []
>>> def flaky():
...     calls.append(1)
...     if len(calls) < 3:
...         raise ConnectionResetError("reset by peer")
...     return "done"
>>> with_retries(flaky, sleep=lambda s: None), len(calls)
('done', 3)
"""
from __future__ import annotations

import errno
import logging
import random
import time
from typing import Callable, TypeVar

from ..errors import CkptError

T = TypeVar("T")
log = logging.getLogger("ckptctl.storage")

#: Error codes of S3 answers that say "try again".
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                    "TooManyRequests", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
                    "ServiceUnavailable", "BadGateway", "GatewayTimeout"}
_TRANSIENT_NAMES = {"ReadTimeoutError", "ConnectTimeoutError", "TimeoutError", "FSTimeoutError",
                    "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError",
                    "ConnectionClosedError", "ServerDisconnectedError", "ConnectionResetError",
                    "ConnectionAbortedError", "ConnectionRefusedError", "BrokenPipeError",
                    "ClientPayloadError", "IncompleteRead", "IncompleteReadError",
                    "ResponseStreamingError", "ClientOSError", "EndpointConnectionError",
                    "ClientConnectorError"}
_TRANSIENT_ERRNO = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
                    errno.ETIMEDOUT, errno.EAGAIN}


def is_transient(e: BaseException) -> bool:
    """Would the same request, tried again a little later, likely succeed?

    True for 5xx answers, throttling, timeouts and connections refused, reset or closed;
    for a :class:`~ckptctl.errors.CkptError` from a store, for the codes
    ``REMOTE_TIMEOUT``/``REMOTE_UNREACHABLE`` and server errors, except the ones a store
    raises without asking the server (its circuit breaker already gave up on it).

    >>> from ckptctl.errors import NotFoundError, StorageError
    >>> is_transient(ConnectionResetError()), is_transient(TimeoutError())
    (True, True)
    >>> is_transient(StorageError("s3://b/x", "timed out", code="REMOTE_TIMEOUT"))
    True
    >>> is_transient(NotFoundError("s3://b/x", "not found")), is_transient(PermissionError())
    (False, False)
    """
    if isinstance(e, CkptError):
        flag = getattr(e, "transient", None)
        if flag is not None:
            return bool(flag)
        return e.code in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE")
    seen: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(seen) < 10 and not any(x is y for y in seen):
        seen.append(x)
        if {c.__name__ for c in type(x).__mro__} & _TRANSIENT_NAMES:
            return True
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            if code in _TRANSIENT_CODES or status == 429 or 500 <= int(status) < 600:
                return True
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNO:
            return True
        x = x.__cause__ or x.__context__
    return False


def with_retries(fn: Callable[[], T], *, attempts: int = 4, base: float = 0.5, cap: float = 8.0,
                 what: str = "", on_retry: Callable[[int, BaseException, float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, tried up to ``attempts`` times while it fails transiently (:func:`is_transient`).

    Before try ``k+1`` it sleeps a uniformly random time in ``[0, min(cap, base * 2**(k-1))]``
    ("full jitter": threads that failed together do not come back together) and calls
    ``on_retry(k, error, delay)``. A failure that is not transient, or the last one, is raised
    as it is. ``what`` names the step in the debug log.

    >>> with_retries(lambda: 1 / 0, sleep=lambda s: None)
    Traceback (most recent call last):
    ZeroDivisionError: division by zero
    >>> delays = []
    >>> def down():
    ...     raise TimeoutError("no answer")
    >>> with_retries(down, attempts=3, base=1, sleep=delays.append)
    Traceback (most recent call last):
    TimeoutError: no answer
    >>> len(delays), 0 <= delays[0] <= 1, 0 <= delays[1] <= 2
    (2, True, True)
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for k in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by is_transient, re-raised as is
            if k == attempts or not is_transient(e):
                raise
            delay = random.uniform(0.0, min(cap, base * 2 ** (k - 1)))
            log.debug("retrying %s after %s (try %d of %d, in %.2f s)", what or "request",
                      type(e).__name__, k + 1, attempts, delay)
            if on_retry is not None:
                on_retry(k, e, delay)
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
