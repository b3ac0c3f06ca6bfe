"""One commit protocol for every writer (reshard, consolidate): an output folder is either
committed, or marked as unfinished, or gone.

1. ``.ckptctl-writing`` (who, where, when) is written into DST first; while it is there
   ``ls``/``verify`` call the folder incomplete, whatever else it holds;
2. data files are written and made durable before they are closed (``fsync`` locally; S3
   completes the upload);
3. the format's own markers (``.metadata``, the HF index) are published atomically;
4. :meth:`OutputDir.commit` syncs the folder and removes the marker; the caller then
   writes the manifest last.

Any exception on the way (Ctrl-C, SIGTERM turned into Ctrl-C by the CLI, a full disk, a
bug) removes what this run created, and DST itself when it did not exist before.
``force`` replaces a non-empty DST, but only what the command itself would have written:
an unfinished ckptctl write, or one checkpoint that is not pinned, not a delta pack's base
and holds no file of anyone else's (:func:`~ckptctl.catalog.ownership.why_not_replace`); a
folder of checkpoints or user files is refused, naming them. The marker goes in first,
then the manifest and the format's markers are removed before the rest, so a crash
mid-delete never leaves something that looks valid.

>>> with OutputDir(open_store("out/"), command="consolidate") as out:   # doctest: +SKIP
...     with out.open("model.safetensors") as f:
...         f.write(data)
...     out.commit()
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Iterable

from ..catalog.writers import live_writer
from ..errors import CkptError, UsageError
from ..formats.dcp import METADATA
from ..formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER, control_name, sidecar_of
from ..storage import Store
from ..storage.localio import kernel_copy, start_writeback, sync_dir
from ..storage.failures import storage_error

#: Files whose presence makes a folder look committed: removed first by ``--force``.
_COMMIT_FILES = (MANIFEST, METADATA, "model.safetensors.index.json")
#: A local output file starts writing its bytes back every this many bytes written
#: (:func:`~ckptctl.storage.localio.start_writeback`), so its fsync at close finds them
#: mostly on disk already.
WRITEBACK_STEP = 32 << 20


class Cancelled(Exception):
    """Raised inside writer threads once the run is being abandoned."""


def _sync_dir(path: str) -> None:
    """:func:`~ckptctl.storage.localio.sync_dir`, for a folder that may be gone already."""
    try:
        sync_dir(path)
    except FileNotFoundError:
        pass


def run_jobs(fn: Callable, jobs: Iterable, workers: int, cancel: threading.Event, *,
             name: str = "ckptctl") -> list:
    """``[fn(job) for job in jobs]`` on ``workers`` threads. On the first error (or a Ctrl-C
    in the waiting thread) ``cancel`` is set, jobs not started are dropped, and the error is
    raised once the running ones stopped (they watch ``cancel``).

    >>> import threading
    >>> run_jobs(lambda x: x * 2, [1, 2, 3], 2, threading.Event())
    [2, 4, 6]
    """
    jobs = list(jobs)
    if not jobs:
        return []
    with ThreadPoolExecutor(max(1, min(workers, len(jobs))), thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, j) for j in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]
        except BaseException:
            cancel.set()
            for f in futures:
                f.cancel()
            raise


class _OutFile:
    """A binary file being written for :class:`OutputDir`: every write checks for
    cancellation, and a clean close makes the bytes durable before returning."""

    def __init__(self, out: "OutputDir", rel: str, f, tmp: str | None):
        self.out, self.rel, self.f, self.tmp = out, rel, f, tmp
        self._pos = self._written_back = 0  # bytes written by write(); write-back started

    def _io(self, fn, *args):
        try:
            return fn(*args)
        except CkptError:
            raise
        except OSError as e:  # in words: "no space left on device", as every copier says
            raise storage_error(self.out.store.display(self.rel), e) from None

    def write(self, b) -> int:
        if self.out.cancelled.is_set():
            raise Cancelled(self.rel)
        self._io(self.f.write, b)
        self._pos += memoryview(b).nbytes
        if self._pos - self._written_back >= WRITEBACK_STEP and self.out.store.is_local:
            start_writeback(self.f.fileno(), self._written_back, self._pos - self._written_back)
            self._written_back = self._pos
        return len(b)

    @property
    def path(self) -> str | None:
        """The local file being written (its temporary name until closed); None on S3."""
        store = self.out.store
        return store.full(self.tmp or self.rel) if store.is_local else None

    def write_at(self, b, at: int) -> None:
        """Write ``b`` at byte ``at`` of a local file (no buffering, no file position):
        for writers that also copy ranges in with :meth:`copy_in`."""
        if self.out.cancelled.is_set():
            raise Cancelled(self.rel)
        fd = self.f.fileno()
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            done += self._io(os.pwrite, fd, view[done:], at + done)

    def copy_in(self, src_fd: int, offset: int, n: int, at: int) -> int:
        """Copy ``n`` bytes at ``offset`` of the open file ``src_fd`` to byte ``at`` of
        this local file, in the kernel (:func:`~ckptctl.storage.localio.kernel_copy`);
        the bytes copied (fewer: the source ended)."""
        return self.guarded(kernel_copy, src_fd, self.f.fileno(), offset, n, at)

    def guarded(self, fn, *args):
        """``fn(*args)``, a write to this file's :attr:`path` by the caller's own means
        (a :class:`~ckptctl.storage.directwrite.DirectWriter`), as every write here is:
        refused once the run is cancelled, an ``OSError`` in words."""
        if self.out.cancelled.is_set():
            raise Cancelled(self.rel)
        return self._io(fn, *args)

    def close(self) -> None:
        store = self.out.store
        if hasattr(self.f, "sync"):  # storage.StoreFile: flush + local fsync
            self._io(self.f.sync)
        elif store.is_local:
            self._io(self.f.flush)
            self._io(os.fsync, self.f.fileno())
        self._io(self.f.close)  # S3: completes the multipart upload
        if self.tmp is not None:
            self._io(os.replace, store.full(self.tmp), store.full(self.rel))
            self.out._track(self.rel)

    def abort(self) -> None:
        try:
            if hasattr(self.f, "discard"):  # fsspec S3: abort the multipart upload
                self.f.discard()
            else:
                self.f.close()
        except Exception:  # noqa: BLE001 - the original error matters, not this one
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


class OutputDir:
    """The destination of one writer run; a context manager. See the module docstring.

    ``single_file``: the output is one file in a folder (``consolidate ... x.pt``,
    ``x.safetensors``): no marker (nothing else is in flight beside it); the file is
    written under a temporary name (locally ``.<name>.partial``; S3 completes its upload
    at once), fsync'd, renamed into place and the folder synced, replacing an older file
    only with ``force`` and never a folder. ``marker``: the file is a single-file
    checkpoint that gets a manifest (``unpack``): its writing marker
    (``<name>.ckptctl-writing``) goes first and :meth:`commit` removes it, as a folder's;
    ``force`` removes an older file's sidecar manifest right after the marker, and never
    replaces a pinned one.
    """

    def __init__(self, store: Store, *, command: str, force: bool = False,
                 single_file: str | None = None, source: str | None = None,
                 storage_options: dict | None = None, base: str | None = None,
                 marker: bool = False):
        self.store, self.command, self.force = store, command, force
        self.base = base  # a delta pack's base id, in the marker: gc keeps that base
        self.storage_options = storage_options  # to find the packs a replaced base had
        self.single_file = single_file
        self.single_marker = marker and single_file is not None
        self.source = source  # never written into nor removed (``--force`` on the source)
        self.cancelled = threading.Event()
        self.created: list[str] = []
        self._lock = threading.Lock()
        self._existed = True

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "OutputDir":
        store = self.store
        if self.source is not None and overlaps(store, self.single_file, self.source):
            raise UsageError(f"destination {store.display(self.single_file or '')} overlaps "
                             f"the source {self.source}; choose another place")
        if self.single_file is not None:
            self._check_file()
            if self.single_marker:
                self._mark_single()
            return self
        self._existed = store.exists()
        files = store.list_files() if self._existed else {}
        if files:
            from ..catalog.ownership import why_not_replace

            why = why_not_replace(store, files, self.storage_options)
            if why is not None:  # --force never takes what this command would not write
                raise UsageError(f"destination {store.url} is not empty and {why}; choose "
                                 "a new place" + (" (--force replaces only an unfinished "
                                                  "write or one unpinned checkpoint)"
                                                  if self.force else ""))
            if not self.force:
                raise UsageError(f"destination {store.url} is not empty; choose a new place "
                                 "or pass --force to replace it")
        if WRITING_MARKER in files:
            self._refuse_live_writer()
        try:
            self._write_marker()  # from here on the folder is incomplete, whatever it holds
            for rel in _COMMIT_FILES:  # then what makes it look valid goes first
                if rel in files:
                    store.remove(rel)
            for rel in files:
                if rel not in _COMMIT_FILES and rel != WRITING_MARKER:
                    store.remove(rel)
            if store.is_local:  # sub-folders the old content had
                for d in sorted({rel.rsplit("/", 1)[0] for rel in files if "/" in rel},
                                key=lambda d: -d.count("/")):
                    _remove_empty_dirs(store.full(), d)
        except BaseException:  # __exit__ does not run when __enter__ fails
            self.cancelled.set()
            self._cleanup()
            raise
        return self

    def _check_file(self) -> None:
        """A one-file output replaces a file of that name only with ``force``, and never a
        folder (``x.safetensors/`` left by an older ckptctl, or anyone's)."""
        store, rel = self.store, self.single_file
        if not store.exists(rel):
            return
        if store.isdir(rel):
            raise UsageError(f"destination {store.display(rel)} is a folder, and this output "
                             "is one file; choose a new name, or remove the folder first")
        if not self.force:
            raise UsageError(f"destination {store.display(rel)} exists; choose a new name "
                             "or pass --force to replace it")
        if self.single_marker and store.exists(control_name(PIN_FILE, rel)):
            raise UsageError(f"destination {store.display(rel)} is a pinned checkpoint "
                             "(ckptctl unpin it first); choose a new name")

    def _mark_single(self) -> None:
        """A single-file checkpoint's writing marker, then (``force``) the sidecar
        manifest of the file it replaces: from here on it reads as incomplete."""
        rel = self.single_file
        try:
            self._write_marker(control_name(WRITING_MARKER, rel))
            if self.force:
                self.store.remove(control_name(MANIFEST, rel))
        except BaseException:  # __exit__ does not run when __enter__ fails
            self.cancelled.set()
            self._cleanup()
            raise

    def join(self) -> "OutputDir":
        """Enter as a helper process of a distributed run (:mod:`ckptctl.writing.distributed`):
        rank 0 prepared the folder and owns its marker; this process only writes its own
        files (and on failure removes those, never the folder)."""
        self._existed = True
        return self

    def _refuse_live_writer(self) -> None:
        """``--force`` replaces what a killed writer left, not a writer still running on
        this host (its marker names a live ckptctl process)."""
        doc = live_writer(self.store)
        if doc is None or int(doc["pid"]) == os.getpid():
            return  # a leftover (or this very process's own)
        pid = doc["pid"]
        raise UsageError(f"{self.store.display(WRITING_MARKER)}: a ckptctl writer (pid {pid}, "
                         f"started {doc.get('started')}) is still writing here; stop it first")

    def _write_marker(self, name: str = WRITING_MARKER) -> None:
        doc = {"pid": os.getpid(), "host": socket.gethostname(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": self.command}
        if self.base:
            doc["base"] = self.base
        self._track(name)
        self.store.write_atomic(name, (json.dumps(doc) + "\n").encode())

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # even after commit(): the manifest did not make it
            self.cancelled.set()
            self._cleanup()
        return False

    def _track(self, rel: str) -> None:
        with self._lock:
            if rel not in self.created:
                self.created.append(rel)

    # ------------------------------------------------------------ writing
    def open(self, rel: str, mode: str = "wb") -> _OutFile:
        """A new file ``rel``, durable once closed without an error."""
        if self.cancelled.is_set():
            raise Cancelled(rel)
        tmp = None
        if self.single_file is not None and self.store.is_local:
            head, _, base = rel.rpartition("/")
            tmp = f"{head + '/' if head else ''}.{base}.partial"
        self._track(tmp or rel)
        return _OutFile(self, rel, self.store.open(tmp or rel, mode), tmp)

    def write_atomic(self, rel: str, data: bytes, *, exclusive: bool = False) -> None:
        """Publish a small file at once (a format's marker: ``.metadata``, an index)."""
        if self.cancelled.is_set():
            raise Cancelled(rel)
        self._track(rel)
        self.store.write_atomic(rel, data, exclusive=exclusive)

    def map(self, fn: Callable, jobs: Iterable, workers: int) -> list:
        """``[fn(job) for job in jobs]`` on ``workers`` threads. On the first error (or a
        Ctrl-C in the waiting thread) the other jobs are cancelled at their next write
        and the error is raised once they stopped."""
        return run_jobs(fn, jobs, workers, self.cancelled)

    def commit(self) -> None:
        """Every data file and format marker is written: make the folder's entries
        durable and remove the unfinished-writer marker. The caller writes the manifest
        next, inside the ``with``: if that fails, the whole output is still removed."""
        if self.single_file is None or self.single_marker:
            self._track(control_name(MANIFEST, self.single_file))
        if self.store.is_local:
            _sync_dir(self.store.full())
        if self.single_file is None or self.single_marker:
            self.store.remove(control_name(WRITING_MARKER, self.single_file))
            if self.store.is_local:
                _sync_dir(self.store.full())

    # ------------------------------------------------------------ cleanup
    def _remove_atomic_temps(self) -> None:
        try:
            names = os.listdir(self.store.full())
        except OSError:
            return
        for rel in list(self.created):
            for n in _temp_names_of(rel, names):
                try:
                    os.unlink(os.path.join(self.store.full(), n))
                except OSError:
                    pass

    def _cleanup(self) -> None:
        """Remove what this run created: commit files first, the marker last. Locally a
        second Ctrl-C cannot cut it short (it takes milliseconds); remotely it can, and a
        server that stopped answering ends it at the first failure."""
        store = self.store
        blocked = _block_signals() if store.is_local else None
        try:
            order = sorted(self.created, key=_cleanup_rank)
            for rel in order:
                try:
                    store.remove(rel)
                except CkptError:
                    if not store.is_local:
                        return
            if store.is_local:
                self._remove_atomic_temps()
            if not self._existed and store.is_local:  # S3 has no folders: nothing is left
                try:
                    os.rmdir(store.full())  # only if nothing else appeared meanwhile
                except OSError:
                    pass
            elif store.is_local:
                _sync_dir(store.full())
        finally:
            _unblock_signals(blocked)


def _cleanup_rank(rel: str) -> tuple[bool, bool]:
    """Where ``rel`` goes in a cleanup: commit files (a single file's sidecar manifest
    too) first, writing markers last.

    >>> sorted(["a.pt.ckptctl-writing", "a.pt", "a.pt.ckptctl.manifest.json"], key=_cleanup_rank)
    ['a.pt.ckptctl.manifest.json', 'a.pt', 'a.pt.ckptctl-writing']
    """
    side = sidecar_of(rel)
    control = side[1] if side else rel
    return control not in _COMMIT_FILES, control == WRITING_MARKER


def _remove_empty_dirs(root: str, rel: str) -> None:
    """rmdir ``root/rel`` and its parents up to ``root`` while they are empty."""
    parts = rel.split("/")
    while parts:
        try:
            os.rmdir(os.path.join(root, *parts))
        except OSError:
            return
        parts.pop()


def overlaps(dst: Store, single_file: str | None, source: str) -> bool:
    """Is the destination (folder, or ``single_file`` in it) the source (a folder or one
    file, a URL), inside it, or around it?

    >>> from ckptctl.storage import open_store
    >>> overlaps(open_store("/r/out"), None, "/r/ck"), overlaps(open_store("/r/ck/hf"), None, "/r/ck")
    (False, True)
    >>> overlaps(open_store("/r"), None, "/r/ck"), overlaps(open_store("/r"), "x.pt", "/r/ck.pt")
    (True, False)
    """
    from ..storage import split_url

    proto, src = split_url(source)
    if proto != dst.protocol and not (proto == "s3" and dst.protocol in ("s3", "s3a")):
        return False
    out = dst.root if single_file is None else f"{dst.root.rstrip('/')}/{single_file}"
    if dst.is_local:
        out, src = os.path.realpath(out), os.path.realpath(src)
    out, src = out.rstrip("/"), src.rstrip("/")
    if out == src or out.startswith(src + "/"):
        return True
    return single_file is None and src.startswith(out + "/")


def _temp_names_of(rel: str, names: Iterable[str]) -> list[str]:
    """Temp files ``Store.write_atomic`` makes for ``rel`` (``.<name>.<random>.tmp``) that
    an interruption can leave behind.

    >>> _temp_names_of(".metadata", ["..metadata.k2j3.tmp", ".metadata", "x.tmp"])
    ['..metadata.k2j3.tmp']
    """
    base = rel.rsplit("/", 1)[-1]
    return [n for n in names if n.startswith(f".{base}.") and n.endswith(".tmp")]


def _block_signals():
    """Ignore SIGINT/SIGTERM while cleaning up, so a second Ctrl-C cannot cut it short
    (signal handlers can only be changed from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    return old


def _unblock_signals(old) -> None:
    for sig, handler in (old or {}).items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
