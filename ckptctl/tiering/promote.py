"""``promote``: copy a checkpoint to another place (tier), verified, rate-limited,
resumable, and committed last.

1. An unsealed but complete source is hashed first (an incomplete one is refused, exit
   1) and sealed where it takes the write; a read-only one (an archive mount, a bucket
   with read-only keys) is left as it is and its manifest goes to the destination only
   (``seal_source``). The manifest says what must arrive, byte for byte.
2. Files are copied in parallel, large ones in parallel parts, under one rate limit;
   every file is hashed while it is copied and published at the destination only when
   it matches the manifest (:mod:`ckptctl.storage.transfer`). Data files go before the
   format's own commit markers (DCP ``.metadata``, the HF index).
3. Every file is checked at the destination by size (one listing), then the manifest is
   written last. POSIX: everything lands in a hidden sibling folder
   ``.NAME.ckptctl-promote`` that is renamed into place at the end. S3: a
   ``.ckptctl-writing`` marker goes first (so ``ls``/``verify``/``latest`` call the prefix
   incomplete), the data at the final keys, then the manifest (exclusive where the server
   honours it), and the marker's removal is the last write (POSIX: after the rename). A
   kill before it leaves something incomplete; a rerun finishes it.
4. A rerun after a crash skips files that are already complete and resumes unfinished
   multipart uploads part by part from a journal (beside a local destination, in
   ``~/.cache/ckptctl/promote`` for a remote one). ``dry_run`` says what a rerun would
   still send.
5. ``delete_source`` removes the source only after the destination is committed and
   checked, its commit markers first, and only when the copy restores without it and
   the source passes the check ``rm`` makes (no file that is not the checkpoint's, no
   pack beside it or elsewhere made against it); else the copy stays committed and the
   source is kept, with a Finding (exit 1) that says why.
6. A delta pack never lands where its base is not: to a plain place it is restored
   (unpacked, its base chain read from where the pack records it); to a pack place it is
   copied as it is only when its base is reachable from there, else packed again against
   a checkpoint there or as a full pack (see :func:`promote`). Every mode reports the id
   of the checkpoint stored (a pack's ``packs``, not the pack's own manifest id).
7. A single-file checkpoint (``train.pt``) goes the same way (:func:`_promote_single`):
   DST is the file when it ends in its name, else the folder it goes into
   (:func:`~ckptctl.formats.locate.single_target`); its writing marker
   (``train.pt.ckptctl-writing``) first, the file, then its sidecar manifest
   (``train.pt.ckptctl.manifest.json``, the source's bytes), the marker's removal last.

>>> r = promote("/nvme/run1/step-200", "s3://bucket/run1/step-200", bwlimit="200MiB/s")  # doctest: +SKIP
>>> r.action, r.bytes_sent == r.bytes                                  # doctest: +SKIP
('promoted', True)
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import CkptError, Finding, FormatError, NotFoundError, StorageError, UsageError
from ..formats.detect import locate  # the checkpoint's own files, as ls counts them
from ..formats.locate import refuse_save_folder, single_files, single_target
from ..formats.manifest import (MANIFEST, PIN_FILE, PROMOTE_WORK_SUFFIX, WRITING_MARKER,
                                Manifest, control_name, is_control_file)
from ..storage import open_store
from ..storage.journal import Journal, journal_path_for
from ..storage.ratelimit import RateLimiter, parse_rate
from ..storage.localio import sync_dir
from ..storage.store import Store
from ..storage.transfer import DEFAULT_PART_SIZE, Transfer
from ..writing.commit import commit, is_format_marker, write_order

#: The journal of a local destination, inside the hidden work folder.
JOURNAL = ".ckptctl-promote.jsonl"
WORK_SUFFIX = PROMOTE_WORK_SUFFIX


@dataclass
class PromoteResult:
    src: str
    dst: str
    action: str  # promoted | up-to-date | dry-run
    manifest_id: str
    sealed_source: bool  # the source was sealed by this run
    num_files: int
    bytes: int
    files_sent: int = 0
    files_skipped: int = 0  # already complete at the destination (a resumed run)
    bytes_sent: int = 0
    parts_sent: int = 0
    parts_resumed: int = 0
    server_copy: bool = False
    deleted_source: bool = False
    seconds: float = 0.0
    #: what a (re)run still sends: the dry run's answer, empty after a real run
    to_send: list[str] = field(default_factory=list)
    bytes_to_send: int = 0
    #: requests made, per side, as counted by the stores
    requests: dict = field(default_factory=dict)
    #: ``--pack``: the base used (its id and URL), chain depth, ratio; a delta pack copied
    #: as it is: its base (``carried``); None otherwise
    pack: dict | None = None
    #: the source had no manifest and was left without one (read-only, or
    #: ``seal_source=False``): its manifest was computed here and is at DST only
    source_unsealed: bool = False

    @property
    def rate(self) -> float:
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["bytes_per_second"] = round(self.rate)
        return doc


def _source(src: str, options: dict | None, *, dry_run: bool, workers: int,
            seal_source: bool | None = None, dst: str | None = None):
    """(store, listing, manifest, its bytes, sealed by us, single file or None) of the
    source checkpoint; an unsealed one is hashed (:func:`~.seal.seal_or_hash`), its
    manifest then maybe only in memory (the listing has no manifest). A single-file
    checkpoint's store is the folder holding it, its manifest the sidecar beside it;
    ``dst``: where a copy of it goes, checked (:func:`single_target`) before anything is
    written."""
    store, files, single = located = locate(src, options)
    refuse_save_folder(located, src, "promote")
    if single and dst is not None:
        single_target(dst, single)  # a usage error (another name) before the seal
    _not_held(store, files, single)
    mname = control_name(MANIFEST, single)
    sealed = False
    if mname not in files:
        if dry_run:
            return store, files, None, None, False, single
        from ..integrity.seal import seal_or_hash

        man, sealed = seal_or_hash(src, options, seal_source=seal_source, workers=workers,
                                   located=(store, files, single))  # incomplete: exit 1
        if sealed:
            store, files, _ = locate(src, options)
    if mname in files:
        raw = store.read(mname)
        man = Manifest.parse(raw, store.display(mname))
    else:  # left unsealed: the manifest exists here, in memory, and goes to DST only
        raw = man.to_bytes()
    for rel, rec in man.files.items():
        if files.get(rel) != rec.size:
            what = "missing" if rel not in files else f"{files[rel]} bytes, manifest says {rec.size}"
            raise Finding(store.display(rel), f"source does not match its manifest ({what}); "
                          "run `ckptctl verify` on it", code="MISSING_FILE" if rel not in files
                          else "SIZE_MISMATCH")
    return store, files, man, raw, sealed, single


def _not_held(store: Store, files: dict[str, int] | None = None,
              single: str | None = None) -> None:
    """Refuse (NOT_COMMITTED) a source that a ckptctl writer or remover holds
    (``.ckptctl-writing``; a single file's: ``FILE.ckptctl-writing``): checked before the
    copy and again before the commit, so a copy that raced a ``gc`` or ``rm`` of its
    source never commits."""
    marker = control_name(WRITING_MARKER, single)
    held = marker in files if files is not None else store.exists(marker)
    if held:
        raise FormatError(store.display(marker), "a ckptctl writer or remover holds "
                          "the source; nothing was committed", code="NOT_COMMITTED")


def _same_content(files: dict[str, int], man: Manifest) -> bool:
    return all(files.get(rel) == rec.size for rel, rec in man.files.items())



def _abort_unfinished(store: Store, man: Manifest) -> None:
    """Abort the multipart uploads left under ``store``. Only a file larger than S3's
    smallest part is ever sent in parts (``--part-size`` is at least that), so a
    checkpoint of small files skips the listing, and with it s3fs's client."""
    from ..storage import multipart

    if any(f.size > multipart.MIN_PART for f in man.files.values()):
        for up in multipart.list_uploads(store):
            multipart.abort_upload(store, up.rel, up.upload_id)

def _marker(man_id: str, journal: str | None) -> bytes:
    return (json.dumps({"command": "promote", "source": man_id, "pid": os.getpid(),
                        "host": socket.gethostname(), "journal": journal,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            + "\n").encode()


class _Destination:
    """Where the files land before the commit, and how the commit publishes them."""

    def __init__(self, dst: str, options: dict | None, man: Manifest | None, src_id: str | None):
        self.final = open_store(dst, options)
        self.options = options
        self.local = self.final.is_local
        self.man, self.src_id = man, src_id
        if self.local:
            parent, name = os.path.split(self.final.root.rstrip("/"))
            if not name:
                raise UsageError("promote needs a destination folder name, not /", dst)
            self.work = open_store(os.path.join(parent, f".{name}{WORK_SUFFIX}"))
        else:
            self.work = self.final

    def state(self) -> tuple[str, dict[str, int]]:
        """("committed" | "other" | "resume" | "fresh", files at the work place)."""
        final = self.final.list_files_if_any()
        if MANIFEST in final:
            other = Manifest.parse(self.final.read(MANIFEST), self.final.display(MANIFEST))
            if self.man is not None and other.id == self.man.id and _same_content(final, other):
                return "committed", final
            raise Finding(self.final.url, f"destination holds another checkpoint ({other.id}); "
                          "remove it first (`ckptctl rm`) or choose another place",
                          code="ALREADY_EXISTS")
        if self.local:
            if final:
                raise Finding(self.final.url, "destination exists and is not empty; remove it "
                              "first or choose another place", code="ALREADY_EXISTS")
            work = self.work.list_files_if_any()
            return ("resume" if work else "fresh"), work
        if not final:
            return "fresh", {}
        if WRITING_MARKER in final:
            try:
                doc = json.loads(self.final.read(WRITING_MARKER))
            except (ValueError, CkptError):
                doc = {}
            if doc.get("command") == "promote" and doc.get("source") == self.src_id:
                return "resume", final
            raise Finding(self.final.display(WRITING_MARKER), "another writer "
                          f"({doc.get('command', 'unknown')}) left or is writing this place; "
                          "remove it first or choose another place", code="ALREADY_EXISTS")
        raise Finding(self.final.url, "destination is not empty and holds no checkpoint of "
                      "ckptctl's; remove it first or choose another place",
                      code="ALREADY_EXISTS")

    def journal_path(self) -> str:
        return self.work.full(JOURNAL) if self.local else journal_path_for(self.final.url)

    def begin(self, journal: str) -> None:
        self.work.write_atomic(WRITING_MARKER, _marker(self.src_id, journal))

    def commit(self, raw: bytes, journal: Journal) -> None:
        journal.remove()
        if self.local:  # what killed runs left in the work folder (temp files, unfinished
            # uploads) must not be published with it
            self.work.remove_many([r for r in self.work.list_files()
                                   if r not in self.man.files and r != WRITING_MARKER])
        elif self.work.caps.multipart:  # uploads a killed run began before its journal
            _abort_unfinished(self.work, self.man)  # knew them: billable, verify warns
        # the marker goes last: a kill before leaves nothing that looks committed and
        # names this source (a rerun adopts the data); after the manifest, a rerun
        # finds it committed and removes the marker
        commit(self.work, self.man, data=raw)
        if self.local:
            self._publish()
        else:
            self.final.remove(WRITING_MARKER)

    def ours(self) -> bool:
        """Does the work place's marker name this promote of this source?"""
        try:
            doc = json.loads(self.work.read(WRITING_MARKER))
        except (ValueError, CkptError):
            return False
        return doc.get("command") == "promote" and doc.get("source") == self.src_id

    def discard_work(self) -> None:
        import shutil

        shutil.rmtree(self.work.root, ignore_errors=False)

    def _publish(self) -> None:
        """Rename the sealed work folder into place (an empty destination folder is
        replaced), then make the rename durable."""
        final = self.final.root
        if os.path.isdir(final) and not os.listdir(final):
            os.rmdir(final)
        os.rename(self.work.root, final)
        sync_dir(os.path.dirname(final) or ".")
        self.final.remove(WRITING_MARKER)


def promote(src: str, dst: str, src_options: dict | None = None,
            dst_options: dict | None = None, *, bwlimit: str | float | None = None,
            workers: int = 4, part_size: int = DEFAULT_PART_SIZE, delete_source: bool = False,
            dry_run: bool = False, limiter: RateLimiter | None = None,
            pack: bool | None = None, base: str | None = "auto", level: int = 3,
            on_bytes: Callable[[int], None] | None = None,
            on_total: Callable[[int], None] | None = None, group=None,
            seal_source: bool | None = None, max_chain: int = 8) -> PromoteResult:
    """Copy the checkpoint at ``src`` to ``dst`` (see the module docstring).

    ``bwlimit`` (``"200MiB/s"``) or a shared ``limiter`` caps the bytes sent per second;
    ``workers`` files or parts are sent at once, parts of ``part_size`` bytes.
    Raises :class:`~ckptctl.errors.Finding` (exit 1) for an incomplete source, a source
    that no longer matches its manifest, or a destination that holds something else.

    ``pack``: True stores a plain source as a pack at ``dst`` (:func:`~.pack.pack`,
    against ``base``: ``"auto"`` is the newest committed checkpoint already beside
    ``dst``, None a full pack); False restores a pack source as a plain checkpoint
    (:func:`~.pack.unpack`); None (default) keeps the source's form, except that a
    delta pack is restored (it needs its base, which a plain place does not hold).
    A pack source with ``pack=True``: a full pack is copied as it is; a delta pack is
    copied as it is when ``base`` is ``"auto"`` and its recorded base is reachable from
    ``dst`` (committed, by id: the chain is carried), else packed again, against
    ``base`` (``"auto"``: the newest committed checkpoint beside ``dst``; None: a full
    pack, with no base at all); a chain that would grow past ``max_chain`` (a pack tier's
    ``max_chain``) gets a full pack. Packing and unpacking run through the pack writer: not
    rate-limited, and a rerun after a crash starts that checkpoint afresh.
    ``delete_source`` never removes a source that the copy still needs (a pack against
    it) or a copy that cannot be restored, nor a source that ``rm`` would keep: one
    holding a user's file, or the base of another pack (Finding, exit 1; the copy stays).

    ``seal_source``: for an unsealed source, True seals it first (a source that cannot
    take the write fails), False never writes into it, None (default) seals it when it
    takes the write and else leaves it as it is (``source_unsealed``); either way the
    destination gets the manifest sealing would write.

    ``group``: a :class:`~ckptctl.writing.distributed.Group` (``Group.from_env()`` under
    torchrun/srun): rank 0 seals the source if needed and prepares DST, data file ``i``
    (largest first) is process ``i % world_size``'s, each under ``bwlimit / world_size``;
    rank 0 then sends the format markers, checks and commits. A failure leaves DST to
    resume, as one process does. Dry runs and ``pack`` conversions are not split (the
    CLI runs a conversion on rank 0 alone).

    >>> promote("hot/step-200", "warm/step-200", dry_run=True).to_send   # doctest: +SKIP
    ['__0_0.distcp', '__1_0.distcp', '.metadata']
    """
    t0 = time.monotonic()
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if part_size < (5 << 20):
        raise UsageError("--part-size must be at least 5MiB (the S3 minimum)")
    if group is not None and group.active and not dry_run and pack is None:
        if why := _one_process(src, src_options):
            raise UsageError(f"{why}: run it without torchrun/srun", src)
        return _promote_shared(group, src, dst, src_options, dst_options, bwlimit=bwlimit,
                               workers=workers, part_size=part_size,
                               delete_source=delete_source, on_bytes=on_bytes,
                               on_total=on_total, t0=t0)
    limiter = limiter or RateLimiter(parse_rate(bwlimit))
    sstore, sfiles, man, raw, sealed, single = _source(
        src, src_options, dry_run=dry_run, workers=workers, seal_source=seal_source,
        dst=None if pack else dst)
    if delete_source and control_name(PIN_FILE, single) in sfiles:  # said before a byte moves
        raise Finding(sstore.display(single) if single else sstore.url, "source is pinned; "
                      "`ckptctl unpin` it or drop --delete-source", code="FINDING")
    from ..formats.pack import is_pack

    carried = None
    if man is not None and is_pack(sfiles):  # how a pack goes (item: no base left behind)
        mode, base, carried = _pack_route(sstore, sfiles, src, dst, dst_options, pack=pack,
                                          base=base, delete_source=delete_source)
    else:
        mode = "pack" if pack and man is not None else "copy"
    if mode != "copy":
        return _convert(src, dst, src_options, dst_options, pack=mode == "pack", base=base,
                        level=level, workers=workers, delete_source=delete_source,
                        dry_run=dry_run, sealed=sealed, man=man, raw=raw, sstore=sstore,
                        sfiles=sfiles, on_bytes=on_bytes, on_total=on_total, t0=t0,
                        max_chain=max_chain, single=single)
    if man is None:  # dry run of an unsealed source: what sealing would list
        return _dry_unsealed(sstore, sfiles, single, dst, pack, t0)
    if single:
        return _promote_single(sstore, sfiles, single, man, raw, sealed, dst, dst_options,
                               limiter=limiter, workers=workers, part_size=part_size,
                               delete_source=delete_source, dry_run=dry_run,
                               on_bytes=on_bytes, on_total=on_total, t0=t0,
                               src_options=src_options)
    return _promote_folder(sstore, sfiles, man, raw, sealed, dst, dst_options,
                           carried=carried, limiter=limiter, workers=workers,
                           part_size=part_size, delete_source=delete_source, dry_run=dry_run,
                           on_bytes=on_bytes, on_total=on_total, t0=t0,
                           src_options=src_options)


def _dry_unsealed(sstore: Store, sfiles: dict[str, int], single: str | None, dst: str,
                  pack: bool | None, t0: float) -> PromoteResult:
    """The dry run of an unsealed source: the files sealing would list, all to send."""
    from ..formats.manifest import is_temp_name

    names = [r for r in sfiles if not is_control_file(r) and not is_temp_name(r)]
    where = "/".join(single_target(dst, single)) if single and not pack else dst
    return PromoteResult(sstore.display(single) if single else sstore.url, where,
                         "dry-run", "", False, len(names),
                         sum(sfiles[r] for r in names), to_send=write_order(names, sfiles),
                         bytes_to_send=sum(sfiles[r] for r in names),
                         seconds=round(time.monotonic() - t0, 3))


def _promote_folder(sstore: Store, sfiles: dict[str, int], man: Manifest, raw: bytes,
                    sealed: bool, dst: str, dst_options: dict | None, *, carried: dict | None,
                    limiter: RateLimiter, workers: int, part_size: int, delete_source: bool,
                    dry_run: bool, on_bytes, on_total, t0: float,
                    src_options: dict | None) -> PromoteResult:
    """:func:`promote` of a checkpoint folder by copying its files (``carried``: the base
    of a delta pack copied as it is); one process."""
    d = _Destination(dst, dst_options, man, man.id)
    if _overlaps(sstore, d.final):
        raise UsageError(f"destination {d.final.url} overlaps the source {sstore.url}")
    result = PromoteResult(sstore.url, d.final.url, "promoted", man.checkpoint_id, sealed,
                           len(man.files), man.total_bytes, pack=carried,
                           source_unsealed=MANIFEST not in sfiles)
    state, present = d.state()
    if state == "committed":
        result.action = "up-to-date"
        if WRITING_MARKER in present and not dry_run:  # killed after the commit: finish it
            d.final.remove(WRITING_MARKER)
        if delete_source and not dry_run:
            result.deleted_source = _delete_source(sstore, sfiles, man, d.final, dst_options,
                                                   src_options)
        result.seconds = round(time.monotonic() - t0, 3)
        return result
    if state == "resume" and d.local and MANIFEST in present and not dry_run:
        _check_landed(d.work, man)  # killed between sealing the work folder and its rename
        d._publish()
        return _finish(result, sstore, sfiles, d, delete_source, t0, src_options)
    journal, present = _open_journal(d, state, present, man, dry_run)
    todo = _pending(result, journal, man)
    result.to_send = write_order(todo, {r: f.size for r, f in man.files.items()})
    if dry_run:
        return _dry(result, t0)
    if on_total:
        on_total(man.total_bytes)
    if WRITING_MARKER not in present:
        d.begin(journal.path)
    t = Transfer(sstore, d.work, journal=journal, algo=man.hash, limiter=limiter,
                 part_size=part_size, workers=workers, on_bytes=on_bytes)
    result.server_copy = t.server_copy
    try:
        _send_in_order(t, man, workers, result)
        _check_landed(d.work, man)
        _not_held(sstore)
        d.commit(raw, journal)
    finally:
        t.close()
        journal.close()
    result.to_send, result.bytes_to_send = [], 0
    return _finish(result, sstore, sfiles, d, delete_source, t0, src_options)


def _open_journal(d: _Destination, state: str, present: dict[str, int], man: Manifest,
                  dry_run: bool) -> tuple[Journal, dict[str, int]]:
    """(the journal of this copy, the files at the work place): what a killed run of this
    source left is adopted, another source's leftovers are discarded."""
    header = {"source": man.id}
    # a dry run reads what a killed run recorded, and writes nothing
    journal = (Journal.peek(d.journal_path(), header) if dry_run and state == "resume"
               else Journal(None if dry_run else d.journal_path(), header, durable=not d.local))
    if state == "resume" and (not d.local or d.ours()):
        _adopt_published(journal, present, man)
    elif state == "resume" and not journal.resumed and not dry_run:
        d.discard_work()  # another source's leftovers: nothing there can be trusted
        journal = Journal(d.journal_path(), {"source": man.id}, durable=not d.local)
        present = {}
    return journal, present


def _send_in_order(t: Transfer, man: Manifest, workers: int, result: PromoteResult) -> None:
    """Send every file of ``man`` not yet there, data files before the format's commit
    markers, counting into ``result``."""
    order = write_order(list(man.files), {r: f.size for r, f in man.files.items()})
    markers = [r for r in order if is_format_marker(r)]
    data = [r for r in order if r not in markers]
    for batch in (data, markers):
        for fc in copy_files(t, batch, man, workers):
            if fc.how != "skipped":
                result.files_sent += 1
                result.bytes_sent += fc.sent
            result.parts_sent += fc.parts_sent
            result.parts_resumed += fc.parts_resumed


@dataclass
class _Prepared:
    """What rank 0 of a shared promote found and set up before the others join."""

    sstore: Store
    sfiles: dict[str, int]
    man: Manifest
    raw: bytes
    sealed: bool
    d: _Destination
    state: str
    journal: Journal | None  # None when DST is done
    go: dict  # what rank 0 broadcasts: the manifest, and whether DST is done


def _promote_shared(group, src: str, dst: str, src_options, dst_options, *, bwlimit, workers,
                    part_size, delete_source, on_bytes, on_total, t0) -> PromoteResult:
    """:func:`promote` as one process of ``group`` (:mod:`~ckptctl.writing.distributed`)."""
    from ..writing.distributed import error_doc

    rate = parse_rate(bwlimit)
    limiter = RateLimiter(rate / group.world_size if rate else rate)
    r0 = group.rank == 0
    prep = _prepare_shared(group, src, dst, src_options, dst_options, workers) if r0 else None
    place = (prep.d.work if r0 else _Destination(dst, dst_options, None, None).work) \
        if group.backend == "files" else None
    go = _meet(group, prep, place)
    if r0 and go["done"]:  # committed already, or killed just before its rename
        _release_done(group, place, prep)
        return promote(src, dst, src_options, dst_options, bwlimit=bwlimit, workers=workers,
                       part_size=part_size, delete_source=delete_source)
    if r0:
        sstore, man, d, journal = prep.sstore, prep.man, prep.d, prep.journal
        result = PromoteResult(sstore.url, d.final.url, "promoted", man.checkpoint_id,
                               prep.sealed, len(man.files), man.total_bytes,
                               source_unsealed=MANIFEST not in prep.sfiles)
        if on_total:
            on_total(man.total_bytes)
    else:
        sstore, d, result = _join_shared(go, src, dst, src_options, dst_options)
        man = d.man
        if go["done"]:
            group.gather({"error": None}, place)
            result.seconds = round(time.monotonic() - t0, 3)
            return result
        journal = Journal(f"{d.journal_path()}.rank{group.rank}", {"source": man.id},
                          durable=not d.local)
        _adopt_published(journal, d.work.list_files_if_any(), man)
    sizes = {rel: f.size for rel, f in man.files.items()}
    order = write_order(list(man.files), sizes)
    markers = [rel for rel in order if is_format_marker(rel)]
    mine = group.mine([rel for rel in order if rel not in markers])
    t = Transfer(sstore, d.work, journal=journal, algo=man.hash, limiter=limiter,
                 part_size=part_size, workers=workers, on_bytes=on_bytes)
    result.server_copy = t.server_copy
    counts = {"files_sent": 0, "bytes_sent": 0, "parts_sent": 0, "parts_resumed": 0,
              "files_skipped": 0}
    own = None
    try:
        _send_counted(t, mine, man, workers, counts)
    except BaseException as e:  # noqa: BLE001 - every process must reach the gather
        own = e
    if not r0:
        return _end_share(group, place, t, journal, own, counts, result, t0)
    try:
        docs = group.gather({"error": error_doc(own) if own else None, **counts}, place)
        group.clear(place)
        _raise_failed(docs, own)
        for k in counts:
            setattr(result, k, sum(doc[k] for doc in docs))
        before = counts["files_sent"], counts["bytes_sent"]
        _send_counted(t, markers, man, workers, counts)  # after every process's data
        result.files_sent += counts["files_sent"] - before[0]
        result.bytes_sent += counts["bytes_sent"] - before[1]
        _check_landed(d.work, man)
        _not_held(sstore)
        d.commit(prep.raw, journal)
    finally:
        t.close()
        journal.close()
    return _finish(result, sstore, prep.sfiles, d, delete_source, t0, src_options)


def _prepare_shared(group, src: str, dst: str, src_options, dst_options,
                    workers: int) -> _Prepared:
    """Rank 0, before the others join: the source (sealed if need be), DST checked and,
    unless done, its journal opened and marker written; a failure reaches the others
    first where the meeting place is not DST."""
    from ..writing.distributed import error_doc

    journal = None
    try:
        sstore, sfiles, man, raw, sealed, _ = _source(src, src_options, dry_run=False,
                                                      workers=workers)
        d = _Destination(dst, dst_options, man, man.id)
        if _overlaps(sstore, d.final):
            raise UsageError(f"destination {d.final.url} overlaps the source {sstore.url}")
        state, present = d.state()
        done = state == "committed" or (state == "resume" and d.local and MANIFEST in present)
        if not done:  # as one process opens it: another source's leftovers go, marker too
            journal, present = _open_journal(d, state, present, man, dry_run=False)
            if WRITING_MARKER not in present:
                d.begin(journal.path)
        go = {"error": None, "done": done, "manifest": raw.decode()}
        return _Prepared(sstore, sfiles, man, raw, sealed, d, state, journal, go)
    except BaseException as e:
        if journal is not None:
            journal.close()
        if group.backend == "gloo":  # files: the meeting place is DST, not ours yet
            group.broadcast({"error": error_doc(e)})
        raise


def _meet(group, prep: _Prepared | None, place) -> dict:
    """Rank 0's word (``prep.go``) broadcast to every process; a rank 0 that failed stops
    the others (RankFailed)."""
    from ..writing.distributed import RankFailed

    try:
        go = group.broadcast(prep.go if prep is not None else None, place)
    except BaseException:
        if prep is not None and prep.journal is not None:
            prep.journal.close()
        raise
    if go.get("error") is not None:
        e = go["error"]
        raise RankFailed(f"rank 0 failed: {e['message']}", e["exit_code"], e["code"])
    return go


def _release_done(group, place, prep: _Prepared) -> None:
    """Rank 0, DST already done: let the others go and clear the meeting place."""
    group.gather({"error": None}, place)
    group.clear(place)
    if place is not None and prep.d.local and prep.state == "committed":
        try:  # the rendezvous made the work folder: nothing is to be published from it
            os.rmdir(prep.d.work.root)
        except OSError:
            pass


def _join_shared(go: dict, src: str, dst: str, src_options,
                 dst_options) -> tuple[Store, _Destination, PromoteResult]:
    """A process other than rank 0: (the source's store, DST, its result), from rank 0's
    manifest."""
    man = Manifest.parse(go["manifest"].encode(), src)
    sstore = locate(src, src_options)[0]
    d = _Destination(dst, dst_options, man, man.id)
    result = PromoteResult(sstore.url, d.final.url, "up-to-date" if go["done"] else
                           "promoted", man.checkpoint_id, False, len(man.files),
                           man.total_bytes)
    return sstore, d, result


def _send_counted(t: Transfer, names: list[str], man: Manifest, workers: int,
                  counts: dict[str, int]) -> None:
    """Send ``names``, counting files, bytes and parts into ``counts``."""
    for fc in copy_files(t, names, man, workers):
        if fc.how != "skipped":
            counts["files_sent"] += 1
            counts["bytes_sent"] += fc.sent
        else:
            counts["files_skipped"] += 1
        counts["parts_sent"] += fc.parts_sent
        counts["parts_resumed"] += fc.parts_resumed


def _end_share(group, place, t: Transfer, journal: Journal, own: BaseException | None,
               counts: dict[str, int], result: PromoteResult, t0: float) -> PromoteResult:
    """A process other than rank 0, its share sent or failed: report to rank 0, then
    return its own counts or raise its failure."""
    from ..writing.distributed import error_doc

    t.close()
    if own is None:
        journal.remove()  # this share is published: adoption finds it on a rerun
    else:
        journal.close()
    group.gather({"error": error_doc(own) if own else None, **counts}, place)
    if own is not None:
        raise own
    for k, v in counts.items():
        setattr(result, k, v)
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _raise_failed(docs: list[dict], own: BaseException | None) -> None:
    """Rank 0: raise the first failure the processes reported (its own as it was)."""
    from ..writing.distributed import RankFailed

    for r, doc in enumerate(docs):
        if doc["error"] is not None:
            if r == 0:
                raise own
            e = doc["error"]
            raise RankFailed(f"rank {r} failed: {e['message']} (nothing was committed, "
                             "rerun to resume)", e["exit_code"], e["code"])


def _promote_single(sstore: Store, sfiles: dict[str, int], single: str, man: Manifest,
                    raw: bytes, sealed: bool, dst: str, dst_options: dict | None, *,
                    limiter: RateLimiter, workers: int, part_size: int, delete_source: bool,
                    dry_run: bool, on_bytes, on_total, t0: float,
                    src_options: dict | None) -> PromoteResult:
    """:func:`promote` of the single-file checkpoint ``single`` (in the folder ``sstore``,
    ``sfiles`` the file and its sidecars). DST is the file, or the folder it goes into
    under its own name (:func:`~ckptctl.formats.locate.single_target`). Its writing marker
    goes first (``train.pt.ckptctl-writing``, naming this source), then the file (hashed
    while copied, published only when it matches), then its sidecar manifest (the
    source's bytes: the same id), exclusively; the marker's removal is the last write. A
    rerun adopts the file a killed run published and resumes an unfinished multipart
    upload from its journal (``~/.cache/ckptctl/promote``).

    >>> promote("hot/train.pt", "s3://b/warm/").dst              # doctest: +SKIP
    's3://b/warm/train.pt'
    """
    folder, name = single_target(dst, single)
    dstore = open_store(folder, dst_options)
    where = dstore.display(name)
    if _overlaps(sstore, dstore, single):
        raise UsageError(f"destination {where} is the source")
    result = PromoteResult(sstore.display(single), where, "promoted", man.checkpoint_id,
                           sealed, len(man.files), man.total_bytes,
                           source_unsealed=control_name(MANIFEST, single) not in sfiles)
    state, present = _single_state(dstore, name, man)
    marker = control_name(WRITING_MARKER, name)
    if state == "committed":
        result.action = "up-to-date"
        if marker in present and not dry_run:  # killed after the commit: finish it
            dstore.remove(marker)
        if delete_source and not dry_run:
            result.deleted_source = _delete_source(sstore, sfiles, man, dstore, dst_options,
                                                   src_options, single=single)
        result.seconds = round(time.monotonic() - t0, 3)
        return result
    header, path = {"source": man.id}, journal_path_for(where)
    journal = (Journal.peek(path, header) if dry_run and state == "resume"
               else Journal(None if dry_run else path, header, durable=not dstore.is_local))
    if state == "resume":
        _adopt_published(journal, present, man)
    todo = result.to_send = _pending(result, journal, man)
    if dry_run:
        return _dry(result, t0)
    if on_total:
        on_total(man.total_bytes)
    if marker not in present:
        dstore.write_atomic(marker, _marker(man.id, journal.path))
    t = Transfer(sstore, dstore, journal=journal, algo=man.hash, limiter=limiter,
                 part_size=part_size, workers=workers, on_bytes=on_bytes)
    result.server_copy = t.server_copy
    try:
        for fc in copy_files(t, todo, man, workers):
            result.files_sent += 1
            result.bytes_sent += fc.sent
            result.parts_sent += fc.parts_sent
            result.parts_resumed += fc.parts_resumed
        try:
            landed = dstore.size(name)
        except NotFoundError:
            landed = None
        if landed != man.files[name].size:
            raise Finding(where, f"did not land at the destination ({landed} bytes, not "
                          f"{man.files[name].size}); nothing was committed, rerun to resume",
                          code="SIZE_MISMATCH")
        _not_held(sstore, None, single)
        journal.remove()
        _abort_uploads(dstore, name)
        commit(dstore, man, data=raw, single=name)
        dstore.remove(marker)
    finally:
        t.close()
        journal.close()
    result.to_send, result.bytes_to_send = [], 0
    if delete_source:
        result.deleted_source = _delete_source(sstore, sfiles, man, dstore, dst_options,
                                               src_options, single=single)
    result.requests = {"source": _requests(sstore), "destination": _requests(dstore)}
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _single_state(dstore: Store, name: str, man: Manifest) -> tuple[str, dict[str, int]]:
    """(``"committed"`` | ``"resume"`` | ``"fresh"``, the file and sidecars there) of the
    destination file ``name`` in ``dstore`` for a copy of ``man``; anything else there (a
    folder of that name, another checkpoint, a file no ckptctl copy of this one left) is
    refused (Finding ``ALREADY_EXISTS``, exit 1): never overwritten."""
    where = dstore.display(name)
    if dstore.isdir(name) if dstore.is_local else dstore.list_files_if_any(name):
        raise Finding(where, "destination is a folder; remove it first or choose another "
                      "place", code="ALREADY_EXISTS")
    present = single_files(dstore, name, require_file=False)
    mname, marker = control_name(MANIFEST, name), control_name(WRITING_MARKER, name)
    if mname in present:
        other = Manifest.parse(dstore.read(mname), dstore.display(mname))
        if other.id == man.id and present.get(name) == man.files[name].size:
            return "committed", present
        raise Finding(where, f"destination holds another checkpoint ({other.id}); remove it "
                      "first (`ckptctl rm`) or choose another place", code="ALREADY_EXISTS")
    if marker in present:
        try:
            doc = json.loads(dstore.read(marker))
        except (ValueError, CkptError):
            doc = {}
        if isinstance(doc, dict) and doc.get("command") == "promote" \
                and doc.get("source") == man.id:
            return "resume", present
        raise Finding(dstore.display(marker), "another writer "
                      f"({doc.get('command', 'unknown') if isinstance(doc, dict) else 'unknown'}) "
                      "left or is writing this place; remove it first or choose another place",
                      code="ALREADY_EXISTS")
    if name in present:
        raise Finding(where, "destination exists and is no copy of this checkpoint (no "
                      "manifest beside it); remove it first or choose another place",
                      code="ALREADY_EXISTS")
    _refuse_checkpoint_folder(dstore, where)
    return "fresh", present


def _refuse_checkpoint_folder(dstore: Store, where: str) -> None:
    """A single file is never copied into a folder that is a checkpoint of its own (a
    sealed DCP folder would then hold a file its manifest does not list, and its row
    would swallow the copy): Finding ``ALREADY_EXISTS`` (exit 1). One listing of the
    folder's top.

    >>> import tempfile, pathlib; from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / ".metadata").write_bytes(b"x")
    >>> _refuse_checkpoint_folder(open_store(str(d)), "x/train.pt")
    Traceback (most recent call last):
    ckptctl.errors.Finding: x/train.pt: the destination folder is a checkpoint of its own; promote the file beside it, not into it
    """
    from ..formats.detect import group_checkpoints

    from ..errors import NotFoundError

    try:
        top = dstore.list_files(recursive=False)
    except NotFoundError:
        return  # nothing there yet
    if "" in group_checkpoints(top) or MANIFEST in top or WRITING_MARKER in top:
        raise Finding(where, "the destination folder is a checkpoint of its own; promote "
                      "the file beside it, not into it", code="ALREADY_EXISTS")


def _abort_uploads(store: Store, rel: str) -> None:
    """Abort the unfinished multipart uploads of ``rel`` a killed run began before its
    journal knew them (billable, and verify warns of them); others' are left alone."""
    if store.is_local or not store.caps.multipart:
        return
    from ..storage import multipart

    for up in multipart.list_uploads(store):
        if up.rel == rel:
            multipart.abort_upload(store, up.rel, up.upload_id)


def _pending(result: PromoteResult, journal, man: Manifest) -> list[str]:
    """The files of ``man`` the ``journal`` does not hold as sent (in manifest order),
    with the bytes left to send and the files skipped counted into ``result``."""
    todo = [rel for rel in man.files
            if journal.files.get(rel) != (man.files[rel].hash, man.files[rel].size)]
    result.bytes_to_send = sum(journal.pending_bytes(r, man.files[r].size) for r in todo)
    result.files_skipped = len(man.files) - len(todo)
    return todo


def _dry(result: PromoteResult, t0: float) -> PromoteResult:
    """``result`` as a dry run returns it: what a run would still send, nothing sent."""
    result.action = "dry-run"
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _finish(result: PromoteResult, sstore: Store, sfiles: dict[str, int], d: "_Destination",
            delete_source: bool, t0: float, src_options: dict | None = None,
            single: str | None = None) -> PromoteResult:
    if delete_source:
        result.deleted_source = _delete_source(sstore, sfiles, d.man, d.final, d.options,
                                               src_options, single=single)
    result.requests = {"source": _requests(sstore), "destination": _requests(d.work)}
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _convert(src: str, dst: str, src_options, dst_options, *, pack: bool, base, level: int,
             workers: int, delete_source: bool, dry_run: bool, sealed: bool, man: Manifest,
             raw: bytes | None, sstore: Store, sfiles: dict[str, int], on_bytes, on_total,
             t0: float, max_chain: int = 8, single: str | None = None) -> PromoteResult:
    """``promote --pack`` of a plain source, or ``--unpack`` of a pack: the pack writer
    or reader does the copy; the same rails as a plain promote around it. ``single``: the
    source is that one file (its pack is a folder); a pack of one file unpacks to a file
    (:func:`~ckptctl.formats.locate.single_target`)."""
    from ..formats.pack import is_pack, read_index
    from ..packs.pack import pack as do_pack
    from ..packs.unpack import unpack as do_unpack

    want = man.checkpoint_id  # a pack restores its source; plain: the manifest's own id
    one = None if pack else read_index(sstore, sfiles).single  # unpacks to that one file
    if one:
        folder, one = single_target(dst, one)
        final = open_store(folder, dst_options)
        present = single_files(final, one, require_file=False)
    else:
        final = open_store(dst, dst_options)
        present = None
    mname, marker = control_name(MANIFEST, one), control_name(WRITING_MARKER, one)
    where = final.display(one) if one else final.url
    if _overlaps(sstore, final, single):
        raise UsageError(f"destination {where} overlaps the source {sstore.url}")
    result = PromoteResult(sstore.display(single) if single else sstore.url, where,
                           "packed" if pack else "unpacked", want, sealed, len(man.files),
                           man.total_bytes,
                           source_unsealed=control_name(MANIFEST, single) not in sfiles)
    present = final.list_files_if_any() if present is None else present
    force = False
    if mname in present:
        there = Manifest.parse(final.read(mname), final.display(mname))
        if there.checkpoint_id == want and is_pack(present) == pack \
                and marker not in present:
            result.action = "up-to-date"
            if delete_source and not dry_run:
                result.deleted_source = _delete_source(sstore, sfiles, man, final, dst_options,
                                                       src_options, single=single)
            result.seconds = round(time.monotonic() - t0, 3)
            return result
        raise Finding(where, f"destination holds another checkpoint ({there.checkpoint_id}); "
                      "remove it first (`ckptctl rm`) or choose another place",
                      code="ALREADY_EXISTS")
    if present:
        if marker not in present:
            raise Finding(where, "destination is not empty and holds no checkpoint of "
                          "ckptctl's; remove it first or choose another place",
                          code="ALREADY_EXISTS")
        force = True  # what a killed pack or unpack left: started afresh
    auto_base = pack and base == "auto"
    listed = None
    if auto_base:
        base, listed = _newest_beside(final, dst, dst_options)
        if base is not None and delete_source and _overlaps(open_store(base, dst_options),
                                                            sstore):
            base = None  # the source itself: about to go, so no base for the copy
    result.pack = {"base": base}
    if dry_run:
        result.action = "dry-run"
        result.to_send = sorted(man.files)
        result.bytes_to_send = man.total_bytes
        result.seconds = round(time.monotonic() - t0, 3)
        return result
    if pack:
        def pack_against(base_url):
            return do_pack(src, dst, base=base_url, level=level, workers=workers, force=force,
                           max_chain=max_chain,
                           storage_options=src_options, dst_storage_options=dst_options,
                           base_storage_options=dst_options, on_bytes=on_bytes,
                           on_total=on_total,
                           source_manifest=raw if control_name(MANIFEST, single)
                           not in sfiles else None,
                           base_listing=listed if base_url is not None else None)

        try:
            r = pack_against(base)
        except CkptError as e:  # the newest pack there cannot be restored, or its tensors
            # not read in place (an Orbax pack: tensorstore reads files): no delta on it
            if not auto_base or e.code not in ("MISSING_BASE", "UNSUPPORTED_FORMAT"):
                raise
            r = pack_against(None)
            r.full_reason = f"{base} was not usable as a base ({e.message}): wrote a full pack"
            base = None
        result.bytes_sent = r.bytes_out
        result.pack = {"base": r.base, "base_url": base if r.base else None, "depth": r.depth,
                       "ratio": r.ratio, "full_reason": r.full_reason,
                       "base_read_from": r.base_read_from}
    else:
        r = do_unpack(src, dst, workers=workers, force=force, storage_options=src_options,
                      dst_storage_options=dst_options, on_bytes=on_bytes, on_total=on_total)
        result.bytes_sent = r.bytes
    result.files_sent = r.num_files
    result.num_files = r.num_files
    return _finish(result, sstore, sfiles, _Destination(dst, dst_options, man, want),
                   delete_source, t0, src_options, single=single)


def _newest_beside(final: Store, dst: str, options: dict | None) -> tuple[str | None, tuple]:
    """``--base auto``: the newest committed checkpoint in the folder that will hold
    ``dst`` (a pack or not), or None (a full pack), and that folder's listing as
    ``(store, groups)`` (a base chain's levels are found there without a listing each;
    None when there was none). One listing names the candidates
    (a manifest, no writer's marker), newest first by the step in the name, then the
    commit time; only they are read, newest first, until one is committed
    (:func:`~ckptctl.catalog.state.checkpoint_state`). ``latest`` would read every
    checkpoint there, and in a pack tier each through its base chain: a hop's cost
    would grow with the tier."""
    from ..formats.detect import group_checkpoints, step_from_name
    from ..formats.pack import is_pack
    from ..formats.locate import located_in
    from .policy import Item, newest_first
    from ..catalog.state import checkpoint_state

    parent = dst.rstrip("/").rsplit("/", 1)[0] if "/" in dst.rstrip("/") else "."
    if not final.is_local and parent.endswith(":/"):
        return None, None  # a bucket root has no parent folder to look in
    try:
        root = open_store(parent, options)
        files = root.list_files()
    except CkptError:  # nothing there yet, or not a place that lists
        return None, None
    groups = group_checkpoints(files)
    listed = (root, groups)
    items = []
    for rel, group in groups.items():
        own = {k[len(rel) + 1:] for k in group} if rel else set(group)
        url = root.display(rel)
        if not rel or MANIFEST not in own or WRITING_MARKER in own \
                or url.rstrip("/") == final.url.rstrip("/"):
            continue
        items.append(Item(rel, step_from_name(rel), root.modified(f"{rel}/{MANIFEST}"),
                          "sealed"))
    for item in newest_first(items):
        url = root.display(item.name)
        located = located_in(root, item.name, groups[item.name])
        if is_pack(located[1]):  # committed (its manifest is there); the pack writer walks
            return url, listed  # its chain, and promote falls back to a full pack if broken
        if Item(item.name, item.step, item.time,
                checkpoint_state(url, options, located=located).state).committed:
            return url, listed
    return None, listed


def _requests(store: Store) -> dict:
    """What a store was asked, as the JSON documents name it (``read_bytes`` and
    ``write_bytes`` as in ``reshard``'s ranks).

    >>> _requests(open_store("."))["reads"]
    0
    """
    st = store.stats
    return {"reads": st.reads, "read_bytes": st.bytes_read, "lists": st.lists,
            "writes": st.writes, "write_bytes": st.bytes_written, "deletes": st.deletes,
            "other": st.requests}


def copy_files(t: Transfer, names: list[str], man: Manifest, workers: int):
    """Copy ``names`` on ``workers`` threads; the first error stops the others (at their
    next part) and is raised once they stopped."""
    from ..writing.output import run_jobs

    done = run_jobs(lambda rel: t.copy(rel, man.files[rel].size, man.files[rel].hash),
                    names, workers, t.cancel, name="ckptctl-file")
    t.flush()  # small files a local destination staged: durable and under their names now
    return done


def _adopt_published(journal: Journal, present: dict[str, int], man: Manifest) -> None:
    """A destination's files (remote objects, files in the local work folder) exist under
    their own name only once their upload or rename completed, and that happens only after
    their bytes matched the manifest: a file at its manifest size under a marker naming
    this source is done, even when the journal is lost or lags (a rerun on another host, a
    kill between the publish and the journal line)."""
    for rel, rec in man.files.items():
        if present.get(rel) == rec.size and rel not in journal.files:
            journal.file_done(rel, rec.hash, rec.size)


def _check_landed(work: Store, man: Manifest) -> None:
    """One listing: every file the manifest names is at the destination, at its size."""
    landed = work.list_files()
    for rel, rec in man.files.items():
        if landed.get(rel) != rec.size:
            what = "missing" if rel not in landed else f"{landed[rel]} bytes, not {rec.size}"
            raise Finding(work.display(rel), f"did not land at the destination ({what}); "
                          "nothing was committed, rerun to resume", code="SIZE_MISMATCH")


def _delete_source(store: Store, files: dict[str, int], man: Manifest, final: Store,
                   dst_options: dict | None, src_options: dict | None = None, *,
                   single: str | None = None) -> bool:
    """``--delete-source``: remove the source (``files``: its listing, ``man``: the
    manifest the copy was made to) once the copy at ``final`` restores on its own (no
    delta pack whose base chain is missing or runs through the source) and the source
    passes the check ``rm`` makes (:func:`~.ownership.check_removable`): it holds no file
    that is not the checkpoint's and is no base of a pack beside it or elsewhere.
    Either refusal comes after the copy committed: a Finding (exit 1) that says the copy
    is there and the source was kept, and why; a rerun once the cause is gone finds the
    copy up to date and removes the source. ``single``: the source is that one file in
    ``store`` (removed with its sidecars)."""
    from ..catalog.ownership import check_removable
    from ..writing.removal import remove_checkpoint

    _restores_without(final, dst_options, store, single, man.checkpoint_id)
    try:
        check_removable(store.display(single) if single else store.url, store, files, man,
                        single=single, storage_options=src_options)
    except Finding as e:
        raise Finding(e.path, f"the copy at {final.url} is committed; kept the source: "
                      f"{e.message}", code=e.code) from None
    remove_checkpoint(store, files, single=single)
    return True


def _restores_without(final: Store, options: dict | None, source: Store,
                      single: str | None = None, source_id: str | None = None) -> None:
    """Refuse (Finding, exit 1) to let ``source`` go when the checkpoint at ``final`` is a
    delta pack that cannot be restored from there, or whose base chain uses ``source``
    (``single``: the one file ``single`` in it, whose id ``source_id`` a level of the
    chain then names: a copy elsewhere of the same id is not told apart, and kept).

    >>> import tempfile
    >>> _restores_without(open_store(tempfile.mkdtemp()), None, open_store(tempfile.mkdtemp()))
    """
    from ..formats.detect import group_checkpoints
    from ..formats.pack import ChainWalk, PackStore, is_pack, open_pack
    from ..catalog.checks import base_unrestorable

    files = final.list_files_if_any()
    if not is_pack(files):
        return
    walk = ChainWalk(persist=True)  # the levels' small files from the object cache
    ps = open_pack(final, files, storage_options=options, ahead=walk)
    parent = final.parent()
    if not final.is_local and ps.index.base and "/" in parent.root.strip("/"):
        # the chain's levels are its siblings: one listing, fresh (the walk starts at the
        # first base lookup); never of a whole bucket, as --base auto never looks there
        walk.listed = (parent, group_checkpoints(parent.list_files()))
    opened = [ps]
    try:
        while isinstance(ps, PackStore) and ps.index.base:
            why = base_unrestorable(ps, options)
            if why:
                raise Finding(final.url, f"not removing the source: the copy cannot be "
                              f"restored ({why})", code="MISSING_BASE")
            named = ps.index.base["id"]
            ps = ps._base_store()
            opened.append(ps)
            if (single is not None and named == source_id) or \
                    (single is None and _overlaps(getattr(ps, "raw", ps), source)):
                raise Finding(final.url, "not removing the source: the copy is a delta pack "
                              "made against it (promote again with --base none, or keep it)",
                              code="HAS_DEPENDANTS")
    finally:
        for store in opened:
            store.close()


def _one_process(src: str, options: dict | None) -> str | None:
    """Why a promote of ``src`` runs in one process, or None (its files can be split over
    torchrun/srun's): a delta pack is restored on its way to a plain place; a single-file
    checkpoint is one file. One listing, one small read."""
    from ..formats.pack import is_pack, read_index

    store, files, single = locate(src, options)
    if single:
        return "a single-file checkpoint is one file, sent by one process"
    if is_pack(files) and read_index(store, files).base is not None:
        return ("a delta pack is restored (unpacked) on its way to a plain place, which "
                "runs in one process")
    return None


def _pack_route(sstore: Store, sfiles: dict[str, int], src: str, dst: str,
                dst_options: dict | None, *, pack: bool | None, base: str | None,
                delete_source: bool) -> tuple[str, str | None, dict | None]:
    """How the pack at ``sstore`` goes to ``dst``: ``("copy", base, carried)`` copies it
    as it is (``carried``: the base a delta pack keeps, found from ``dst``),
    ``("unpack", ...)`` restores it, ``("pack", base, None)`` packs its checkpoint again
    against ``base`` (``"auto"``, a URL, None: full). A delta pack is copied only where
    its base is reachable; to a plain place (``pack`` None or False) it is restored."""
    from ..formats.pack import read_index

    if pack is False:
        return "unpack", base, None
    index = read_index(sstore, sfiles)
    if index.base is None:  # a full pack stands alone
        return ("pack", base, None) if pack and base not in ("auto", None) \
            else ("copy", base, None)
    if not pack:
        return "unpack", base, None
    if base == "auto":
        found = _base_from(dst, dst_options, index)
        if found is not None and not (delete_source and _overlaps(
                open_store(found, dst_options), sstore)):
            return "copy", base, {"base": index.base["id"], "base_url": found,
                                  "depth": index.depth, "carried": True}
    return "pack", base, None


def _base_from(dst: str, options: dict | None, index) -> str | None:
    """The URL of the base the delta pack ``index`` records, as seen from ``dst``, when it
    is there, is that checkpoint (by id) and is restorable; else None."""
    from ..formats.pack import base_resolver, join_url
    from ..catalog.state import COMPLETE, SEALED, checkpoint_state

    if not index.base.get("url"):
        return None
    url = join_url(dst.rstrip("/"), index.base["url"])
    try:
        bstore = base_resolver(dst.rstrip("/"), index, None, options)()
    except StorageError:
        raise
    except CkptError:
        return None
    try:
        if checkpoint_state(bstore.url, options).state not in (SEALED, COMPLETE):
            return None
    finally:
        bstore.close()
    return url


def _overlaps(a: Store, b: Store, single: str | None = None) -> bool:
    """Do the folders of stores ``a`` and ``b`` overlap (one is, or holds, the other)?
    ``single``: ``a`` is the one file ``single`` in that folder, which overlaps ``b``
    only as ``b`` itself or a folder holding it.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); a, b = open_store(d), open_store(d + "/x")
    >>> _overlaps(a, b), _overlaps(a, b, "a.pt"), _overlaps(a, a, "a.pt")
    (True, False, True)
    """
    if a.protocol != b.protocol or a.is_local != b.is_local:
        return False
    ra, rb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    if a.is_local:
        ra, rb = os.path.realpath(a.root) + "/", os.path.realpath(b.root) + "/"
    if not a.is_local and not a.same_server(b):
        return False
    if single is not None:
        return (ra + single + "/").startswith(rb)
    return ra.startswith(rb) or rb.startswith(ra)
