"""URL -> :class:`Store`: one checkpoint root on any fsspec filesystem.

A store speaks in paths relative to its root, refuses paths that escape it, and turns
every storage failure into a :class:`~ckptctl.errors.CkptError` with a one-line message
(never the credentials).

>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a.bin").write_bytes(b"0123456789")
>>> s = open_store(d)
>>> s.read_range("a.bin", 2, 5), s.list_files()
(b'234', {'a.bin': 10})
"""
from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import (CkptError, NotFoundError, StorageError, UnsafeInputError, UsageError,
                      shorten)
from .localio import sync_dir, sync_files

#: Descriptors a local store keeps open for ranged reads before it recycles them.
MAX_OPEN_FILES = 256

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


@dataclass
class IOStats:
    """What a store did: counted by the store itself, per call it makes."""

    reads: int = 0
    bytes_read: int = 0
    lists: int = 0
    #: files and parts written by write_atomic, write_file and multipart.upload_part (a
    #: write_file counts one, whatever fsspec sends for it)
    writes: int = 0
    bytes_written: int = 0
    #: delete requests (S3: one per DeleteObjects batch of up to 1,000 keys)
    deletes: int = 0
    #: other requests: multipart create/complete/abort, server-side copies
    requests: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a store can promise (:attr:`Store.caps`).

    ``atomic_rename``: a finished file can be renamed into place (POSIX). ``exclusive_create``:
    a write can refuse an existing name (POSIX ``link``; S3 ``If-None-Match: *``, which some
    servers ignore, rclone among them: a committer still reads back). ``server_side_copy``:
    :func:`~ckptctl.storage.multipart.copy_object` copies without the bytes passing through
    this process. ``multipart``: the :mod:`~ckptctl.storage.multipart` calls work.
    """

    atomic_rename: bool
    exclusive_create: bool
    server_side_copy: bool
    multipart: bool


def parse_storage_options(pairs: list[str] | None) -> dict:
    """Turn repeated ``key=value`` flags into fsspec storage options.

    Values ``true``/``false``/integers are typed; dotted keys nest.

    >>> parse_storage_options(["endpoint_url=http://x:9", "client_kwargs.region_name=us",
    ...                        "use_ssl=false", "max_concurrency=4"])
    {'endpoint_url': 'http://x:9', 'client_kwargs': {'region_name': 'us'}, 'use_ssl': False, 'max_concurrency': 4}
    """
    out: dict = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option expects key=value, got {pair.split('=')[0]!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lstrip("-").isdigit():
            value = int(raw)
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def split_url(url: str) -> tuple[str, str]:
    """``s3://b/p`` -> (``s3``, ``b/p``); plain paths and ``file://`` -> (``file``, abs path).

    >>> split_url("s3://bucket/run/step-1/"), split_url("file:///tmp/x")
    (('s3', 'bucket/run/step-1'), ('file', '/tmp/x'))
    """
    if "://" in url:
        proto, rest = url.split("://", 1)
        proto = proto.lower()
        if proto == "file":
            return "file", os.path.abspath(rest or "/")
        if proto in ("s3", "s3a", "gs", "gcs", "az", "abfs") and (not rest or rest[0] == "/"):
            raise UsageError(f"no bucket in the URL (expected {proto}://BUCKET/PREFIX)", url)
        return proto, rest.rstrip("/")
    return "file", os.path.abspath(url)


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


def _s3_options(options: dict, timeout: float | None = None) -> dict:
    """ckptctl's s3fs options under the user's own (which win, key by key).

    ``timeout`` (default :func:`request_timeout`) bounds one request, retries included:
    botocore tries it :data:`BOTO_ATTEMPTS` times (s3fs :data:`S3FS_ATTEMPTS`), each try
    waiting at most ``timeout / 3`` for the connection (10 s at most) and for each read,
    so a server that accepts and never answers fails the request after about ``timeout``
    s (plus botocore's backoff between tries, under 3 s).

    >>> o = _s3_options({"config_kwargs": {"read_timeout": 300}}, timeout=60)
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


def _s3_budget(fs) -> float | None:
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
        options = _s3_options(options)
        import json

        key = json.dumps([options, [os.environ.get(v) for v in _S3_ENV], os.getpid()],
                         sort_keys=True, default=repr)
        with _filesystems_lock:
            fs = _filesystems.get(key)
            if fs is None:
                fs = _filesystems[key] = _make_filesystem("s3", options)
        return fs
    return _make_filesystem(protocol, options)


def _make_filesystem(protocol: str, options: dict):
    import fsspec

    retries = None
    if protocol == "s3":
        # s3fs takes its retry count as an attribute only: passed to the constructor it
        # reaches aiobotocore's session, which refuses it (TypeError at the first request)
        retries = options.pop("retries")
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as e:
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


def open_store(url: str, storage_options: dict | None = None) -> "Store":
    """Open the place at ``url`` (a plain path, ``file://``, ``s3://bucket/prefix``, ...)."""
    protocol, path = split_url(url)
    if protocol == "file" and not storage_options:
        return Store(path, None, protocol, path)  # fsspec imported only if a call needs it
    fs = make_filesystem(protocol, storage_options)
    return Store(url.rstrip("/") if protocol != "file" else path, fs, protocol, path)


def safe_relpath(rel: str, *, where: str = "") -> str:
    """Normalise a path found in a checkpoint and refuse anything that leaves the root.

    >>> safe_relpath("./a/b.distcp")
    'a/b.distcp'
    >>> safe_relpath("../etc/passwd")
    Traceback (most recent call last):
    ckptctl.errors.UnsafeInputError: path '../etc/passwd' escapes the checkpoint root
    """
    bad = (not rel or "\x00" in rel or rel.startswith(("/", "\\")) or "\\" in rel
           or (len(rel) > 1 and rel[1] == ":"))
    norm = posixpath.normpath(rel) if not bad else rel
    if bad or norm == ".." or norm.startswith("../") or norm == ".":
        raise UnsafeInputError(where or None, f"path {rel!r} escapes the checkpoint root",
                               code="PATH_ESCAPE")
    return norm


class Store:
    """A checkpoint root on a filesystem. Every path argument is relative to the root."""

    def __init__(self, url: str, fs, protocol: str, root: str):
        self.url = url
        self._fs = fs
        self.protocol = protocol
        self.root = root.rstrip("/") if root != "/" else root
        self.stats = IOStats()
        self._lock = threading.Lock()
        self._small: "SmallFileCache | None" = None
        self._fds: dict[str, list[int]] = {}  # rel -> [descriptor, readers using it now]
        self._real_root_kept: str | None = None
        #: remote files' modification times from the last listing that showed them: ``ls``
        #: and ``gc`` date checkpoints without one HEAD request each
        self._mtimes: dict[str, float] = {}

    @property
    def fs(self):
        """The fsspec filesystem (a local store makes its own on first use: listing,
        stat and whole reads of local files go straight to the OS, so commands that only
        read local metadata never import fsspec)."""
        if self._fs is None:
            self._fs = make_filesystem(self.protocol)
        return self._fs

    def cache_small_files(self, sizes: dict[str, int], *, max_file: int = 16 << 20,
                          budget: int = 256 << 20) -> None:
        """Serve ranged reads of small remote files from one whole-file GET each (LRU,
        ``budget`` bytes at most): a DCP checkpoint of many small chunks then costs one
        request per file, not several per chunk; whole reads (:meth:`read`) share it. A
        second call keeps what is cached (one opened checkpoint passed on: seal, ls). No
        effect on local stores."""
        if self.is_local:
            return
        if self._small is None:
            self._small = SmallFileCache(sizes, max_file, budget)
        else:
            with self._small.lock:
                self._small.sizes.update(sizes)

    # ---------------------------------------------------------------- paths
    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def full(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (refusing escapes)."""
        if not rel:
            return self.root
        rel = safe_relpath(rel, where=self.url)
        full = posixpath.join(self.root, rel)
        if self.is_local:
            self._refuse_links_out(rel, full)
        return full

    def _real_root(self) -> str:
        """The root with its links resolved; kept once the root exists (ckptctl makes its
        roots as folders, so the answer cannot change under it)."""
        real = self._real_root_kept
        if real is None:
            real = os.path.realpath(self.root)
            if os.path.isdir(real):
                self._real_root_kept = real
        return real

    def _refuse_links_out(self, rel: str, full: str) -> None:
        """Refuse ``rel`` if a symbolic link on its way (inside the root) leads out of the
        root. Only the components below the root are looked at, one ``lstat`` each up to
        the first that does not exist, and a full ``realpath`` only where one is a link:
        two ``realpath`` s a call (a dozen syscalls) were 20% of a 1,000-file restore."""
        real_root = self._real_root()
        path = real_root.rstrip("/")
        for part in rel.split("/"):
            path = f"{path}/{part}"
            try:
                st = os.lstat(path)
            except OSError:
                return  # nothing below exists, so there is no link to follow
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(full)
                if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
                    raise UnsafeInputError(self.display(rel), "link points outside the "
                                           "checkpoint root", code="PATH_ESCAPE")
                return

    def display(self, rel: str = "") -> str:
        """``rel`` as the user should see it (a URL for remote stores)."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str, *, listed: dict[str, str] | None = None) -> "Store":
        """A store rooted at a sub-folder. ``listed``: names under this store -> the same
        files' names under the child, whose modification times this store's listing
        showed: the child knows them too (no HEAD each)."""
        sub = Store(self.display(rel), self._fs, self.protocol, self.full(rel))
        if listed:
            with self._lock:
                sub._mtimes.update({new: self._mtimes[old] for old, new in listed.items()
                                    if old in self._mtimes})
        return sub

    def parent(self) -> "Store":
        """The store of the folder holding this one, on the same filesystem (same
        credentials and endpoint).

        >>> open_store("/tmp/run/step-1").parent().url
        '/tmp/run'
        """
        root = posixpath.dirname(self.root.rstrip("/")) or "/"
        if self.is_local:
            return Store(root, self._fs, self.protocol, root)
        url = self.url.rstrip("/")
        if url.count("/") <= 2:  # s3://bucket: nothing above it
            return self
        return Store(url.rsplit("/", 1)[0], self.fs, self.protocol, root)

    def local_path(self, rel: str) -> str | None:
        """A path the OS can open (for mmap), or None for remote stores."""
        return self.full(rel) if self.is_local else None

    @property
    def is_s3(self) -> bool:
        return self.protocol in ("s3", "s3a")

    @property
    def caps(self) -> "Capabilities":
        """What this store can promise (see :class:`Capabilities`).

        >>> import tempfile
        >>> open_store(tempfile.mkdtemp()).caps
        Capabilities(atomic_rename=True, exclusive_create=True, server_side_copy=True, multipart=True)
        """
        if self.is_local:
            return Capabilities(True, True, True, True)
        if self.is_s3:  # If-None-Match is sent; whether the server honours it is its business
            return Capabilities(False, True, True, True)
        return Capabilities(False, False, False, False)

    def same_server(self, other: "Store") -> bool:
        """Can a server-side copy go from this store to ``other``? Both local, or both S3 at
        the same endpoint with the same access key.

        >>> import tempfile
        >>> open_store(tempfile.mkdtemp()).same_server(open_store(tempfile.mkdtemp()))
        True
        """
        if self.is_local or other.is_local:
            return self.is_local and other.is_local
        if not (self.is_s3 and other.is_s3):
            return False
        return (self._server().partition(":")[2] == other._server().partition(":")[2]
                and getattr(self.fs, "key", None) == getattr(other.fs, "key", None))

    def _count(self, **fields: int) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # ---------------------------------------------------------------- errors
    @contextlib.contextmanager
    def _errors(self, rel: str) -> Iterator[None]:
        """Turn any failure of the storage calls inside into one :class:`CkptError`
        naming ``rel`` and the cause (see :func:`storage_error`).

        Once a request to a server has timed out or found it unreachable, further
        requests to that server fail at once for the next budget's worth of seconds
        (a circuit breaker): a command that is failing anyway, its other threads and its
        cleanup do not each wait out the whole budget again."""
        server = None if self.is_local else self._server()
        if server is not None:
            dead = _dead_server(server)
            if dead is not None:
                err = StorageError(self.display(rel), dead[0], code=dead[1])
                err.transient = False  # not asked again: retrying only spins until it clears
                raise err
        try:
            yield
        except CkptError:
            raise
        except Exception as e:  # noqa: BLE001 - every storage failure becomes one line
            budget = _s3_budget(self.fs)
            err = storage_error(self.display(rel), e, remote=not self.is_local,
                                budget=budget, secrets=self._secrets())
            # a connection cut mid-body broke one request, not the server: no trip, so an
            # outer retry (retry.with_retries) gets to ask again
            if server is not None and err.code in _NO_SERVER and _CUT not in err.message:
                _mark_dead(server, err.message, err.code, budget or DEFAULT_TIMEOUT)
            raise err from None

    def _server(self) -> str:
        fs = self.fs
        endpoint = getattr(fs, "endpoint_url", None) or (
            getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
        return f"{self.protocol}:{endpoint or ''}"

    def _secrets(self) -> list[str]:
        fs = self.fs
        found = [getattr(fs, a, None) for a in ("key", "secret", "token")]
        found += [os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_SESSION_TOKEN")]
        sk = getattr(fs, "storage_options", None) or {}
        found += [sk.get(k) for k in ("key", "secret", "token", "password")
                  if isinstance(sk, dict)]
        return [x for x in found if isinstance(x, str) and len(x) >= 4]

    # ---------------------------------------------------------------- reads
    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, in one request. Short if the file is."""
        if end <= start:
            return b""
        if self._small is not None and self._small.wants(rel):
            return self._small.get(rel, lambda: self._read_whole(rel))[start:end]
        with self._errors(rel):
            if self.is_local:  # pread on a kept descriptor: no open/seek/close per chunk
                with self._fd(rel) as fd:
                    data = os.pread(fd, end - start, start)
            else:
                data = self.fs.cat_file(self.full(rel), start=start, end=end)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the bytes at ``start``; returns how many there were. Local
        files are read straight into ``buf`` (``preadv``), S3 objects too (one ranged GET,
        :func:`~ckptctl.storage.s3data.get_into`): no new memory per read, which matters
        since first touches of fresh memory run at a fraction of copy speed."""
        if self.is_local and not (self._small is not None and self._small.wants(rel)):
            n = 0
            with self._errors(rel):
                with self._fd(rel) as fd:
                    while n < len(buf):
                        k = os.preadv(fd, [buf[n:]], start + n)
                        if k == 0:
                            break
                        n += k
            with self._lock:
                self.stats.reads += 1
                self.stats.bytes_read += n
            return n
        if self.is_s3 and not (self._small is not None and self._small.wants(rel)):
            from . import s3data  # ranged GETs read straight into buf, off s3fs's loop

            return s3data.get_into(self, rel, start, buf)
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def read_whole_into(self, rel: str, buf: memoryview) -> int:
        """Read a whole file that should hold ``len(buf)`` bytes into ``buf``; returns the
        size found (the caller compares it with what it expected). On S3 one GET of the
        whole object (:func:`~ckptctl.storage.s3data.get_whole_into`: the native client
        where installed), elsewhere :meth:`read_into`."""
        if self.is_s3 and len(buf) and not (self._small is not None and self._small.wants(rel)):
            from . import s3data

            return s3data.get_whole_into(self, rel, buf)
        return self.read_into(rel, 0, buf)

    @contextlib.contextmanager
    def _fd(self, rel: str) -> Iterator[int]:
        """A kept read descriptor of ``rel`` for the block. A descriptor is closed only
        when no reader holds it: closed under a reader, its number could be reused by the
        next open and that reader would get another file's bytes."""
        with self._lock:
            held = self._fds.get(rel)
            if held is None:
                if len(self._fds) >= MAX_OPEN_FILES:  # thousands of rank files: stay bounded
                    self._drop_fds(list(self._fds))
                held = self._fds[rel] = [os.open(self.full(rel), os.O_RDONLY
                                                 | getattr(os, "O_CLOEXEC", 0)), 0]
            held[1] += 1
        try:
            yield held[0]
        finally:
            with self._lock:
                held[1] -= 1
                if not held[1] and self._fds.get(rel) is not held:  # dropped while held
                    os.close(held[0])

    def _drop_fds(self, rels: list[str]) -> None:
        """Forget the descriptors of ``rels`` (caller holds the lock); one in use is
        closed by its last reader."""
        for rel in rels:
            held = self._fds.pop(rel, None)
            if held is not None and not held[1]:
                os.close(held[0])

    def _uncache(self, rel: str) -> None:
        """A file about to change is no longer served from the small-file cache."""
        with self._lock:
            self._mtimes.pop(rel, None)
        if self._small is not None:
            with self._small.lock:
                self._small.sizes.pop(rel, None)
                self._small.data.pop(rel, None)

    def _forget(self, rel: str) -> None:
        with self._lock:
            self._drop_fds([rel])

    def close(self) -> None:
        """Close kept file descriptors (reads reopen them as needed)."""
        with self._lock:
            self._drop_fds(list(self._fds))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def read(self, rel: str) -> bytes:
        """A whole (small) file; from the small-file cache when it is on and holds it."""
        if self._small is not None and self._small.wants(rel):
            return self._small.get(rel, lambda: self._read_whole(rel))
        return self._read_whole(rel)

    def iter_blocks(self, rel: str, *, block: int = 8 << 20,
                    on_bytes: Callable[[int], None] | None = None) -> Iterator[memoryview | bytes]:
        """Stream a whole file in blocks, in order: the one read loop of ckptctl (hashing,
        ``verify --level full``, copies).

        Local files are read with ``readinto`` into a buffer this thread reuses (1 MiB: it
        stays in cache while the caller hashes it), so a block is only valid until the next
        one is asked for: consume or copy it first. S3 objects come in ``block``-byte
        ranged GETs, four in flight (:func:`~ckptctl.storage.s3data.iter_blocks`), each also
        valid until the next is asked for; other remote files stream ``block`` bytes per
        read; small files the store caches (:meth:`cache_small_files`) come from the cache.
        ``on_bytes(n)`` is called for each block; stats count one read and the bytes; every
        failure is one :class:`CkptError` naming ``rel``.

        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"x" * 3_000_000)
        >>> [len(b) for b in open_store(d).iter_blocks("f")]
        [1048576, 1048576, 902848]
        """
        if self._small is not None and self._small.wants(rel):
            data = self.read(rel)  # counted by the read
            if data:
                if on_bytes:
                    on_bytes(len(data))
                yield memoryview(data)
            return
        total = 0
        try:
            if self.is_local:
                buf = _take_buffer()
                try:
                    with self._errors(rel):
                        f = open(self.full(rel), "rb", buffering=0)
                    with f:
                        if hasattr(os, "posix_fadvise"):
                            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                        mv = memoryview(buf)
                        while True:
                            with self._errors(rel):
                                n = f.readinto(mv)
                            if not n:
                                break
                            total += n
                            if on_bytes:
                                on_bytes(n)
                            yield mv[:n]
                finally:
                    _give_buffer(buf)
            elif self.is_s3:  # ranged GETs in flight while the caller hashes
                from . import s3data

                for view in s3data.iter_blocks(self, rel, self.size(rel), block=block):
                    total += len(view)
                    if on_bytes:
                        on_bytes(len(view))
                    yield view
            else:
                with self._errors(rel):
                    f = self.fs.open(self.full(rel), "rb", block_size=block)
                try:
                    while True:
                        with self._errors(rel):
                            data = f.read(block)
                        if not data:
                            break
                        total += len(data)
                        if on_bytes:
                            on_bytes(len(data))
                        yield data
                finally:
                    with contextlib.suppress(Exception):
                        f.close()
        finally:
            self._count(reads=1, bytes_read=total)

    def _read_whole(self, rel: str) -> bytes:
        # s3fs HEADs a file before a whole GET to split large ones into concurrent ranges;
        # whole reads here are small files (metadata, manifests): one GET, not HEAD + GET
        kw = {"max_concurrency": 1} if self.is_s3 else {}
        with self._errors(rel):
            if self.is_local:
                with open(self.full(rel), "rb") as f:
                    data = f.read()
            else:
                data = self.fs.cat_file(self.full(rel), **kw)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def open(self, rel: str, mode: str = "rb", **kw) -> "StoreFile":
        """A file object: streaming reads, or a streaming write (S3: one multipart upload).

        Every call on it (``write``, ``read``, ``flush``, ``close``, where S3 uploads and a
        full disk shows up) fails as one :class:`CkptError` naming ``rel``. Leaving a
        ``with`` block by an exception abandons a remote write (the upload is aborted, no
        partial object appears) instead of completing it.
        """
        if "w" in mode or "x" in mode:
            self._uncache(rel)
        with self._errors(rel):
            full = self.full(rel)
            if self.is_local and ("w" in mode or "x" in mode):
                self._forget(rel)
                os.makedirs(os.path.dirname(full), exist_ok=True)
            return StoreFile(self, rel, self.fs.open(full, mode, **kw), mode)

    def size(self, rel: str) -> int:
        with self._errors(rel):
            if self.is_local:
                return os.stat(self.full(rel)).st_size
            return int(self.fs.size(self.full(rel)))

    def exists(self, rel: str = "") -> bool:
        with self._errors(rel):
            if self.is_local:
                return os.path.exists(self.full(rel))
            return bool(self.fs.exists(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        with self._errors(rel):
            if self.is_local:
                return os.path.isdir(self.full(rel))
            return bool(self.fs.isdir(self.full(rel)))

    def list_files(self, rel: str = "", *, recursive: bool = True) -> dict[str, int]:
        """Every file under ``rel`` -> size, paths relative to the store root, sorted."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            if recursive and self.is_s3:
                found = self._list_s3(base)
            elif recursive and self.is_local:
                found = _walk_local(base)
            elif recursive:
                found = self.fs.find(base, detail=True, withdirs=False)
            else:
                found = {e["name"]: e for e in self.fs.ls(base, detail=True)
                         if e.get("type") == "file"}
        out = {}
        prefix = self.root.rstrip("/") + "/"
        for name, info in found.items():
            name = name.rstrip("/")  # fsspec names S3 objects bucket/key, like our root
            if name.startswith(prefix):
                out[name[len(prefix):]] = int(info.get("size") or 0)
                when = info.get("LastModified") if not self.is_local else None
                if hasattr(when, "timestamp"):
                    with self._lock:
                        self._mtimes[name[len(prefix):]] = when.timestamp()
        return dict(sorted(out.items()))

    def _list_s3(self, base: str) -> dict[str, dict]:
        """Every object under ``base`` (``bucket/prefix``): ListObjectsV2 pages of 1,000
        keys, one after the other, as ``fs.find`` names them. Not ``fs.find`` itself: it
        checks each new folder against a list of its parent's folders (quadratic: ~20 s
        for 10,000 checkpoint folders under one prefix)."""
        bucket, _, key = base.partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        found: dict[str, dict] = {}
        token = None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, **kw)
            for o in page.get("Contents") or []:
                if not o["Key"].endswith("/"):  # a folder marker, not a file
                    found[f"{bucket}/{o['Key']}"] = {"size": o.get("Size", 0),
                                                     "LastModified": o.get("LastModified")}
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    def list_dirs(self, rel: str = "") -> list[str]:
        """Immediate sub-folders of ``rel``, relative to the store root."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            entries = self.fs.ls(base, detail=True)
        prefix = self.root.rstrip("/") + "/"
        return sorted(e["name"].rstrip("/")[len(prefix):] for e in entries
                      if e.get("type") == "directory" and e["name"].startswith(prefix))

    def modified(self, rel: str) -> float | None:
        """Modification time (seconds since the epoch) or None if the store has none; a
        remote file's from the listing that showed it, when there was one (no request)."""
        with self._lock:
            listed = self._mtimes.get(rel)
        if listed is not None:
            return listed
        with self._errors(rel):
            if self.is_local:
                return os.stat(self.full(rel)).st_mtime
            try:
                ts = self.fs.modified(self.full(rel))
            except (NotImplementedError, KeyError, AttributeError):
                return None
        return ts.timestamp() if ts else None

    # ---------------------------------------------------------------- writes
    def write_atomic(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        """Publish a small file all at once: readers see nothing or all of it.

        POSIX: temp file in the same folder, fsync, then rename (``exclusive``: link, which
        fails if the name exists), then fsync the folder. S3: one PUT, with
        ``If-None-Match: *`` when ``exclusive`` (servers that ignore it are caught by the
        read-back check of the caller).
        """
        full = self.full(rel)
        self._uncache(rel)
        if self.is_local:
            self._forget(rel)
            self._write_atomic_local(rel, full, data, exclusive)
        elif self.is_s3:
            from . import s3data

            try:
                s3data.put_object(self, rel, data, exclusive=exclusive)
            except CkptError as e:
                if e.code != "ALREADY_EXISTS":
                    raise
                from ..errors import Finding
                raise Finding(self.display(rel), "already exists (another writer "
                              "committed it)", code="ALREADY_EXISTS") from None
        else:
            with self._errors(rel):
                try:
                    self.fs.pipe_file(full, bytes(data),
                                      mode="create" if exclusive else "overwrite")
                except FileExistsError:
                    from ..errors import Finding
                    raise Finding(self.display(rel), "already exists (another writer "
                                  "committed it)", code="ALREADY_EXISTS") from None
        self._count(writes=1, bytes_written=len(data))

    def stage(self, rel: str, data: bytes | memoryview) -> str:
        """Write a small file of a local store to a hidden temp file beside ``rel``, neither
        durable nor under its name yet: :meth:`publish_staged` publishes many at once.
        Returns the temp file's path.

        >>> import tempfile
        >>> s = open_store(tempfile.mkdtemp()); s.publish_staged({"a/x": s.stage("a/x", b"1")})
        >>> s.read("a/x")
        b'1'
        """
        if not self.is_local:
            raise UsageError(f"{self.url}: staged writes are for local stores")
        full = self.full(rel)
        self._uncache(rel)
        with self._errors(rel):
            fd, tmp = local_temp(full)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            finally:
                os.close(fd)
        self._count(writes=1, bytes_written=len(data))
        return tmp

    def publish_staged(self, staged: dict[str, str]) -> None:
        """Publish files :meth:`stage` wrote (``rel -> temp path``): make their bytes durable
        in one flush of the file system (``syncfs``; an fsync of each where there is none),
        then rename each into place and fsync each folder once. Two fsyncs a file cost
        more than the copy itself for small files (1,000 files of 100 kB: 1.03 s against
        0.32 s here), and a file still shows under its name only once its bytes are
        durable."""
        if not staged:
            return
        first = next(iter(staged))
        with self._errors(first):
            sync_files(list(staged.values()))
        folders: dict[str, None] = {}
        for rel, tmp in staged.items():
            full = self.full(rel)
            self._forget(rel)
            with self._errors(rel):
                os.replace(tmp, full)
            folders.setdefault(os.path.dirname(full))
        for folder in folders:
            with self._errors(os.path.relpath(folder, self.root)):
                sync_dir(folder)

    def _write_atomic_local(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:

        folder = os.path.dirname(full)
        with self._errors(rel):
            fd, tmp = local_temp(full)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if exclusive:
                    try:
                        os.link(tmp, full)
                    except FileExistsError:
                        from ..errors import Finding
                        raise Finding(self.display(rel), "already exists (another writer "
                                      "committed it)", code="ALREADY_EXISTS") from None
                else:
                    os.replace(tmp, full)
                    tmp = None
            finally:
                if tmp is not None and os.path.exists(tmp):
                    os.unlink(tmp)
            sync_dir(folder)

    def write_file(self, rel: str, blocks: Iterable[bytes | memoryview], *,
                   algo: str | None = "xxh3-128",
                   on_bytes: Callable[[int], None] | None = None) -> tuple[str | None, int]:
        """Write a file from a stream of blocks, hashing them on the way: (hex digest or
        None when ``algo`` is None, size).

        Durable before it returns, and all or nothing: POSIX writes a hidden temp file in
        the same folder, fsyncs it, renames it into place and fsyncs the folder; S3 sends
        one PUT or a multipart upload (fsspec). If anything fails, the blocks' producer
        included, nothing appears at ``rel`` (temp file removed, upload aborted) and the
        error is raised (a storage failure as one :class:`CkptError` naming ``rel``).

        >>> import tempfile
        >>> s = open_store(tempfile.mkdtemp())
        >>> s.write_file("a/b.bin", [b"abc", memoryview(b"def")], algo="sha256")[1]
        6
        >>> s.read("a/b.bin")
        b'abcdef'
        """
        from .hashing import new_hasher

        h = new_hasher(algo) if algo else None
        total = 0
        full = self.full(rel)
        self._uncache(rel)

        def each(write) -> None:
            nonlocal total
            for b in blocks:  # pulled outside the error mapping: the producer's own errors stay its own
                n = len(b) if not isinstance(b, memoryview) else b.nbytes
                with self._errors(rel):
                    write(b)
                if h is not None:
                    h.update(b)
                total += n
                if on_bytes:
                    on_bytes(n)

        if self.is_local:
            self._forget(rel)
            folder = os.path.dirname(full)
            with self._errors(rel):
                fd, tmp = local_temp(full)
            try:
                with open(fd, "wb") as f:
                    each(f.write)
                    with self._errors(rel):
                        f.flush()
                        os.fsync(f.fileno())
                with self._errors(rel):
                    os.replace(tmp, full)
                    tmp = None
                    sync_dir(folder)
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        else:
            f = self.open(rel, "wb")
            try:
                each(f.write)
            except BaseException:
                f.discard()
                raise
            f.close()  # completes the upload (aborts it if that fails)
        self._count(writes=1, bytes_written=total)
        return (h.hexdigest() if h is not None else None), total

    def remove_many(self, rels: Sequence[str]) -> int:
        """Delete files in the order given (missing ones are fine); returns how many names
        were handled (``len(rels)``).

        Every name is checked (no escape from the root) before anything is deleted. POSIX
        unlinks one by one and then fsyncs each folder touched, so a caller that removes a
        commit marker in one call and the data in a second call has the marker's removal
        durable first. S3 sends DeleteObjects batches of up to 1,000 keys, one after the
        other; any key the server refuses to delete raises (one line, the first key).

        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp(); _ = [pathlib.Path(d, n).write_bytes(b"") for n in "ab"]
        >>> s = open_store(d); s.remove_many(["a", "b", "missing"]), s.list_files()
        (3, {})
        """
        rels = list(rels)
        fulls = [self.full(r) for r in rels]
        for r in rels:
            self._uncache(r)
        if self.is_local:
            folders: dict[str, None] = {}
            for r, full in zip(rels, fulls):
                self._forget(r)
                with self._errors(r):
                    try:
                        os.unlink(full)
                    except FileNotFoundError:
                        continue
                self._count(deletes=1)
                folders.setdefault(os.path.dirname(full))
            for folder in folders:
                with self._errors(os.path.relpath(folder, self.root)):
                    with contextlib.suppress(FileNotFoundError):
                        sync_dir(folder)
        elif self.is_s3:
            for i in range(0, len(rels), DELETE_BATCH):
                self._delete_batch(rels[i:i + DELETE_BATCH], fulls[i:i + DELETE_BATCH])
        else:
            for r in rels:
                self.remove(r)
        return len(rels)

    def _delete_batch(self, rels: list[str], fulls: list[str]) -> None:
        bucket = fulls[0].partition("/")[0]
        objects = [{"Key": f.partition("/")[2]} for f in fulls]
        with self._errors(rels[0]):
            resp = self.fs.call_s3("delete_objects", Bucket=bucket,
                                   Delete={"Objects": objects, "Quiet": True})
        self._count(deletes=1)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        errors = resp.get("Errors") or []
        if errors:
            first = errors[0]
            key = f"{bucket}/{first.get('Key', '')}"
            rel = dict(zip(fulls, rels)).get(key, rels[0])
            why = ": ".join(x for x in (str(first.get("Code") or ""),
                                        shorten(str(first.get("Message") or ""), 80)) if x)
            raise StorageError(self.display(rel), _scrub(
                f"the server refused to delete {len(errors)} of {len(rels)} objects"
                f"{f' ({why})' if why else ''}", self._secrets()))

    def remove(self, rel: str) -> None:
        """Delete one file (missing is fine)."""
        self._uncache(rel)
        if self.is_local:
            self._forget(rel)
        with self._errors(rel):
            try:
                if self.is_local:  # no fsspec import for a local command
                    os.unlink(self.full(rel))
                else:
                    self.fs.rm_file(self.full(rel))
            except FileNotFoundError:
                pass
        self._count(deletes=1)


#: Keys per S3 DeleteObjects request (the API's maximum).
DELETE_BATCH = 1000


def _walk_local(base: str) -> dict[str, dict]:
    """Every file under the local folder ``base`` -> ``{"size"}``, as fsspec's local
    ``find`` lists them: sub-folders descended, symbolic links not followed but listed
    as files (sized as their target, 0 when it is gone), a folder that cannot be read
    left out, an entry gone meanwhile skipped.

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a").mkdir(), pathlib.Path(d, "a", "x").write_bytes(b"12")
    >>> [(k[len(d):], v["size"]) for k, v in _walk_local(d).items()]
    [('/a/x', 2)]
    """
    out: dict[str, dict] = {}
    todo = [base]
    while todo:
        folder = todo.pop()
        try:
            it = os.scandir(folder)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
                        continue
                    size = e.stat(follow_symlinks=False).st_size
                    if e.is_symlink():
                        try:
                            size = e.stat(follow_symlinks=True).st_size
                        except OSError:
                            size = 0
                except FileNotFoundError:
                    continue
                out[e.path] = {"size": size}
    return out
#: Local streamed reads use buffers of this size (measured faster than 8 MiB: the block
#: stays in cache between the read and the hash).
LOCAL_BLOCK = 1 << 20
_tls = threading.local()


def _take_buffer() -> bytearray:
    """A 1 MiB read buffer for this thread, reused across files (fresh memory is slow to
    touch); a nested reader in the same thread gets a buffer of its own."""
    free = getattr(_tls, "free", None)
    if free is None:
        free = _tls.free = []
    return free.pop() if free else bytearray(LOCAL_BLOCK)


def _give_buffer(buf: bytearray) -> None:
    free = getattr(_tls, "free", None)  # a generator may be closed from another thread
    if free is None:
        free = _tls.free = []
    if len(free) < 4:
        free.append(buf)


def local_temp(full: str) -> tuple[int, str]:
    """A hidden temp file ``.<name>.<random>.tmp`` beside ``full`` (its folder made if
    needed), with the permissions ``open()`` would give it: what every atomic local write
    publishes by rename. One ``open`` in the common case: the folder is made only when the
    open says it is missing, and the umask applies by itself (``tempfile.mkstemp`` makes
    0600, and with its ``makedirs`` and ``fchmod`` it was 12% of a 1,000-file restore).

    >>> import os, tempfile
    >>> fd, tmp = local_temp(os.path.join(tempfile.mkdtemp(), "a", "x.bin")); os.close(fd)
    >>> os.path.basename(tmp).startswith(".x.bin.") and tmp.endswith(".tmp")
    True
    """
    folder, base = os.path.split(full)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f".{base}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
    raise FileExistsError(errno.EEXIST, "no free temporary name", full)


def error_code(e: BaseException) -> str | None:
    """The S3 error code (``NoSuchUpload``...) or ``HTTP <status>`` an exception carries,
    looking through its causes; None for anything else.

    >>> error_code(ValueError("x")) is None
    True
    """
    return _client_code(_chain(e))


class StoreFile:
    """A file of a :class:`Store` whose every I/O call runs inside the store's error
    mapping. Used like the file it wraps (``write``, ``read``, ``readinto``, ``seek``,
    ``tell``, ``flush``, ``close``, ``with``); other attributes pass through.

    >>> import tempfile
    >>> s = open_store(tempfile.mkdtemp())
    >>> with s.open("x.bin", "wb") as f:
    ...     f.write(b"abc")
    3
    >>> with s.open("x.bin") as f:
    ...     f.read()
    b'abc'
    """

    def __init__(self, store: Store, rel: str, f, mode: str):
        self.store, self.rel, self.f, self.mode = store, rel, f, mode

    @property
    def writing(self) -> bool:
        return any(c in self.mode for c in "wxa+")

    def write(self, b) -> int:
        with self.store._errors(self.rel):
            n = self.f.write(b)
        return len(b) if n is None else n

    def read(self, n: int = -1) -> bytes:
        with self.store._errors(self.rel):
            return self.f.read(n)

    def readinto(self, b) -> int:
        with self.store._errors(self.rel):
            return self.f.readinto(b)

    def seek(self, pos: int, whence: int = 0) -> int:
        with self.store._errors(self.rel):
            return self.f.seek(pos, whence)

    def tell(self) -> int:
        with self.store._errors(self.rel):
            return self.f.tell()

    def flush(self) -> None:
        with self.store._errors(self.rel):
            self.f.flush()

    def sync(self) -> None:
        """Flush and make what was written durable (local ``fsync``; S3: nothing until
        ``close`` completes the upload)."""
        with self.store._errors(self.rel):
            self.f.flush()
            if self.store.is_local:
                os.fsync(self.f.fileno())

    def close(self) -> None:
        """Finish the file (S3: upload the rest and complete the upload). If that fails,
        the remote upload is aborted where the server can still be reached."""
        try:
            with self.store._errors(self.rel):
                self.f.close()
        except CkptError as e:
            if self.writing and not self.store.is_local and e.code not in _NO_SERVER:
                self.discard()
            _mark_closed(self.f)
            raise

    def discard(self) -> None:
        """Abandon the file without publishing it (S3: abort the multipart upload; local:
        close it, the bytes written stay for the caller to remove). Never raises."""
        try:
            if self.writing and not self.store.is_local and hasattr(self.f, "discard"):
                self.f.discard()
            else:
                self.f.close()
        except Exception:  # noqa: BLE001 - the error that made us abandon it matters
            pass
        _mark_closed(self.f)

    @property
    def closed(self) -> bool:
        return bool(getattr(self.f, "closed", False))

    def __enter__(self) -> "StoreFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.discard()
        return False

    def __getattr__(self, name):
        if name == "f":  # not set yet (half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.f, name)

    def __iter__(self):
        return iter(self.f)


def _mark_closed(f) -> None:
    """Make sure a failed fsspec file does not retry its upload from ``__del__``."""
    try:
        if getattr(f, "closed", True) is False:
            f.closed = True
    except Exception:  # noqa: BLE001 - a plain file object: its own close already ran
        pass


#: Error codes after which talking to the server again (to abort an upload) is pointless.
_NO_SERVER = ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE")
_CUT = "connection closed by the server"
_dead: dict[str, tuple[float, str, str]] = {}  # server -> (monotonic deadline, message, code)
_dead_lock = threading.Lock()


def _mark_dead(server: str, message: str, code: str, seconds: float) -> None:
    import time

    with _dead_lock:
        _dead[server] = (time.monotonic() + seconds, message, code)


def _dead_server(server: str) -> tuple[str, str] | None:
    """(message, code) of the failure that marked ``server`` dead, while that holds."""
    import time

    with _dead_lock:
        hit = _dead.get(server)
        if hit is None:
            return None
        if time.monotonic() >= hit[0]:
            del _dead[server]
            return None
        return hit[1], hit[2]


def forget_dead_servers() -> None:
    """Clear the circuit breaker (tests; a long-running caller that knows better)."""
    with _dead_lock:
        _dead.clear()

_ERRNO_TEXT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "is a directory",
    errno.ENOTDIR: "a parent is not a directory",
    errno.EFBIG: "file too large for the file system",
    errno.EMFILE: "too many open files",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "I/O error from the device",
    errno.ESTALE: "stale file handle (network file system)",
}


def _chain(e: BaseException) -> list[BaseException]:
    """``e``, its causes and contexts, and the ``error`` botocore wraps, outermost first."""
    out: list[BaseException] = []
    todo = [e]
    while todo and len(out) < 20:
        x = todo.pop(0)
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        kw = getattr(x, "kwargs", None)
        inner = kw.get("error") if isinstance(kw, dict) else None
        todo += [x.__cause__, x.__context__, inner if isinstance(inner, BaseException) else None,
                 getattr(x, "os_error", None)]
    return out


def _client_code(chain: list[BaseException]) -> str | None:
    for x in chain:
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            if code:
                return str(code)
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status:
                return f"HTTP {status}"
    return None


def _names(chain: list[BaseException]) -> set[str]:
    return {c.__name__ for x in chain for c in type(x).__mro__}


def storage_error(shown: str, e: BaseException, *, remote: bool = False,
                  budget: float | None = None, secrets: list[str] | None = None) -> CkptError:
    """The one-line error for a storage failure ``e`` at ``shown``: what happened, in words
    (never a bare exception class, never a credential).

    >>> import errno
    >>> str(storage_error("out/model.safetensors", OSError(errno.ENOSPC, "No space left")))
    'out/model.safetensors: no space left on device'
    >>> str(storage_error("s3://b/x", TimeoutError(), remote=True, budget=60))
    's3://b/x: timed out after 60 s (server not answering; see --timeout)'
    """
    chain = _chain(e)
    names = _names(chain)
    code = _client_code(chain) if remote else None
    after = f" after {budget:g} s" if budget else ""

    def bad(message: str, code_: str = "IO_ERROR", cls=StorageError, *,
            transient: bool = False) -> CkptError:
        err = cls(shown, _scrub(message, secrets), code=code_)
        err.transient = transient  # retry.is_transient: worth trying again later?
        return err

    if code == "NoSuchBucket":
        return bad("no such bucket", "MISSING_FILE", NotFoundError)
    if code in ("NoSuchKey", "NoSuchUpload", "HTTP 404") or isinstance(e, FileNotFoundError):
        return bad("not found", "MISSING_FILE", NotFoundError)
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                "AllAccessDisabled", "AccountProblem", "InvalidToken", "HTTP 403") or (
            names & {"NoCredentialsError", "PartialCredentialsError",
                     "CredentialRetrievalError"}):
        what = {"InvalidAccessKeyId": "unknown access key",
                "SignatureDoesNotMatch": "wrong secret key",
                "ExpiredToken": "expired session token"}.get(code or "")
        if names & {"NoCredentialsError", "PartialCredentialsError"}:
            what = "no credentials"
        return bad(f"access denied ({what or code or 'check credentials'}; check "
                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --storage-option key=/secret=)")
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests", "HTTP 429"):
        return bad(f"server is throttling requests ({code}); still refused{after}, "
                   "retry later or raise --timeout", "REMOTE_TIMEOUT", transient=True)
    if code in ("RequestTimeout",):
        return bad(f"server timed out reading the request ({code})", "REMOTE_TIMEOUT",
                   transient=True)
    if code in ("InternalError", "ServiceUnavailable", "HTTP 500", "HTTP 502", "HTTP 503",
                "HTTP 504"):
        return bad(f"server error ({code})", transient=True)
    # before the timeouts: urllib3's NewConnectionError (a refused connection) is a
    # subclass of its ConnectTimeoutError
    if names & {"ConnectionRefusedError"} or any(
            getattr(x, "errno", None) == errno.ECONNREFUSED for x in chain):
        return bad("remote unreachable (connection refused)", "REMOTE_UNREACHABLE",
                   transient=True)
    if names & {"ReadTimeoutError", "ConnectTimeoutError", "TimeoutError", "FSTimeoutError",
                "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError"}:
        if "ConnectTimeoutError" in names:
            return bad(f"remote unreachable (connect timed out{after})", "REMOTE_UNREACHABLE",
                       transient=True)
        return bad(f"timed out{after} (server not answering; see --timeout)", "REMOTE_TIMEOUT",
                   transient=True)
    if names & {"gaierror", "ClientConnectorDNSError"}:
        return bad("remote unreachable (host name not found)", "REMOTE_UNREACHABLE")
    if names & {"EndpointConnectionError", "ClientConnectorError", "ProxyConnectionError"}:
        return bad("remote unreachable (could not connect)", "REMOTE_UNREACHABLE",
                   transient=True)
    if names & {"SSLError", "ClientSSLError", "SSLCertVerificationError"}:
        return bad("TLS error talking to the server (certificate or protocol)",
                   "REMOTE_UNREACHABLE")
    if names & {"ConnectionClosedError", "ServerDisconnectedError", "ConnectionResetError",
                "BrokenPipeError", "ClientPayloadError", "IncompleteRead",
                "IncompleteReadError", "ResponseStreamingError", "ClientOSError",
                "ConnectionAbortedError"}:
        return bad(f"remote unreachable ({_CUT})", "REMOTE_UNREACHABLE",
                   transient=True)
    if code == "PreconditionFailed" or isinstance(e, FileExistsError):
        return bad("already exists", "ALREADY_EXISTS")
    if code:  # any other answer of the server: its code says what it refused
        return bad(f"refused by the server ({code})")
    if isinstance(e, OSError):
        if e.errno in _ERRNO_TEXT:
            return bad(_ERRNO_TEXT[e.errno])
        if isinstance(e, PermissionError):
            return bad("permission denied")
        if isinstance(e, IsADirectoryError):
            return bad("is a directory")
        text = e.strerror or (os.strerror(e.errno) if e.errno else "") or type(e).__name__
        return bad(f"I/O error: {text}")
    if isinstance(e, MemoryError):
        return bad("out of memory")
    for x in chain:  # s3fs hands unknown -o KEY=VALUE to its session at the first request
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(x))
        if isinstance(x, TypeError) and unknown:
            return UsageError(f"unknown storage option {unknown.group(1)!r} (S3: endpoint_url, "
                              "key, secret, token, profile, client_kwargs...)", shown)
    detail = shorten(_scrub(str(e), secrets), 160)  # scrubbed first: no half a secret
    return bad(f"storage error ({type(e).__name__}{': ' + detail if detail else ''})")


def _scrub(message: str, secrets: list[str] | None) -> str:
    for s in secrets or ():
        message = message.replace(s, "***")
    return message


class SmallFileCache:
    """Whole small files kept in memory, least recently used evicted past ``budget``."""

    def __init__(self, sizes: dict[str, int], max_file: int, budget: int):
        import collections

        self.sizes, self.max_file, self.budget = dict(sizes), max_file, budget
        self.data: "collections.OrderedDict[str, bytes]" = collections.OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict[str, threading.Lock] = {}

    def wants(self, rel: str) -> bool:
        size = self.sizes.get(rel)
        return size is not None and size <= self.max_file

    def get(self, rel: str, load) -> bytes:
        with self.lock:
            if rel in self.data:
                self.data.move_to_end(rel)
                return self.data[rel]
            file_lock = self.loading.setdefault(rel, threading.Lock())
        with file_lock:  # one GET per file even when threads ask at once
            with self.lock:
                if rel in self.data:
                    return self.data[rel]
            blob = load()
            with self.lock:
                self.data[rel] = blob
                while sum(len(b) for b in self.data.values()) > self.budget and len(self.data) > 1:
                    self.data.popitem(last=False)
            return blob
