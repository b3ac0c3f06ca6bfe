"""Re-rooting a delta pack: :func:`reroot` writes the checkpoint a pack holds again
against a newer base (or none) and puts it in the pack's place, crash-safe, so that its
old base can go; :func:`finish_reroot` completes or clears away what an interrupted
re-root left.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from ..errors import CkptError, Finding, StorageError, UsageError
from ..formats.manifest import MANIFEST, Manifest
from ..formats.pack import DEFAULT_MAX_CHAIN, PACK_INDEX
from ..storage import open_store
from ..writing.commit import commit
from .pack import pack
from .unpack import open_pack_url

#: ``command`` in the writing marker of a pack whose files a re-root is replacing
REROOT_COMMAND = "reroot"


@dataclass
class RerootResult:
    """What :func:`reroot` (or :func:`finish_reroot`) did to the pack at ``url``.
    ``action``: ``re-rooted``; ``up-to-date`` (a full pack: no base to lose);
    ``finished`` (a re-root a crash interrupted, completed); ``discarded`` (what an
    interrupted one left that is no longer wanted, removed); ``busy`` (a ckptctl process
    on this host is re-rooting it: left alone); ``none`` (nothing was left).
    ``base``/``depth``: what it is made against now (None, 0: a full pack); ``was``:
    the base id it had."""

    url: str
    action: str
    manifest_id: str | None = None
    base: str | None = None
    base_url: str | None = None
    depth: int = 0
    was: str | None = None
    bytes_before: int = 0
    bytes_after: int = 0
    full_reason: str | None = None

    def to_dict(self) -> dict:
        """The ``--json`` document: every field."""
        return asdict(self)


def _reached(step: str, url: str) -> None:
    """Called after each durable step of a re-root (``staged``, ``marked``, ``cleared``,
    ``placed``, ``committed``, ``unmarked``, ``unsealed-stage``): the seam where the
    crash tests stop a re-root. A no-op."""


def reroot(url: str, *, base: str | None = None, max_chain: int = DEFAULT_MAX_CHAIN,
           storage_options: dict | None = None, workers: int | None = None,
           level: int = 3) -> RerootResult:
    """Write the checkpoint the delta pack at ``url`` holds again, against ``base`` (a
    sealed checkpoint, or pack, beside it; None: a full pack), and put that pack in
    ``url``'s place, so that the old base is no longer needed. The checkpoint keeps its
    id, so the packs made against it stay valid; the new pack is never deeper than the
    old one (nor than ``max_chain``: past it, a full pack), so their chains still get
    shorter towards the root.

    Crash-safe, with a committed, restorable copy of the checkpoint at every moment:

    1. the new pack is written beside it (:func:`~ckptctl.formats.pack.reroot_stage`:
       ``.NAME.ckptctl-reroot``) and committed, manifest last; the old pack is untouched;
    2. ``url`` gets a writing marker (command ``reroot``): from here readers of the packs
       made against it take their base from the staged copy;
    3. the old pack's own files go (manifest first; a pin, references left by packs
       elsewhere and a user's files stay), the staged files are placed (a hard link
       locally, a server-side copy on S3) and checked by size, the manifest written last,
       then the marker removed;
    4. the staged copy is removed, manifest first.

    A rerun after a crash anywhere finishes it (:func:`finish_reroot`); the base it no
    longer needs is then the caller's to remove (``gc``).

    >>> reroot("cold/step-70").depth                                # doctest: +SKIP
    0
    """
    from ..formats.pack import reroot_stage

    if finish_reroot(url, storage_options).action == "busy":
        raise Finding(url, "a ckptctl process on this host is re-rooting it; let it finish")
    old = open_pack_url(url, storage_options)
    try:
        depth, was = old.index.depth, (old.index.base or {}).get("id")
        before = sum(old.raw_files.values())
    finally:
        old.close()
    if was is None:
        return RerootResult(url, "up-to-date", bytes_before=before, bytes_after=before)
    stage = reroot_stage(url)
    r = pack(url, stage, base=base, max_chain=min(max_chain, depth), workers=workers,
             level=level, storage_options=storage_options,
             dst_storage_options=storage_options, seal_source=False)
    _reached("staged", url)
    sstore = open_store(stage, storage_options)
    sfiles = sstore.list_files()
    _install(sstore, sfiles, open_store(url, storage_options))
    _discard_stage(sstore, sfiles, url)
    return RerootResult(url, "re-rooted", r.source_id, r.base,
                        base if r.base else None, r.depth, was, before,
                        sum(sfiles.values()), r.full_reason)


def finish_reroot(url: str, storage_options: dict | None = None) -> RerootResult:
    """Complete, or clear away, what a re-root of the pack at ``url`` that did not finish
    left (see :func:`reroot`); ``action`` ``none`` when there is nothing. The staged copy
    is installed when it is committed and ``url`` holds the same checkpoint or a marked,
    half-replaced one; it is removed when it is not committed (the old pack was never
    touched), when it is installed already, or when ``url`` now holds another checkpoint
    or nothing. A staged copy or a pack that a live ckptctl process on this host is
    writing, or that another command is writing or removing, is left alone (``busy``).

    >>> finish_reroot("cold/step-70").action                        # doctest: +SKIP
    'none'
    """
    from ..formats.manifest import WRITING_MARKER
    from ..formats.pack import reroot_stage

    sstore = open_store(reroot_stage(url), storage_options)
    sfiles = sstore.list_files_if_any()
    if not sfiles:
        return RerootResult(url, "none")
    target = open_store(url, storage_options)
    tfiles = target.list_files_if_any()
    if _held(sstore, sfiles) or _held(target, tfiles):
        return RerootResult(url, "busy")
    staged = _committed(sstore, sfiles)
    there = _committed(target, tfiles) if WRITING_MARKER not in tfiles else None
    ours = WRITING_MARKER in tfiles and _marker_command(target) == REROOT_COMMAND
    if WRITING_MARKER in tfiles and (staged is None) == ours:
        # another command's write there, or (never left by a re-root: the copy goes only
        # once the pack is whole) a half-replaced pack without a whole copy: left alone
        return RerootResult(url, "busy")
    install = staged is not None and (ours or (
        there is not None and there.id != staged.id
        and there.checkpoint_id == staged.checkpoint_id and _restorable(sstore.url,
                                                                        storage_options)))
    if install:
        _install(sstore, sfiles, target)
    _discard_stage(sstore, sfiles, url)
    return RerootResult(url, "finished" if install or (
        there is not None and staged is not None and there.id == staged.id) else "discarded",
        staged.checkpoint_id if staged is not None else None)


def _held(store, files: dict[str, int]) -> bool:
    """Does a ckptctl process on this host, other than this one, hold ``store`` (its
    writing marker names it, and it runs)?"""
    from ..catalog.writers import live_writer
    from ..formats.manifest import WRITING_MARKER

    if WRITING_MARKER not in files:
        return False
    doc = live_writer(store)
    return doc is not None and int(doc["pid"]) != os.getpid()


def _marker_command(store) -> str | None:
    import json

    from ..formats.manifest import WRITING_MARKER

    try:
        doc = json.loads(store.read(WRITING_MARKER))
    except (CkptError, ValueError):
        return None
    return doc.get("command") if isinstance(doc, dict) else None


def _committed(store, files: dict[str, int]) -> Manifest | None:
    """The manifest of the committed pack at ``store`` (no writing marker, every file it
    lists there at its size), else None."""
    from ..formats.manifest import WRITING_MARKER

    if MANIFEST not in files or PACK_INDEX not in files or WRITING_MARKER in files:
        return None
    try:
        man = Manifest.read(store, files)
    except StorageError:
        raise
    except CkptError:
        return None
    if man is None or any(files.get(rel) != e.size for rel, e in man.files.items()):
        return None
    return man


def _restorable(url: str, storage_options: dict | None) -> bool:
    """Does the pack at ``url`` open, with its whole base chain there and committed?"""
    from ..catalog.checks import base_unrestorable

    try:
        ps = open_pack_url(url, storage_options)
    except StorageError:
        raise
    except CkptError:
        return False
    try:
        return base_unrestorable(ps, storage_options) is None
    finally:
        ps.close()


def _install(stage, sfiles: dict[str, int], target) -> None:
    """Put the committed pack at ``stage`` in place of the pack at ``target`` (steps 2
    and 3 of :func:`reroot`); redone from the start after a crash."""
    import json
    import socket

    from ..formats.manifest import WRITING_MARKER
    from ..formats.pack import DATA_NAME
    from ..storage.localio import sync_dir

    raw = stage.read(MANIFEST)
    man = Manifest.parse(raw, stage.display(MANIFEST))
    doc = {"pid": os.getpid(), "host": socket.gethostname(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": REROOT_COMMAND, "from": stage.url}
    target.write_atomic(WRITING_MARKER, (json.dumps(doc) + "\n").encode())
    _reached("marked", target.url)
    old = target.list_files()
    for rel in (MANIFEST, PACK_INDEX):  # what makes it read as a pack goes first
        if rel in old:
            target.remove_many([rel])
    target.remove_many(sorted(rel for rel in old if DATA_NAME.match(rel)))
    _reached("cleared", target.url)
    for rel in sorted(man.files, key=lambda r: r == PACK_INDEX):  # the index after the data
        _place(stage, target, rel, man)
    _reached("placed", target.url)
    landed = target.list_files()
    wrong = [rel for rel, e in man.files.items() if landed.get(rel) != e.size]
    if wrong:
        raise StorageError(target.display(wrong[0]), "a re-rooted pack's file did not land "
                           f"whole ({landed.get(wrong[0])} bytes, {man.files[wrong[0]].size} "
                           "expected); run gc again")
    if target.is_local:
        sync_dir(target.full())
    commit(target, man, data=raw)
    _reached("committed", target.url)
    target.remove(WRITING_MARKER)
    if target.is_local:
        sync_dir(target.full())
    _reached("unmarked", target.url)


def _place(src, dst, rel: str, man: Manifest) -> None:
    """Copy the committed file ``rel`` from ``src`` to ``dst`` (same name): a hard link
    between local folders, a server-side copy on one S3 server, else streamed and hashed
    against ``man``."""
    from ..storage.multipart import copy_object

    dst.remove(rel)  # a redo after a crash: what an earlier try placed
    if src.is_local and dst.is_local:
        try:
            os.link(src.full(rel), dst.full(rel))
            return
        except OSError:
            pass  # a file system without hard links: copied
    try:
        copy_object(src, rel, dst, rel)
        return
    except StorageError as e:
        if e.code in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE"):
            raise
    except UsageError:
        pass  # not the same server
    digest, _ = dst.write_file(rel, src.iter_blocks(rel), algo=man.hash)
    if digest != man.files[rel].hash:
        raise Finding(dst.display(rel), f"copy differs from the staged pack's manifest "
                      f"({man.hash})", code="HASH_MISMATCH")


def _discard_stage(stage, files: dict[str, int], url: str) -> None:
    """Remove a re-root's staged copy, its manifest first (step 4 of :func:`reroot`)."""
    from ..writing.removal import remove_checkpoint

    if MANIFEST in files:
        stage.remove_many([MANIFEST])
        _reached("unsealed-stage", url)
    rest = stage.list_files_if_any()
    if rest:
        remove_checkpoint(stage, rest, force_pinned=True)
