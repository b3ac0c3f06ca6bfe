"""``seal``: write the manifest of a checkpoint a framework wrote, making it "committed".

Structural checks run first; an incomplete or inconsistent checkpoint is refused (exit 1).
Sealing a sealed checkpoint verifies it against its manifest instead and says so; tags it
is given that the manifest lacks are added (action ``"tagged"``).
The manifest is written last, atomically and exclusively: a concurrent sealer of other
content or another step loses cleanly (exit 1) instead of overwriting, and concurrent
sealers of the same content with different tags all end up in one manifest
(:func:`_publish`): tags are a set, and a seal that exits 0 has its tags stored.
A single-file checkpoint (``train.pt``, ``model.safetensors``) is sealed the same way; its
manifest is the sidecar beside it, ``train.pt.ckptctl.manifest.json``
(:func:`~ckptctl.formats.manifest.control_name`).

>>> r = seal("ckpt/", step=1200, tags=["release"])          # doctest: +SKIP
>>> r.action, r.manifest_id                                 # doctest: +SKIP
('sealed', 'xxh3-128:5c1f...')
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from .._deps import MissingDependencyError
from ..catalog.checks import Problem
from ..errors import CkptError, Finding, FormatError, StorageError
from ..formats.detect import locate, open_checkpoint
from ..formats.locate import refuse_save_folder, split_file_url
from ..formats.manifest import MANIFEST, Manifest, control_name, is_control_file, is_temp_name
from ..storage import Store, digest_bytes, normalize_algo, open_store
from ..writing.commit import commit, manifest_for
from .verify import check_and_hash, verify


#: Reads and conditional writes of the manifest before a seal gives up on a manifest that
#: other writers keep changing (each round is a few requests).
ROUNDS = 16
#: Where the server ignores conditional writes: rounds of the intent protocol, and how
#: long an intent may live before a sealer takes it for a killed one's.
INTENT_ROUNDS = 40
STALE_INTENT = 600.0
_INTENT = re.compile(r"^\.ckptctl-seal-([0-9a-f]{32})-(\d+)-([0-9a-f]{8})\.tmp$")


@dataclass
class SealResult:
    url: str
    action: str  # "sealed", "updated", "tagged" or "verified"
    manifest_id: str | None
    format: str
    step: int | None
    hash: str
    num_files: int
    bytes: int
    seconds: float
    problems: list[Problem] = field(default_factory=list)
    #: the tags the stored manifest has (this seal's and any a concurrent sealer added)
    tags: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _worst(problems: list[Problem]) -> Problem:
    return next((p for p in problems if p.severity == "error"), problems[0])


def seal(url: str, storage_options: dict | None = None, *, hash: str | None = None,
         step: int | None = None, tags: list[str] | None = None, workers: int = 4,
         on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None, update: bool = False) -> SealResult:
    """Hash every file and write ``ckptctl.manifest.json`` last (a single-file
    checkpoint: ``FILE.ckptctl.manifest.json`` beside it).

    Raises :class:`~ckptctl.errors.Finding` (exit 1) if the checkpoint is incomplete or
    inconsistent, or if it is sealed and no longer matches its manifest.

    A sealed checkpoint is verified against its manifest; files it does not list are
    reported (``problems``: EXTRA_FILE warnings); ``tags`` it lacks are added (action
    ``"tagged"``; nothing else in it changes). ``update=True`` reseals it instead:
    once every listed file still matches its hash, the files added since are hashed and
    a new manifest (the old step and tags kept unless given; ``hash=None``: the old
    algorithm) atomically replaces the old one, last (action ``"updated"``).

    >>> seal("ckpt/", update=True).action                       # doctest: +SKIP
    'updated'
    """
    t0 = time.monotonic()
    algo = normalize_algo(hash or "xxh3-128")
    located = locate(url, storage_options)
    refuse_save_folder(located, url, "seal")
    store, files, single = located
    mname = control_name(MANIFEST, single)
    # Listed once, opened once: the listing and the checkpoint are passed on, and small
    # remote files (.metadata, the manifest, small chunks) are fetched once and shared by
    # the metadata reader, verify and the hashes (S3: one LIST, one GET of .metadata).
    store.cache_small_files(files)
    replaces = None
    if mname in files:
        r = verify(url, storage_options, level="full", workers=workers, on_bytes=on_bytes,
                   located=located, uploads=False, on_total=on_total)
        if any(p.severity == "error" for p in r.problems):  # a stray temp file is no reason
            p = _worst(r.problems)
            raise Finding(p.path or url, f"already sealed, but {p.code}: {p.message}"
                          + (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""),
                          code=p.code)
        doc = Manifest.read(store, files, single)
        old = _update_plan(doc, files, hash=hash, step=step, tags=tags) if update else None
        if old is None:
            action = "verified"
            if not set(tags or []) <= set(doc.tags):  # seal --tag of a sealed checkpoint
                doc = _publish(url, storage_options, dataclasses.replace(
                    doc, tags=sorted(set(doc.tags) | set(tags))), first=False, single=single)
                action = "tagged"
            return SealResult(url, action, doc.id, doc.format, doc.step, doc.hash,
                              len(doc.files), doc.total_bytes,
                              round(time.monotonic() - t0, 3), problems=list(r.problems),
                              tags=sorted(doc.tags))
        algo, step, tags, known = old
        from ..catalog.ownership import check_removable  # a new id strands the packs made on it

        check_removable(url, store, files, doc, doing="reseal", algo=algo, single=single,
                        storage_options=storage_options)
        already = doc.total_bytes  # verify read them
        replaces = doc.id
    else:
        known, already = {}, 0
    man = _hash_manifest(url, storage_options, located, algo=algo, step=step, tags=tags,
                         known=known, already=already, workers=workers, on_bytes=on_bytes,
                         on_total=on_total)
    stored = _publish(url, storage_options, man, replaces=replaces,
                      first=mname not in files, single=single)
    return SealResult(url, "updated" if mname in files else "sealed", stored.id,
                      man.format, stored.step, algo, len(man.files), man.total_bytes,
                      round(time.monotonic() - t0, 3), tags=sorted(stored.tags))


def manifest_of(url: str, storage_options: dict | None = None, *, hash: str | None = None,
                step: int | None = None, tags: list[str] | None = None, workers: int = 4,
                on_bytes: Callable[[int], None] | None = None,
                on_total: Callable[[int], None] | None = None,
                located: tuple | None = None) -> Manifest:
    """The manifest :func:`seal` would write for the unsealed checkpoint at ``url``,
    computed (structure checked, every file hashed) without writing anything there: how
    ``pack`` and ``promote`` take a source they may not or cannot write to (a read-only
    mount, an archive bucket). An incomplete checkpoint is refused (exit 1) as by seal.

    >>> manifest_of("/archive/step-80").id                     # doctest: +SKIP
    'xxh3-128:5c1f...'
    """
    algo = normalize_algo(hash or "xxh3-128")
    located = located or locate(url, storage_options)
    refuse_save_folder(located, url, "seal")
    store, files, single = located
    store.cache_small_files(files)
    return _hash_manifest(url, storage_options, located, algo=algo, step=step, tags=tags,
                          known={}, already=0, workers=workers, on_bytes=on_bytes,
                          on_total=on_total)


def seal_or_hash(url: str, storage_options: dict | None = None, *,
                 seal_source: bool | None = None, workers: int = 4,
                 located: tuple | None = None) -> tuple[Manifest, bool]:
    """For a copier (``pack``, ``promote``) of the unsealed checkpoint at ``url``: its
    manifest, and whether it is now sealed there (then read the stored one back).
    ``seal_source`` True seals it (:func:`seal`; a source that refuses the write fails);
    False never writes there (:func:`manifest_of`); None (the default) seals it when it
    takes the write, and else (a read-only mount or bucket, read-only keys: the write
    fails with a storage error) keeps the manifest in memory only, for the destination.
    An incomplete checkpoint is refused (exit 1) either way.

    >>> man, sealed = seal_or_hash("/archive/step-80")          # doctest: +SKIP
    >>> sealed                                                 # doctest: +SKIP
    False
    """
    if seal_source:
        seal(url, storage_options, workers=workers)
        store, files, single = locate(url, storage_options)
        return Manifest.read(store, files, single), True
    located = located or locate(url, storage_options)
    man = manifest_of(url, storage_options, workers=workers, located=located)
    if seal_source is None:
        try:
            return _publish(url, storage_options, man, first=True, single=located[2]), True
        except StorageError:  # the source does not take writes: it stays as it is
            pass
    return man, False


def _hash_manifest(url: str, storage_options, located, *, algo: str, step, tags, known,
                   already: int, workers: int, on_bytes, on_total) -> Manifest:
    """The manifest to commit: every file not in ``known`` (files a manifest proved just
    now) hashed in the one read that runs every check its format carries (structure, zip
    CRC-32s, ``integrity.json``: :func:`~.verify.check_and_hash`), so that a manifest is
    never written over bytes the format itself says are wrong. Nothing is written."""
    store, files, _ = located
    try:
        ck = open_checkpoint(url, storage_options, strict=False, located=located)
    except (StorageError, MissingDependencyError):
        raise
    except CkptError:
        ck = None  # verify opens it again and reports what is wrong as a finding
    if ck is not None:
        ck = _as_verify_reads(url, storage_options, located, ck)
    names = sorted(rel for rel in files if not is_control_file(rel) and not is_temp_name(rel)
                   and rel not in known)  # known: proven against the manifest just now
    r, digests = check_and_hash(url, storage_options, algo=algo, names=names, workers=workers,
                                on_bytes=on_bytes, located=located, checkpoint=ck,
                                on_total=on_total and (lambda n: on_total(already + n)))
    _refuse_problems(url, r.problems)
    if step is None:
        step = ck.step
    hashes = {**known, **digests}
    for rel in names:
        if rel not in digests or digests[rel][1] != files[rel]:
            raise Finding(store.display(rel), "changed size while being sealed: is a writer "
                          "still running?", code="SIZE_MISMATCH")
    return manifest_for(ck, hashes, algo=algo, step=step, tags=tags)


def _as_verify_reads(url: str, storage_options, located, ck):
    """The checkpoint as ``verify`` opens it (its checks, and the logical digest the
    manifest records): a lone torch.save zip is read without torch there (byte ranges of
    its records); torch's safe loader has read it first (``ck``), so what that loader
    refuses is never sealed. Anything else: ``ck`` itself."""
    if not located[2] or ck.format != "torch":
        return ck
    return open_checkpoint(url, storage_options, strict=False, read_step=False,
                           located=located, torch_free=True)


def _refuse_problems(url: str, problems: list[Problem]) -> None:
    """A seal stops at the first error a check found (exit 1), naming its file and entry;
    warnings (a stray temp file) are no reason."""
    errors = [p for p in problems if p.severity == "error"]
    if not errors:
        return
    p = errors[0]
    raise Finding(p.path or url, f"refusing to seal: {p.code}: "
                  + (f"{p.entry}: " if p.entry else "") + p.message
                  + (f" (+{len(errors) - 1} more problems)" if len(errors) > 1 else ""),
                  code=p.code)


# --------------------------------------------------------------------------- publishing


def _merged(stored: Manifest | None, want: Manifest, replaces: str | None,
            where: str) -> Manifest | None:
    """What to write over ``stored`` (None: nothing is there) so that it says ``want``
    with ``want``'s tags: None when it says that already. The same
    checkpoint (id and step) keeps its manifest and gains the tags; one whose id is
    ``replaces`` (``seal --update``) is replaced, keeping its tags; anything else is
    another writer's checkpoint: :class:`~ckptctl.errors.Finding` (exit 1).

    >>> from ckptctl.formats.manifest import FileEntry
    >>> a = Manifest({"x": FileEntry(1, "h")}, step=5, tags=["a"])
    >>> _merged(a, dataclasses.replace(a, tags=["b"]), None, "m").tags
    ['a', 'b']
    >>> _merged(a, a, None, "m") is None
    True
    """
    tags = set(want.tags)
    if stored is None:
        return dataclasses.replace(want, tags=sorted(tags))
    if stored.id == want.id and stored.step == want.step:
        if tags <= set(stored.tags):
            return None
        return dataclasses.replace(stored, tags=sorted(tags | set(stored.tags)))
    if replaces is not None and stored.id == replaces:
        return dataclasses.replace(want, tags=sorted(tags | set(stored.tags)))
    raise Finding(where, "another writer committed this checkpoint at the same time with "
                  "other content or step; its manifest won", code="ALREADY_EXISTS")


def _read_stored(store: Store, name: str = MANIFEST) -> tuple[Manifest | None, str | None]:
    """The stored manifest ``name`` read fresh (never a cached copy), and its version."""
    from ..storage.conditional import read_versioned

    got = read_versioned(store, name)
    if got is None:
        return None, None
    return Manifest.parse(got[0], store.display(name)), got[1]


def _publish(url: str, storage_options: dict | None, want: Manifest, *,
             replaces: str | None = None, first: bool = False,
             single: str | None = None) -> Manifest:
    """Commit ``want`` as the manifest at ``url`` so that no concurrent sealer's tags are
    lost; returns the manifest stored (``want``'s checkpoint with at least its tags).
    ``single``: ``url`` names that one file; its manifest is the sidecar beside it.

    ``first``: the listing showed no manifest, so the one exclusive write of every commit
    (:func:`~ckptctl.writing.commit.commit`) goes first. When it finds one there (another
    sealer won), or for a sealed checkpoint, the stored manifest is read and rewritten
    with the union of the tags (:func:`_merged`), as a compare-and-swap: POSIX under an
    exclusive lock of the folder, S3 with ``If-Match`` on the ETag read. A server that
    ignores conditional writes (``rclone serve s3``) gets :func:`_publish_unconditional`.
    """
    from ..storage.conditional import (create_if_absent, folder_lock, honours_conditions,
                                       replace_if)

    # its own store: no cached copy of the manifest
    store = open_store(split_file_url(url)[0] if single else url, storage_options)
    name = control_name(MANIFEST, single)
    where = store.display(name)
    if not honours_conditions(store, f".ckptctl-probe-{uuid.uuid4().hex}.tmp"):
        return _publish_unconditional(store, want, replaces, name)
    if first:
        try:
            commit(store, want, single=single)
            return want
        except Finding as e:
            if e.code != "ALREADY_EXISTS":
                raise
    with folder_lock(store):
        for _ in range(ROUNDS):
            stored, version = _read_stored(store, name)
            target = _merged(stored, want, replaces, where)
            if target is None:
                return stored
            if stored is None:
                create_if_absent(store, name, target.to_bytes())
            else:
                replace_if(store, name, target.to_bytes(), version)
            # and read again: what is stored now is the answer (ours, or a rival's to merge)
    raise Finding(where, "the manifest kept changing under other writers; rerun",
                  code="ALREADY_EXISTS")


def _publish_unconditional(store: Store, want: Manifest, replaces: str | None,
                           name: str = MANIFEST) -> Manifest:
    """:func:`_publish` where writes cannot be conditional: each sealer first leaves an
    *intent* (``.ckptctl-seal-<random>-<pid>-<host>.tmp``), then in rounds lists the
    folder, reads the manifest, writes it with the union of its tags and the stored ones,
    lists again and reads it back. It is done (exit 0) once a round's second listing
    shows no other intent and the read-back holds its tags: a writer that could still
    overwrite that manifest without them read it before our write and keeps its intent
    until after its own write, so that listing would have shown it. When others are
    there, the one with the later name steps aside (removes its intent, waits for the
    earlier ones to go, starts again); the earliest goes on. Nothing better works without
    compare-and-swap; a sealer that cannot finish exits 1, never 0 with its tags lost.
    Intents are only listed, never read (a read racing its removal hangs on rclone); one
    older than :data:`STALE_INTENT`, or of a dead process of this host, is a killed
    sealer's: removed, ignored. ``name``: the manifest's (a single file's sidecar)."""
    where = store.display(name)
    stale: set[str] = set()
    me = _put_intent(store, want)
    try:
        for attempt in range(INTENT_ROUNDS):
            top = store.list_files(recursive=False)
            try:
                stored, _ = _read_stored(store, name) if name in top else (None, None)
            except FormatError:  # caught mid-write by another sealer: look again
                time.sleep(min(0.05 * 1.3 ** attempt, 1.0))
                continue
            target = _merged(stored, want, replaces, where)
            if target is not None:
                store.write_atomic(name, target.to_bytes())
            live = _live_intents(store, store.list_files(recursive=False), me, stale)
            try:
                back, _ = _read_stored(store, name)
            except FormatError:
                continue
            if back is None or _merged(back, want, replaces, where) is not None:
                continue  # a writer that had not seen ours overwrote it: once more
            if not live:
                return back
            earlier = {n for n in live if _intent_key(n) < _intent_key(me)}
            if earlier:  # step aside until the earlier ones are done, then start again
                store.remove(me)
                _wait_gone(store, earlier, stale)
                me = _put_intent(store, want)
            else:
                time.sleep(min(0.05 * 1.3 ** attempt, 1.0))  # the later ones step aside
        raise Finding(where, "other seals of this checkpoint kept running at the same "
                      "time; rerun when they are done", code="ALREADY_EXISTS")
    finally:
        store.remove(me)


def _host() -> str:
    return digest_bytes(socket.gethostname().encode(), "xxh3-128")[:8]


def _put_intent(store: Store, want: Manifest) -> str:
    """Leave this sealer's intent (its name says all that others need; the body is for
    people)."""
    name = f".ckptctl-seal-{uuid.uuid4().hex}-{os.getpid()}-{_host()}.tmp"
    doc = {"command": "seal", "id": want.id, "step": want.step, "tags": sorted(want.tags),
           "host": socket.gethostname(), "pid": os.getpid(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    store.write_atomic(name, (json.dumps(doc, sort_keys=True) + "\n").encode())
    return name


def _intent_key(name: str) -> str:
    return _INTENT.match(name).group(1)


def _live_intents(store: Store, listing: dict[str, int], me: str, stale: set[str]) -> list[str]:
    """The other sealers' intents in ``listing`` that are not a killed one's (a stale
    one is removed)."""
    out = []
    for name in listing:
        m = _INTENT.match(name)
        if name == me or m is None or name in stale:
            continue
        if _stale(store, name, int(m.group(2)), m.group(3)):
            stale.add(name)
            store.remove(name)
            continue
        out.append(name)
    return out


def _stale(store: Store, name: str, pid: int, host: str) -> bool:
    """Is this intent a killed sealer's? Left by a process of this host that is gone, or
    older than :data:`STALE_INTENT` (by the listing's time)."""
    if host == _host() and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
    when = store.modified(name)
    return when is not None and time.time() - when > STALE_INTENT


def _wait_gone(store: Store, names: set[str], stale: set[str]) -> None:
    """Wait (bounded, backing off) until the intents ``names`` are gone."""
    for attempt in range(INTENT_ROUNDS):
        top = store.list_files(recursive=False)
        if not names & set(_live_intents(store, top, "", stale)):
            return
        time.sleep(min(0.05 * 1.3 ** attempt, 1.0))
    raise Finding(store.display(MANIFEST), "another seal of this checkpoint is still "
                  "running; rerun when it is done", code="ALREADY_EXISTS")


def _update_plan(doc: Manifest, files: dict[str, int], *, hash: str | None, step: int | None,
                 tags: list[str] | None):
    """For ``seal --update`` of a verified sealed checkpoint: (algo, step, tags, the
    listed files' (digest, size) to keep), or None when the manifest already says it all.

    >>> from ckptctl.formats.manifest import FileEntry
    >>> doc = Manifest({"x": FileEntry(1, "h")}, step=5, tags=["a"])
    >>> _update_plan(doc, {"x": 1, MANIFEST: 9}, hash=None, step=None, tags=None) is None
    True
    >>> _update_plan(doc, {"x": 1, "config.json": 2}, hash=None, step=None, tags=["b"])
    ('xxh3-128', 5, ['a', 'b'], {'x': ('h', 1)})
    """
    algo = normalize_algo(hash) if hash else doc.hash
    new_tags = sorted(set(doc.tags) | set(tags or []))
    new_step = doc.step if step is None else step
    added = [rel for rel in files if rel not in doc.files and not is_control_file(rel)
             and not is_temp_name(rel)]
    if not added and new_step == doc.step and new_tags == sorted(doc.tags) and algo == doc.hash:
        return None
    known = doc.hashes() if algo == doc.hash else {}
    return algo, new_step, new_tags, known
