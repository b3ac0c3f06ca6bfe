"""The quick level of ``verify``, which is what a checkpoint's state is (``ls``, through
:func:`~ckptctl.catalog.state.checkpoint_state`): :class:`QuickCheck` finds, with no
tensor data read, its commit state (manifest, or the format's own marker), every file at
its recorded size, a ckptctl writer at work (:mod:`ckptctl.catalog.writers`), stray temp
files, orphaned multipart uploads, links leaving the root, byte extents past their file's
end, a delta pack's base chain (:func:`base_unrestorable`) and the step entry. Each finding
is a :class:`Problem`; ``verify``'s structure and full levels build on this class
(:mod:`ckptctl.integrity`).

>>> c = QuickCheck("ckpt/", uploads=False)                  # doctest: +SKIP
>>> c.quick()                                               # doctest: +SKIP
>>> c.sealed, [p.code for p in c.problems]                  # doctest: +SKIP
(False, ['MISSING_FILE'])
"""
from __future__ import annotations

from dataclasses import dataclass

from .._deps import MissingDependencyError
from ..errors import (CkptError, NotFoundError, ProblemCode, StorageError,
                      UnsupportedFormatError, UsageError)
from ..formats import dcp
from ..formats.detect import locate, open_checkpoint, resolve_step
from ..formats.locate import refuse_save_folder
from ..formats.manifest import (MANIFEST, WRITING_MARKER, control_name, is_control_file,
                                is_temp_name, read_manifest, writer_unfinished)
from ..model import Checkpoint
from ..storage import open_store
from .writers import RESUME, unfinished_writer

#: The codes verify reports (``verify`` of :class:`~ckptctl.errors.ProblemCode`).
_REPORTED = frozenset(c.value for c in ProblemCode if c.verify)


@dataclass
class Problem:
    """One finding of verify: its stable ``code`` (:data:`~ckptctl.integrity.verify.PROBLEM_CODES`),
    ``severity`` (``error`` fails verify; ``warning`` only with ``--strict``), where it is
    (``path``: a file as its store displays it; ``entry``: a tensor or object) and what."""

    code: str
    severity: str  # "error" or "warning"
    path: str | None
    entry: str | None
    message: str


def verify_code(code, otherwise: str):
    """``code`` when it is one verify reports (:class:`~ckptctl.errors.ProblemCode` with
    ``verify``), else ``otherwise``: the code a raised error's finding is filed under.

    >>> verify_code("CHUNK_GAP", "MALFORMED_METADATA"), verify_code("USAGE", "MALFORMED_CHUNK")
    ('CHUNK_GAP', 'MALFORMED_CHUNK')
    """
    return code if code in _REPORTED else otherwise


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
    else:  # the root of the chain: committed and whole, as the quick level says
        check = QuickCheck(bstore.url, storage_options, uploads=False)
        check.quick()
        errors = [p for p in check.problems if p.severity == "error"]
        why = None
        if errors:  # what ls would call it (catalog/state.py): not committed
            p = errors[0]
            why = (f"its base {base['id']} ({bstore.url}) is not committed: {p.code}: "
                   f"{p.path + ': ' if p.path else ''}{p.message}")
    if bases is not None:
        bases[key] = why
    return why


