"""Multipart upload planning and resume for :class:`~ckptctl.storage.transfer.Transfer`:
an upload a killed run left is picked up where the journal and the server agree on its
parts (:func:`resumable_upload`), else a new one is started and journaled
(:func:`start_upload`); :func:`landed` tells a lost answer to a completion from a
failed one.

>>> import tempfile
>>> from ckptctl.storage import open_store
>>> from ckptctl.storage.journal import Journal
>>> dst, journal = open_store(tempfile.mkdtemp()), Journal(None, {})
>>> plan = start_upload(journal, dst, "a.bin", 12 << 20, 5 << 20)
>>> plan.part_size, plan.have, resumable_upload(journal, dst, "a.bin").upload_id == plan.upload_id
(5242880, {}, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import CkptError
from . import multipart
from .journal import Journal
from .store import Store


@dataclass
class UploadPlan:
    """A multipart upload to send a file's parts to: its id, its part size, and the parts
    the server already holds that the journal vouches for (number -> part; empty for a
    new upload)."""

    upload_id: str
    part_size: int
    have: dict[int, multipart.Part]


def resumable_upload(journal: Journal, dst: Store, rel: str) -> UploadPlan | None:
    """The upload of ``rel`` a killed run left, with the parts the server holds that the
    journal vouches for (same ETag and size), or None (none journaled, or the server no
    longer has it: aborted or completed meanwhile, and the journal forgets it)."""
    rec = journal.uploads.get(rel)
    if rec is None:
        return None
    try:
        listed = {p.number: p for p in multipart.list_parts(dst, rel, rec.upload_id)}
    except CkptError as e:
        if e.code != "MISSING_FILE":  # NoSuchUpload: aborted or completed meanwhile
            raise
        journal.forget(rel)
        return None
    good = {n: p for n, p in listed.items()
            if n in rec.parts and (rec.parts[n].etag, rec.parts[n].size) == (p.etag, p.size)}
    return UploadPlan(rec.upload_id, rec.part_size, good)


def start_upload(journal: Journal, dst: Store, rel: str, size: int, part_size: int, *,
                 retry: Callable[[Callable[[], str]], str] | None = None) -> UploadPlan:
    """The upload to send ``rel`` (``size`` bytes) to: the one a killed run left
    (:func:`resumable_upload`), else a new one with parts of about ``part_size``
    (:func:`~.multipart.part_size_for`), journaled before any part is sent. ``retry``
    wraps the call that creates it (e.g. retries with backoff)."""
    resumed = resumable_upload(journal, dst, rel)
    if resumed is not None:
        return resumed
    size_of_parts = multipart.part_size_for(size, part_size)

    def create() -> str:
        return multipart.create_upload(dst, rel, part_size=size_of_parts)

    upload_id = retry(create) if retry is not None else create()
    journal.upload_started(rel, upload_id, size_of_parts)
    return UploadPlan(upload_id, size_of_parts, {})


def landed(dst: Store, rel: str, size: int) -> bool:
    """Is ``rel`` at ``dst`` with ``size`` bytes? (A completion retried after its answer
    was lost finds the upload gone: the file it made is the proof.)

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a").write_bytes(b"abc")
    >>> landed(open_store(d), "a", 3), landed(open_store(d), "missing", 3)
    (True, False)
    """
    try:
        return dst.size(rel) == size
    except CkptError:
        return False
