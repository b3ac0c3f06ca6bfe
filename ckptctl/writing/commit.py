"""One commit for every writer: build the :class:`~ckptctl.formats.manifest.Manifest` from
what was written and publish it last, exclusively, then read it back.

``seal`` hands over the hashes it computed, ``reshard``/``consolidate`` the hashes their
writers computed while writing (nothing is listed or re-read but the format's own small
metadata, for the summary), ``promote`` the source's manifest, which it copies verbatim
so the checkpoint keeps its id.

>>> import tempfile, pathlib
>>> from ckptctl.storage import open_store
>>> from ckptctl.formats.manifest import FileEntry, Manifest
>>> s = open_store(tempfile.mkdtemp())
>>> m = Manifest({"a.bin": FileEntry(3, "ab")}, step=7)
>>> commit(s, m) == m.id == Manifest.read(s).id
True
"""
from __future__ import annotations

import datetime as dt

from .. import __version__
from ..errors import Finding, FormatError
from ..formats.manifest import MANIFEST, FileEntry, Manifest, control_name, logical_digest
from ..storage import Store


#: Files a format reads as "this checkpoint is complete": every copier writes them after the
#: data (and a deleter removes them, with the manifest, before it).
FORMAT_MARKERS = (".metadata", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_format_marker(rel: str) -> bool:
    """Is ``rel`` a format's own commit marker (DCP ``.metadata``, an HF index)?

    >>> is_format_marker("sub/.metadata"), is_format_marker("__0_0.distcp")
    (True, False)
    """
    return rel.rsplit("/", 1)[-1] in FORMAT_MARKERS


def write_order(names, sizes: dict[str, int]) -> list[str]:
    """The order a copier writes files in: data, largest first (they take longest), then
    the format markers.

    >>> write_order([".metadata", "a", "b"], {".metadata": 1, "a": 5, "b": 9})
    ['b', 'a', '.metadata']
    """
    data = sorted((n for n in names if not is_format_marker(n)), key=lambda n: (-sizes[n], n))
    return data + sorted(n for n in names if is_format_marker(n))


def manifest_for(ck, hashes: dict[str, tuple[str, int]], *, algo: str = "xxh3-128",
                 step: int | None = None, tags: list[str] | None = None,
                 base: str | None = None) -> Manifest:
    """The manifest of checkpoint ``ck`` whose files hash to ``hashes`` (file ->
    (digest, size)), with a summary of its logical model. ``created`` is when its newest
    file was written (its store's modification times; now where it keeps none): the same
    whoever seals it and whenever, so a writer that seals as it saves and a later ``seal``
    write the same bytes.

    >>> manifest_for(ck, {"__0_0.distcp": ("9f2c...", 4096)}, step=20).id   # doctest: +SKIP
    'xxh3-128:5c1f...'
    """
    from ..catalog.inspect import summarize

    s = summarize(ck)
    store = getattr(ck, "store", None)
    written = store.newest_modified(hashes) if store is not None else None
    when = (dt.datetime.fromtimestamp(written, dt.timezone.utc) if written is not None
            else dt.datetime.now(dt.timezone.utc))
    summary = {"num_tensors": s.num_tensors, "num_objects": s.num_objects,
               "num_params": s.num_params, "total_bytes": sum(n for _, n in hashes.values()),
               "logical_digest": logical_digest(ck)}
    return Manifest(files={rel: FileEntry(size, digest)
                           for rel, (digest, size) in sorted(hashes.items())},
                    hash=algo, format=ck.format, step=step, tags=sorted(set(tags or [])),
                    created=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    summary=summary, tool=f"ckptctl {__version__}", base=base)


def commit(store: Store, manifest: Manifest, *, replace: bool = False,
           data: bytes | None = None, single: str | None = None) -> str:
    """Publish ``manifest`` as the checkpoint's commit marker; return its id.

    Written last, atomically, and exclusively unless ``replace`` (``seal --update``:
    the new manifest replaces the old one in one step, so a crash leaves one or the
    other). ``data``: the exact bytes to store (``promote`` keeps the source's bytes).
    ``single``: the checkpoint is that one file in ``store``; its manifest is the sidecar
    beside it (``train.pt.ckptctl.manifest.json``).
    Another writer may have committed first, or after us on servers that ignore
    ``If-None-Match`` (rclone): what is stored is read back and must describe the same
    content, step and tags, else :class:`~ckptctl.errors.Finding` (exit 1) says so.

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> s = open_store(tempfile.mkdtemp())
    >>> m = Manifest({"a.pt": FileEntry(3, "ab")})
    >>> commit(s, m, single="a.pt") == m.id, sorted(s.list_files())
    (True, ['a.pt.ckptctl.manifest.json'])
    """
    data = manifest.to_bytes() if data is None else data
    name = control_name(MANIFEST, single)
    try:
        store.write_atomic(name, data, exclusive=not replace)
    except Finding as e:
        if e.code != "ALREADY_EXISTS":
            raise
    try:
        stored = Manifest.parse(store.read(name), store.display(name))
    except FormatError:
        stored = None
    if stored is None or _key(stored) != _key(manifest):
        raise Finding(store.display(name), "another writer committed this checkpoint at "
                      "the same time with other content, step or tags; its manifest won",
                      code="ALREADY_EXISTS")
    return manifest.id


def _key(m: Manifest) -> tuple:
    return m.id, m.step, sorted(m.tags)


def commit_written(store: Store, hashes: dict[str, tuple[str, int]], *, step: int | None,
                   tags: list[str] | None = None, algo: str = "xxh3-128") -> str:
    """Seal what a writer just wrote at ``store`` from the hashes it computed; its id.

    The output is opened from ``hashes`` (no listing); only its format's own metadata is
    read, for the manifest's summary.

    >>> commit_written(out.store, writer.hashes, step=20)           # doctest: +SKIP
    'xxh3-128:...'
    """
    from ..formats.detect import open_checkpoint

    files = {rel: size for rel, (_, size) in hashes.items()}
    out = open_checkpoint(store.url, None, read_step=False, located=(store, files, None))
    return commit(store, manifest_for(out, hashes, algo=algo, step=step, tags=tags))
