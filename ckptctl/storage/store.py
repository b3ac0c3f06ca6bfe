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
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Iterator

from ..errors import CkptError, NotFoundError, StorageError, UnsafeInputError, UsageError

#: Descriptors a local store keeps open for ranged reads before it recycles them.
MAX_OPEN_FILES = 256


@dataclass
class IOStats:
    """What a store did: counted by the store itself, per call it makes."""

    reads: int = 0
    bytes_read: int = 0
    lists: int = 0


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
        return proto, rest.rstrip("/")
    return "file", os.path.abspath(url)


def _s3_options(options: dict) -> dict:
    opts = {"use_listings_cache": False, "skip_instance_cache": True}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get(
            "client_kwargs", {}):
        opts["endpoint_url"] = endpoint
    opts.update(options)
    # botocore validates full-object CRCs on ranged GETs against servers (rclone) that send
    # them for the whole object, and fails; ckptctl verifies content with its own hashes.
    cfg = {"response_checksum_validation": "when_required",
           "request_checksum_calculation": "when_required"}
    cfg.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = cfg
    return opts


def make_filesystem(protocol: str, options: dict | None = None):
    """An fsspec filesystem for ``protocol`` with ckptctl's defaults (S3: endpoint from
    ``AWS_ENDPOINT_URL``, no listing cache)."""
    import fsspec

    options = dict(options or {})
    if protocol in ("s3", "s3a"):
        options = _s3_options(options)
        protocol = "s3"
    try:
        return fsspec.filesystem(protocol, **options)
    except ImportError as e:
        raise StorageError(None, f"no filesystem for {protocol}://: {e}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad storage options for {protocol}://: {type(e).__name__}") from None


def open_store(url: str, storage_options: dict | None = None) -> "Store":
    """Open the place at ``url`` (a plain path, ``file://``, ``s3://bucket/prefix``, ...)."""
    protocol, path = split_url(url)
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
        self.fs = fs
        self.protocol = protocol
        self.root = root.rstrip("/") if root != "/" else root
        self.stats = IOStats()
        self._lock = threading.Lock()
        self._small: "SmallFileCache | None" = None
        self._fds: dict[str, int] = {}

    def cache_small_files(self, sizes: dict[str, int], *, max_file: int = 16 << 20,
                          budget: int = 256 << 20) -> None:
        """Serve ranged reads of small remote files from one whole-file GET each (LRU,
        ``budget`` bytes at most): a DCP checkpoint of many small chunks then costs one
        request per file, not several per chunk. No effect on local stores."""
        if not self.is_local:
            self._small = SmallFileCache(sizes, max_file, budget)

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
            real_root = os.path.realpath(self.root)
            real = os.path.realpath(full)
            if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
                raise UnsafeInputError(self.display(rel), "link points outside the checkpoint root",
                                      code="PATH_ESCAPE")
        return full

    def display(self, rel: str = "") -> str:
        """``rel`` as the user should see it (a URL for remote stores)."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> "Store":
        """A store rooted at a sub-folder."""
        return Store(self.display(rel), self.fs, self.protocol, self.full(rel))

    def local_path(self, rel: str) -> str | None:
        """A path the OS can open (for mmap), or None for remote stores."""
        return self.full(rel) if self.is_local else None

    # ---------------------------------------------------------------- errors
    @contextlib.contextmanager
    def _errors(self, rel: str) -> Iterator[None]:
        shown = self.display(rel)
        try:
            yield
        except FileNotFoundError:
            raise NotFoundError(shown, "not found") from None
        except IsADirectoryError:
            raise StorageError(shown, "is a directory") from None
        except PermissionError:
            raise StorageError(shown, "permission denied") from None
        except CkptError:
            raise
        except OSError as e:
            raise StorageError(shown, f"I/O error: {e.strerror or type(e).__name__}") from None
        except Exception as e:  # botocore/aiohttp errors: keep the class name, not the text
            name = type(e).__name__
            if "Credential" in name or "AccessDenied" in str(e)[:200]:
                raise StorageError(shown, "access denied (check credentials)") from None
            if "Connect" in name or "Endpoint" in name:
                raise StorageError(shown, f"remote unreachable ({name})") from None
            raise StorageError(shown, f"storage error ({name})") from None

    # ---------------------------------------------------------------- reads
    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, in one request. Short if the file is."""
        if end <= start:
            return b""
        if self._small is not None and self._small.wants(rel):
            return self._small.get(rel, lambda: self.read(rel))[start:end]
        with self._errors(rel):
            if self.is_local:  # pread on a kept descriptor: no open/seek/close per chunk
                data = os.pread(self._fd(rel), end - start, start)
            else:
                data = self.fs.cat_file(self.full(rel), start=start, end=end)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the bytes at ``start``; returns how many there were. Local
        files are read straight into ``buf`` (``preadv``): no new memory per read, which
        matters since first touches of fresh memory run at a fraction of copy speed."""
        if self.is_local and not (self._small is not None and self._small.wants(rel)):
            n = 0
            with self._errors(rel):
                fd = self._fd(rel)
                while n < len(buf):
                    k = os.preadv(fd, [buf[n:]], start + n)
                    if k == 0:
                        break
                    n += k
            with self._lock:
                self.stats.reads += 1
                self.stats.bytes_read += n
            return n
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                if len(self._fds) >= MAX_OPEN_FILES:  # thousands of rank files: stay bounded
                    for old in self._fds.values():
                        os.close(old)
                    self._fds.clear()
                fd = os.open(self.full(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds[rel] = fd
            return fd

    def _forget(self, rel: str) -> None:
        with self._lock:
            fd = self._fds.pop(rel, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close kept file descriptors (reads reopen them as needed)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def read(self, rel: str) -> bytes:
        """A whole (small) file."""
        with self._errors(rel):
            data = self.fs.cat_file(self.full(rel))
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def open(self, rel: str, mode: str = "rb", **kw):
        """A file object: streaming reads, or a streaming write (S3: one multipart upload)."""
        with self._errors(rel):
            full = self.full(rel)
            if self.is_local and ("w" in mode or "x" in mode):
                self._forget(rel)
                os.makedirs(os.path.dirname(full), exist_ok=True)
            return self.fs.open(full, mode, **kw)

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
        return dict(sorted(out.items()))

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
        """Modification time (seconds since the epoch) or None if the store has none."""
        with self._errors(rel):
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
        if self.is_local:
            self._forget(rel)
            self._write_atomic_local(rel, full, data, exclusive)
            return
        with self._errors(rel):
            try:
                self.fs.pipe_file(full, data, mode="create" if exclusive else "overwrite")
            except FileExistsError:
                from ..errors import Finding
                raise Finding(self.display(rel), "already exists (another writer committed it)",
                              code="ALREADY_EXISTS") from None

    def _write_atomic_local(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:
        import tempfile

        folder = os.path.dirname(full)
        with self._errors(rel):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".tmp",
                                       dir=folder)
            try:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; publish like open() would
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
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def remove(self, rel: str) -> None:
        """Delete one file (missing is fine)."""
        if self.is_local:
            self._forget(rel)
        with self._errors(rel):
            try:
                self.fs.rm_file(self.full(rel))
            except FileNotFoundError:
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
