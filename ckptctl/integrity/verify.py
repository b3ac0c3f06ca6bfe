"""``verify``: integrity checks for CI gates, at three levels, each including the one before.

* ``quick``: commit state (manifest, or the format's own marker), every file present at
  its recorded size, stray temp files and orphaned multipart uploads;
* ``structure``: metadata parses; chunks tile each tensor exactly; every byte extent lies
  inside its file; dtype x elements = bytes; DCP chunk zips are well-formed; HF index and
  files agree; state closure against ``require``;
* ``full``: each data file read once: its content hash against the manifest, or, unsealed,
  the CRC-32 of every zip record (DCP chunks, torch.save files; ``content`` says which was
  proven, ``decoded-only`` where the format carries no checksum); NaN/Inf counts from the
  same bytes (``check_finite``); a deterministic sample of files (``sample``).

Problem codes are stable (see :data:`PROBLEM_CODES`); ``ok`` is False on any problem.
Another framework's layout is refused by name (exit 3), a run's root given as one
checkpoint is a usage error (exit 2); :func:`verify_all` verifies each checkpoint under it.

>>> r = verify("ckpt/", level="quick")                      # doctest: +SKIP
>>> r.ok, [p.code for p in r.problems]                      # doctest: +SKIP
(False, ['MISSING_FILE'])
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from .._deps import MissingDependencyError
from ..errors import (CkptError, FormatError, NotFoundError, ProblemCode, StorageError,
                      UnsupportedFormatError, UsageError)
from ..formats import dcp
from ..formats.detect import locate, open_checkpoint, resolve_step
from ..formats.locate import refuse_save_folder
from ..formats.megatron import INTEGRITY
from ..formats.manifest import (MANIFEST, WRITING_MARKER, control_name, is_control_file,
                                is_temp_name, read_manifest, writer_unfinished)
from ..model import Checkpoint, TensorEntry
from ..storage import normalize_algo, open_store
from ..catalog.closure import classify, parse_parts
from ..catalog.vocabulary import counted_files

LEVELS = ("quick", "structure", "full")
#: Object entries up to this size are scanned for globals the safe loader refuses.
OBJECT_SCAN_LIMIT = 64 << 20

#: Every problem code verify reports, with what it means (compatibility view of
#: :class:`~ckptctl.errors.ProblemCode`, the whole vocabulary).
PROBLEM_CODES: dict[str, str] = {c.value: c.doc for c in ProblemCode if c.verify}


#: Bytes the structure check reads per DCP chunk when it reads only the zip's tail and head;
#: a file no larger than that times its chunks is read whole, in one request.
STRUCTURE_READ_PER_CHUNK = 16 << 10


@dataclass
class Problem:
    code: str
    severity: str  # "error" or "warning"
    path: str | None
    entry: str | None
    message: str


@dataclass
class VerifyResult:
    """What verify found and what it read. ``ok`` is the verdict the exit status carries
    (:meth:`judge`): no problem of severity ``error``, and with ``strict`` no warning
    either (EXTRA_FILE, STRAY_TEMP, ORPHANED_UPLOAD: a README beside a checkpoint does not
    fail a CI gate unless it asks). Counts are ``num_*`` as in every verb (README, "JSON
    vocabulary"); ``files_checked``, ``files_read`` and ``tensors_checked`` are the older
    names of three of them, still read and set.

    >>> r = VerifyResult(True, "quick", "ck", "dcp", True,
    ...                  problems=[Problem("EXTRA_FILE", "warning", "ck/NOTES.md", None, "x")])
    >>> r.judge().ok, r.judge(strict=True).ok, r.num_warnings, r.num_errors
    (True, False, 1, 0)
    """

    ok: bool
    level: str
    url: str
    format: str | None
    sealed: bool
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    #: the checkpoint's files, as every verb counts them (ops/vocabulary.counted_files)
    num_files: int = 0
    bytes_read: int = 0
    num_tensors_checked: int = 0
    seconds: float = 0.0
    hash: str | None = None
    non_finite: dict[str, dict] = field(default_factory=dict)
    #: what the full level proved about the bytes: "hashes" (manifest), "integrity.json"
    #: (Megatron's SHA-256 manifest), "crc" (every zip record's CRC-32), "decoded-only" (no
    #: checksum in the format), or "crc+decoded-only"
    content: str | None = None
    #: files whose content the full level read (``--sample``: its share)
    num_files_read: int = 0
    #: warnings fail too (``verify --strict``)
    strict: bool = False

    @property
    def num_errors(self) -> int:
        return sum(p.severity == "error" for p in self.problems)

    @property
    def num_warnings(self) -> int:
        return sum(p.severity != "error" for p in self.problems)

    def judge(self, strict: bool | None = None) -> "VerifyResult":
        """Set ``ok`` from the problems (and ``strict``, when given); returns self."""
        if strict is not None:
            self.strict = strict
        self.ok = not self.num_errors and not (self.strict and self.num_warnings)
        return self

    files_checked = property(lambda self: self.num_files,
                             lambda self, n: setattr(self, "num_files", n))
    files_read = property(lambda self: self.num_files_read,
                          lambda self, n: setattr(self, "num_files_read", n))
    tensors_checked = property(lambda self: self.num_tensors_checked,
                               lambda self, n: setattr(self, "num_tensors_checked", n))

    def to_dict(self) -> dict:
        """The ``--json`` document, with ``num_errors`` and ``num_warnings``."""
        doc = asdict(self)
        doc.update(num_errors=self.num_errors, num_warnings=self.num_warnings)
        return doc


#: The ckptctl writers a writing marker can name (its ``command``'s first word) whose fix
#: is not a rerun with --force: (how to name it, what to say). A promote resumes; a
#: removal is finished by rm; a pack's re-root by the gc (or watch) of its tier. The
#: others (reshard, consolidate, pack, unpack) start over, and only with --force, which
#: replaces nothing but such an unfinished write.
_RESUME = {
    "promote": ("a promote", "did not finish: rerun the same promote to resume it (it "
                "sends only what is missing; removing the folder would discard what it "
                "sent)"),
    "rm": ("a `ckptctl rm`", "did not finish removing it: rerun the rm to finish"),
    "gc": ("a `ckptctl gc`", "did not finish removing it: `ckptctl rm` it to finish"),
    "reroot": ("a re-root of this pack (gc of a pack tier)", "did not finish: rerun the gc "
               "(or watch) of its tier, which finishes it"),
}
#: A marker's size past which it is not read (a writer's is a hundred bytes or so).
_MARKER_MAX = 64 << 10


def unfinished_writer(store, files: dict[str, int], single: str | None = None) -> str:
    """What verify says of a folder that a ckptctl writer holds (``.ckptctl-writing``):
    which command wrote it, by whom and since when, as its marker says (one small read),
    whether that writer still runs (this host only), and the fix that keeps the work done
    (:data:`_RESUME`): a promote resumes, a reshard or consolidate starts over with
    --force. ``single``: the marker of that one file (``train.pt.ckptctl-writing``).

    >>> import json, tempfile
    >>> from ckptctl.storage import open_store
    >>> st = open_store(tempfile.mkdtemp())
    >>> st.write_atomic(".ckptctl-writing", json.dumps({"command": "promote", "pid": 1,
    ...     "host": "node7", "started": "2026-01-01T00:00:00Z"}).encode())
    >>> print(unfinished_writer(st, st.list_files()))
    a promote (pid 1 on node7, started 2026-01-01T00:00:00Z) did not finish: rerun the same \
promote to resume it (it sends only what is missing; removing the folder would discard what it sent)
    >>> st.write_atomic(".ckptctl-writing", json.dumps({"command": "reshard"}).encode())
    >>> print(unfinished_writer(st, st.list_files()))
    a `ckptctl reshard` did not finish: rerun with --force to start it over (it does not \
resume; --force replaces only such an unfinished write)
    >>> st.write_atomic(".ckptctl-writing", b"{}")
    >>> print(unfinished_writer(st, st.list_files()))
    a ckptctl writer did not finish: rerun with --force the command that wrote it, to start \
it over (a promote: rerun it as it was, it resumes)
    """
    doc = _marker_doc(store, files, single)
    command = doc.get("command") if isinstance(doc.get("command"), str) else None
    verb = command.split()[0] if command and command.split() else None
    pid = f"pid {doc['pid']}" + (f" on {doc['host']}" if doc.get("host") else "") \
        if doc.get("pid") else ""
    who = ", ".join(x for x in (pid, f"started {doc['started']}" if doc.get("started")
                                else "") if x)
    what = (_RESUME[verb][0] if verb in _RESUME else f"a `ckptctl {command}`" if verb
            else "a ckptctl writer") + (f" ({who})" if who else "")
    if _still_running(store, doc, single):
        return f"{what} is still at work on it: wait for it to finish"
    if verb in _RESUME:
        return f"{what} {_RESUME[verb][1]}"
    if verb:
        return (f"{what} did not finish: rerun with --force to start it over (it does not "
                "resume; --force replaces only such an unfinished write)")
    return (f"{what} did not finish: rerun with --force the command that wrote it, to start "
            "it over (a promote: rerun it as it was, it resumes)")


def _marker_doc(store, files: dict[str, int], single: str | None = None) -> dict:
    """The writing marker's JSON (``{}`` when it is too large, unreadable or not a JSON
    object: a torn write says nothing); an I/O failure raises (exit 3)."""
    import json

    name = control_name(WRITING_MARKER, single)
    if files.get(name, 0) > _MARKER_MAX:
        return {}
    try:
        doc = json.loads(store.read(name))
    except StorageError:
        raise
    except (CkptError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _still_running(store, doc: dict, single: str | None = None) -> bool:
    """Does the marker name a ckptctl process that still runs on this host (not this
    one: a writer that failed in this process has stopped)?"""
    import os
    import socket

    from ..writing.output import live_writer

    if doc.get("host") != socket.gethostname() or doc.get("pid") == os.getpid():
        return False  # another host's cannot be checked from here; this process verifies
    return live_writer(store, single) is not None


def base_unrestorable(ps, storage_options: dict | None = None,
                      bases: dict | None = None) -> str | None:
    """Why the delta pack ``ps`` (a :class:`~ckptctl.formats.pack.PackStore`) cannot be
    restored from here, or None when its base chain is all there and committed (or it
    has no base). I/O failures raise (exit 3): they say nothing about the pack.
    ``bases``: answers already found in this call (base URL and id -> answer).

    >>> base_unrestorable(open_pack_url("cold/step-80"))       # doctest: +SKIP
    'its base xxh3-128:9f.. (cold/step-60) is incomplete: NOT_COMMITTED: ...'
    """
    from ..formats.pack import join_url

    base = ps.index.base
    if not base or not ps.index.needs_base:  # no chunk decodes against it
        return None
    where = join_url(ps.url, base["url"]) if base.get("url") else "no recorded place"
    try:
        bstore = ps._base_store()
    except StorageError:
        raise
    except CkptError as e:
        return f"its base {base['id']} ({where}) cannot be used: {e.message}"
    from ..formats.pack import PackStore

    key = (bstore.url, base["id"])
    if bases is not None and key in bases:
        return bases[key]
    if isinstance(bstore, PackStore):
        # the resolver checked it is there, not held by a writer, sealed, the right id and
        # shallower, and opening it checked its files against its manifest: what is left
        # is its own base, one level down (a listing and two small reads a level)
        why = base_unrestorable(bstore, storage_options, bases)
    else:  # the root of the chain: committed and whole, as verify's quick level says
        errors = [p for p in verify(bstore.url, storage_options, level="quick",
                                    uploads=False).problems if p.severity == "error"]
        why = None
        if errors:  # what ls would call it (catalog/state.py): not committed
            p = errors[0]
            why = (f"its base {base['id']} ({bstore.url}) is not committed: {p.code}: "
                   f"{p.path + ': ' if p.path else ''}{p.message}")
    if bases is not None:
        bases[key] = why
    return why


class _Checker:
    def __init__(self, url, storage_options, level, require, check_finite, sample, workers,
                 on_bytes, located=None, checkpoint=None, uploads=True, on_total=None,
                 group=None):
        self.group = group  # ops.distributed.Group: this process reads its share (full level)
        self.url, self.opts, self.level = url, storage_options, level
        self.located, self.opened, self.uploads = located, checkpoint, uploads
        self.require = parse_parts(require) if isinstance(require, str) else list(require or [])
        self.check_finite, self.sample, self.workers = check_finite, sample, workers
        self.on_bytes, self.on_total = on_bytes, on_total
        self.problems: list[Problem] = []
        self.ck: Checkpoint | None = None
        self.result = VerifyResult(False, level, url, None, False)
        #: sealing (:func:`check_and_hash`): the files to hash with ``seal_algo`` in the
        #: full pass that checks them, and the (digest, size) of each, filled by it
        self.seal_algo: str | None = None
        self.seal_names: list[str] = []
        self.digests: dict[str, tuple[str, int]] = {}

    def add(self, code, message, *, path=None, entry=None, severity="error"):
        self.problems.append(Problem(code, severity, path, entry, message))

    def add_error(self, e: CkptError):
        self.add(e.code if e.code in PROBLEM_CODES else "MALFORMED_METADATA", e.message,
                 path=e.path)

    # ------------------------------------------------------------ quick
    def quick(self):
        from ..formats.pack import pack_view  # ls hands over a pack folder's own listing

        try:
            located = pack_view(self.located or locate(self.url, self.opts), self.opts)
        except NotFoundError:
            if self._promote_underway():
                return
            raise
        refuse_save_folder(located, self.url, "verify")
        store, files, single = located
        self.store, self.files = store, files
        self.manifest_name = control_name(MANIFEST, single)  # a single file's: its sidecar
        from ..catalog.ownership import is_control_temp

        for rel in files:
            if is_temp_name(rel) and not is_control_temp(rel):  # a marker never published
                self.add("STRAY_TEMP", "leftover temporary file", path=store.display(rel),
                         severity="warning")
        if self.uploads:
            self._orphaned_uploads(store)
        self._links_inside(store, files)
        if writer_unfinished(files, single):  # killed, or still writing: nothing to check
            from ..formats.detect import detect_format
            from ..formats.locate import file_format

            self.add("NOT_COMMITTED", unfinished_writer(store, files, single),
                     path=store.display(control_name(WRITING_MARKER, single)))
            self.result.format = file_format(single) if single else detect_format(files)
            self.manifest = None
            return
        try:  # a single file's is the sidecar beside it (train.pt.ckptctl.manifest.json)
            self.manifest = read_manifest(store, files, single)
        except StorageError:
            raise  # I/O: exit 3, not a finding about the checkpoint
        except CkptError as e:
            self.manifest = None
            self.add_error(e)
        self.result.sealed = self.manifest is not None
        if self.manifest is not None:
            mfiles = self.manifest.files
            for rel, rec in mfiles.items():
                if rel not in files:
                    self.add("MISSING_FILE", "listed in the manifest but missing",
                             path=store.display(rel))
                elif files[rel] != rec.size:
                    self.add("SIZE_MISMATCH", f"{files[rel]} bytes, manifest says {rec.size}",
                             path=store.display(rel))
            for rel in files:
                if rel not in mfiles and not is_control_file(rel) and not is_temp_name(rel):
                    self.add("EXTRA_FILE", "not listed in the manifest", path=store.display(rel),
                             severity="warning")
        if single:  # its sidecars are no content: the files checked and read are the one
            self.files = {rel: n for rel, n in files.items() if not is_control_file(rel)}
        try:
            # torch_free: a torch.save zip is checked from its records and their CRCs
            # (formats/torchfile.read_torch_zip), no import of torch
            self.ck = self.opened or open_checkpoint(self.url, self.opts, strict=False,
                                                     read_step=False, located=located,
                                                     torch_free=True)
            self.result.format = self.ck.format
            self.result.step = self.ck.step
        except (StorageError, MissingDependencyError, UsageError):
            raise  # exit 3 (2 for a run folder), not a finding about the checkpoint
        except UnsupportedFormatError as e:
            if getattr(e, "framework", None) or not any(p.severity == "error"
                                                        for p in self.problems):
                raise  # another framework's layout, or nothing ckptctl reads: exit 3
            self.add_error(e)  # a sealed checkpoint whose data files went missing
            return
        except CkptError as e:
            self.add_error(e)
            return
        if self.ck.format == "dcp":
            for rel in sorted(dcp.referenced_files(self.ck)):
                if rel not in files and not (self.manifest and rel in self.manifest.files):
                    self.add("MISSING_FILE", "referenced by .metadata but missing",
                             path=store.display(rel))
        self._extents_inside_files()
        self._base_chain()
        self._step_entry()

    def _promote_underway(self) -> bool:
        """A local destination that is not there, beside the work folder of a promote
        into it (``.NAME.ckptctl-promote``: a local promote publishes by renaming it, so
        one killed leaves only that): NOT_COMMITTED, saying to rerun the promote, which
        resumes from it. False when there is no such folder (the place is just absent)."""
        import os

        from ..formats.manifest import PROMOTE_WORK_SUFFIX as WORK_SUFFIX

        if "://" in self.url and not self.url.startswith("file://"):
            return False
        parent, name = os.path.split(self.url.removeprefix("file://").rstrip("/"))
        work = os.path.join(parent, f".{name}{WORK_SUFFIX}")
        if not name or not os.path.isdir(work):
            return False
        store = open_store(work)
        files = store.list_files_if_any()
        if WRITING_MARKER in files:
            why = unfinished_writer(store, files)
        else:  # killed before its marker: the folder is a promote's all the same
            why = " ".join(_RESUME["promote"])
        self.add("NOT_COMMITTED", f"nothing committed here yet: {why}",
                 path=store.display(WRITING_MARKER) if WRITING_MARKER in files else work)
        return True

    def _base_chain(self):
        """A delta pack is restorable only while its base chain is: MISSING_BASE names
        the first base that is not there, not committed, or not the one it was made
        against (one listing and manifest read per base, no tensor data)."""
        from ..formats.pack import PackStore

        reason = base_unrestorable(self.store, self.opts, getattr(self, "bases", None)) \
            if isinstance(self.store, PackStore) else None
        if reason:
            self.add("MISSING_BASE", reason, path=self.store.display(MANIFEST))

    def _step_entry(self):
        """The step as ``inspect`` reports it: a step entry wins over the name (for DCP one
        small read), once the files it lives in are known to be there."""
        ck = self.ck
        if ck.info.get("step_entry_read") or ck.info.get("step_source") == "manifest" \
                or any(p.severity == "error" for p in self.problems):
            return
        try:
            resolve_step(ck, self.url)
        except (StorageError, MissingDependencyError):
            raise
        except CkptError:  # an unreadable entry: the structure level reports it
            return
        self.result.step = ck.step

    def _links_inside(self, store, files):
        """A file that is a link leaving the root is PATH_ESCAPE at every level."""
        if not store.is_local:
            return
        for rel in files:
            try:
                store.full(rel)
            except CkptError as e:
                if e.code != "PATH_ESCAPE":
                    raise
                self.add("PATH_ESCAPE", e.message, path=store.display(rel))

    def _orphaned_uploads(self, store):
        if not store.is_s3:
            return
        from ..storage.multipart import list_uploads

        try:
            uploads = list_uploads(store)
        except CkptError:  # servers without the call: nothing to report
            return
        for up in uploads:
            self.add("ORPHANED_UPLOAD", f"unfinished multipart upload {up.upload_id[:16]}",
                     path=store.display(up.rel), severity="warning")

    def _extents_inside_files(self):
        ck = self.ck
        for t in ck.tensors.values():
            for c in t.chunks:
                self._extent_ok(c.extent, t.name)
        for o in ck.objects.values():
            if o.extent is not None:
                self._extent_ok(o.extent, o.name)

    def _extent_ok(self, ext, name):
        size = self.files.get(ext.file)
        if size is None or ext.encoding == "torch_save":
            return
        if ext.offset + ext.length > size:
            self.add("SIZE_MISMATCH" if ext.offset < size else "OUT_OF_BOUNDS",
                     f"bytes {ext.offset}..{ext.offset + ext.length} lie past the end of the "
                     f"file ({size} bytes)", path=self.store.display(ext.file), entry=name)

    # ------------------------------------------------------------ structure
    def structure(self):
        ck = self.ck
        for t in ck.tensors.values():
            self._tiling(t)
        if ck.format == "dcp":
            self._dcp_zips()
        if self.require:
            present = {classify(n) for n in list(ck.tensors) + list(ck.objects)}
            for part in self.require:
                if part not in present:
                    self.add("MISSING_STATE", f"required state {part!r} is absent")
        if self.manifest is not None:
            fmt = self.manifest.format
            if fmt and fmt != ck.format:
                self.add("MANIFEST_MISMATCH", f"manifest says format {fmt}, files are {ck.format}",
                         path=self.store.display(self.manifest_name))
            from ..formats.manifest import logical_digest

            want = self.manifest.summary.get("logical_digest")
            if want and want != logical_digest(ck):
                self.add("MANIFEST_MISMATCH", "the metadata describes other tensors than when "
                         "sealed", path=self.store.display(self.manifest_name))

    def _tiling(self, t: TensorEntry):
        """Chunks must tile the tensor: in bounds, no gap, no overlap.

        Cut the tensor into the grid that all chunk edges define; each grid cell must be
        covered exactly once. DTensor layouts make that grid the mesh, so it stays small.
        """
        import numpy as np

        nd = len(t.shape)
        n = len(t.chunks)
        offs = np.array([c.offsets for c in t.chunks], dtype=np.int64).reshape(n, nd)
        ends = offs + np.array([c.sizes for c in t.chunks], dtype=np.int64).reshape(n, nd)
        outside = (ends > np.array(t.shape, dtype=np.int64)).any(axis=1)
        if outside.any():
            c = t.chunks[int(outside.argmax())]
            self.add("OUT_OF_BOUNDS", f"chunk at {list(c.offsets)} size {list(c.sizes)} "
                     f"lies outside the tensor's shape {list(t.shape)}", entry=t.name)
            return
        if t.numel == 0:
            return
        if not t.chunks:
            self.add("CHUNK_GAP", "tensor has no chunks", entry=t.name)
            return
        if nd == 0:
            if len(t.chunks) > 1:
                self.add("CHUNK_OVERLAP", "scalar stored more than once", entry=t.name)
            return
        live = (ends > offs).all(axis=1)  # empty chunks cover nothing
        lo, hi = offs[live], ends[live]
        cuts = [np.unique(np.concatenate(([0, d], lo[:, i], hi[:, i])))
                for i, d in enumerate(t.shape)]
        ncells = math.prod(len(x) - 1 for x in cuts)
        if ncells > 4_000_000:
            total = sum(c.numel for c in t.chunks)
            if total != t.numel:
                self.add("CHUNK_GAP" if total < t.numel else "CHUNK_OVERLAP",
                         f"chunks hold {total} elements of {t.numel}", entry=t.name)
            return
        first = [np.searchsorted(cuts[i], lo[:, i]) for i in range(nd)]
        last = [np.searchsorted(cuts[i], hi[:, i]) for i in range(nd)]
        cover = np.zeros([len(x) - 1 for x in cuts], dtype=np.int32)
        if all((b - a == 1).all() for a, b in zip(first, last)):
            np.add.at(cover, tuple(first), 1)  # each chunk is one cell: a mesh layout
        else:
            for k in range(len(lo)):
                cover[tuple(slice(first[i][k], last[i][k]) for i in range(nd))] += 1
        if (cover > 1).any():
            self.add("CHUNK_OVERLAP", "chunks cover part of the tensor more than once",
                     entry=t.name)
        if (cover == 0).any():
            self.add("CHUNK_GAP", "part of the tensor is covered by no chunk", entry=t.name)

    def _dcp_zips(self):
        """Each chunk's zip holds the one tensor the metadata describes (dtype, sizes, a
        storage of the record's length that its view stays inside); zstd chunks have their
        head decompressed for that. Object entries hold nothing the safe loader refuses."""
        from ..formats.tensorio import open_zstd_chunk, check_stored, locate_payload

        ck = self.ck
        by_file: dict[str, list] = {}  # file -> [(index, tensor, chunk)]: one job per file
        for i, (t, c) in enumerate((t, c) for t in ck.tensors.values() for c in t.chunks
                                   if c.extent.encoding in ("torch_zip", "torch_zip+zstd")
                                   and self._inside(c.extent)):
            by_file.setdefault(c.extent.file, []).append((i, t, c))
        pickles: dict = {}  # data.pkl bytes -> parsed: the chunks of a tensor share them
        keep = self.level == "full"  # the full pass reads each payload where these say

        def one_file(rel):
            chunks = by_file[rel]
            read = None
            # A file of many small chunks (thousands of ranks) is read once, whole; that is
            # no more bytes than a tail and a head per chunk. Large chunks: only those reads.
            if self.files[rel] <= min(len(chunks) * STRUCTURE_READ_PER_CHUNK, 64 << 20):
                blob = self.store.read_range(rel, 0, self.files[rel])
                read = lambda _rel, a, b: blob[a:b]  # noqa: E731
            return [(i, r) for i, t, c in chunks if (r := one(t, c, read)) is not None]

        def one(t, c, read):
            where = self.store.display(c.extent.file)
            try:
                if c.extent.encoding == "torch_zip":
                    p = locate_payload(ck, c.extent, read=read, cache=keep, pickles=pickles)
                    check_stored(t, c, p.stored, p.length, where)
                else:
                    open_zstd_chunk(ck, t, c, read_size=64 << 10).close()
            except StorageError:
                raise
            except CkptError as e:
                code = e.code if e.code in ("DTYPE_SIZE_MISMATCH", "OUT_OF_BOUNDS",
                                            "UNSAFE_INPUT") else "MALFORMED_CHUNK"
                return (code, e.message, c.extent.file, t.name)
            return None

        objs = [o for o in ck.objects.values() if o.extent is not None
                and o.extent.encoding in ("torch_zip", "torch_zip+zstd") and self._inside(o.extent)]

        def obj(o):
            from ..formats.tensorio import scan_object

            if o.extent.length > OBJECT_SCAN_LIMIT:
                return None
            try:
                scan_object(ck, o, expect=OBJECT_SCAN_LIMIT)
            except StorageError:
                raise
            except CkptError as e:
                code = "UNSAFE_INPUT" if e.code == "UNSAFE_INPUT" else "MALFORMED_CHUNK"
                return (code, e.message, o.extent.file, o.name)
            return None

        with ThreadPoolExecutor(self.workers) as pool:
            found = sorted(hit for hits in pool.map(one_file, by_file) for hit in hits)
            for res in [r for _, r in found] + list(pool.map(obj, objs)):
                if res:
                    code, msg, rel, name = res
                    self.add(code, msg, path=self.store.display(rel), entry=name)

    def _inside(self, ext) -> bool:
        size = self.files.get(ext.file)
        return size is not None and ext.offset + ext.length <= size

    # ------------------------------------------------------------ full
    def _sampled(self, names: list[str]) -> list[str]:
        if self.sample is None or self.sample >= 1:
            return names
        import xxhash

        key = lambda n: xxhash.xxh64_intdigest(n.encode())  # noqa: E731 - deterministic order
        ranked = sorted(names, key=key)
        return sorted(ranked[:max(1, math.ceil(len(ranked) * self.sample))])

    def _data_files(self) -> list[str]:
        """The files whose content a full verify reads (the manifest's, when sealed)."""
        if self.manifest is not None:
            m = self.manifest.files
            return [rel for rel in sorted(m) if rel in self.files and self.files[rel] == m[rel].size]
        ck = self.ck
        used = {c.extent.file for t in ck.tensors.values() for c in t.chunks}
        used |= {o.extent.file for o in ck.objects.values() if o.extent is not None}
        bad = {p.path for p in self.problems if p.code in ("MISSING_FILE", "SIZE_MISMATCH")}
        return sorted(rel for rel in used if rel in self.files
                      and self.store.display(rel) not in bad)

    def _integrity(self) -> dict[str, str] | None:
        """Megatron's ``integrity.json`` of a ``torch_dist`` checkpoint (``{"algorithm":
        "sha256", "files": {name: hex digest}}``) as name -> digest, or None when there is
        none; a file that says anything else is a finding."""
        from ..formats.limits import load_json

        if not self.ck.info.get("megatron") or INTEGRITY not in self.files:
            return None
        where = self.store.display(INTEGRITY)
        try:
            if self.files[INTEGRITY] > 64 << 20:
                raise FormatError(where, f"{self.files[INTEGRITY]} bytes: no integrity manifest")
            doc = load_json(self.store.read(INTEGRITY), where)
            listed = doc.get("files") if isinstance(doc, dict) else None
            if not isinstance(listed, dict) or doc.get("algorithm", "sha256") != "sha256" or \
                    not all(isinstance(k, str) and "/" not in k and isinstance(v, str)
                            for k, v in listed.items()):
                raise FormatError(where, "not Megatron's integrity manifest ({'algorithm': "
                                  "'sha256', 'files': {name: digest}})")
        except FormatError as e:
            self.add("MALFORMED_METADATA", e.message, path=where)
            return None
        return {k: v.lower() for k, v in listed.items()}

    def full(self):
        """Read every data file once: content hash (sealed) or the CRC-32 of every zip record
        (unsealed DCP and torch.save), NaN/Inf counts on the same bytes; what a format
        cannot carry in a checksum is reported as decoded only."""
        from ..formats.tensorio import locate_payload
        from ..storage import new_hasher
        from .scan import Finite, ZipCrc, scan_file

        ck, store = self.ck, self.store
        sealing = self.seal_algo is not None  # the files to seal, checked as unsealed ones
        sealed = self.manifest is not None and not sealing
        algo = normalize_algo(self.manifest.hash) if sealed else None
        self.result.hash = algo
        # Megatron's own SHA-256 manifest: checked when there is no ckptctl one
        integrity = None if sealed else self._integrity()
        if sealing:
            files = list(self.seal_names)
        else:
            files = self._data_files() if integrity is None else \
                sorted(set(self._data_files()) | {rel for rel in integrity if rel in self.files})
            files = self._sampled(files)
        if self.group is not None and self.group.active:  # file i: process i % world size
            files = self.group.mine(files)
        chosen = set(files)
        regions: dict[str, list] = {rel: [] for rel in files}
        side: list = []  # (kind, entry, chunk): decoded apart from the file scan
        crc_files: set[str] = set()
        tensors_seen: set[str] = set()

        for t in ck.tensors.values():
            for c in t.chunks:
                ext = c.extent
                if ext.file not in chosen:
                    continue
                tensors_seen.add(t.name)
                if ext.encoding == "torch_zip+zstd":
                    if not sealed or self.check_finite:
                        side.append(("zstd", t, c))
                    if not sealed:
                        crc_files.add(ext.file)
                    continue
                if ext.encoding == "torch_save":
                    if self.check_finite:
                        side.append(("torch", t, c))
                    continue
                if ext.encoding == "torch_zip":
                    p = _or_none(locate_payload, ck, ext)
                    if p is None:
                        continue
                    if not sealed:
                        regions[ext.file].append(
                            (ZipCrc(ext.offset, ext.offset + ext.length, list(p.entries),
                                    store.display(ext.file)), t.name))
                        crc_files.add(ext.file)
                    if self.check_finite and t.dtype.is_floating and t.dtype.bits % 8 == 0:
                        if p.stored.storage_numel == p.stored.numel:  # a permutation: same counts
                            regions[ext.file].append(
                                (Finite(p.offset, p.offset + p.length, t.dtype, t.name), t.name))
                        else:
                            side.append(("chunk", t, c))
                elif self.check_finite and t.dtype.is_floating and t.dtype.bits % 8 == 0:
                    regions[ext.file].append(
                        (Finite(ext.offset, ext.offset + ext.length, t.dtype, t.name), t.name))
        for o in ck.objects.values():
            ext = o.extent
            if sealed or ext is None or ext.file not in chosen:
                continue
            if ext.encoding == "torch_zip":
                from ..formats.tensorio import zip_entries

                entries = _or_none(zip_entries, ck, ext)
                if entries is None:
                    continue
                regions[ext.file].append((ZipCrc(ext.offset, ext.offset + ext.length, entries,
                                                 store.display(ext.file)), o.name))
            elif ext.encoding == "torch_zip+zstd":
                side.append(("zstd-object", o, None))
        torch_files = {c.extent.file for t in ck.tensors.values() for c in t.chunks
                       if c.extent.encoding == "torch_save"}
        torch_files |= {o.extent.file for o in ck.objects.values()
                        if o.extent is not None and o.extent.encoding == "torch_save"}
        torch_files |= set(ck.info.get("zip_files", ()))  # DeepSpeed's rank files
        if not sealed and torch_files:
            from ..formats.tensorio import zip_entries
            from ..model import Extent

            for rel in sorted(torch_files & chosen):
                entries = _or_none(zip_entries, ck, Extent(rel, 0, self.files[rel]))
                if entries is None:  # a legacy (non-zip) torch.save file: no CRCs to check
                    continue
                regions[rel].append((ZipCrc(0, self.files[rel], entries, store.display(rel)), None))
                crc_files.add(rel)

        if self.on_total:  # what on_bytes will count: every file read, zstd chunks decoded
            self.on_total(sum(self.files[rel] for rel in files
                              if sealed or sealing or regions[rel] or rel not in torch_files)
                          + sum(e.dtype.nbytes(c.numel) for kind, e, c in side if kind == "zstd"))

        def scan(rel):
            hasher = new_hasher(algo) if sealed else \
                new_hasher("sha256") if integrity and rel in integrity else None
            content = new_hasher(self.seal_algo) if sealing else None
            todo = regions[rel]
            if not sealed and not sealing and not todo and rel in torch_files:
                return rel, None, []  # a legacy torch.save file: decoded by torch.load
            try:
                n = scan_file(store, rel, [r for r, _ in todo], on_bytes=self.on_bytes,
                              hasher=_Both(hasher, content) if hasher and content
                              else hasher or content)
            except CkptError as e:
                if isinstance(e, StorageError) or getattr(store, "protocol", None) != "pack":
                    raise
                # a pack's chunk that fails its checksum: a finding about the pack
                self.add(e.code if e.code in PROBLEM_CODES else "MALFORMED_CHUNK", e.message,
                         path=e.path)
                return rel, "unreadable", []
            if content is not None:
                self.digests[rel] = (content.hexdigest(), n)
            return rel, hasher.hexdigest() if hasher else None, todo

        def decode(job):
            kind, e, c = job
            return job, self._decode_side(kind, e, c)

        with ThreadPoolExecutor(max(1, min(self.workers, len(files) + len(side) or 1))) as pool:
            scans = list(pool.map(scan, files))
            sides = list(pool.map(decode, side))
        read = 0
        for rel, digest, todo in scans:
            if digest is None and not todo and not sealed and rel in torch_files \
                    and rel not in self.digests:
                continue
            read += 1
            if sealed and digest != self.manifest.files[rel].hash:
                damaged = self._damaged(rel, rel in torch_files)
                self.add("HASH_MISMATCH", f"content hash differs from the manifest ({algo})"
                         + damage_words(damaged), path=store.display(rel),
                         entry=damaged[0] if damaged and len(damaged) == 1 else None)
            if integrity and rel in integrity and digest != integrity[rel]:
                self.add("HASH_MISMATCH", "SHA-256 differs from the one Megatron's "
                         "integrity.json records", path=store.display(rel))
            for r, name in todo:
                if isinstance(r, ZipCrc) and r.bad:
                    self.add("CRC_MISMATCH", f"CRC-32 of zip record {r.bad[0]} differs from the "
                             f"one its writer recorded" + (f" (+{len(r.bad) - 1} more)"
                                                           if len(r.bad) > 1 else ""),
                             path=store.display(rel), entry=name)
                elif isinstance(r, Finite):
                    self._count(r.name, r.counts)
        for (kind, e, c), (counts, bad, err) in sides:
            if err is not None:
                self.add(err.code if err.code in PROBLEM_CODES and err.code != "MALFORMED_METADATA"
                         else "MALFORMED_CHUNK", err.message, path=err.path, entry=e.name)
            if bad:
                self.add("CRC_MISMATCH", f"CRC-32 of zip record {bad[0]} differs from the one "
                         "its writer recorded", path=store.display((c or e).extent.file)
                         if c else store.display(e.extent.file), entry=e.name)
            if counts:
                self._count(e.name, counts)
        for name, counts in sorted(self.result.non_finite.items()):
            self.add("NON_FINITE", f"{counts['nan']} NaN, {counts['inf']} Inf", entry=name)
        self.result.files_read = read
        self.result.tensors_checked = len(tensors_seen)
        self._share = {"files": files, "crc_files": crc_files, "tensors": tensors_seen}
        if sealed:
            self.result.content = "hashes"
        elif integrity is not None:
            self.result.content = "integrity.json"
            for rel in sorted(set(integrity) - set(self.files)):
                self.add("MISSING_FILE", "listed in Megatron's integrity.json but missing",
                         path=store.display(rel))
            unlisted = [rel for rel in self._data_files() if rel not in integrity]
            if unlisted:
                self.add("MANIFEST_MISMATCH", "not listed in Megatron's integrity.json",
                         path=store.display(unlisted[0]))
        else:
            plain = [rel for rel in files if rel not in crc_files]
            self.result.content = ("crc" if not plain else "decoded-only" if not crc_files
                                   else "crc+decoded-only")

    def _damaged(self, rel: str, torch_file: bool) -> list[str] | None:
        """After ``rel`` failed its content hash: the entries whose bytes are damaged, by
        the format's own checks, as an unsealed full verify runs them (the CRC-32 of every
        zip record of its DCP chunks and objects, of a torch.save file's records, zstd
        chunks decoded). A second read, of this file alone; None when nothing in it
        carries a checksum (safetensors, a file the format does not name)."""
        from ..formats.tensorio import zip_entries
        from ..model import Extent
        from .scan import ZipCrc, scan_file

        ck, where = self.ck, self.store.display(rel)
        regions, bad = [], []
        for e, ext in [(t, c.extent) for t in ck.tensors.values() for c in t.chunks] \
                + [(o, o.extent) for o in ck.objects.values() if o.extent is not None]:
            if ext.file == rel and ext.encoding == "torch_zip":
                entries = _or_none(zip_entries, ck, ext)
                if entries is None:  # its zip's directory is what no longer parses
                    bad.append(f"{e.name} (its zip directory)")
                else:
                    regions.append((ZipCrc(ext.offset, ext.offset + ext.length, entries,
                                           where), e.name))
        zstd = [(t, c) for t in ck.tensors.values() for c in t.chunks
                if c.extent.file == rel and c.extent.encoding == "torch_zip+zstd"]
        if torch_file:  # a whole torch.save zip: its records name no entry
            entries = _or_none(zip_entries, ck, Extent(rel, 0, self.files[rel]))
            if entries is not None:
                regions.append((ZipCrc(0, self.files[rel], entries, where), None))
        if not regions and not zstd and not bad:
            return None
        try:
            if regions:
                scan_file(self.store, rel, [r for r, _ in regions])
        except StorageError:
            raise
        except CkptError:  # a pack's chunk that no longer decodes: what was found so far
            return list(dict.fromkeys(bad)) or None
        bad += [x for r, name in regions if r.bad
                for x in ([name] if name else [f"zip record {b}" for b in r.bad])]
        bad += [t.name for t, c in zstd if self._zstd_damaged(t, c)]
        return list(dict.fromkeys(bad))

    def _zstd_damaged(self, t, c) -> bool:
        """Does a zstd chunk fail to decode, or one of its zip records its CRC-32?"""
        from ..formats.tensorio import open_zstd_chunk

        try:
            z = open_zstd_chunk(self.ck, t, c, crc=True)
            try:
                while z.read(4 << 20):
                    pass
                z.finish()
                return bool(z.bad_records)
            finally:
                z.close()
        except StorageError:
            raise
        except CkptError:
            return True

    def _count(self, name: str, counts: dict) -> None:
        if counts["nan"] or counts["inf"]:
            prev = self.result.non_finite.setdefault(name, {"nan": 0, "inf": 0})
            prev["nan"] += counts["nan"]
            prev["inf"] += counts["inf"]

    def _decode_side(self, kind, e, c):
        """Decode what the file scan cannot see: zstd chunks (streamed, CRC-checked when
        unsealed), torch.save tensors and views of larger storages (for NaN/Inf)."""
        from ..formats.tensorio import open_zstd_chunk, chunk_bytes
        from .scan import Finite, ZipCrc

        counts, bad = None, []
        finite = (self.check_finite and kind != "zstd-object" and e.dtype.is_floating
                  and e.dtype.bits % 8 == 0)
        try:
            if kind == "zstd":
                z = open_zstd_chunk(self.ck, e, c, crc=self.manifest is None)
                try:
                    f = Finite(0, z.nbytes, e.dtype, e.name) if finite else None
                    while block := z.read(4 << 20):
                        if f is not None:
                            f.feed(memoryview(block))
                        if self.on_bytes:
                            self.on_bytes(len(block))
                    z.finish()
                    bad = z.bad_records
                finally:
                    z.close()
                counts = f.counts if f is not None else None
            elif kind == "zstd-object":
                from ..formats.tensorio import decompress_bounded

                ext = e.extent
                blob = self.store.read_range(ext.file, ext.offset, ext.offset + ext.length)
                zipped = decompress_bounded(blob, self.store.display(ext.file), OBJECT_SCAN_LIMIT)
                from ..formats.torchzip import central_directory

                entries, _ = central_directory(zipped, len(zipped),
                                               where=self.store.display(ext.file))
                r = ZipCrc(0, len(zipped), entries, self.store.display(ext.file))
                r.feed(memoryview(zipped))
                r.finish(True)
                bad = r.bad
            elif finite:
                f = Finite(0, 0, e.dtype, e.name)
                f.feed(memoryview(chunk_bytes(self.ck, e, c)))
                counts = f.counts
        except StorageError:
            raise
        except CkptError as err:
            return None, [], err
        return counts, bad, None

    def run(self) -> VerifyResult:
        t0 = time.monotonic()
        self.quick()
        fatal = self.ck is None
        if not fatal and self.level in ("structure", "full"):
            self.store.cache_small_files(self.files)  # reading chunks: whole small files
            self.structure()
        if self.level == "full" and self.group is not None and self.group.active:
            from ..writing.distributed import full_shared

            full_shared(self.group, self, run=not fatal)  # rank 0 gets every finding
        elif not fatal and self.level == "full" and not (
                self.seal_algo and any(p.severity == "error" for p in self.problems)):
            self.full()  # (a seal refused on its structure reads no data)
        r = self.result
        r.num_files = len(counted_files(getattr(self, "files", {}),
                                        getattr(self, "manifest", None),
                                        store=getattr(self, "store", None)))
        r.problems = self.problems
        r.judge()
        r.bytes_read = (self.store.stats.bytes_read if hasattr(self, "store") else 0) \
            + getattr(self, "_other_bytes", 0)
        r.seconds = round(time.monotonic() - t0, 3)
        return r


def damage_words(damaged: list[str] | None, shown: int = 3) -> str:
    """HASH_MISMATCH's tail: which entries the damaged bytes are in (``damaged``, from the
    format's own CRC-32s), or that every record still matches; "" when the file carries
    no checksum (None).

    >>> damage_words(["model.w"])
    '; the damaged bytes are in model.w (CRC-32 of its zip record)'
    >>> damage_words(["a", "b", "c", "d"])
    '; the damaged bytes are in a, b, c (+1 more) (CRC-32 of their zip records)'
    >>> damage_words(None), damage_words([])[:52]
    ('', '; the CRC-32 of every zip record in it still matches')
    """
    if damaged is None:
        return ""
    if not damaged:
        return ("; the CRC-32 of every zip record in it still matches: the damage is "
                "outside the entries' data (zip headers), or the manifest was changed")
    names = ", ".join(damaged[:shown]) + (f" (+{len(damaged) - shown} more)"
                                          if len(damaged) > shown else "")
    return (f"; the damaged bytes are in {names} (CRC-32 of "
            + ("its zip record)" if len(damaged) == 1 else "their zip records)"))


class _Both:
    """Two hashers fed the same bytes (a file's content hash for its manifest and the
    SHA-256 Megatron's ``integrity.json`` records)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def update(self, data) -> None:
        self.a.update(data)
        self.b.update(data)

    def hexdigest(self) -> str:
        return self.a.hexdigest()


def _or_none(fn, *args):
    """``fn(*args)``, or None when it finds the input malformed: the structure level reports
    that; an I/O error still stops the command (exit 3)."""
    try:
        return fn(*args)
    except StorageError:
        raise
    except CkptError:
        return None


def _check_args(level: str, sample: float | None) -> None:
    """The usage errors of verify's level and sample (exit 2), before anything is read."""
    if level not in LEVELS:
        raise UsageError(f"unknown level {level!r} (choose from {', '.join(LEVELS)})")
    if sample is not None and not 0 < sample <= 1:
        raise UsageError("--sample takes a fraction in (0, 1]")
    if sample is not None and level != "full":  # only the full level reads file contents
        raise UsageError(f"--sample needs --level full (it picks the files whose contents "
                         f"are read; --level {level} reads none)")


def verify(url: str, storage_options: dict | None = None, *, level: str = "structure",
           require: str | list[str] | None = None, check_finite: bool = False,
           sample: float | None = None, workers: int = 4,
           on_bytes: Callable[[int], None] | None = None, located: tuple | None = None,
           checkpoint: Checkpoint | None = None, uploads: bool = True,
           on_total: Callable[[int], None] | None = None, group=None,
           bases: dict | None = None) -> VerifyResult:
    """Check the checkpoint at ``url``; problems are collected, not raised. ``bases``: a
    dict one caller shares across many verifies (``ls`` of a root of delta packs), so
    each base chain is checked once, not once per pack above it.

    Raises only when the place cannot be read at all (exit 3): not found, unreachable.
    A caller that has already listed or opened the checkpoint passes it on, so nothing is
    listed or read twice: ``located`` (what :func:`~ckptctl.formats.detect.locate`
    returned), ``checkpoint`` (opened from that listing with ``strict=False``).
    ``uploads=False`` skips the look for orphaned S3 multipart uploads (one more listing;
    they are only ever warnings). ``on_bytes(n)``: n more bytes read (full level);
    ``on_total(n)``: called once before the reads with the bytes they come to.
    ``group``: a :class:`~ckptctl.writing.distributed.Group` (``Group.from_env()`` under
    torchrun/srun): the full level's files are split over the processes and rank 0's
    result holds every finding (``bytes_read``: all processes together).
    """
    _check_args(level, sample)
    c = _Checker(url, storage_options, level, require, check_finite, sample, workers,
                 on_bytes, located, checkpoint, uploads, on_total, group=group)
    c.bases = bases
    return c.run()


def check_and_hash(url: str, storage_options: dict | None = None, *, algo: str,
                   names: list[str], workers: int = 4,
                   on_bytes: Callable[[int], None] | None = None,
                   on_total: Callable[[int], None] | None = None,
                   located: tuple | None = None, checkpoint: Checkpoint | None = None
                   ) -> tuple[VerifyResult, dict[str, tuple[str, int]]]:
    """What a seal stands on: the checks of ``verify --level full`` of an unsealed
    checkpoint (structure, every zip record's CRC-32, Megatron's ``integrity.json``, zstd
    chunks decoded) on the files ``names``, in the same read that hashes each of them with
    ``algo``. Returns the result and each file's (digest, bytes read); the data is not
    read at all when the structure is already wrong. A sealed checkpoint (``seal
    --update``) has its new files checked as unsealed ones.

    >>> r, digests = check_and_hash("ckpt/", algo="xxh3-128", names=["__0_0.distcp"])  # doctest: +SKIP
    >>> r.ok, digests["__0_0.distcp"][1]                       # doctest: +SKIP
    (True, 4194304)
    """
    c = _Checker(url, storage_options, "full", None, False, None, workers, on_bytes,
                 located, checkpoint, False, on_total)
    c.seal_algo, c.seal_names = normalize_algo(algo), list(names)
    return c.run(), c.digests


@dataclass
class CheckpointVerify:
    """One checkpoint of a ``verify ROOT --all``: its name under ROOT (as ``ls`` shows
    it), verify's result, and ``error`` ({code, exit_code, message, path}) when verify
    could not read it at all (another framework's layout...): then ``result.ok`` is
    False and it has no problems of its own."""

    name: str
    result: VerifyResult
    error: dict | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, **self.result.to_dict(), "error": self.error}


