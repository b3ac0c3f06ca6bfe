"""The ckptctl manifest, ``ckptctl.manifest.json``: the commit marker of a sealed checkpoint.

A :class:`Manifest` is parsed (bounded, validated: every file a safe relative path with a
size and a hash) and serialised here; ``writing/commit.py`` builds one from what a writer
wrote and commits it. Its :attr:`~Manifest.id` comes from content alone.

>>> m = Manifest.parse(b'{"hash": "xxh3-128", "files": {"a.bin": {"size": 3, "hash": "ab"}}}', "x")
>>> m.files["a.bin"], m.id[:9], m.total_bytes
(FileEntry(size=3, hash='ab'), 'xxh3-128:', 3)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import FormatError, UnsafeInputError
from ..storage import Store, safe_relpath
from .limits import load_json

MANIFEST = "ckptctl.manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
#: Written first and removed last by every ckptctl writer (writing/output.py): while it is
#: there, the folder is an unfinished write whatever else it holds.
WRITING_MARKER = ".ckptctl-writing"
#: A local promote builds ``.NAME`` + this beside its destination and renames it into
#: place last: one killed leaves only that folder (``verify`` of the destination says so).
PROMOTE_WORK_SUFFIX = ".ckptctl-promote"
#: A pin (``ckptctl pin``): kept by ``gc`` and ``rm``; it belongs to one place, so it is not
#: part of the checkpoint's content (never in a manifest, never copied by ``promote``).
PIN_FILE = ".ckptctl-pinned"
#: Files of ckptctl's own that sit in a checkpoint folder but are not its content.
CONTROL_FILES = (MANIFEST, WRITING_MARKER, PIN_FILE)
#: A single-file checkpoint (``train.pt``) has no folder of its own: its manifest, writing
#: marker and pin sit beside it, named after it (``train.pt.ckptctl.manifest.json``,
#: ``train.pt.ckptctl-writing``, ``train.pt.ckptctl-pinned``): files it owns, as a folder
#: owns its own (listed, copied, pinned and removed with it; never a checkpoint of their own).
SIDECAR_SUFFIXES = {MANIFEST: ".ckptctl.manifest.json", WRITING_MARKER: ".ckptctl-writing",
                    PIN_FILE: ".ckptctl-pinned"}
#: What a single-file checkpoint's name ends with (formats/locate.py: ``file_format``).
_SINGLE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
#: A delta pack in another root needs this checkpoint as its base: one small file per
#: pack, ``.ckptctl-needed-by.<hash of the pack's URL>`` (catalog/ownership.py); bound to
#: this place like a pin, so never copied and never part of a manifest.
NEEDED_BY_PREFIX = ".ckptctl-needed-by."


def control_name(control: str, single: str | None = None) -> str:
    """The name of ckptctl's file ``control`` (:data:`MANIFEST`, :data:`WRITING_MARKER`,
    :data:`PIN_FILE`) for a checkpoint: in its folder, or beside its one file ``single``
    (:data:`SIDECAR_SUFFIXES`).

    >>> control_name(MANIFEST), control_name(MANIFEST, "train.pt")
    ('ckptctl.manifest.json', 'train.pt.ckptctl.manifest.json')
    >>> control_name(PIN_FILE, "epoch=0-step=2.ckpt")
    'epoch=0-step=2.ckpt.ckptctl-pinned'
    """
    return control if single is None else single + SIDECAR_SUFFIXES[control]


def sidecar_of(rel: str) -> tuple[str, str] | None:
    """``(file, control)`` when ``rel`` is ckptctl's file ``control`` beside the
    single-file checkpoint ``file`` (same folder), else None.

    >>> sidecar_of("run/train.pt.ckptctl.manifest.json")
    ('run/train.pt', 'ckptctl.manifest.json')
    >>> sidecar_of(".ckptctl-pinned") is None, sidecar_of("notes.ckptctl-pinned") is None
    (True, True)
    """
    for control, suffix in SIDECAR_SUFFIXES.items():
        if rel.endswith(suffix):
            owner = rel[:-len(suffix)]
            if owner.rsplit("/", 1)[-1].endswith(_SINGLE_SUFFIXES):
                return owner, control
    return None


def sidecars(single: str, files: dict[str, int]) -> dict[str, int]:
    """The sidecars of the single-file checkpoint ``single`` that the listing ``files``
    (of the folder holding it) shows.

    >>> sidecars("a.pt", {"a.pt": 9, "a.pt.ckptctl-pinned": 1, "b.pt.ckptctl-pinned": 1})
    {'a.pt.ckptctl-pinned': 1}
    """
    return {name: files[name] for c in CONTROL_FILES
            if (name := control_name(c, single)) in files}


def writer_unfinished(files: dict[str, int], single: str | None = None) -> bool:
    """Did a ckptctl writer start in this folder (or on this one file) and not finish?

    >>> writer_unfinished({".ckptctl-writing": 80, "model.safetensors": 8}), writer_unfinished({})
    (True, False)
    >>> writer_unfinished({"x.pt": 8, "x.pt.ckptctl-writing": 80}, "x.pt")
    True
    """
    return control_name(WRITING_MARKER, single) in files


def is_control_file(rel: str) -> bool:
    """Is ``rel`` one of ckptctl's own files rather than checkpoint content?

    >>> is_control_file("ckptctl.manifest.json"), is_control_file(".ckptctl-pinned"), is_control_file("a.pt")
    (True, True, False)
    >>> is_control_file(".ckptctl-needed-by.0f3a9c"), is_control_file("a.pt.ckptctl-pinned")
    (True, True)
    """
    return rel in CONTROL_FILES or rel.startswith(NEEDED_BY_PREFIX) or sidecar_of(rel) is not None


@dataclass(frozen=True)
class FileEntry:
    size: int
    hash: str


@dataclass
class Manifest:
    """What a manifest says: the checkpoint's files with their sizes and content hashes,
    its format, step and tags, and a summary of the logical model.

    ``base`` is the id of the checkpoint this one is stored against (a delta pack), or
    None. ``extra`` keeps keys this version does not know, so a rewrite loses nothing.
    """

    files: dict[str, FileEntry]
    hash: str = "xxh3-128"
    format: str | None = None
    step: int | None = None
    tags: list[str] = field(default_factory=list)
    created: str | None = None
    summary: dict = field(default_factory=dict)
    tool: str | None = None
    schema: int = 1
    base: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        """``<algo>:<digest>`` of the files table alone (see :func:`manifest_id`)."""
        return manifest_id(self.to_dict())

    @property
    def checkpoint_id(self) -> str:
        """The id of the checkpoint this folder restores: a pack's manifest names it as
        ``packs`` (its own :attr:`id` is the pack's files'); anything else is itself.

        >>> Manifest({}, extra={"packs": "xxh3-128:ab"}).checkpoint_id
        'xxh3-128:ab'
        """
        packs = self.extra.get("packs")
        return packs if isinstance(packs, str) else self.id

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def hashes(self) -> dict[str, tuple[str, int]]:
        """Every file as ``(digest, size)``, the form writers hand over."""
        return {rel: (f.hash, f.size) for rel, f in self.files.items()}

    def to_dict(self) -> dict:
        doc = dict(self.extra)
        doc.update({"schema": self.schema, "tool": self.tool, "format": self.format,
                    "step": self.step, "tags": sorted(set(self.tags)), "created": self.created,
                    "hash": self.hash, "summary": self.summary,
                    "files": {rel: {"size": f.size, "hash": f.hash}
                              for rel, f in sorted(self.files.items())}})
        if self.base is not None:
            doc["base"] = self.base
        return doc

    def to_bytes(self) -> bytes:
        """Canonical bytes (:func:`serialize`)."""
        return serialize(self.to_dict())

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Manifest":
        """Validate and parse manifest bytes; :class:`FormatError` /
        :class:`UnsafeInputError` (a path leaving the root) naming ``where`` else.

        >>> Manifest.parse(b'{"files": {"../x": {"size": 1, "hash": "a"}}}', "m")
        Traceback (most recent call last):
        ckptctl.errors.UnsafeInputError: m: path '../x' escapes the checkpoint root
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise UnsafeInputError(where, "manifest is absurdly large")
        doc = load_json(data, where, "manifest")
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise FormatError(where, "manifest has no files table")
        files = {}
        for rel, rec in doc["files"].items():
            safe = safe_relpath(rel, where=where)
            if safe != rel:
                raise FormatError(where, f"manifest names {rel!r}, not a normalised path")
            size = rec.get("size") if isinstance(rec, dict) else None
            digest = rec.get("hash") if isinstance(rec, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 \
                    or not isinstance(digest, str):
                raise FormatError(where, f"manifest entry {rel!r} needs a size and a hash")
            files[rel] = FileEntry(size, digest)
        step = doc.get("step")
        tags = doc.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise FormatError(where, "manifest tags must be a list of strings")
        known = {"files", "hash", "format", "step", "tags", "created", "summary", "tool",
                 "schema", "base"}
        return cls(files=files, hash=str(doc.get("hash") or "xxh3-128"),
                   format=doc.get("format") if isinstance(doc.get("format"), str) else None,
                   step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                   tags=list(tags), created=doc.get("created"),
                   summary=doc.get("summary") if isinstance(doc.get("summary"), dict) else {},
                   tool=doc.get("tool"), schema=doc.get("schema") or 1,
                   base=doc.get("base") if isinstance(doc.get("base"), str) else None,
                   extra={k: v for k, v in doc.items() if k not in known})

    @classmethod
    def read(cls, store: Store, files: dict[str, int] | None = None,
             single: str | None = None) -> "Manifest | None":
        """The checkpoint's manifest, or None when it has none (``files``: its listing,
        when the caller has it; else one existence check). ``single``: the checkpoint is
        that one file in ``store``, its manifest the sidecar beside it."""
        name = control_name(MANIFEST, single)
        where = store.display(name)
        if files is not None:
            if name not in files:
                return None
            if files[name] > MAX_MANIFEST_BYTES:
                raise UnsafeInputError(where, "manifest is absurdly large")
        elif not store.exists(name):
            return None
        return cls.parse(store.read(name), where)


def read_manifest(store: Store, files: dict[str, int],
                  single: str | None = None) -> Manifest | None:
    """The parsed manifest, or None when the checkpoint has none (``single``: of that one
    file, from its sidecar)."""
    return Manifest.read(store, files, single)

SCHEMA = 1

#: Names a writer uses while a file is not yet committed; never part of a checkpoint.
TEMP_PATTERNS = ("*.tmp", "*.tmp-*", ".*.tmp", "*.partial", "*.part", "*.incomplete",
                 ".metadata.tmp", "*.lock", ".*.upload", ".*.parts")


def is_temp_name(rel: str) -> bool:
    """Is ``rel`` a writer's temporary file (``.metadata.tmp``, ``x.partial``...)?

    >>> is_temp_name(".metadata.tmp"), is_temp_name("a/.ckptctl.manifest.json.x1.tmp"), is_temp_name("__0_0.distcp")
    (True, True, False)
    """
    import fnmatch

    base = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(base, p) for p in TEMP_PATTERNS)


