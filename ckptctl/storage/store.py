"""URL -> :class:`Store`: one checkpoint root on any fsspec filesystem.

A store speaks in paths relative to its root, refuses paths that escape it, and turns
every storage failure into a :class:`~ckptctl.errors.CkptError` with a one-line message
(never the credentials). :class:`Store` is the contract and its implementation for any
fsspec filesystem; local disks (:class:`~ckptctl.storage.local_store.LocalStore`) and S3
(:class:`~ckptctl.storage.s3_store.S3Store`) each have their own module, and
:func:`~ckptctl.storage.backends.open_store` picks one by the URL (``tests/test_store_contract.py`` runs the same
checks against all of them).

>>> from ckptctl.storage import open_store
>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a.bin").write_bytes(b"0123456789")
>>> s = open_store(d)
>>> s.read_range("a.bin", 2, 5), s.list_files(), type(s).__name__
(b'234', {'a.bin': 10}, 'LocalStore')
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import CkptError, NotFoundError, UnsafeInputError, UsageError
from .failures import NO_SERVER, CUT, dead_server, mark_dead, storage_error
from .filesystems import DEFAULT_TIMEOUT, make_filesystem, s3_budget

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
    """A checkpoint root on a filesystem. Every path argument is relative to the root.

    This class answers through fsspec alone, for any protocol; a backend's own module
    subclasses it where its OS or API does better (``_stream``, ``_find``, ``_put``,
    ``_write_stream``, ``_remove_all`` and the small methods they sit beside).
    """

    #: a POSIX file system: paths the OS opens, rename, fsync
    is_local = False
    #: an S3 API (s3fs + the bulk client of :mod:`~ckptctl.storage.s3data`)
    is_s3 = False

    def __init__(self, url: str, fs, protocol: str, root: str):
        self.url = url
        self._fs = fs
        self.protocol = protocol
        self.root = root.rstrip("/") if root != "/" else root
        self.stats = IOStats()
        self._lock = threading.Lock()
        self._small: "SmallFileCache | None" = None
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

    def cache_small_files(self, sizes: dict[str, int], *, max_file: int = 16 << 20,
                          budget: int = 256 << 20, persist: bool = False) -> None:
        """Serve ranged reads of small remote files from one whole-file GET each (LRU,
        ``budget`` bytes at most): a DCP checkpoint of many small chunks then costs one
        request per file, not several per chunk; whole reads (:meth:`read`) share it. A
        second call keeps what is cached (one opened checkpoint passed on: seal, ls). No
        effect on local stores. ``persist``: files the listing showed with an ETag come
        from the object cache on local disk when it holds them, and go there when read
        (:mod:`~ckptctl.storage.objcache`; for a chain walk, never for what must prove
        the store's bytes)."""
        if self._small is None:
            self._small = SmallFileCache(sizes, max_file, budget)
        else:
            with self._small.lock:
                self._small.sizes.update(sizes)
        if persist and self._objects is None:
            from .objcache import default_cache

            self._objects = default_cache()

    def _cached(self, rel: str) -> bool:
        return self._small is not None and self._small.wants(rel)

    # ---------------------------------------------------------------- paths
    def full(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (refusing escapes)."""
        if not rel:
            return self.root
        return posixpath.join(self.root, safe_relpath(rel, where=self.url))

    def display(self, rel: str = "") -> str:
        """``rel`` as the user should see it (a URL for remote stores)."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str, *, listed: dict[str, str] | None = None) -> "Store":
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

    def parent(self) -> "Store":
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
        >>> open_store(tempfile.mkdtemp()).caps
        Capabilities(atomic_rename=True, exclusive_create=True, server_side_copy=True, multipart=True)
        """
        return Capabilities(False, False, False, False)

    def same_server(self, other: "Store") -> bool:
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
            budget = s3_budget(self.fs)
            err = storage_error(self.display(rel), e, remote=not self.is_local,
                                budget=budget, secrets=self._secrets())
            # a connection cut mid-body broke one request, not the server: no trip, so an
            # outer retry (retry.with_retries) gets to ask again
            if server is not None and err.code in NO_SERVER and CUT not in err.message:
                mark_dead(server, err.message, err.code, budget or DEFAULT_TIMEOUT)
            raise err from None

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

    # ---------------------------------------------------------------- reads
    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, in one request. Short if the file is."""
        if end <= start:
            return b""
        if self._cached(rel):
            return self._small.get(rel, lambda: self._load_small(rel))[start:end]
        with self._errors(rel):
            data = self._pread(rel, start, end)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def _pread(self, rel: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.full(rel), start=start, end=end)

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the bytes at ``start``; returns how many there were. Local
        files are read straight into ``buf`` (``preadv``), S3 objects too (one ranged GET,
        :func:`~ckptctl.storage.s3data.get_into`): no new memory per read, which matters
        since first touches of fresh memory run at a fraction of copy speed."""
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def read_whole_into(self, rel: str, buf: memoryview) -> int:
        """Read a whole file that should hold ``len(buf)`` bytes into ``buf``; returns the
        size found (the caller compares it with what it expected). On S3 one GET of the
        whole object (:func:`~ckptctl.storage.s3data.get_whole_into`: the native client
        where installed), elsewhere :meth:`read_into`."""
        return self.read_into(rel, 0, buf)

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

    def read(self, rel: str) -> bytes:
        """A whole (small) file; from the small-file cache when it is on and holds it."""
        if self._cached(rel):
            return self._small.get(rel, lambda: self._load_small(rel))
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

        >>> from ckptctl.storage import open_store
        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"x" * 3_000_000)
        >>> [len(b) for b in open_store(d).iter_blocks("f")]
        [1048576, 1048576, 902848]
        """
        if self._cached(rel):
            data = self.read(rel)  # counted by the read
            if data:
                if on_bytes:
                    on_bytes(len(data))
                yield memoryview(data)
            return
        total = 0
        try:
            for view in self._stream(rel, block):
                total += len(view)
                if on_bytes:
                    on_bytes(len(view))
                yield view
        finally:
            self._count(reads=1, bytes_read=total)

    def _stream(self, rel: str, block: int) -> Iterator[memoryview | bytes]:
        """The blocks of :meth:`iter_blocks`, read from the file itself."""
        with self._errors(rel):
            f = self.fs.open(self.full(rel), "rb", block_size=block)
        try:
            while True:
                with self._errors(rel):
                    data = f.read(block)
                if not data:
                    break
                yield data
        finally:
            with contextlib.suppress(Exception):
                f.close()

    def _load_small(self, rel: str) -> bytes:
        """A small file for the small-file cache: from the object cache when it holds the
        object the listing showed (same key, size and ETag), else read and kept there."""
        with self._lock:
            etag = self._etags.get(rel)
        size = self._small.sizes.get(rel) if self._small is not None else None
        if self._objects is None or not etag or size is None:
            return self._read_whole(rel)
        ident = (self._server(), self.full(rel), size, etag)
        blob = self._objects.get(ident)
        if blob is None:
            blob = self._read_whole(rel)
            self._objects.put(ident, blob)
        else:
            with self._lock:
                self.stats.cache_hits += 1
        return blob

    def _read_whole(self, rel: str) -> bytes:
        with self._errors(rel):
            data = self._cat(rel)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def _cat(self, rel: str) -> bytes:
        return self.fs.cat_file(self.full(rel))

    def open(self, rel: str, mode: str = "rb", **kw) -> "StoreFile":
        """A file object: streaming reads, or a streaming write (S3: one multipart upload).

        Every call on it (``write``, ``read``, ``flush``, ``close``, where S3 uploads and a
        full disk shows up) fails as one :class:`CkptError` naming ``rel``. Leaving a
        ``with`` block by an exception abandons a remote write (the upload is aborted, no
        partial object appears) instead of completing it.
        """
        writing = "w" in mode or "x" in mode
        if writing:
            self._uncache(rel)
        with self._errors(rel):
            full = self.full(rel)
            if writing:
                self._forget(rel)
                self._make_parent(full)
            return StoreFile(self, rel, self.fs.open(full, mode, **kw), mode)

    def _make_parent(self, full: str) -> None:
        """Before a file is written at ``full``: make its folder where folders are real."""

    def size(self, rel: str) -> int:
        with self._errors(rel):
            return int(self.fs.size(self.full(rel)))

    def exists(self, rel: str = "") -> bool:
        with self._errors(rel):
            return bool(self.fs.exists(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        with self._errors(rel):
            return bool(self.fs.isdir(self.full(rel)))

    def list_files(self, rel: str = "", *, recursive: bool = True) -> dict[str, int]:
        """Every file under ``rel`` -> size, paths relative to the store root, sorted."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            if recursive:
                found = self._find(base)
            else:
                found = {e["name"]: e for e in self.fs.ls(base, detail=True)
                         if e.get("type") == "file"}
        out = {}
        prefix = self._listed_prefix()
        for name, info in found.items():
            name = name.rstrip("/")  # fsspec names S3 objects bucket/key, like our root
            if name.startswith(prefix):
                out[name[len(prefix):]] = int(info.get("size") or 0)
                when, etag = info.get("LastModified"), info.get("ETag")
                with self._lock:
                    if hasattr(when, "timestamp"):
                        self._mtimes[name[len(prefix):]] = when.timestamp()
                    if isinstance(etag, str) and etag.strip('"'):
                        self._etags[name[len(prefix):]] = etag
        return dict(sorted(out.items()))

    def list_files_if_any(self, rel: str = "") -> dict[str, int]:
        """:meth:`list_files`, or ``{}`` where nothing is there (a missing folder, or on
        S3 a missing bucket). On an object store that is the listing alone, with no
        existence check first (s3fs's ``exists`` of a prefix is a HEAD and a listing of
        its own: two requests more before every promote).

        >>> import tempfile; from ckptctl.storage import open_store
        >>> open_store(tempfile.mkdtemp()).list_files_if_any("nothing/here")
        {}
        """
        if self.is_local and not self.exists(rel):
            return {}
        try:
            return self.list_files(rel)
        except NotFoundError:
            return {}

    def _listed_prefix(self) -> str:
        """How the filesystem's listings spell this store's root, with a trailing ``/``
        (fsspec's memory filesystem puts a ``/`` in front of the path it was given)."""
        return self.fs._strip_protocol(self.root).rstrip("/") + "/"

    def _find(self, base: str) -> dict[str, dict]:
        """Every file under the path ``base``: full name -> ``{"size", "LastModified"?}``."""
        return self.fs.find(base, detail=True, withdirs=False)

    def list_dirs(self, rel: str = "") -> list[str]:
        """Immediate sub-folders of ``rel``, relative to the store root."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            entries = self.fs.ls(base, detail=True)
        prefix = self._listed_prefix()
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
            return self._mtime(rel)

    def newest_modified(self, rels) -> float | None:
        """The latest modification time among the files ``rels`` (seconds since the
        epoch), None where the store keeps none: what a listing showed, one listing more
        when it did not show them all (a remote store; a local one stats each file).

        >>> open_store(str(tmp)).newest_modified(["a.bin", "b.bin"])   # doctest: +SKIP
        1764806400.0
        """
        rels = list(rels)
        with self._lock:
            missing = [r for r in rels if r not in self._mtimes]
        if missing and not self.is_local:
            self.list_files()
        times = []
        for rel in rels:
            try:
                times.append(self.modified(rel))
            except CkptError:
                times.append(None)
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def _mtime(self, rel: str) -> float | None:
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
        self._forget(rel)
        self._put(rel, full, data, exclusive)
        self._count(writes=1, bytes_written=len(data))

    def _put(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:
        """:meth:`write_atomic`'s write: all of ``data`` at ``full`` at once."""
        with self._errors(rel):
            try:
                self.fs.pipe_file(full, bytes(data), mode="create" if exclusive else "overwrite")
            except FileExistsError:
                raise already_exists(self.display(rel)) from None

    def stage(self, rel: str, data: bytes | memoryview) -> str:
        """Write a small file of a local store to a hidden temp file beside ``rel``, neither
        durable nor under its name yet: :meth:`publish_staged` publishes many at once.
        Returns the temp file's path.

        >>> from ckptctl.storage import open_store
        >>> import tempfile
        >>> s = open_store(tempfile.mkdtemp()); s.publish_staged({"a/x": s.stage("a/x", b"1")})
        >>> s.read("a/x")
        b'1'
        """
        raise UsageError(f"{self.url}: staged writes are for local stores")

    def publish_staged(self, staged: dict[str, str]) -> None:
        """Publish files :meth:`stage` wrote (``rel -> temp path``), local stores only."""
        if staged:
            raise UsageError(f"{self.url}: staged writes are for local stores")

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

        >>> from ckptctl.storage import open_store
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

        self._write_stream(rel, full, each)
        self._count(writes=1, bytes_written=total)
        return (h.hexdigest() if h is not None else None), total

    def _write_stream(self, rel: str, full: str, each: Callable) -> None:
        """:meth:`write_file`'s write: ``each(write)`` calls ``write`` with every block;
        publish the file only when it returns."""
        f = self.open(rel, "wb")
        try:
            each(f.write)
        except BaseException:
            f.discard()
            raise
        f.close()  # completes the upload (aborts it if that fails)

    def remove_many(self, rels: Sequence[str]) -> int:
        """Delete files in the order given (missing ones are fine); returns how many names
        were handled (``len(rels)``).

        Every name is checked (no escape from the root) before anything is deleted. POSIX
        unlinks one by one and then fsyncs each folder touched, so a caller that removes a
        commit marker in one call and the data in a second call has the marker's removal
        durable first. S3 sends DeleteObjects batches of up to 1,000 keys, one after the
        other; any key the server refuses to delete raises (one line, the first key).

        >>> from ckptctl.storage import open_store
        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp(); _ = [pathlib.Path(d, n).write_bytes(b"") for n in "ab"]
        >>> s = open_store(d); s.remove_many(["a", "b", "missing"]), s.list_files()
        (3, {})
        """
        rels = list(rels)
        fulls = [self.full(r) for r in rels]
        for r in rels:
            self._uncache(r)
        self._remove_all(rels, fulls)
        return len(rels)

    def _remove_all(self, rels: list[str], fulls: list[str]) -> None:
        for r in rels:
            self.remove(r)

    def remove(self, rel: str) -> None:
        """Delete one file (missing is fine)."""
        self._uncache(rel)
        self._forget(rel)
        with self._errors(rel):
            try:
                self._unlink(self.full(rel))
            except FileNotFoundError:
                pass
        self._count(deletes=1)

    def _unlink(self, full: str) -> None:
        self.fs.rm_file(full)


def already_exists(shown: str):
    """The error of an exclusive write that found its name taken (another writer
    committed first): exit 1, ``ALREADY_EXISTS``."""
    from ..errors import Finding

    return Finding(shown, "already exists (another writer committed it)",
                   code="ALREADY_EXISTS")


class StoreFile:
    """A file of a :class:`Store` whose every I/O call runs inside the store's error
    mapping. Used like the file it wraps (``write``, ``read``, ``readinto``, ``seek``,
    ``tell``, ``flush``, ``close``, ``with``); other attributes pass through.

    >>> from ckptctl.storage import open_store
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
            if self.writing and not self.store.is_local and e.code not in NO_SERVER:
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
