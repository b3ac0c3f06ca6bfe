"""``ls``: every checkpoint under a root, with its step, format, state, size and time.

One recursive listing finds the candidates; each is then classified from its metadata
(one or two small reads each, no tensor data).

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
from ..formats.manifest import MANIFEST, PIN_FILE, WRITING_MARKER, Manifest
from ..formats.torchsave import is_torch_file
from ..model import natural_key
from ..storage import open_store
from .state import CORRUPT, UNKNOWN, StateReport, checkpoint_state

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
    #: a ``.ckptctl-pinned`` file is in the folder (``ckptctl pin``); it is not counted
    #: in ``bytes``/``num_files``: not part of the checkpoint
    pinned: bool = False
    # for gc, rm and latest; not in --json: (store, files, single) as formats.detect.locate
    # returns them, cut from the root's listing, and the manifest (``ls(manifests=True)``)
    located: tuple | None = field(default=None, repr=False, compare=False,
                                  metadata={"json": False})
    manifest: Manifest | None = field(default=None, repr=False, compare=False,
                                      metadata={"json": False})

    def to_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self)
               if f.metadata.get("json", True)}
        doc["modified"] = iso_utc(doc["modified"])
        return doc


@dataclass
class LsResult:
    root: str
    checkpoints: list[CheckpointRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The ``--json`` document: times as ISO-8601 UTC strings."""
        return {"root": self.root, "checkpoints": [c.to_dict() for c in self.checkpoints]}


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
    and standalone torch.save files. Key: the checkpoint's path relative to the root.

    >>> sorted(group_checkpoints({"a/.metadata": 1, "a/__0_0.distcp": 5, "b.pt": 3}))
    ['a', 'b.pt']
    """
    by_dir: dict[str, dict[str, int]] = {}
    for rel, size in files.items():
        d, base = posixpath.split(rel)
        by_dir.setdefault(d, {})[base] = size
    found: dict[str, dict[str, int]] = {}
    for d in sorted(by_dir):
        if any(d == c or d.startswith(c + "/") for c in found if c):
            continue  # inside a checkpoint already found
        own = by_dir[d]
        fmt = detect_format(own)
        if fmt in ("dcp", "safetensors", "composite", "pack") \
                or (fmt is None and MANIFEST in own) \
                or WRITING_MARKER in own:  # an unfinished ckptctl write is listed incomplete
            found[d] = {k: v for k, v in files.items() if d == "" or k.startswith(d + "/")}
        elif fmt == "torch":
            if any(_HF_BIN.match(f) for f in own):
                found[d] = {k: v for k, v in files.items() if d == "" or k.startswith(d + "/")}
            else:
                for f in own:
                    if is_torch_file(f):
                        found[posixpath.join(d, f)] = {posixpath.join(d, f): own[f]}
    return found


def _located(store, rel: str, group: dict[str, int]) -> tuple:
    """What :func:`~ckptctl.formats.detect.locate` would return for one candidate, cut
    from the root's listing: the checkpoint is classified without listing it again."""
    if rel in group:  # a lone torch.save file
        d, name = posixpath.split(rel)
        return (store.child(d) if d else store), {name: group[rel]}, name
    if not rel:
        return store, dict(group), None
    return store.child(rel), {k[len(rel) + 1:]: v for k, v in group.items()}, None


def _lone_file(store, root: str, storage_options: dict | None) -> tuple:
    """(store, files) when ``root`` lists nothing: a missing place is an error (exit 3),
    an empty folder or bucket lists no checkpoint, a file is listed from its folder."""
    if not store.exists():
        raise NotFoundError(root, "no such file or directory")
    if store.isdir():
        return store, {}
    parent_url, name = root.rstrip("/").rsplit("/", 1) if "/" in root.rstrip("/") else (".", root)
    parent = open_store(parent_url or "/", storage_options)
    return parent, {name: parent.size(name)}


def ls(root: str, storage_options: dict | None = None, *, workers: int = 8,
       manifests: bool = False) -> LsResult:
    """List the checkpoints under ``root``, sorted by step, then name in natural order
    (:func:`~ckptctl.model.natural_key`). Files with a checkpoint's suffix that are no
    checkpoint (TorchScript archives, ``.pth`` path files) are skipped, not called corrupt.
    ``manifests``: also hand back each sealed checkpoint's manifest (``gc``: tags, ids,
    pack bases), read from what classifying it fetched (no new request on S3)."""
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

    skipped: dict[str, str] = {}

    def row(rel: str) -> CheckpointRow | None:
        url = store.display(rel) if rel else store.url
        located = _located(store, rel, groups[rel])
        try:
            rep = checkpoint_state(url, storage_options, located=located)
        except StorageError:
            raise  # the storage itself failed: not a finding about one checkpoint
        except CkptError as e:  # one bad checkpoint never hides the others
            rep = StateReport(CORRUPT, f"{e.code}: {e}", None, None)
        if rep.state in (CORRUPT, UNKNOWN) and rel in groups[rel]:  # a lone file unloaded:
            why = not_a_checkpoint(store, rel, groups[rel][rel])  # TorchScript, .pth text?
            if why:  # not listed (healthy files cost no extra read)
                skipped[rel] = why
                return None
        step = rep.step if rep.step is not None else step_from_name(rel or root)
        fmt = rep.format or detect_format(  # a lone file keeps its name (relpath gives ".")
            {posixpath.basename(k) if k == rel else posixpath.relpath(k, rel) if rel else k: v
             for k, v in groups[rel].items()})
        mtime = None
        marker = max(groups[rel], key=lambda k: (k.endswith((MANIFEST, ".metadata")), k))
        try:
            mtime = store.modified(marker)
        except Exception:  # noqa: BLE001 - a missing mtime is not worth failing ls
            pass
        manifest = None
        if manifests and rep.state == "sealed":
            try:
                manifest = Manifest.read(located[0], located[1])
            except StorageError:
                raise
            except CkptError:  # changed since it was classified: no tags, id or base
                pass
        own = located[1]
        pinned = not located[2] and PIN_FILE in own
        content = [v for k, v in own.items() if not (pinned and k == PIN_FILE)]
        return CheckpointRow(rel or posixpath.basename(root.rstrip("/")), url, step, fmt,
                             rep.state, rep.reason, sum(content), len(content), mtime,
                             pinned, located, manifest)

    with ThreadPoolExecutor(max(1, min(workers, len(groups)))) as pool:
        rows = [r for r in pool.map(row, sorted(groups)) if r is not None]
    if lone and not rows:
        raise UnsupportedFormatError(root, f"not a checkpoint: {next(iter(skipped.values()))}")
    rows.sort(key=lambda r: (r.step is None, r.step if r.step is not None else 0,
                             natural_key(r.name)))
    return LsResult(shown_root, rows)