def logical_digest(ck, algo: str = "xxh3-128") -> str:
    """A digest of the logical model: names, dtypes, shapes, chunk boxes and byte extents.

    Two checkpoints with the same digest describe the same tensors laid out the same way.
    """
    from ..storage import digest_bytes

    rows = []
    for t in sorted(ck.tensors.values(), key=lambda t: t.name):
        rows.append(["t", t.name, t.dtype.name, list(t.shape),
                     sorted([list(c.offsets), list(c.sizes), c.extent.file, c.extent.offset,
                             c.extent.length, c.extent.encoding] for c in t.chunks)])
    for o in sorted(ck.objects.values(), key=lambda o: o.name):
        e = o.extent
        rows.append(["o", o.name] + ([e.file, e.offset, e.length] if e else []))
    return digest_bytes(json.dumps(rows, separators=(",", ":")).encode(), algo)


def serialize(doc: dict) -> bytes:
    """Canonical bytes: sorted keys, fixed separators, a trailing newline."""
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def manifest_id(doc: dict, algo: str | None = None) -> str:
    """The checkpoint's identity, ``<algo>:<digest>``, derived from its content alone (each
    file's name, size and hash; not the creation time, tags or tool version): two sealers of
    the same bytes get the same id, whoever's manifest is stored.

    >>> a = {"hash": "xxh3-128", "created": "x", "files": {"f": {"size": 1, "hash": "ab"}}}
    >>> manifest_id(a) == manifest_id(dict(a, created="y"))
    True
    """
    from ..storage import digest_bytes

    algo = algo or doc.get("hash") or "xxh3-128"
    files = {rel: {"size": rec.get("size"), "hash": rec.get("hash")}
             for rel, rec in sorted((doc.get("files") or {}).items())}
    canon = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return f"{algo}:{digest_bytes(canon, algo)}"
