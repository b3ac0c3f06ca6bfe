"""Copy files between two stores: hashed while copying, checked against the hash they
must have *before* they are published, rate-limited, in parallel parts, resumable.

A file is published at the destination only once its bytes hashed to the expected
digest: a small file in one atomic write, a large one as a multipart upload completed
last (local stores: a temp file renamed into place). So anything that exists at the
destination under its name is whole and proven, and a killed transfer leaves only
unfinished uploads, which the :class:`~ckptctl.storage.journal.Journal` lets a rerun
resume part by part (parts already sent are re-read and re-hashed, never re-sent).

Its pieces live beside it: the part workers, their slots and buffers in
:mod:`~ckptctl.storage.transfer_parts`, the planning and resume of an upload in
:mod:`~ckptctl.storage.upload_resume`, the two multipart copies of one file in
:mod:`~ckptctl.storage.transfer_multipart`.

>>> t = Transfer(src, dst, journal=j, limiter=RateLimiter(200 << 20))   # doctest: +SKIP
>>> t.copy("__0_0.distcp", 1 << 30, "9f2c...").sent                     # doctest: +SKIP
1073741824
"""
from __future__ import annotations

import os
import threading
from typing import Callable

from ..errors import Finding
from . import multipart
from .hashing import hash_file, new_hasher
from .journal import Journal
from .localio import copies_through_memory
from .ratelimit import RateLimiter
from .store import Store
from .transfer_multipart import KernelMultipart, MemoryMultipart
from .transfer_parts import Cancelled, FileCopy, PartScheduler, hash_mismatch

__all__ = ["DEFAULT_PART_SIZE", "KERNEL_LANES", "STAGE_BYTES", "STAGE_FILES", "Cancelled",
           "FileCopy", "Transfer"]

DEFAULT_PART_SIZE = 32 << 20
#: Small files a local destination holds staged (written, not yet durable nor under their
#: names) before they are published together: at most this many files or bytes.
STAGE_FILES = 512
STAGE_BYTES = 256 << 20
#: Parts of one file copied in the kernel at once (local to local). One, as ``cp``: ext4
#: serializes writers of one inode on its lock, and four workers spinning on it cost up
#: to 4x the system CPU of one (perf: 23% of samples in ``rwsem_spin_on_owner``), for no
#: gain in wall time; files still go in parallel, one per worker.
KERNEL_LANES = 1


def _discard(temps) -> None:
    """Remove staged temp files, best effort: cleanup must not hide the error that led
    here (some may be renamed or gone already; the commit removes strays)."""
    for tmp in temps:
        try:
            os.unlink(tmp)
        except OSError:
            pass


