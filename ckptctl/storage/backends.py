"""Which store answers a URL: :func:`open_store`.

>>> import tempfile
>>> type(open_store(tempfile.mkdtemp())).__name__, type(open_store("s3://b/run")).__name__
('LocalStore', 'S3Store')
"""
from __future__ import annotations

from .filesystems import make_filesystem
from .local_store import LocalStore
from .s3_store import S3Store
from .store import Store
from .urls import split_url


def open_store(url: str, storage_options: dict | None = None) -> "Store":
    """Open the place at ``url`` (a plain path, ``file://``, ``s3://bucket/prefix``, ...):
    a :class:`~ckptctl.storage.local_store.LocalStore`, an
    :class:`~ckptctl.storage.s3_store.S3Store`, or a :class:`Store` on the fsspec
    filesystem of any other protocol.

    >>> type(open_store("s3://bucket/run")).__name__, type(open_store("memory://x")).__name__
    ('S3Store', 'Store')
    """
    protocol, path = split_url(url)
    if protocol == "file":
        # no fsspec import unless storage options ask for it (or a call needs it)
        fs = make_filesystem(protocol, storage_options) if storage_options else None
        return LocalStore(path, fs, protocol, path)
    fs = make_filesystem(protocol, storage_options)
    if protocol in ("s3", "s3a"):
        return S3Store(url.rstrip("/"), fs, protocol, path)
    return Store(url.rstrip("/"), fs, protocol, path)
