"""``ls``: every checkpoint under a root, with its step, format, state, size and time.

One recursive listing finds the candidates (paginated on S3: one LIST per 1,000 keys).
Each is then classified (``check``):

* ``quick``: from its metadata, as ``verify --level quick`` does (one or two small reads
  each, no tensor data): what ``auto`` does on local stores, where reads cost no request,
  and on remote roots of up to :data:`QUICK_LIMIT` checkpoints;
* ``listing``: from that one listing alone, wherever it can tell: a ``.ckptctl-writing``
  marker is ``incomplete``; a manifest, or DCP's ``.metadata`` / safetensors files, is a
  *provisional* ``sealed`` / ``complete`` (``CheckpointRow.exact`` False: the files those
  name were not read), with the step from the name (``step-1200``). A checkpoint whose name
  carries no step, a pack, a lone file, or a folder missing its commit marker is checked as
  ``quick`` does. What ``auto`` does on bigger remote roots: 10,000 checkpoints on S3 cost
  ~40 LISTs, not 19,000 GETs. :func:`confirm` checks provisional rows for real; ``latest``
  and ``gc`` call it on the few rows their answer rests on.

>>> [c.name for c in ls("runs/llama").checkpoints]           # doctest: +SKIP
['step-100', 'step-200']
"""
from __future__ import annotations

import datetime as dt
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from ..errors import CkptError, NotFoundError, StorageError, UnsupportedFormatError
from ..formats.detect import detect_format, not_a_checkpoint, step_from_name
from ..formats.locate import located_in, pointers, single_files
from ..formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER, Manifest, control_name
from ..formats.pack import is_pack
from ..formats.torchsave import is_torch_file
from ..model import natural_key
from ..storage import open_store
from .state import (COMPLETE, CORRUPT, INCOMPLETE, SEALED, UNKNOWN, StateReport,
                    checkpoint_state)
from .vocabulary import counted_files

#: ``check`` values of :func:`ls` (``auto``: ``quick`` on local stores and on remote roots
#: of at most :data:`QUICK_LIMIT` checkpoints, ``listing`` on bigger remote roots)
CHECKS = ("auto", "quick", "listing")
#: Up to this many checkpoints, ``auto`` reads each one even on a remote root (2-3 small
#: GETs each, a second or two): a step entry then wins over the name, as ``inspect`` says.
QUICK_LIMIT = 100

_HF_BIN = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")


@dataclass
class CheckpointRow:
    name: str
    url: str
    step: int | None
    format: str | None
    state: str
    reason: str
    bytes: int
    num_files: int
    modified: float | None
    #: a ``.ckptctl-pinned`` file is in the folder (``ckptctl pin``); ``bytes`` and
    #: ``num_files`` count the checkpoint's files without ckptctl's markers (manifest, pin:
    #: :func:`~ckptctl.catalog.vocabulary.counted_files`)
    pinned: bool = False
    # for gc, rm and latest; not in --json: (store, files, single) as formats.detect.locate
    # returns them, cut from the root's listing, and the manifest (``ls(manifests=True)``)
    located: tuple | None = field(default=None, repr=False, compare=False,
                                  metadata={"json": False})
    manifest: Manifest | None = field(default=None, repr=False, compare=False,
                                      metadata={"json": False})
    #: False: ``state`` (and ``step``) come from the listing alone (``ls(check="listing")``),
    #: a sealed or complete one unread (:func:`confirm` reads it); not in --json
    exact: bool = field(default=True, repr=False, compare=False, metadata={"json": False})

    def to_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self)
               if f.metadata.get("json", True)}
        doc["modified"] = iso_utc(doc["modified"])
        return doc

    @property
    def signature(self) -> list:
        """What stays the same while nothing is written to the checkpoint (``watch``'s
        settle test)."""
        return [self.state, self.bytes, self.num_files, self.modified]


