"""Read-modify-write of one small file that concurrent writers cannot lose: the storage
side of ``seal``'s tag merge (:mod:`ckptctl.integrity.seal`).

- POSIX: :func:`folder_lock` holds an exclusive ``flock`` on the folder around the read
  and the replace; a first write is exclusive (``link``) anyway.
- S3: a first write sends ``If-None-Match: *`` (:meth:`Store.write_atomic` with
  ``exclusive``), a replace ``If-Match: <ETag>`` of what was read
  (:func:`read_versioned`, :func:`replace_if`): a lost race answers 412 and the caller
  reads again. Some servers ignore both headers (``rclone serve s3``):
  :func:`honours_conditions` asks once per server for two conditional writes that must
  fail, and says whether they did.

>>> import tempfile
>>> from ckptctl.storage import open_store
>>> s = open_store(tempfile.mkdtemp())
>>> honours_conditions(s, ".probe.tmp"), read_versioned(s, "m.json")
(True, None)
>>> s.write_atomic("m.json", b"{}")
>>> data, version = read_versioned(s, "m.json")
>>> replace_if(s, "m.json", b"[]", version), s.read("m.json")
(True, b'[]')
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..errors import Finding, NotFoundError
from .store import Store

#: An ETag no object has: a replace conditioned on it must fail where ``If-Match`` works.
_NO_ETAG = '"00000000000000000000000000000000"'
_known: dict[str, bool] = {}  # server -> honours If-None-Match and If-Match
_known_lock = threading.Lock()


@contextlib.contextmanager
def folder_lock(store: Store) -> Iterator[bool]:
    """Hold an exclusive lock on a local store's folder for the ``with`` block (other
    holders wait; a lock per open, so threads of one process exclude each other too).
    Yields whether a lock is held: False for a remote store, or a filesystem without
    ``flock`` (some NFS or Lustre mounts), where nothing is held.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> with folder_lock(open_store(tempfile.mkdtemp())) as held:
    ...     held
    True
    """
    if not store.is_local:
        yield False
        return
    import fcntl

    try:
        fd = os.open(store.full(), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)  # releases the lock


def read_versioned(store: Store, rel: str) -> tuple[bytes, str | None] | None:
    """``(bytes, version)`` of ``rel`` read fresh (never from the small-file cache), or
    None when it is not there. S3: the version is the ETag, asked before the bytes are
    read, so a change between the two makes a :func:`replace_if` with it fail rather
    than overwrite; locally it is None (hold :func:`folder_lock` instead)."""
    store._uncache(rel)
    etag = None
    if store.conditional_writes:
        try:
            etag = store.version_of(rel)
        except NotFoundError:
            return None
    try:
        data = store._read_whole(rel)
    except NotFoundError:
        return None
    return data, etag


def replace_if(store: Store, rel: str, data: bytes, version: str | None) -> bool:
    """Replace ``rel`` with ``data`` if it is still the version :func:`read_versioned`
    gave (S3: ``If-Match``); False when another writer changed it since. Locally the
    replace is atomic (temp file and rename) and unconditional: hold :func:`folder_lock`.
    """
    if not store.conditional_writes or version is None:
        store.write_atomic(rel, data)
        return True
    return store.put_if_match(rel, data, version)


def create_if_absent(store: Store, rel: str, data: bytes) -> bool:
    """Write ``rel`` unless it exists (POSIX ``link``; S3 ``If-None-Match: *``, which
    some servers ignore: see :func:`honours_conditions`); False when it existed."""
    try:
        store.write_atomic(rel, data, exclusive=True)
    except Finding as e:
        if e.code != "ALREADY_EXISTS":
            raise
        return False
    return True


def honours_conditions(store: Store, scratch: str) -> bool:
    """Does the server behind ``store`` refuse a write whose condition fails, for both
    ``If-None-Match: *`` and ``If-Match``? Local stores: True. S3: asked once per server
    and process, with the object ``scratch`` (a temporary name of the caller's, beside
    the file it means to write: written, overwritten under both conditions, removed).
    Other remote stores: False."""
    if store.is_local:
        return True
    if not store.conditional_writes:
        return False
    server = store._server()
    with _known_lock:
        if server in _known:
            return _known[server]
    body = b"ckptctl: does this server honour If-None-Match and If-Match?\n"
    store.write_atomic(scratch, body)
    try:
        ok = not create_if_absent(store, scratch, body) \
            and not replace_if(store, scratch, body, _NO_ETAG)
    finally:
        store.remove(scratch)
    with _known_lock:
        _known[server] = ok
    return ok


__all__ = ["folder_lock", "read_versioned", "replace_if", "create_if_absent",
           "honours_conditions"]
