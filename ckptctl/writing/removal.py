"""Delete one checkpoint so that a crash at any moment leaves something ``incomplete``,
never something that looks valid (DESIGN.md, "Integrity and commit").

Order: the ``.ckptctl-writing`` marker is written first (from then on ``ls``, ``verify``
and ``latest`` call the folder incomplete whatever it still holds: a half-deleted HF
shard set or composite folder has no marker of its own to lose), then the commit markers
go (the manifest, then DCP ``.metadata`` / ``model.safetensors.index.json``), then the
data (:meth:`~ckptctl.storage.Store.remove_many`: ordered, batched on S3), the pin and
the writing marker last. Local folders left empty are removed. A single-file checkpoint
(``train.pt``) goes the same way without a marker (its data is one delete): its sidecar
manifest first, then the file, then its other sidecars (writing marker, pin).

>>> from ckptctl.storage import open_store
>>> r = remove_checkpoint(open_store("runs/step-100"))        # doctest: +SKIP
>>> r.num_files, r.bytes                                      # doctest: +SKIP
(5, 81920)
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from ..errors import CkptError, Finding, UsageError
from ..formats.dcp import METADATA
from ..formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER, control_name
from ..storage import Store

#: Files whose presence makes a folder look committed, most authoritative first.
COMMIT_MARKERS = (MANIFEST, METADATA, "model.safetensors.index.json")


@dataclass
class RemoveResult:
    url: str
    num_files: int
    bytes: int
    was_pinned: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def deletion_order(files: dict[str, int]) -> list[str]:
    """The files of a checkpoint in the order they are deleted: commit markers first
    (top level, then nested ones), data next, the pin last.

    >>> deletion_order({"__0_0.distcp": 9, ".metadata": 1, "ckptctl.manifest.json": 1,
    ...                 ".ckptctl-pinned": 1})
    ['ckptctl.manifest.json', '.metadata', '__0_0.distcp', '.ckptctl-pinned']
    """
    def rank(rel: str):
        base = rel.rsplit("/", 1)[-1]
        if base in COMMIT_MARKERS:
            return (0, rel.count("/"), COMMIT_MARKERS.index(base), rel)
        if rel == PIN_FILE:
            return (2, 0, 0, rel)
        return (1, 0, 0, rel)

    return sorted((rel for rel in files if rel != WRITING_MARKER), key=rank)


def _pin_reason(store: Store, pin: str = PIN_FILE) -> str:
    """What a pin says about itself, for a refusal message (one small read)."""
    try:
        doc = json.loads(store.read(pin))
        who, why = doc.get("by") or "?", doc.get("reason") or ""
        return f"pinned by {who}" + (f": {why}" if why else "")
    except (CkptError, ValueError, AttributeError):
        return "pinned"


def remove_checkpoint(store: Store, files: dict[str, int] | None = None, *,
                      single: str | None = None, force_pinned: bool = False) -> RemoveResult:
    """Delete the checkpoint rooted at ``store`` (``files``: its listing when the caller
    has one, else it is listed; ``single``: the one file of a lone-file checkpoint in
    ``store``, removed with its sidecars: :func:`remove_single`). A pinned checkpoint is
    refused (exit 1) unless ``force_pinned``.

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "step-1"; d.mkdir()
    >>> _ = (d / ".metadata").write_bytes(b"m"); _ = (d / "__0_0.distcp").write_bytes(b"data")
    >>> r = remove_checkpoint(open_store(str(d)))
    >>> (r.num_files, r.bytes, d.exists())
    (2, 5, False)
    """
    if single is not None:
        return remove_single(store, single, files, force_pinned=force_pinned)
    if files is None:
        files = store.list_files()
    if not files:
        raise UsageError(f"{store.url}: nothing to remove (no files here)")
    pinned = PIN_FILE in files
    if pinned and not force_pinned:
        raise Finding(store.url, f"{_pin_reason(store)}; unpin it first (ckptctl unpin), "
                      "or pass --force")
    doc = {"pid": os.getpid(), "host": socket.gethostname(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": "rm"}
    store.write_atomic(WRITING_MARKER, (json.dumps(doc) + "\n").encode())
    order = deletion_order(files)
    markers = [rel for rel in order if rel.rsplit("/", 1)[-1] in COMMIT_MARKERS]
    for rel in markers:  # one call each: gone (and durable) before the next, and the data
        _remove_many(store, [rel])
    _remove_many(store, order[len(markers):])
    store.remove(WRITING_MARKER)
    if store.is_local:
        _remove_empty_folders(store, files)
    from ..formats.manifest import is_control_file, is_temp_name

    # num_files and bytes as every verb counts a checkpoint's (ops/vocabulary.counted_files):
    # ckptctl's markers aside; rm took only a checkpoint that holds no file not its own
    content = {k: v for k, v in files.items() if not is_control_file(k) and not is_temp_name(k)}
    return RemoveResult(store.url, len(content), sum(content.values()), pinned)


def remove_single(store: Store, single: str, files: dict[str, int] | None = None, *,
                  force_pinned: bool = False) -> RemoveResult:
    """Delete the single-file checkpoint ``single`` in the folder ``store`` and its
    sidecars (``files``: the file and its sidecars as the caller listed them; else looked
    up): its manifest first (gone, and durable, before the data), then the file, then
    its writing marker and pin. A pinned one is refused (exit 1) unless ``force_pinned``.

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.pt").write_bytes(b"data")
    >>> _ = (d / "a.pt.ckptctl.manifest.json").write_bytes(b"{}")
    >>> r = remove_single(open_store(str(d)), "a.pt")
    >>> (r.num_files, r.bytes, sorted(p.name for p in d.iterdir()))
    (1, 4, [])
    """
    from ..formats.locate import single_files

    if files is None or single not in files:
        files = single_files(store, single) or {single: store.size(single)}
    pin = control_name(PIN_FILE, single)
    pinned = pin in files
    if pinned and not force_pinned:
        raise Finding(store.display(single), f"{_pin_reason(store, pin)}; unpin it first "
                      "(ckptctl unpin), or pass --force")
    _remove_many(store, [control_name(MANIFEST, single)])  # the commit marker: first, alone
    _remove_many(store, [single, control_name(WRITING_MARKER, single), pin])
    return RemoveResult(store.display(single), 1, files[single], pinned)


def _remove_many(store: Store, rels: list[str]) -> None:
    """Ordered deletes: :meth:`Store.remove_many` (S3: batches of up to 1,000 keys), or
    one by one on a store without it."""
    if not rels:
        return
    many = getattr(store, "remove_many", None)
    if many is not None:
        many(rels)
        return
    for rel in rels:
        store.remove(rel)


def _remove_empty_folders(store: Store, files: dict[str, int]) -> None:
    """rmdir the sub-folders the checkpoint had, deepest first, then its own folder,
    each only if empty (something else put there stays, with its folder)."""
    root = store.full()
    subs = sorted({rel.rsplit("/", 1)[0] for rel in files if "/" in rel},
                  key=lambda d: -d.count("/"))
    for d in subs:
        parts = d.split("/")
        while parts:
            try:
                os.rmdir(os.path.join(root, *parts))
            except OSError:
                break
            parts.pop()
    try:
        os.rmdir(root)
    except OSError:
        pass

