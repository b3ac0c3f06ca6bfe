"""The file objects :meth:`~ckptctl.storage.store.Store.open` returns:
:class:`StoreFile`, every call inside the store's error mapping.
"""
from __future__ import annotations

import os

from ..errors import CkptError
from .failures import NO_SERVER
from .store_core import StoreCore


class StoreFile:
    """A file of a :class:`~ckptctl.storage.store.Store` whose every I/O call runs inside
    the store's error mapping. Used like the file it wraps (``write``, ``read``,
    ``readinto``, ``seek``, ``tell``, ``flush``, ``close``, ``with``); other attributes
    pass through.

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

    def __init__(self, store: StoreCore, rel: str, f, mode: str):
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