class Transfer:
    """Copies files from ``src`` to ``dst`` with one rate limit, one pool of part
    uploads (``workers``) and one journal. Thread-safe: call :meth:`copy` from several
    threads (one per file) at once."""

    def __init__(self, src: Store, dst: Store, *, journal: Journal, algo: str = "xxh3-128",
                 limiter: RateLimiter | None = None, part_size: int = DEFAULT_PART_SIZE,
                 workers: int = 4, on_bytes: Callable[[int], None] | None = None):
        self.src, self.dst, self.journal, self.algo = src, dst, journal, algo
        self.limiter = limiter or RateLimiter(None)
        self.part_size, self.workers, self.on_bytes = part_size, max(1, workers), on_bytes
        if self.limiter.rate:
            # a part goes out in one burst once its bytes are paid for, so any window can
            # hold one part more than the rate allows: keep a part within a quarter second
            # of the limit (32 MiB parts at 20 MiB/s overshot 10 s windows by 12%)
            self.part_size = min(self.part_size,
                                 max(multipart.MIN_PART, int(self.limiter.rate / 4)))
        #: the part workers, the slots and buffers of the parts in flight, the cancel flag
        self.parts = PartScheduler(self.workers)
        self.cancel, self.pool = self.parts.cancel, self.parts.pool
        self.server_copy = (not src.is_local and src.same_server(dst)
                            and dst.caps.server_side_copy)
        # the limit holds where the bytes cross the network: a remote source is paced as
        # it is read (else 2 * workers parts arrive in one unpaced burst), a local one as
        # it is sent (so re-reading the parts of a resumed upload costs nothing)
        self.pace_reads = not src.is_local
        # local to local: onto ext4 the parts go through memory (read, hashed from the
        # buffer, written with O_DIRECT: localio.copies_through_memory says why); onto
        # other file systems they are copied in the kernel (a reflink on XFS and btrfs)
        # and the file is proven where it landed, hashed from the page cache behind them
        self.kernel = (src.is_local and dst.is_local
                       and not copies_through_memory(dst.full("")))
        # a local destination takes small files in batches (:meth:`flush`): written to temp
        # files, made durable together, then renamed; the journal hears of them after that
        self.batch = dst.is_local
        self._staged: dict[str, tuple[str, str, int]] = {}  # rel -> (temp path, digest, size)
        self._staged_bytes = 0
        self._staged_lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def close(self) -> None:
        """Stop the part workers; staged files not yet flushed are removed (a rerun sends
        them again)."""
        self.parts.shutdown()
        with self._staged_lock:
            left, self._staged = self._staged, {}
        _discard(tmp for tmp, _, _ in left.values())

    def flush(self) -> None:
        """Publish the small files staged so far (:meth:`Store.publish_staged`) and
        journal them. :func:`~ckptctl.tiering.promote.copy_files` calls it once its files
        are copied; :meth:`copy` calls it every :data:`STAGE_FILES` files or
        :data:`STAGE_BYTES` bytes, so a kill costs a rerun at most that much."""
        with self._flush_lock:
            with self._staged_lock:
                batch, self._staged, self._staged_bytes = self._staged, {}, 0
            if not batch:
                return
            try:
                self.dst.publish_staged({rel: tmp for rel, (tmp, _, _) in batch.items()})
            except BaseException:
                _discard(tmp for tmp, _, _ in batch.values())
                raise
            for rel, (_, digest, size) in batch.items():
                self.journal.file_done(rel, digest, size)

    def _stage(self, rel: str, data: memoryview, digest: str) -> None:
        tmp = self.dst.stage(rel, data)
        with self._staged_lock:
            old = self._staged.pop(rel, None)
            self._staged[rel] = (tmp, digest, len(data))
            self._staged_bytes += len(data)
            full = len(self._staged) >= STAGE_FILES or self._staged_bytes >= STAGE_BYTES
        if old is not None:
            _discard([old[0]])
        if full:
            self.flush()

    def progress(self, n: int) -> None:
        """``n`` more bytes are done: tell ``on_bytes``."""
        if self.on_bytes and n:
            self.on_bytes(n)

    def _mismatch(self, rel: str, digest: str) -> Finding:
        return hash_mismatch(self.src.display(rel), digest)

    # ------------------------------------------------------------------ one file
    def copy(self, rel: str, size: int, want: str) -> FileCopy:
        """Copy ``rel`` (``size`` bytes, content hash ``want``) unless the journal says it
        is already complete at the destination at that size."""
        self.parts.check()
        done = self.journal.files.get(rel)
        if done == (want, size):
            self.progress(size)
            return FileCopy(rel, size, want, "skipped")
        if self.server_copy:
            return self._server_copy(rel, size, want)
        if size <= self.part_size:
            return self._put(rel, size, want)
        if not self.dst.caps.multipart:
            return self._streamed(rel, size, want)
        if self.kernel:
            return self._kernel_multipart(rel, size, want)
        return self._multipart(rel, size, want)

    def _put(self, rel: str, size: int, want: str) -> FileCopy:
        buf, view = self.parts.take(size, at_least=self.part_size)
        try:
            if self.pace_reads:
                self.limiter.acquire(size)
            got = (self.parts.retry(lambda: self.src.read_whole_into(rel, view), rel)
                   if size else 0)
            data = view[:got]
            h = new_hasher(self.algo)
            h.update(data)
            digest = h.hexdigest()
            if got != size or digest != want:
                raise self._mismatch(rel, digest)
            self.parts.check()
            if not self.pace_reads:
                self.limiter.acquire(size)
            if self.batch:
                self._stage(rel, data, digest)
            else:
                self.parts.retry(lambda: self.dst.write_atomic(rel, data), rel)
        finally:
            self.parts.give(buf)
        if not self.batch:
            self.journal.file_done(rel, digest, size)
        self.progress(size)
        return FileCopy(rel, size, digest, "put", sent=size)

    def _streamed(self, rel: str, size: int, want: str) -> FileCopy:
        """A large file to a store with no multipart uploads of its own (GCS, Azure): one
        streamed write (:meth:`Store.write_file`: gcsfs's resumable upload, obstore's block
        writer) fed by the source's blocks, hashed on the way, in bounded memory. The
        write is published only if the whole file hashes to ``want``: a mismatch is
        raised by the feed itself, which abandons the write. A killed copy sends the
        file again (no part-level resume through these clients)."""
        h, got = new_hasher(self.algo), 0

        def blocks():
            nonlocal got
            for block in self.src.iter_blocks(rel, block=min(self.part_size, 8 << 20)):
                self.parts.check()
                self.limiter.acquire(len(block))
                h.update(block)
                got += len(block)
                yield block
                self.progress(len(block))
            if got != size or h.hexdigest() != want:
                raise self._mismatch(rel, h.hexdigest())

        self.dst.write_file(rel, blocks(), algo=None)
        self.journal.file_done(rel, want, size)
        return FileCopy(rel, size, want, "put", sent=size)

    def _server_copy(self, rel: str, size: int, want: str) -> FileCopy:
        self.parts.retry(lambda: multipart.copy_object(self.src, rel, self.dst, rel), rel)
        digest, n = hash_file(self.dst, rel, self.algo)  # proven where it landed
        if (digest, n) != (want, size):
            self.dst.remove(rel)
            raise self._mismatch(rel, digest)
        self.journal.file_done(rel, digest, size)
        self.progress(size)
        return FileCopy(rel, size, digest, "server-copy")

    def _multipart(self, rel: str, size: int, want: str) -> FileCopy:
        """A multipart copy through memory (:class:`~.transfer_multipart.MemoryMultipart`):
        parts read and sent by the workers, hashed in order here, the upload completed
        only if the whole file hashes to ``want``; parts a killed run left are re-read and
        re-hashed, never re-sent."""
        return MemoryMultipart(self, rel, size, want).run()

    def _kernel_multipart(self, rel: str, size: int, want: str) -> FileCopy:
        """A local-to-local multipart copy in the kernel, :data:`KERNEL_LANES` parts at
        once, hashed behind them where they landed
        (:class:`~.transfer_multipart.KernelMultipart`)."""
        return KernelMultipart(self, rel, size, want, lanes=KERNEL_LANES).run()
