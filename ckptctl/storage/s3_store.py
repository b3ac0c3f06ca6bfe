"""The S3 store: a :class:`~ckptctl.storage.store.Store` on s3fs for listings and
metadata, whose bulk bytes go through :mod:`~ckptctl.storage.s3data` (ranged GETs into
reused buffers, whole small objects through the native client where installed, PUTs that
carry the user's ``s3_additional_kwargs``), listings as ListObjectsV2 pages and deletes
as DeleteObjects batches.

>>> s = S3Store("s3://bucket/run", None, "s3", "bucket/run")
>>> s.caps.exclusive_create, s.child("step-1").full("a.bin"), s.parent().url
(True, 'bucket/run/step-1/a.bin', 's3://bucket')
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import CkptError, StorageError, shorten
from .failures import scrub
from .store import Store
from .store_commit import already_exists
from .store_core import Capabilities

#: Keys per S3 DeleteObjects request (the API's maximum).
DELETE_BATCH = 1000


class S3Store(Store):
    """A checkpoint root under ``s3://bucket/prefix`` (see the module docstring)."""

    is_s3 = True

    @property
    def caps(self) -> Capabilities:
        # If-None-Match is sent; whether the server honours it is its business
        return Capabilities(False, True, True, True)

    def same_server(self, other: Store) -> bool:
        if not other.is_s3:
            return False
        return (self._server().partition(":")[2] == other._server().partition(":")[2]
                and getattr(self.fs, "key", None) == getattr(other.fs, "key", None))

    # ---------------------------------------------------------------- reads
    def read_into(self, rel: str, start: int, buf: memoryview) -> int:
        if self._cached(rel):
            return super().read_into(rel, start, buf)
        from . import s3data  # ranged GETs read straight into buf, off s3fs's loop

        return s3data.get_into(self, rel, start, buf)

    def read_whole_into(self, rel: str, buf: memoryview) -> int:
        if not len(buf) or self._cached(rel):
            return super().read_whole_into(rel, buf)
        from . import s3data

        return s3data.get_whole_into(self, rel, buf)

    def _stream(self, rel: str, block: int) -> Iterator[memoryview]:
        from . import s3data  # ranged GETs in flight while the caller hashes

        yield from s3data.iter_blocks(self, rel, self.size(rel), block=block)

    def _cat(self, rel: str) -> bytes:
        # s3fs HEADs a file before a whole GET to split large ones into concurrent ranges;
        # whole reads here are small files (metadata, manifests): one GET, not HEAD + GET
        return self.fs.cat_file(self.full(rel), max_concurrency=1)

    def _find(self, base: str) -> dict[str, dict]:
        """Every object under ``base`` (``bucket/prefix``): ListObjectsV2 pages of 1,000
        keys, one after the other, as ``fs.find`` names them. Not ``fs.find`` itself: it
        checks each new folder against a list of its parent's folders (quadratic: ~20 s
        for 10,000 checkpoint folders under one prefix)."""
        bucket, _, key = base.partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        found: dict[str, dict] = {}
        token = None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, **kw)
            for o in page.get("Contents") or []:
                if not o["Key"].endswith("/"):  # a folder marker, not a file
                    found[f"{bucket}/{o['Key']}"] = {"size": o.get("Size", 0),
                                                     "LastModified": o.get("LastModified"),
                                                     "ETag": o.get("ETag")}
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    # ---------------------------------------------------------------- conditional writes
    conditional_writes = True

    def version_of(self, rel: str) -> str | None:
        """The ETag of ``rel`` now (what :meth:`put_if_match` compares); NotFoundError
        when it is not there."""
        bucket, _, key = self.full(rel).partition("/")
        with self._errors(rel):
            return self.fs.call_s3("head_object", Bucket=bucket, Key=key).get("ETag")

    def put_if_match(self, rel: str, data: bytes, version: str) -> bool:
        """Replace ``rel`` if its ETag is still ``version`` (``If-Match``); False when
        another writer changed it since (412) or is writing it now (409)."""
        bucket, _, key = self.full(rel).partition("/")
        self._uncache(rel)
        try:
            with self._errors(rel):
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=version)
        except CkptError as e:
            if e.code == "ALREADY_EXISTS" or "ConditionalRequestConflict" in e.message:
                return False
            raise
        self._count(writes=1, bytes_written=len(data))
        return True

    # ---------------------------------------------------------------- writes
    def _put(self, rel: str, full: str, data: bytes, exclusive: bool) -> None:
        from . import s3data

        try:
            s3data.put_object(self, rel, data, exclusive=exclusive)
        except CkptError as e:
            if e.code != "ALREADY_EXISTS":
                raise
            raise already_exists(self.display(rel)) from None

    def _remove_all(self, rels: list[str], fulls: list[str]) -> None:
        for i in range(0, len(rels), DELETE_BATCH):
            self._delete_batch(rels[i:i + DELETE_BATCH], fulls[i:i + DELETE_BATCH])

    def _delete_batch(self, rels: list[str], fulls: list[str]) -> None:
        bucket = fulls[0].partition("/")[0]
        objects = [{"Key": f.partition("/")[2]} for f in fulls]
        with self._errors(rels[0]):
            resp = self.fs.call_s3("delete_objects", Bucket=bucket,
                                   Delete={"Objects": objects, "Quiet": True})
        self._count(deletes=1)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        errors = resp.get("Errors") or []
        if errors:
            first = errors[0]
            key = f"{bucket}/{first.get('Key', '')}"
            rel = dict(zip(fulls, rels)).get(key, rels[0])
            why = ": ".join(x for x in (str(first.get("Code") or ""),
                                        shorten(str(first.get("Message") or ""), 80)) if x)
            raise StorageError(self.display(rel), scrub(
                f"the server refused to delete {len(errors)} of {len(rels)} objects"
                f"{f' ({why})' if why else ''}", self._secrets()))
