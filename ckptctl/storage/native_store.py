"""A :class:`~ckptctl.storage.store.Store` on a native object-store client: obstore (Rust's
``object_store``: requests run with the GIL released, many in flight, started in
milliseconds). :class:`NativeStore` speaks obstore's calls; a backend module gives it its
client (:mod:`~ckptctl.storage.azure`: Azure Blob).

Paths are ``container/key`` as everywhere (``full``); the client is the container's, so a
request names the key only. Listings carry sizes, modification times and ETags (kept:
no HEAD later); exclusive writes send ``If-None-Match: *`` and conditional updates
``If-Match`` (:meth:`NativeStore.put_if_match`), which the servers enforce.

>>> s = NativeStore("az://c/run", None, "az", "c/run")
>>> s.key("step-1/a.bin"), s.caps.exclusive_create
('run/step-1/a.bin', True)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from ..errors import NotFoundError
from .store import Store
from .store_commit import already_exists
from .store_core import Capabilities

#: A write up to this size goes as one PUT; a larger one through obstore's multipart writer.
ONE_PUT = 8 << 20

_clients: dict[str, object] = {}
_clients_lock = threading.Lock()


def shared_client(key: str, make):
    """The obstore store for ``key`` (a bucket or container and the settings it was made
    with, the process id among them): made by ``make()`` once per process, then shared
    by its threads (one connection pool, one credential cache).

    >>> shared_client("k", lambda: object()) is shared_client("k", lambda: object())
    True
    """
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = make()
        return client


class NativeReads(Store):
    """Listings, metadata and reads of a checkpoint root in a bucket or container, on an
    obstore client: :class:`NativeStore` adds writes; S3 takes these and keeps its own
    writes (:class:`~ckptctl.storage.s3_native.NativeS3Store`). ``client_factory`` gives
    the bucket's obstore store; ``options``: the storage options it was opened with
    (kept for the children and parents of this store)."""

    def __init__(self, url: str, fs, protocol: str, root: str, *, client_factory=None,
                 options: dict | None = None):
        super().__init__(url, fs, protocol, root)
        self._client_factory = client_factory
        self._options = dict(options or {})

    def child(self, rel: str, *, listed: dict[str, str] | None = None) -> "NativeReads":
        sub = super().child(rel, listed=listed)
        sub._client_factory, sub._options = self._client_factory, self._options
        return sub

    def parent(self) -> "NativeReads":
        up = super().parent()
        up._client_factory, up._options = self._client_factory, self._options
        return up

    # ---------------------------------------------------------------- the client
    def client(self):
        """The obstore store of this root's bucket or container."""
        if self._client_factory is None:
            raise NotImplementedError(f"{type(self).__name__} has no client")
        return self._client_factory(self.root.partition("/")[0])

    def key(self, rel: str = "") -> str:
        """The object key of ``rel`` (the path inside the bucket or container)."""
        return self.full(rel).partition("/")[2]

    @property
    def fs(self):
        """An fsspec filesystem for the same place, for callers that need one (DCP's
        writer); made on first use."""
        if self._fs is None:
            from .filesystems import make_filesystem

            self._fs = make_filesystem(self.protocol, self._options)
        return self._fs

    def _budget(self) -> float | None:
        from .filesystems import request_timeout

        return request_timeout()

    def same_server(self, other: Store) -> bool:
        return False

    def _server(self) -> str | None:
        return f"{self.protocol}:{self.root.partition('/')[0]}"

    def _secrets(self) -> list[str]:
        return []

    # ---------------------------------------------------------------- listing
    def size(self, rel: str) -> int:
        import obstore

        with self._errors(rel):
            return int(obstore.head(self.client(), self.key(rel))["size"])

    def exists(self, rel: str = "") -> bool:
        import obstore

        if self.key(rel):  # a file (the root itself may be one), else a folder
            try:
                with self._errors(rel):
                    obstore.head(self.client(), self.key(rel))
                return True
            except NotFoundError:
                pass
        return self.isdir(rel)

    def isdir(self, rel: str = "") -> bool:
        """Something lies under ``rel``; at the bucket's root: the bucket exists."""
        import obstore

        prefix = self.key(rel)
        try:
            with self._errors(rel):
                for chunk in obstore.list(self.client(), prefix=f"{prefix}/" if prefix else None,
                                          chunk_size=1):
                    return bool(chunk)
        except NotFoundError:
            return False
        return not prefix

    def _listed_prefix(self) -> str:
        return self.root.rstrip("/") + "/"

    def _find(self, base: str) -> dict[str, dict]:
        import obstore

        container, _, key = base.partition("/")
        prefix = key.rstrip("/") + "/" if key else None
        found = {}
        for chunk in obstore.list(self.client(), prefix=prefix):
            for o in chunk:
                found[f"{container}/{o['path']}"] = _entry(o)
        return found

    def _ls_files(self, base: str) -> dict[str, dict]:
        import obstore

        container, _, key = base.partition("/")
        listed = obstore.list_with_delimiter(self.client(), key.rstrip("/") + "/" if key else None)
        return {f"{container}/{o['path']}": _entry(o) for o in listed["objects"]}

    def list_dirs(self, rel: str = "") -> list[str]:
        import obstore

        prefix = self.key(rel)
        with self._errors(rel):
            self.stats.lists += 1
            listed = obstore.list_with_delimiter(self.client(), f"{prefix}/" if prefix else None)
        root = self.key()
        cut = len(root) + 1 if root else 0
        return sorted(p.rstrip("/")[cut:] for p in listed["common_prefixes"])

    def _mtime(self, rel: str) -> float | None:
        import obstore

        when = obstore.head(self.client(), self.key(rel)).get("last_modified")
        return when.timestamp() if when is not None else None

    # ---------------------------------------------------------------- reads
    def _pread(self, rel: str, start: int, end: int) -> bytes:
        import obstore

        try:
            return bytes(obstore.get_range(self.client(), self.key(rel), start=start, end=end))
        except Exception as e:  # noqa: BLE001 - a range past the end: read what is there
            first = str(e).partition("\n")[0]
            if _name(e) == "NotFoundError" or "non-partial response" in first:
                raise  # (a server that ignores ranges: the S3 store reads it otherwise)
            if "416" in first:  # starts at or past the end
                return b""
            size = int(obstore.head(self.client(), self.key(rel))["size"])
            if end <= size:
                raise
            if start >= size:
                return b""
            return bytes(obstore.get_range(self.client(), self.key(rel), start=start, end=size))

    def read_whole_into(self, rel: str, buf: memoryview) -> int:
        """One GET of the whole object into ``buf``; returns its size (which the caller
        compares with what it expected: only ``len(buf)`` bytes are copied)."""
        if not len(buf) or self._cached(rel):
            return super().read_whole_into(rel, buf)
        data = self._read_whole(rel)
        n = min(len(data), len(buf))
        buf[:n] = data[:n]
        return len(data)

    def _stream(self, rel: str, block: int) -> Iterator[memoryview]:
        """The object's body as it arrives, cut into ``block``-byte pieces (the last one
        shorter), as every store's ``iter_blocks`` gives them."""
        import obstore

        with self._errors(rel):
            chunks = iter(obstore.get(self.client(), self.key(rel)).stream(min_chunk_size=block))
        pending = bytearray()
        while True:
            with self._errors(rel):
                chunk = next(chunks, None)
            if chunk is None:
                break
            pending += memoryview(chunk)
            while len(pending) >= block:
                piece = bytes(pending[:block])
                del pending[:block]
                yield memoryview(piece)
        if pending:
            yield memoryview(bytes(pending))

    def _cat(self, rel: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.client(), self.key(rel)).bytes())



