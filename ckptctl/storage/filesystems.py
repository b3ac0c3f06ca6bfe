"""fsspec filesystems with ckptctl's settings: the request budget (``--timeout``) and
how botocore spends it, the S3 endpoint from the environment, one shared filesystem per
endpoint, settings and credentials in a process.

>>> set_timeout(5); request_timeout()
5.0
>>> set_timeout(None)
"""
from __future__ import annotations

import os
import threading

from ..errors import StorageError, UsageError

#: Seconds one remote request may take in all, retries included (``--timeout``).
DEFAULT_TIMEOUT = 60.0
#: How a request's budget is spent: botocore tries it this many times (standard mode
#: retries throttling, 5xx, timeouts and connection errors). s3fs's own retry loop is
#: set to one try: it nests (a read runs s3fs's loop around a call that runs it again),
#: so its retries would multiply the budget. A body that breaks off mid-transfer is
#: therefore not retried: the command stops with one line and can be rerun.
BOTO_ATTEMPTS = 3
S3FS_ATTEMPTS = 1
_timeout: float | None = None


def parse_timeout(value) -> float:
    """A ``--timeout``/``CKPTCTL_TIMEOUT`` value in seconds (> 0).

    >>> parse_timeout("2.5"), parse_timeout(60)
    (2.5, 60.0)
    """
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"--timeout expects seconds, got {str(value)[:40]!r}") from None
    if not t > 0 or t == float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {value}")
    return t


def set_timeout(seconds: float | None) -> None:
    """Set the budget of one remote request (retries included) for stores opened from now
    on; ``None`` goes back to ``CKPTCTL_TIMEOUT`` or :data:`DEFAULT_TIMEOUT`.

    >>> set_timeout(5); request_timeout()
    5.0
    >>> set_timeout(None)
    """
    global _timeout
    _timeout = None if seconds is None else parse_timeout(seconds)


def request_timeout() -> float:
    """The budget of one remote request: :func:`set_timeout`, else ``CKPTCTL_TIMEOUT``,
    else :data:`DEFAULT_TIMEOUT` (60 s)."""
    if _timeout is not None:
        return _timeout
    env = os.environ.get("CKPTCTL_TIMEOUT")
    return parse_timeout(env) if env else DEFAULT_TIMEOUT


def s3fs_options(options: dict, timeout: float | None = None) -> dict:
    """ckptctl's s3fs options under the user's own (which win, key by key).

    ``timeout`` (default :func:`request_timeout`) bounds one request, retries included:
    botocore tries it :data:`BOTO_ATTEMPTS` times (s3fs :data:`S3FS_ATTEMPTS`), each try
    waiting at most ``timeout / 3`` for the connection (10 s at most) and for each read,
    so a server that accepts and never answers fails the request after about ``timeout``
    s (plus botocore's backoff between tries, under 3 s).

    >>> o = s3fs_options({"config_kwargs": {"read_timeout": 300}}, timeout=60)
    >>> o["retries"], o["config_kwargs"]["read_timeout"], o["config_kwargs"]["connect_timeout"]
    (1, 300, 10.0)
    >>> o["config_kwargs"]["retries"]  # botocore's max_attempts would count retries only
    {'total_max_attempts': 3, 'mode': 'standard'}
    """
    timeout = parse_timeout(timeout) if timeout is not None else request_timeout()
    for key in ("config_kwargs", "client_kwargs"):
        if key in options and not isinstance(options[key], dict):
            raise UsageError(f"storage option {key} takes dotted keys, e.g. "
                             f"-o {key}.{'read_timeout=300' if key == 'config_kwargs' else 'region_name=us-east-1'}")
    per_try = timeout / (BOTO_ATTEMPTS * S3FS_ATTEMPTS)
    opts = {"use_listings_cache": False, "skip_instance_cache": True, "retries": S3FS_ATTEMPTS}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in (
            options.get("client_kwargs") or {}):
        opts["endpoint_url"] = endpoint
    opts.update(options)
    # botocore validates full-object CRCs on ranged GETs against servers (rclone) that send
    # them for the whole object, and fails; ckptctl verifies content with its own hashes.
    cfg = {"response_checksum_validation": "when_required",
           "request_checksum_calculation": "when_required",
           "connect_timeout": min(per_try, 10.0), "read_timeout": per_try,
           "retries": {"total_max_attempts": BOTO_ATTEMPTS, "mode": "standard"}}
    cfg.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = cfg
    return opts


def gcs_options(options: dict, env=None) -> dict:
    """gcsfs's options: the emulator from ``STORAGE_EMULATOR_HOST`` (anonymous, no
    project lookup), ckptctl's request budget, the user's options over both.

    A request is tried up to :data:`GCSFS_ATTEMPTS` times (:func:`_gcs_class`), each try
    waiting ``budget / 3`` at most for the connection (10 s at most) and between two
    reads of the answer: a server that accepts and never answers fails a request after
    about the budget.

    >>> gcs_options({}, env={"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"})["token"]
    'anon'
    """
    env = os.environ if env is None else env
    per_try = request_timeout() / GCSFS_ATTEMPTS
    opts: dict = {"requests_timeout": _aiohttp_timeout(per_try), "skip_instance_cache": True,
                  "use_listings_cache": False}
    emulator = env.get("STORAGE_EMULATOR_HOST", "")
    if emulator and emulator != "default":
        opts.update(endpoint_url=emulator if "://" in emulator else f"http://{emulator}",
                    token="anon", project="ckptctl")
    opts.update(options)
    return opts


#: tries per GCS request (gcsfs's own loop, 6 tries with up to 31 s of backoff, is
#: replaced: :func:`_gcs_class`)
GCSFS_ATTEMPTS = 3