@dataclass
class LsResult:
    root: str
    checkpoints: list[CheckpointRow] = field(default_factory=list)
    #: the root's pointer files (DeepSpeed's ``latest``, Megatron's tracker) and what each
    #: names (:func:`~ckptctl.formats.locate.pointers`)
    pointers: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The ``--json`` document: times as ISO-8601 UTC strings."""
        return {"root": self.root, "checkpoints": [c.to_dict() for c in self.checkpoints],
                "pointers": self.pointers}


def iso_utc(ts: float | None) -> str | None:
    """Seconds since the epoch as ISO-8601 UTC, to the second (None stays None).

    >>> iso_utc(0), iso_utc(None)
    ('1970-01-01T00:00:00Z', None)
    """
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def group_checkpoints(files: dict[str, int]) -> dict[str, dict[str, int]]:
    """Group a recursive listing into checkpoints: folders that hold a format's files,
    folders of another framework's layout (one checkpoint each, refused by name when
    read: a DeepSpeed tag folder, an Orbax step folder), and standalone torch.save files.
    Key: the checkpoint's path relative to the root
    (:func:`ckptctl.formats.detect.group_checkpoints`).

    >>> sorted(group_checkpoints({"a/.metadata": 1, "a/__0_0.distcp": 5, "b.pt": 3}))
    ['a', 'b.pt']
    >>> sorted(group_checkpoints({"ds/global_step5/mp_rank_00_model_states.pt": 3,
    ...                           "ds/global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt": 3}))
    ['ds/global_step5']
    """
    from ..formats.detect import group_checkpoints as group

    return group(files)


def listing_state(files: dict[str, int], where: str) -> tuple[StateReport, bool] | None:
    """A checkpoint folder's state from its listing alone, and whether that is final
    (``exact``); None where only reading it can tell (a pack, a folder without a commit
    marker, formats whose completeness the names do not show). ``where``: the folder's URL.

    >>> listing_state({".ckptctl-writing": 9, "__0_0.distcp": 5}, "r/s")[0].state
    'incomplete'
    >>> r, exact = listing_state({"ckptctl.manifest.json": 9, ".metadata": 1}, "r/s")
    >>> r.state, r.format, exact
    ('sealed', 'dcp', False)
    >>> listing_state({"__0_0.distcp": 5}, "r/s") is None
    True
    """
    fmt = detect_format(files)
    if WRITING_MARKER in files:  # verify stops there: the very words it would use
        return StateReport(INCOMPLETE, f"NOT_COMMITTED: {where}/{WRITING_MARKER}: a ckptctl "
                           "writer did not finish; rerun with --force", fmt, None), True
    if is_pack(files) or fmt not in ("dcp", "safetensors") \
            or any(is_torch_file(f) for f in files if "/" not in f):
        return None  # .bin next to safetensors: only reading tells what they are
    if fmt == "safetensors" and "model.safetensors.index.json" in files:
        fmt = "hf-safetensors"  # as the reader names it
    if MANIFEST in files:
        return StateReport(SEALED, "manifest present (from the listing: not read; "
                           "`ckptctl verify` checks it)", fmt, None), False
    if fmt == "dcp" and ".metadata" not in files:
        return None  # incomplete or corrupt: reading tells which (no request for it here)
    return StateReport(COMPLETE, "format metadata present (from the listing: not read; "
                       "`ckptctl verify` checks it)", fmt, None), False


def _lone_file(store, root: str, storage_options: dict | None) -> tuple:
    """(store, files) when ``root`` lists nothing: a missing place is an error (exit 3),
    an empty folder, bucket or S3 prefix (in a bucket that exists) lists no checkpoint,
    a file is listed from its folder."""
    if not store.exists():
        scheme = store.url.partition("://")[0]
        if not store.is_local and "/" in store.root.strip("/") and open_store(
                f"{scheme}://{store.root.split('/', 1)[0]}", storage_options).exists():
            return store, {}  # object stores have no folders: an unused prefix is empty
        raise NotFoundError(root, "no such file or directory")
    if store.isdir():
        return store, {}
    parent_url, name = root.rstrip("/").rsplit("/", 1) if "/" in root.rstrip("/") else (".", root)
    parent = open_store(parent_url or "/", storage_options)
    return parent, single_files(parent, name) or {name: parent.size(name)}  # + its sidecars


def ls(root: str, storage_options: dict | None = None, *, workers: int = 8,
       manifests: bool = False, check: str = "quick") -> LsResult:
    """List the checkpoints under ``root``, sorted by step, then name in natural order
    (:func:`~ckptctl.model.natural_key`). Files with a checkpoint's suffix that are no
    checkpoint (TorchScript archives, ``.pth`` path files) are skipped, not called corrupt.
    ``manifests``: also hand back each sealed checkpoint's manifest (``gc``: tags, ids,
    pack bases), read from what classifying it fetched (no new request on S3); rows
    classified from the listing (``check``, see the module docstring) carry none until
    :func:`confirm`."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, not {check!r}")
    store = open_store(root, storage_options)
    files = store.list_files()
    shown_root, lone = store.url, False
    if not files:
        store, files = _lone_file(store, root, storage_options)
        lone = bool(files)
    groups = group_checkpoints(files)
    if lone and not groups:
        raise UnsupportedFormatError(root, "not a checkpoint")
    if lone and "" in groups:  # one safetensors file: listed as itself, not as its folder
        groups = {next(iter(files)): groups[""]}

    if check == "auto":
        check = "quick" if store.is_local or len(groups) <= QUICK_LIMIT else "listing"
    skipped: dict[str, str] = {}
    ctx = _Ctx(store, root, storage_options, manifests, skipped)
    quick = []
    rows = []
    for rel in sorted(groups):
        row = ctx.from_listing(rel, groups[rel]) if check == "listing" else None
        if row is None:
            quick.append(rel)
        else:
            rows.append(row)
    if quick:
        with ThreadPoolExecutor(max(1, min(workers, len(quick)))) as pool:
            rows += [r for r in pool.map(lambda rel: ctx.row(rel, groups[rel]), quick)
                     if r is not None]
    if lone and not rows:
        raise UnsupportedFormatError(root, f"not a checkpoint: {next(iter(skipped.values()))}")
    rows.sort(key=lambda r: (r.step is None, r.step if r.step is not None else 0,
                             natural_key(r.name)))
    parents = {posixpath.dirname(rel) for rel in groups} | {""}
    return LsResult(shown_root, rows, pointers(store, files, parents) if not lone else [])