class NativeStore(NativeReads):
    """A checkpoint root in a bucket or container, on an obstore client, writes included
    (see the module docstring). Subclasses give :meth:`client` (the container's obstore
    store) and may override :meth:`_server` and :meth:`_secrets`."""

    #: If-None-Match / If-Match are sent and honoured (conditional.py asks)
    conditional_writes = True

    @property
    def caps(self) -> Capabilities:
        return Capabilities(False, True, False, False)

    # ---------------------------------------------------------------- writes
    def open(self, rel: str, mode: str = "rb", **kw):
        if "w" in mode or "x" in mode:
            return open_write(self, rel, mode)
        from .store_file import StoreFile

        with self._errors(rel):
            import obstore

            return StoreFile(self, rel, obstore.open_reader(self.client(), self.key(rel)), mode)

    def _put(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:
        put_whole(self, rel, data, exclusive)

    def version_of(self, rel: str) -> str | None:
        """The ETag of ``rel`` now (what :meth:`put_if_match` compares); NotFoundError
        when it is not there."""
        import obstore

        with self._errors(rel):
            return obstore.head(self.client(), self.key(rel)).get("e_tag")

    def put_if_match(self, rel: str, data: bytes, version: str) -> bool:
        """Replace ``rel`` if its ETag is still ``version``; False when it changed."""
        import obstore

        self._uncache(rel)
        with self._errors(rel):
            try:
                obstore.put(self.client(), self.key(rel), bytes(data), mode={"e_tag": version})
            except Exception as e:  # noqa: BLE001 - obstore's classes, by name
                if _name(e) in ("PreconditionError", "AlreadyExistsError", "NotFoundError"):
                    return False
                raise
        self._count(writes=1, bytes_written=len(data))
        return True

    def _remove_all(self, rels: list[str], fulls: list[str]) -> None:
        for rel in rels:
            self.remove(rel)

    def _unlink(self, full: str) -> None:
        unlink(self, full)


def put_whole(store: NativeReads, rel: str, data, exclusive: bool) -> None:
    """One PUT of all of ``data`` at ``rel`` through ``store``'s obstore client;
    ``exclusive``: ``If-None-Match: *``, an existing object refused as ALREADY_EXISTS
    (a server that ignores the header overwrites: callers read back what they must)."""
    import obstore

    with store._errors(rel):
        try:
            obstore.put(store.client(), store.key(rel), memoryview(data).cast("B"),
                        mode="create" if exclusive else "overwrite")
        except Exception as e:  # noqa: BLE001 - obstore's classes, by name
            if _name(e) in ("AlreadyExistsError", "PreconditionError"):
                raise already_exists(store.display(rel)) from None
            raise


def open_write(store: NativeReads, rel: str, mode: str = "wb"):
    """``rel`` opened for a streamed write through ``store``'s obstore client (one PUT up
    to :data:`ONE_PUT` bytes, a multipart upload beyond), published on ``close``; leaving
    a ``with`` block by an exception abandons it."""
    from .store_file import StoreFile

    store._uncache(rel)
    store._forget(rel)
    with store._errors(rel):
        return StoreFile(store, rel, _Writer(store.client(), store.key(rel)), mode)


def unlink(store: NativeReads, full: str) -> None:
    """Delete the object ``full`` (``bucket/key``); FileNotFoundError when it is not
    there (nor its bucket: nothing to delete either way)."""
    import obstore

    try:
        obstore.delete(store.client(), full.partition("/")[2])
    except FileNotFoundError:  # obstore's not-found is the builtin
        raise FileNotFoundError(full) from None


def _name(e: BaseException) -> str:
    return type(e).__name__


def _entry(o: dict) -> dict:
    """An obstore listing entry as the listings here name it."""
    return {"size": o.get("size", 0), "LastModified": o.get("last_modified"),
            "ETag": o.get("e_tag")}


class _Writer:
    """A file written to an object: kept in memory up to :data:`ONE_PUT` bytes and sent as
    one PUT on ``close``; beyond that, streamed through obstore's multipart writer.
    ``discard`` abandons it: nothing appears under the name."""

    def __init__(self, client, key: str):
        self.client, self.key = client, key
        self.buf = bytearray()
        self.stream = None
        self.closed = False

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        if self.stream is None and len(self.buf) + n <= ONE_PUT:
            self.buf += b
            return n
        if self.stream is None:
            import obstore

            self.stream = obstore.open_writer(self.client, self.key)
            self.stream.write(bytes(self.buf))
            self.buf = bytearray()
        self.stream.write(bytes(b) if not isinstance(b, bytes) else b)
        return n

    def flush(self) -> None:
        """Nothing reaches the object before ``close``."""

    def tell(self) -> int:
        raise NotImplementedError("a streamed object write has no position")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.close()
            return
        import obstore

        obstore.put(self.client, self.key, bytes(self.buf))

    def discard(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            with contextlib.suppress(Exception):  # an exception in: the upload is aborted
                self.stream.__exit__(RuntimeError, RuntimeError("discarded"), None)


__all__ = ["NativeReads", "NativeStore", "ONE_PUT"]