class QuickCheck:
    """The quick level's checks of the checkpoint at ``url`` (:meth:`quick`), problems
    collected in ``problems``, not raised; what it learns on the way is kept for the
    levels above: ``store``, ``files`` (its listing), ``manifest``, ``ck`` (opened with
    ``strict=False``, None when it could not be), ``format``, ``sealed`` and ``step``.

    ``located``, ``checkpoint``: a listing or an opened checkpoint the caller already has
    (nothing is listed or read twice); ``uploads=False`` skips the look for orphaned S3
    multipart uploads; ``bases``: shared across one caller's checks, so each delta pack's
    base chain is checked once.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 located: tuple | None = None, checkpoint: Checkpoint | None = None,
                 uploads: bool = True, bases: dict | None = None):
        self.url, self.opts = url, storage_options
        self.located, self.opened, self.uploads, self.bases = located, checkpoint, uploads, bases
        self.problems: list[Problem] = []
        self.ck: Checkpoint | None = None
        self.store = None
        self.files: dict[str, int] = {}
        self.manifest = None
        self.manifest_name: str | None = None
        self.format: str | None = None
        self.sealed = False
        self.step: int | None = None

    def add(self, code, message, *, path=None, entry=None, severity="error"):
        """Record a finding (an error unless ``severity`` says otherwise)."""
        self.problems.append(Problem(code, severity, path, entry, message))

    def add_error(self, e: CkptError):
        """Record a raised error as a finding: its code when verify reports it, else
        MALFORMED_METADATA."""
        self.add(verify_code(e.code, "MALFORMED_METADATA"), e.message, path=e.path)

    def quick(self):
        """Run the quick level's checks (module docstring). Raises only when the place
        cannot be read at all (exit 3: not found, unreachable, another framework's layout)
        or is a run's root (exit 2)."""
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
        from .ownership import is_control_temp

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
            self.format = file_format(single) if single else detect_format(files)
            self.manifest = None
            return
        try:  # a single file's is the sidecar beside it (train.pt.ckptctl.manifest.json)
            self.manifest = read_manifest(store, files, single)
        except StorageError:
            raise  # I/O: exit 3, not a finding about the checkpoint
        except CkptError as e:
            self.manifest = None
            self.add_error(e)
        self.sealed = self.manifest is not None
        if self.manifest is not None:
            self._against_manifest(store, files)
        if single:  # its sidecars are no content: the files checked and read are the one
            self.files = {rel: n for rel, n in files.items() if not is_control_file(rel)}
        if not self._open(located):
            return
        if self.ck.format == "dcp":
            for rel in sorted(dcp.referenced_files(self.ck)):
                if rel not in files and not (self.manifest and rel in self.manifest.files):
                    self.add("MISSING_FILE", "referenced by .metadata but missing",
                             path=store.display(rel))
        self._extents_inside_files()
        self._base_chain()
        self._step_entry()

    def _against_manifest(self, store, files):
        """Every file the manifest lists is there at its size; a file it does not list
        (but ckptctl's own and temp files) is EXTRA_FILE, a warning."""
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

    def _open(self, located) -> bool:
        """Open the checkpoint from ``located`` (or take the one handed over) into
        ``ck``; False, with the problem recorded, when it cannot be."""
        from ..formats.orbax import metadata_only

        try:
            # torch_free: a torch.save zip is checked from its records and their CRCs
            # (formats/torchfile.read_torch_zip), no import of torch; the quick level
            # alone reads no array, so an Orbax checkpoint on an object store is judged
            # by its files there (formats/orbax.py), the levels above refuse it by name
            with metadata_only(getattr(self, "level", "quick") == "quick"):
                self.ck = self.opened or open_checkpoint(self.url, self.opts, strict=False,
                                                         read_step=False, located=located,
                                                         torch_free=True)
            self.format = self.ck.format
            self.step = self.ck.step
        except (StorageError, MissingDependencyError, UsageError):
            raise  # exit 3 (2 for a run folder), not a finding about the checkpoint
        except UnsupportedFormatError as e:
            if getattr(e, "framework", None) or not any(p.severity == "error"
                                                        for p in self.problems):
                raise  # another framework's layout, or nothing ckptctl reads: exit 3
            self.add_error(e)  # a sealed checkpoint whose data files went missing
            return False
        except CkptError as e:
            self.add_error(e)
            return False
        return True

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
            why = " ".join(RESUME["promote"])
        self.add("NOT_COMMITTED", f"nothing committed here yet: {why}",
                 path=store.display(WRITING_MARKER) if WRITING_MARKER in files else work)
        return True

    def _base_chain(self):
        """A delta pack is restorable only while its base chain is: MISSING_BASE names
        the first base that is not there, not committed, or not the one it was made
        against (one listing and manifest read per base, no tensor data)."""
        from ..formats.pack import PackStore

        reason = base_unrestorable(self.store, self.opts, self.bases) \
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
        self.step = ck.step

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