def confirm(rows: list[CheckpointRow], storage_options: dict | None = None, *,
            manifests: bool = False, workers: int = 8) -> list[CheckpointRow]:
    """``rows`` of an ``ls`` with each provisional one (``exact`` False) classified by
    reading it, as ``ls(check="quick")`` would have (the same row; its manifest too with
    ``manifests``); exact rows come back as they are, in the same order. Nothing is listed
    again: the files are the listing's.

    >>> fresh = confirm(ls("s3://b/run", check="listing").checkpoints[-2:])  # doctest: +SKIP
    """
    todo = [i for i, r in enumerate(rows) if not r.exact]
    if not todo:
        return list(rows)
    out = list(rows)

    def one(i: int) -> CheckpointRow:
        r = rows[i]
        rep, step, fmt, manifest = _Ctx(None, r.url, storage_options, manifests,
                                        {}).classify(r.name, r.url, r.located)
        size, count = content(r.located, manifest)
        return CheckpointRow(r.name, r.url, step, fmt or r.format, rep.state, rep.reason,
                             size, count, r.modified, r.pinned, r.located,
                             manifest if manifests else None)

    with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        for i, row in zip(todo, pool.map(one, todo)):
            out[i] = row
    return out


class _Ctx:
    """What every row of one ``ls`` shares: the root's store, options and findings."""

    def __init__(self, store, root: str, storage_options, manifests: bool, skipped: dict):
        self.store, self.root, self.opts = store, root, storage_options
        self.manifests, self.skipped = manifests, skipped
        self.bases: dict = {}  # each delta pack's base chain checked once per ls

    def _common(self, rel: str, group: dict[str, int]):
        store = self.store
        url = store.display(rel) if rel else store.url
        located = located_in(store, rel, group)
        marker = max(group, key=lambda k: (k.endswith((MANIFEST, ".metadata")), k))
        try:
            mtime = store.modified(marker)
        except Exception:  # noqa: BLE001 - a missing mtime is not worth failing ls
            mtime = None
        pinned = control_name(PIN_FILE, located[2]) in located[1]  # a lone file's: beside it
        return url, located, mtime, pinned

    def from_listing(self, rel: str, group: dict[str, int]) -> CheckpointRow | None:
        """The row from the listing alone, or None where it must be read."""
        if not rel or rel in group:  # the root itself, or a lone file
            return None
        step = step_from_name(rel)
        if step is None:  # only reading tells the step (manifest, step entry)
            return None
        found = listing_state({k[len(rel) + 1:]: v for k, v in group.items()},
                              self.store.display(rel))
        if found is None:
            return None
        rep, exact = found
        url, located, mtime, pinned = self._common(rel, group)
        size, count = content(located)  # its manifest unread: the files its format names
        return CheckpointRow(rel, url, step, rep.format, rep.state, rep.reason, size, count,
                             mtime, pinned, located, None, exact)

    def classify(self, rel: str, url: str, located: tuple):
        """(StateReport, step, format, manifest) by reading the checkpoint (``quick``); the
        manifest of a sealed one (what it owns: its ``num_files``), read from what
        classifying it fetched."""
        try:
            rep = checkpoint_state(url, self.opts, located=located, bases=self.bases)
        except StorageError:
            raise  # the storage itself failed: not a finding about one checkpoint
        except CkptError as e:  # one bad checkpoint never hides the others
            rep = StateReport(CORRUPT, f"{e.code}: {e}", None, None)
        step = rep.step if rep.step is not None else step_from_name(rel or self.root)
        manifest = None
        if rep.state == "sealed":
            try:
                manifest = Manifest.read(located[0], located[1], located[2])
            except StorageError:
                raise
            except CkptError:  # changed since it was classified: no tags, id or base
                pass
        return rep, step, rep.format, manifest

    def row(self, rel: str, group: dict[str, int]) -> CheckpointRow | None:
        """The row by reading the checkpoint (``quick``), None for a skipped file."""
        url, located, mtime, pinned = self._common(rel, group)
        rep, step, fmt, manifest = self.classify(rel, url, located)
        if rep.state in (CORRUPT, UNKNOWN) and rel in group:  # a lone file unloaded:
            why = not_a_checkpoint(self.store, rel, group[rel])  # TorchScript, .pth text?
            if why:  # not listed (healthy files cost no extra read)
                self.skipped[rel] = why
                return None
        fmt = fmt or detect_format(  # a lone file keeps its name (relpath gives ".")
            {posixpath.basename(k) if k == rel else posixpath.relpath(k, rel) if rel else k: v
             for k, v in group.items()})
        size, count = content(located, manifest)
        return CheckpointRow(rel or posixpath.basename(self.root.rstrip("/")), url, step, fmt,
                             rep.state, rep.reason, size, count, mtime, pinned, located,
                             manifest if self.manifests else None)


def content(located: tuple, manifest: Manifest | None = None) -> tuple[int, int]:
    """(``bytes``, ``num_files``) of a checkpoint as every verb counts them
    (:func:`~ckptctl.catalog.vocabulary.counted_files`): ``located`` as
    :func:`~ckptctl.formats.locate.located_in` gives it, ``manifest`` its manifest.

    >>> content((None, {".metadata": 2, "x.distcp": 8, "ckptctl.manifest.json": 5,
    ...                 "NOTES.md": 1}, None))
    (10, 2)
    """
    files = counted_files(located[1], manifest, single=located[2])
    return sum(files.values()), len(files)
