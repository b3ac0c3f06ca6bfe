"""What every store is built on: its counters (:class:`IOStats`), its promises
(:class:`Capabilities`) and :class:`StoreCore`, the state, paths, counting, error mapping
and cache bookkeeping that the listing, reading, writing and commit parts of
:class:`~ckptctl.storage.store.Store` share.

>>> s = StoreCore("memory://x/run", None, "memory", "x/run")
>>> s.full("a/b.bin"), s.child("step-1").display("c"), s.caps.multipart
('x/run/a/b.bin', 'memory://x/run/step-1/c', False)
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Iterator

from ..errors import CkptError
from .failures import NO_SERVER, CUT, dead_server, mark_dead, storage_error
from .filesystems import DEFAULT_TIMEOUT, make_filesystem, s3_budget
from .smallfiles import SmallFileCache
from .urls import safe_relpath


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
    #: small files served by the persistent object cache (no request)
    cache_hits: int = 0


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



class StoreCore:
    """A checkpoint root on a filesystem, before it can do anything: where it is
    (:meth:`full`, :meth:`display`, :meth:`child`, :meth:`parent`), what it promises
    (:attr:`caps`), its counters and lock, and the one error mapping (:meth:`_errors`)
    every storage call runs in. :class:`~ckptctl.storage.store.Store` adds listing,
    reading, writing and commit on top."""

    #: a POSIX file system: paths the OS opens, rename, fsync
    is_local = False
    #: an S3 API (s3fs + the bulk client of :mod:`~ckptctl.storage.s3data`)
    is_s3 = False
    #: the store sends If-Match updates (``version_of``/``put_if_match``) and
    #: If-None-Match creates; :mod:`~ckptctl.storage.conditional` asks
    conditional_writes = False

    def __init__(self, url: str, fs, protocol: str, root: str):
        self.url = url
        self._fs = fs
        self.protocol = protocol
        self.root = root.rstrip("/") if root != "/" else root
        self.stats = IOStats()
        self._lock = threading.Lock()
        self._small: SmallFileCache | None = None
        self._objects = None  # the persistent object cache, once cache_small_files(persist)
        #: remote files' modification times from the last listing that showed them: ``ls``
        #: and ``gc`` date checkpoints without one HEAD request each
        self._mtimes: dict[str, float] = {}
        #: remote files' ETags from the same listings: what identifies an object's bytes
        #: to the persistent object cache (:mod:`~ckptctl.storage.objcache`)
        self._etags: dict[str, str] = {}

    @property
    def fs(self):
        """The fsspec filesystem (a local store makes its own on first use: listing,
        stat and whole reads of local files go straight to the OS, so commands that only
        read local metadata never import fsspec)."""
        if self._fs is None:
            self._fs = make_filesystem(self.protocol)
        return self._fs

    # ---------------------------------------------------------------- paths
    def full(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (refusing escapes)."""
        if not rel:
            return self.root
        return posixpath.join(self.root, safe_relpath(rel, where=self.url))

    def display(self, rel: str = "") -> str:
        """``rel`` as the user should see it (a URL for remote stores)."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str, *, listed: dict[str, str] | None = None) -> "StoreCore":
        """A store rooted at a sub-folder. ``listed``: names under this store -> the same
        files' names under the child, whose modification times this store's listing
        showed: the child knows them too (no HEAD each)."""
        sub = type(self)(self.display(rel), self._fs, self.protocol, self.full(rel))
        if listed:
            with self._lock:
                sub._mtimes.update({new: self._mtimes[old] for old, new in listed.items()
                                    if old in self._mtimes})
                sub._etags.update({new: self._etags[old] for old, new in listed.items()
                                   if old in self._etags})
        return sub

    def parent(self) -> "StoreCore":
        """The store of the folder holding this one, on the same filesystem (same
        credentials and endpoint).

        >>> from ckptctl.storage import open_store
        >>> open_store("/tmp/run/step-1").parent().url, open_store("s3://b/run/s").parent().url
        ('/tmp/run', 's3://b/run')
        """
        root = posixpath.dirname(self.root.rstrip("/")) or "/"
        url = self.url.rstrip("/")
        if url.count("/") <= 2:  # s3://bucket: nothing above it
            return self
        return type(self)(url.rsplit("/", 1)[0], self._fs, self.protocol, root)

    def local_path(self, rel: str) -> str | None:
        """A path the OS can open (for mmap), or None for remote stores."""
        return None

    @property
    def caps(self) -> "Capabilities":
        """What this store can promise (see :class:`Capabilities`).

        >>> from ckptctl.storage import open_store
        >>> import tempfile
        >>> open_store(tempfile.mkdtemp()).caps  # doctest: +NORMALIZE_WHITESPACE
        Capabilities(atomic_rename=True, exclusive_create=True, server_side_copy=True,
                     multipart=True)
        """
        return Capabilities(False, False, False, False)

    def same_server(self, other: "StoreCore") -> bool:
        """Can a server-side copy go from this store to ``other``? Both local, or both S3 at
        the same endpoint with the same access key.

        >>> from ckptctl.storage import open_store
        >>> import tempfile
        >>> open_store(tempfile.mkdtemp()).same_server(open_store(tempfile.mkdtemp()))
        True
        """
        return False

    def _count(self, **fields: int) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # ---------------------------------------------------------------- errors
    @contextlib.contextmanager
    def _errors(self, rel: str) -> Iterator[None]:
        """Turn any failure of the storage calls inside into one :class:`CkptError`
        naming ``rel`` and the cause (see :func:`~ckptctl.storage.failures.storage_error`).

        Once a request to a server has timed out or found it unreachable, further
        requests to that server fail at once for the next budget's worth of seconds
        (a circuit breaker): a command that is failing anyway, its other threads and its
        cleanup do not each wait out the whole budget again."""
        server = self._server()
        if server is not None:
            dead = dead_server(server)
            if dead is not None:
                from ..errors import StorageError

                err = StorageError(self.display(rel), dead[0], code=dead[1])
                err.transient = False  # not asked again: retrying only spins until it clears
                raise err
        try:
            yield
        except CkptError:
            raise
        except Exception as e:  # noqa: BLE001 - every storage failure becomes one line
            budget = self._budget()
            err = storage_error(self.display(rel), e, remote=not self.is_local,
                                budget=budget, secrets=self._secrets())
            # a connection cut mid-body broke one request, not the server: no trip, so an
            # outer retry (retry.with_retries) gets to ask again
            if server is not None and err.code in NO_SERVER and CUT not in err.message:
                mark_dead(server, err.message, err.code, budget or DEFAULT_TIMEOUT)
            raise err from None

    def _budget(self) -> float | None:
        """About how long one request may take at most (what a timeout message says)."""
        return s3_budget(self.fs)

    def _server(self) -> str | None:
        """Who answers this store's requests (the circuit breaker's key); None: the OS."""
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

    # ---------------------------------------------------------------- caches
    def _uncache(self, rel: str) -> None:
        """A file about to change is no longer served from the small-file cache."""
        with self._lock:
            self._mtimes.pop(rel, None)
            self._etags.pop(rel, None)
        if self._small is not None:
            with self._small.lock:
                self._small.sizes.pop(rel, None)
                self._small.data.pop(rel, None)

    def _forget(self, rel: str) -> None:
        """A file about to change or go: drop what is kept open of it (local stores)."""

    def close(self) -> None:
        """Close kept file descriptors (reads reopen them as needed)."""
