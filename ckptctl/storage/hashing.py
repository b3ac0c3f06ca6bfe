"""Content hashes of files, streamed with bounded memory.

xxh3-128 by default (10+ GB/s here), sha256 on request. Local files are read with
``readinto`` into one reused per-thread buffer and hashed while it is in cache (several
files hash in parallel from the caller's pool); remote files stream through fsspec.

>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"abc")
>>> from ckptctl.storage import open_store
>>> hash_file(open_store(d), "f", "sha256")[0][:16]
'ba7816bf8f01cfea'
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Callable, Iterable, Protocol

from ..errors import UsageError
from .localio import start_writeback

ALGORITHMS = ("xxh3-128", "sha256")
BLOCK = 8 << 20  # 8 MiB: large enough for the hashers, small enough to keep memory flat


def new_hasher(algo: str):
    """A hashlib-like object for ``xxh3-128`` or ``sha256``."""
    if algo in ("xxh3-128", "xxh3", "xxh128"):
        import xxhash

        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise UsageError(f"unknown hash {algo!r} (choose from {', '.join(ALGORITHMS)})")


def normalize_algo(algo: str) -> str:
    """``xxh3`` -> ``xxh3-128``; validates the name."""
    algo = {"xxh3": "xxh3-128", "xxh128": "xxh3-128"}.get(algo, algo)
    new_hasher(algo)
    return algo


def digest_bytes(data: bytes, algo: str = "xxh3-128") -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


class BlockReader(Protocol):
    """What :func:`hash_file` reads from: anything with a store's streamed read,
    :meth:`~ckptctl.storage.store.Store.iter_blocks` (a store, a pack's
    :class:`~ckptctl.formats.pack.PackStore`). This module sits below the stores: the
    stores' writes hash with it, so it names no store class."""

    def iter_blocks(self, rel: str, *, block: int = ...,
                    on_bytes: Callable[[int], None] | None = None
                    ) -> Iterable[bytes | memoryview]:
        """The bytes of ``rel`` in order, ``block`` bytes at a time."""


def hash_file(store: BlockReader, rel: str, algo: str = "xxh3-128",
              on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
    """(hex digest, bytes hashed) of one file, streamed by the store's ``iter_blocks``
    (:meth:`~ckptctl.storage.store.Store.iter_blocks`).

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "f").write_bytes(b"")
    >>> hash_file(open_store(d), "f")
    ('99aa06d3014798d86001c324468d497f', 0)
    """
    h = new_hasher(algo)
    total = 0
    for block in store.iter_blocks(rel, block=BLOCK, on_bytes=on_bytes):
        h.update(block)
        total += len(block)
    return h.hexdigest(), total


class HashingWriter:
    """Wrap a binary file: count and hash what is written, so a writer can record its
    output's manifest entry without reading it back."""

    def __init__(self, f, algo: str = "xxh3-128", on_bytes: Callable[[int], None] | None = None):
        self.f = f
        self.h = new_hasher(algo)
        self.pos = 0
        self.on_bytes = on_bytes

    def write(self, b) -> int:
        self.f.write(b)
        self.h.update(b)
        self.pos += len(b)
        if self.on_bytes:
            self.on_bytes(len(b))
        return len(b)

    def result(self) -> tuple[str, int]:
        return self.h.hexdigest(), self.pos


class HashBehind:
    """Hash a local file on a thread of its own while it is being written, reading from
    the page cache right behind the writer: the writer calls :meth:`advance` with each
    run of bytes it finished (in file order), :meth:`result` waits for the hash of all
    of them. For bytes the writer never holds itself (copied in the kernel); xxhash and
    ``preadv`` release the GIL, so the hash runs beside the copies. Each run, once hashed,
    starts its write-back to the disk (:func:`~.localio.start_writeback`).

    >>> import tempfile
    >>> f = tempfile.NamedTemporaryFile(); _ = f.write(b"abc"); f.flush()
    >>> hb = HashBehind(f.name, "sha256"); hb.advance(3); hb.result()[0][:16]
    'ba7816bf8f01cfea'
    """

    def __init__(self, path: str, algo: str = "xxh3-128"):
        self.h = new_hasher(algo)
        self._fd = os.open(path, os.O_RDONLY)
        self._cv = threading.Condition()
        self._mark = 0  # bytes the writer finished
        self._pos = 0  # bytes hashed
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ckptctl-hash")
        self._thread.start()

    def advance(self, n: int) -> None:
        """``n`` more bytes are written (after those advanced before)."""
        with self._cv:
            self._mark += n
            self._cv.notify()

    def _run(self) -> None:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        try:
            while True:
                with self._cv:
                    while self._mark == self._pos and not self._closing:
                        self._cv.wait()
                    mark = self._mark
                    if mark == self._pos:
                        return
                start = self._pos
                while self._pos < mark:
                    got = os.preadv(self._fd, [view[:min(BLOCK, mark - self._pos)]], self._pos)
                    if got == 0:
                        raise EOFError(f"the file ends at {self._pos} of {mark} bytes written")
                    self.h.update(view[:got])
                    self._pos += got
                start_writeback(self._fd, start, mark - start)  # the closing fsync waits less
        except BaseException as e:  # noqa: BLE001 - raised in the caller by result()
            self._error = e

    def result(self) -> tuple[str, int]:
        """(hex digest, bytes hashed) once everything advanced is hashed; raises what
        the hashing thread met (an ``OSError``, ``EOFError`` for a file shorter than
        advanced)."""
        self.close()
        if self._error is not None:
            raise self._error
        return self.h.hexdigest(), self._pos

    def close(self) -> None:
        """Stop once what was advanced is hashed (or the thread failed), and release
        the file; :meth:`result` calls it, an aborting writer calls it alone."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