@dataclass
class VerifyAllResult:
    """``verify ROOT --all``: every checkpoint ``ls`` finds under ROOT, in its order;
    ``ok`` when each one is (an empty root is ok)."""

    ok: bool
    level: str
    url: str
    checkpoints: list[CheckpointVerify] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    strict: bool = False

    def judge(self, strict: bool) -> "VerifyAllResult":
        """Each checkpoint's verdict with warnings failing (``strict``) or not
        (:meth:`VerifyResult.judge`; one that could not be read stays not ok); returns
        self."""
        self.strict = strict
        for c in self.checkpoints:
            if c.error is None:
                c.result.judge(strict)
            else:
                c.result.strict = strict
        self.ok = all(c.result.ok for c in self.checkpoints)
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "level": self.level, "url": self.url, "strict": self.strict,
                "num_checkpoints": len(self.checkpoints),
                "num_ok": sum(c.result.ok for c in self.checkpoints),
                "checkpoints": [c.to_dict() for c in self.checkpoints],
                "bytes_read": self.bytes_read, "seconds": self.seconds}


def verify_all(root: str, storage_options: dict | None = None, *, level: str = "structure",
               require: str | list[str] | None = None, check_finite: bool = False,
               sample: float | None = None, workers: int = 4,
               on_bytes: Callable[[int], None] | None = None) -> VerifyAllResult:
    """Verify each checkpoint under ``root`` as ``ls`` groups them (one listing of the
    root, then :func:`verify` of each at ``level``), like ``restic check`` of a
    repository. A checkpoint verify cannot read (another framework's layout, a file of
    no format ckptctl knows) is reported with its error, not ok; an I/O failure stops
    the run (exit 3): it says nothing about the checkpoints.

    >>> r = verify_all("runs/llama", level="quick")              # doctest: +SKIP
    >>> r.ok, [(c.name, c.result.ok) for c in r.checkpoints]     # doctest: +SKIP
    (False, [('step-100', True), ('step-200', False)])
    """
    from .._deps import MissingDependencyError
    from ..catalog.ls import ls

    _check_args(level, sample)
    t0 = time.monotonic()
    rows = ls(root, storage_options, check="listing").checkpoints
    out = VerifyAllResult(True, level, root.rstrip("/") if len(root) > 1 else root)
    for row in rows:
        try:
            r = verify(row.url, storage_options, level=level, require=require,
                       check_finite=check_finite, sample=sample, workers=workers,
                       on_bytes=on_bytes, located=row.located)
            out.checkpoints.append(CheckpointVerify(row.name, r))
        except (StorageError, MissingDependencyError):
            raise
        except CkptError as e:
            out.checkpoints.append(CheckpointVerify(
                row.name, VerifyResult(False, level, row.url, row.format, False, row.step),
                {"code": str(e.code), "exit_code": e.exit_code, "message": str(e),
                 "path": e.path}))
    out.ok = all(c.result.ok for c in out.checkpoints)
    out.bytes_read = sum(c.result.bytes_read for c in out.checkpoints)
    out.seconds = round(time.monotonic() - t0, 3)
    return out
