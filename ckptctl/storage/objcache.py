"""Small remote objects kept on local disk by what the listing says they are: server,
key, size and ETag. A pack hop walks its base's delta chain (each level's index,
manifest and small data file); the levels do not change once committed, so after the
first hop each level costs no GET at all, and a hop's fixed cost stays the same however
deep the chain (issue 20).

Only objects a listing showed with an ETag are kept (an S3 ETag changes whenever the
bytes do: it is their MD5, or one per multipart upload or encryption). An entry holds the
bytes after a header with their xxh3-128; an entry that does not match is a miss (and is
removed), so a damaged cache costs a GET, never a wrong byte. The cache never fails a
command: a full or read-only disk makes every call a miss. It lives in
``$XDG_CACHE_HOME/ckptctl/objects`` and holds at most :data:`BUDGET` bytes (the least
recently used go first). Readers that must prove what the store holds (``verify``,
restores) never use it.

>>> c = ObjectCache(tempfile.mkdtemp())
>>> c.put(("s3:http://h", "b/k", 3, '"e1"'), b"abc"); c.get(("s3:http://h", "b/k", 3, '"e1"'))
b'abc'
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile

#: the largest object kept, and what the whole cache may hold
MAX_ENTRY = 2 << 20
BUDGET = 64 << 20
_MAGIC = b"ckptctl-obj1\n"


class ObjectCache:
    """The cache in folder ``root`` (see the module docstring)."""

    def __init__(self, root: str, budget: int = BUDGET):
        self.root, self.budget = root, budget

    def _path(self, ident: tuple) -> str:
        key = "\0".join(str(x) for x in ident).encode()
        return os.path.join(self.root, hashlib.sha256(key).hexdigest()[:40])

    def get(self, ident: tuple) -> bytes | None:
        """The bytes of the object ``ident`` (server, key, size, etag), or None."""
        import xxhash

        path = self._path(ident)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_ENTRY + 64)
        except OSError:
            return None
        head = len(_MAGIC) + 16
        blob = raw[head:]
        if raw[:len(_MAGIC)] != _MAGIC or len(blob) != ident[2] or \
                xxhash.xxh3_128_digest(blob) != raw[len(_MAGIC):head]:
            with contextlib.suppress(OSError):
                os.unlink(path)  # damaged or from another version: asked again
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept longest
        return blob

    def put(self, ident: tuple, blob: bytes) -> None:
        """Keep ``blob`` as the object ``ident`` (ignored when larger than
        :data:`MAX_ENTRY`, not the size ``ident`` says, or the disk refuses)."""
        import xxhash

        if len(blob) > MAX_ENTRY or len(blob) != ident[2]:
            return
        tmp = None
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + xxhash.xxh3_128_digest(blob) + blob)
            os.replace(tmp, self._path(ident))  # readers see a whole entry or none
            tmp = None
            self._trim()
        except OSError:
            pass
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _trim(self) -> None:
        entries = []
        with os.scandir(self.root) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat()
                    entries.append((st.st_mtime, st.st_size, e.path))
        total = sum(n for _, n, _ in entries)
        for _, n, path in sorted(entries):
            if total <= self.budget:
                return
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= n


def default_cache() -> ObjectCache:
    """The cache under ``$XDG_CACHE_HOME/ckptctl/objects`` (default ``~/.cache``)."""
    from .journal import cache_dir

    return ObjectCache(os.path.join(cache_dir(), "objects"))


__all__ = ["ObjectCache", "default_cache", "MAX_ENTRY", "BUDGET"]
