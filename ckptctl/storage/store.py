"""URL -> :class:`Store`: one checkpoint root on any fsspec filesystem.

A store speaks in paths relative to its root, refuses paths that escape it, and turns
every storage failure into a :class:`~ckptctl.errors.CkptError` with a one-line message
(never the credentials). :class:`Store` is the contract and its implementation for any
fsspec filesystem; local disks (:class:`~ckptctl.storage.local_store.LocalStore`) and S3
(:class:`~ckptctl.storage.s3_store.S3Store`) each have their own module, and
:func:`~ckptctl.storage.backends.open_store` picks one by the URL
(``tests/test_store_contract.py`` runs the same checks against all of them).

>>> from ckptctl.storage import open_store
>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a.bin").write_bytes(b"0123456789")
>>> s = open_store(d)
>>> s.read_range("a.bin", 2, 5), s.list_files(), type(s).__name__
(b'234', {'a.bin': 10}, 'LocalStore')
"""
from __future__ import annotations

from .store_commit import StoreCommit
from .store_list import StoreListing
from .store_read import StoreReads
from .store_write import StoreWrites


class Store(StoreListing, StoreReads, StoreWrites, StoreCommit):
    """A checkpoint root on a filesystem. Every path argument is relative to the root.

    This class answers through fsspec alone, for any protocol; a backend's own module
    subclasses it where its OS or API does better (``_stream``, ``_find``, ``_put``,
    ``_write_stream``, ``_remove_all`` and the small methods they sit beside).

    It is made of its parts, each in a module of its own, all on
    :class:`~ckptctl.storage.store_core.StoreCore` (state, paths, counters, error
    mapping): :class:`~ckptctl.storage.store_list.StoreListing` (listings, metadata),
    :class:`~ckptctl.storage.store_read.StoreReads` (reads, the small-file caches),
    :class:`~ckptctl.storage.store_write.StoreWrites` (streamed writes) and
    :class:`~ckptctl.storage.store_commit.StoreCommit` (atomic and exclusive writes,
    staged files, ordered deletes).
    """
