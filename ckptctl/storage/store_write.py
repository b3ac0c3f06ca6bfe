"""The streaming-write part of :class:`~ckptctl.storage.store.Store`:
:class:`StoreWrites`, files opened for writing (:meth:`StoreWrites.open`) and whole files
written from a stream of blocks, hashed on the way (:meth:`StoreWrites.write_file`).
"""
from __future__ import annotations

from typing import Callable, Iterable

from .hashing import new_hasher
from .store_core import StoreCore
from .store_file import StoreFile


class StoreWrites(StoreCore):
    """Streamed writes, durable and all or nothing, through fsspec; a backend overrides
    ``_write_stream`` and ``_make_parent`` where its OS or API does better."""

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
        h = new_hasher(algo) if algo else None
        total = 0
        full = self.full(rel)
        self._uncache(rel)

        def each(write) -> None:
            nonlocal total
            # pulled outside the error mapping: the producer's own errors stay its own
            for b in blocks:
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
