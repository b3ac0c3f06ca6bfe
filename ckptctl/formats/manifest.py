"""The ckptctl manifest, ``ckptctl.manifest.json``: the commit marker of a sealed checkpoint.

This module only reads it (``seal`` writes it). It is small JSON, bounded before parsing.

>>> MANIFEST
'ckptctl.manifest.json'
"""
from __future__ import annotations

import json

from ..errors import FormatError, UnsafeInputError
from ..storage import Store

MANIFEST = "ckptctl.manifest.json"
MAX_MANIFEST_BYTES = 256 << 20


def read_manifest(store: Store, files: dict[str, int]) -> dict | None:
    """The parsed manifest, or None when the checkpoint has none."""
    if MANIFEST not in files:
        return None
    where = store.display(MANIFEST)
    if files[MANIFEST] > MAX_MANIFEST_BYTES:
        raise UnsafeInputError(where, "manifest is absurdly large")
    try:
        doc = json.loads(store.read(MANIFEST))
    except (UnicodeDecodeError, ValueError):
        raise FormatError(where, "manifest is not valid JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise FormatError(where, "manifest has no files table")
    return doc
