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
from typing import Callable

from ..errors import UsageError
from .store import Store

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


_tls = threading.local()
LOCAL_BLOCK = 1 << 20  # stays in cache between read and hash; measured faster than 8 MiB


def _local_hash(path: str, h, on_bytes: Callable[[int], None] | None) -> int:
    """Hash a local file with one reused buffer per thread: readinto, then update while the
    block is still in cache. No fresh memory per file, no thread hand-offs."""
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(LOCAL_BLOCK)
    mv = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(mv):
            h.update(mv[:n])
            total += n
            if on_bytes:
                on_bytes(n)
    return total


def hash_file(store: Store, rel: str, algo: str = "xxh3-128",
              on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
    """(hex digest, bytes hashed) of one file."""
    h = new_hasher(algo)
    total = 0
    path = store.local_path(rel)
    with store._errors(rel):
        if path is not None:
            total = _local_hash(path, h, on_bytes)
        else:
            with store.fs.open(store.full(rel), "rb", block_size=BLOCK) as f:
                while block := f.read(BLOCK):
                    h.update(block)
                    total += len(block)
                    if on_bytes:
                        on_bytes(len(block))
    with store._lock:
        store.stats.bytes_read += total
        store.stats.reads += 1
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
