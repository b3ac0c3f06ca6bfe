"""The reading part of :class:`~ckptctl.storage.store.Store`: :class:`StoreReads`,
ranged and whole reads, reads into the caller's buffers, the one streamed read loop
(:meth:`StoreReads.iter_blocks`) and the small-file caches (in memory, and the persistent
object cache on local disk).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from .smallfiles import SmallFileCache
from .store_core import StoreCore


class StoreReads(StoreCore):
    """Reads of a store's files, answered through fsspec; a backend overrides ``_pread``,
    ``_stream``, ``_cat`` (and ``read_into``) where its OS or API does better."""

    def cache_small_files(self, sizes: dict[str, int], *, max_file: int = 16 << 20,
                          budget: int = 256 << 20, persist: bool = False) -> None:
        """Serve ranged reads of small remote files from one whole-file GET each (LRU,
        ``budget`` bytes at most): a DCP checkpoint of many small chunks then costs one
        request per file, not several per chunk; whole reads (:meth:`read`) share it. A
        second call keeps what is cached (one opened checkpoint passed on: seal, ls). No
        effect on local stores. ``persist``: files the listing showed with an ETag come
        from the object cache on local disk when it holds them, and go there when read
        (:mod:`~ckptctl.storage.objcache`; for a chain walk, never for what must prove
        the store's bytes)."""
        if self._small is None:
            self._small = SmallFileCache(sizes, max_file, budget)
        else:
            with self._small.lock:
                self._small.sizes.update(sizes)
        if persist and self._objects is None:
            from .objcache import default_cache

            self._objects = default_cache()

    def _cached(self, rel: str) -> bool:
        return self._small is not None and self._small.wants(rel)

    # ---------------------------------------------------------------- reads
    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, in one request. Short if the file is."""
        if end <= start:
            return b""
        if self._cached(rel):
            return self._small.get(rel, lambda: self._load_small(rel))[start:end]
        with self._errors(rel):
            data = self._pread(rel, start, end)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def _pread(self, rel: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.full(rel), start=start, end=end)

    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` with the bytes at ``start``; returns how many there were. Local
        files are read straight into ``buf`` (``preadv``), S3 objects too (one ranged GET,
        :func:`~ckptctl.storage.s3data.get_into`): no new memory per read, which matters
        since first touches of fresh memory run at a fraction of copy speed."""
        data = self.read_range(rel, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def read_whole_into(self, rel: str, buf: memoryview) -> int:
        """Read a whole file that should hold ``len(buf)`` bytes into ``buf``; returns the
        size found (the caller compares it with what it expected). On S3 one GET of the
        whole object (:func:`~ckptctl.storage.s3data.get_whole_into`: the native client
        where installed), elsewhere :meth:`read_into`."""
        return self.read_into(rel, 0, buf)

    def read(self, rel: str) -> bytes:
        """A whole (small) file; from the small-file cache when it is on and holds it."""
        if self._cached(rel):
            return self._small.get(rel, lambda: self._load_small(rel))
        return self._read_whole(rel)

    def iter_blocks(self, rel: str, *, block: int = 8 << 20,
                    on_bytes: Callable[[int], None] | None = None) -> Iterator[memoryview | bytes]:
        """Stream a whole file in blocks, in order: the one read loop of ckptctl (hashing,
        ``verify --level full``, copies).

        Local files are read with ``readinto`` into a buffer this thread reuses (1 MiB: it
        stays in cache while the caller hashes it), so a block is only valid until the next
        one is asked for: consume or copy it first. S3 objects come in ``block``-byte
        ranged GETs, four in flight (:func:`~ckptctl.storage.s3data.iter_blocks`), each also
        valid until the next is asked for; other remote files stream ``block`` bytes per
        read; small files the store caches (:meth:`cache_small_files`) come from the cache.
        ``on_bytes(n)`` is called for each block; stats count one read and the bytes; every
        failure is one :class:`CkptError` naming ``rel``.

        >>> from ckptctl.storage import open_store
        >>> import tempfile, pathlib
        >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"x" * 3_000_000)
        >>> [len(b) for b in open_store(d).iter_blocks("f")]
        [1048576, 1048576, 902848]
        """
        if self._cached(rel):
            data = self.read(rel)  # counted by the read
            if data:
                if on_bytes:
                    on_bytes(len(data))
                yield memoryview(data)
            return
        total = 0
        try:
            for view in self._stream(rel, block):
                total += len(view)
                if on_bytes:
                    on_bytes(len(view))
                yield view
        finally:
            self._count(reads=1, bytes_read=total)

    def _stream(self, rel: str, block: int) -> Iterator[memoryview | bytes]:
        """The blocks of :meth:`iter_blocks`, read from the file itself."""
        with self._errors(rel):
            f = self.fs.open(self.full(rel), "rb", block_size=block)
        try:
            while True:
                with self._errors(rel):
                    data = f.read(block)
                if not data:
                    break
                yield data
        finally:
            with contextlib.suppress(Exception):
                f.close()

    def _load_small(self, rel: str) -> bytes:
        """A small file for the small-file cache: from the object cache when it holds the
        object the listing showed (same key, size and ETag), else read and kept there."""
        with self._lock:
            etag = self._etags.get(rel)
        size = self._small.sizes.get(rel) if self._small is not None else None
        if self._objects is None or not etag or size is None:
            return self._read_whole(rel)
        ident = (self._server(), self.full(rel), size, etag)
        blob = self._objects.get(ident)
        if blob is None:
            blob = self._read_whole(rel)
            self._objects.put(ident, blob)
        else:
            with self._lock:
                self.stats.cache_hits += 1
        return blob

    def _read_whole(self, rel: str) -> bytes:
        with self._errors(rel):
            data = self._cat(rel)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += len(data)
        return data

    def _cat(self, rel: str) -> bytes:
        return self.fs.cat_file(self.full(rel))
