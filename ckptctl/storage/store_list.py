"""The listing part of :class:`~ckptctl.storage.store.Store`: :class:`StoreListing`,
file listings (sizes, and the modification times and ETags they show, kept so that no
HEAD request is needed later), folders, existence, sizes and modification times.
"""
from __future__ import annotations

from ..errors import CkptError, NotFoundError
from .store_core import StoreCore


class StoreListing(StoreCore):
    """Listings and metadata of a store's files, answered through fsspec; a backend
    overrides ``_find``, ``_listed_prefix``, ``_mtime`` and the small methods where its OS
    or API does better."""

    def size(self, rel: str) -> int:
        with self._errors(rel):
            return int(self.fs.size(self.full(rel)))

    def exists(self, rel: str = "") -> bool:
        with self._errors(rel):
            return bool(self.fs.exists(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        with self._errors(rel):
            return bool(self.fs.isdir(self.full(rel)))

    def list_files(self, rel: str = "", *, recursive: bool = True) -> dict[str, int]:
        """Every file under ``rel`` -> size, paths relative to the store root, sorted."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            if recursive:
                found = self._find(base)
            else:
                found = self._ls_files(base)
        out = {}
        prefix = self._listed_prefix()
        for name, info in found.items():
            name = name.rstrip("/")  # fsspec names S3 objects bucket/key, like our root
            if name.startswith(prefix):
                out[name[len(prefix):]] = int(info.get("size") or 0)
                when, etag = info.get("LastModified"), info.get("ETag")
                with self._lock:
                    if hasattr(when, "timestamp"):
                        self._mtimes[name[len(prefix):]] = when.timestamp()
                    if isinstance(etag, str) and etag.strip('"'):
                        self._etags[name[len(prefix):]] = etag
        return dict(sorted(out.items()))

    def list_files_if_any(self, rel: str = "") -> dict[str, int]:
        """:meth:`list_files`, or ``{}`` where nothing is there (a missing folder, or on
        S3 a missing bucket). On an object store that is the listing alone, with no
        existence check first (s3fs's ``exists`` of a prefix is a HEAD and a listing of
        its own: two requests more before every promote).

        >>> import tempfile; from ckptctl.storage import open_store
        >>> open_store(tempfile.mkdtemp()).list_files_if_any("nothing/here")
        {}
        """
        if self.is_local and not self.exists(rel):
            return {}
        try:
            return self.list_files(rel)
        except NotFoundError:
            return {}

    def _listed_prefix(self) -> str:
        """How the filesystem's listings spell this store's root, with a trailing ``/``
        (fsspec's memory filesystem puts a ``/`` in front of the path it was given)."""
        return self.fs._strip_protocol(self.root).rstrip("/") + "/"

    def _find(self, base: str) -> dict[str, dict]:
        """Every file under the path ``base``: full name -> ``{"size", "LastModified"?}``."""
        return self.fs.find(base, detail=True, withdirs=False)

    def _ls_files(self, base: str) -> dict[str, dict]:
        """The files directly in the folder ``base``: full name -> ``{"size", ...}``."""
        return {e["name"]: e for e in self.fs.ls(base, detail=True) if e.get("type") == "file"}

    def list_dirs(self, rel: str = "") -> list[str]:
        """Immediate sub-folders of ``rel``, relative to the store root."""
        base = self.full(rel)
        with self._errors(rel):
            self.stats.lists += 1
            entries = self.fs.ls(base, detail=True)
        prefix = self._listed_prefix()
        return sorted(e["name"].rstrip("/")[len(prefix):] for e in entries
                      if e.get("type") == "directory" and e["name"].startswith(prefix))

    def modified(self, rel: str) -> float | None:
        """Modification time (seconds since the epoch) or None if the store has none; a
        remote file's from the listing that showed it, when there was one (no request)."""
        with self._lock:
            listed = self._mtimes.get(rel)
        if listed is not None:
            return listed
        with self._errors(rel):
            return self._mtime(rel)

    def newest_modified(self, rels) -> float | None:
        """The latest modification time among the files ``rels`` (seconds since the
        epoch), None where the store keeps none: what a listing showed, one listing more
        when it did not show them all (a remote store; a local one stats each file).

        >>> open_store(str(tmp)).newest_modified(["a.bin", "b.bin"])   # doctest: +SKIP
        1764806400.0
        """
        rels = list(rels)
        with self._lock:
            missing = [r for r in rels if r not in self._mtimes]
        if missing and not self.is_local:
            self.list_files()
        times = []
        for rel in rels:
            try:
                times.append(self.modified(rel))
            except CkptError:
                times.append(None)
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def _mtime(self, rel: str) -> float | None:
        try:
            ts = self.fs.modified(self.full(rel))
        except (NotImplementedError, KeyError, AttributeError):
            return None
        return ts.timestamp() if ts else None
