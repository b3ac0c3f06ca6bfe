"""The commit part of :class:`~ckptctl.storage.store.Store`: :class:`StoreCommit`,
small files published all at once (atomic, or exclusive: refused where the name is
taken, :func:`already_exists`), staged files published together, and deletes in the
order given.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import UsageError
from .store_core import StoreCore


def already_exists(shown: str):
    """The error of an exclusive write that found its name taken (another writer
    committed first): exit 1, ``ALREADY_EXISTS``."""
    from ..errors import Finding

    return Finding(shown, "already exists (another writer committed it)",
                   code="ALREADY_EXISTS")


class StoreCommit(StoreCore):
    """Atomic and exclusive writes and ordered deletes, through fsspec; a backend
    overrides ``_put``, ``stage``, ``publish_staged``, ``_remove_all`` and ``_unlink``
    where its OS or API does better."""

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