def _aiohttp_timeout(per_try: float):
    """aiohttp's timeouts for one try: the connection and each read, not the whole body
    (a large ranged GET may take longer than one try's share of the budget)."""
    try:
        from aiohttp import ClientTimeout
    except ImportError:  # gcsfs is not installed: opening the filesystem says so
        return per_try
    return ClientTimeout(total=None, sock_connect=min(per_try, 10.0), sock_read=per_try)


def s3_budget(fs) -> float | None:
    """About how long one request to ``fs`` may take at most, from its actual settings."""
    cfg = getattr(fs, "config_kwargs", None)
    if not isinstance(cfg, dict):
        return None
    try:
        read = float(cfg.get("read_timeout", getattr(fs, "read_timeout", 15)))
        retries = cfg.get("retries") or {}
        if "total_max_attempts" in retries:
            boto = int(retries["total_max_attempts"])
        else:  # botocore: retries after the first try (legacy mode's default: 4)
            boto = int(retries.get("max_attempts", 4)) + 1
        return read * max(1, boto) * max(1, int(getattr(fs, "retries", 1)))
    except (TypeError, ValueError):
        return None


#: S3 filesystems made in this process, by their settings: every store of one endpoint
#: shares one client, its connections and its bulk client (a walk down a pack's base
#: chain opened a new client, ~0.25 s, at every level)
_filesystems: dict[str, object] = {}
_filesystems_lock = threading.Lock()
#: what else decides which credentials and endpoint an S3 client uses
_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
           "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_SHARED_CREDENTIALS_FILE",
           "AWS_CONFIG_FILE")


def forget_filesystems() -> None:
    """Drop the shared S3 filesystems (tests: each starts with fresh clients)."""
    with _filesystems_lock:
        _filesystems.clear()


def make_filesystem(protocol: str, options: dict | None = None):
    """An fsspec filesystem for ``protocol`` with ckptctl's defaults (S3: endpoint from
    ``AWS_ENDPOINT_URL``, no listing cache; one per endpoint, settings and credentials in
    a process, shared by its threads)."""
    options = dict(options or {})
    if protocol in ("s3", "s3a"):
        options = s3fs_options(options)
        import json

        key = json.dumps([options, [os.environ.get(v) for v in _S3_ENV], os.getpid()],
                         sort_keys=True, default=repr)
        with _filesystems_lock:
            fs = _filesystems.get(key)
            if fs is None:
                fs = _filesystems[key] = _make_filesystem("s3", options)
        return fs
    if protocol in ("gs", "gcs"):
        options = gcs_options(options)
    return _make_filesystem(protocol, options)


def _make_filesystem(protocol: str, options: dict):
    import fsspec

    retries = None
    if protocol == "s3":
        # s3fs takes its retry count as an attribute only: passed to the constructor it
        # reaches aiobotocore's session, which refuses it (TypeError at the first request)
        retries = options.pop("retries")
    try:
        if protocol in ("gs", "gcs"):
            fs = _gcs_filesystem(options)
        else:
            fs = fsspec.filesystem(protocol, **options)
    except ImportError as e:
        extra = {"gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}.get(protocol)
        if extra:
            from .._deps import MissingDependencyError

            raise MissingDependencyError(f"{protocol}://", f"needs {e.name or 'its client'}: "
                                         f"pip install 'ckptctl[{extra}]'") from None
        raise StorageError(None, f"no filesystem for {protocol}://: {e}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad storage options for {protocol}://: {type(e).__name__}") from None
    if retries is not None:
        try:
            fs.retries = max(1, int(retries))
        except (TypeError, ValueError):
            raise UsageError(f"storage option retries must be an integer, got {retries!r}") \
                from None
    return fs


def _gcs_filesystem(options: dict):
    """gcsfs's plain ``GCSFileSystem`` (:func:`_gcs_class`). ``fsspec.filesystem("gs")``
    gives its ``ExtendedGcsFileSystem`` (zonal and hierarchical buckets), which asks every
    call's bucket for its type over gRPC and does not keep an unknown answer: 30-60 s per
    call against an emulator (fake-gcs-server speaks no gRPC)."""
    return _gcs_class()(**options)


_gcs_made: list = []


def _gcs_class():
    """``GCSFileSystem`` whose requests spend ckptctl's budget: :data:`GCSFS_ATTEMPTS`
    tries, only for what gcsfs itself counts as transient, never past the budget, and
    a refused connection at once (gcsfs alone tries 6 times with 1-16 s between: ~31 s
    of waiting for a server that is not there, whatever ``--timeout`` says)."""
    if _gcs_made:
        return _gcs_made[0]
    import asyncio
    import time

    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import is_retriable

    once = GCSFileSystem._request.__wrapped__  # gcsfs's request without its retry loop

    class BudgetedGCSFileSystem(GCSFileSystem):
        async def _request(self, *args, **kwargs):
            deadline = time.monotonic() + request_timeout()
            for attempt in range(GCSFS_ATTEMPTS):
                try:
                    return await once(self, *args, **kwargs)
                except Exception as e:  # noqa: BLE001 - gcsfs's own judgement decides
                    pause = 0.25 * 4 ** attempt
                    refused = isinstance(e, ConnectionRefusedError) or isinstance(
                        getattr(e, "os_error", None), ConnectionRefusedError)
                    if (attempt == GCSFS_ATTEMPTS - 1 or refused or not is_retriable(e)
                            or time.monotonic() + pause > deadline):
                        raise
                    await asyncio.sleep(pause)

    _gcs_made.append(BudgetedGCSFileSystem)
    return BudgetedGCSFileSystem
