"""The ckptctl manifest, ``ckptctl.manifest.json``: the commit marker of a sealed checkpoint.

This module only reads it (``seal`` writes it). It is small JSON, bounded before parsing.

>>> MANIFEST
'ckptctl.manifest.json'
"""
from __future__ import annotations

import json

from ..errors import FormatError, UnsafeInputError
from ..storage import Store
from .limits import load_json

MANIFEST = "ckptctl.manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
#: Written first and removed last by every ckptctl writer (ops/output.py): while it is
#: there, the folder is an unfinished write whatever else it holds.
WRITING_MARKER = ".ckptctl-writing"


def writer_unfinished(files: dict[str, int]) -> bool:
    """Did a ckptctl writer start in this folder and not finish?

    >>> writer_unfinished({".ckptctl-writing": 80, "model.safetensors": 8}), writer_unfinished({})
    (True, False)
    """
    return WRITING_MARKER in files


def read_manifest(store: Store, files: dict[str, int]) -> dict | None:
    """The parsed manifest, or None when the checkpoint has none."""
    if MANIFEST not in files:
        return None
    where = store.display(MANIFEST)
    if files[MANIFEST] > MAX_MANIFEST_BYTES:
        raise UnsafeInputError(where, "manifest is absurdly large")
    doc = load_json(store.read(MANIFEST), where, "manifest")
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise FormatError(where, "manifest has no files table")
    return doc

SCHEMA = 1

#: Names a writer uses while a file is not yet committed; never part of a checkpoint.
TEMP_PATTERNS = ("*.tmp", "*.tmp-*", ".*.tmp", "*.partial", "*.part", "*.incomplete",
                 ".metadata.tmp", "*.lock")


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


def build_manifest(ck, hashes: dict[str, tuple[str, int]], *, algo: str, step: int | None,
                   tags: list[str], tool_version: str, created: str, summary: dict) -> dict:
    """The manifest document of a checkpoint whose files hash to ``hashes``."""
    return {
        "schema": SCHEMA,
        "tool": f"ckptctl {tool_version}",
        "format": ck.format,
        "step": step,
        "tags": sorted(set(tags)),
        "created": created,
        "hash": algo,
        "files": {rel: {"size": size, "hash": digest} for rel, (digest, size) in sorted(hashes.items())},
        "summary": summary,
    }


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
