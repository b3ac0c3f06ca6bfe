"""``unpack``: restore the checkpoint a pack holds, byte for byte, and
:func:`open_pack_url`, a pack opened for reading.

``unpack`` writes every original file back, checking each against the source manifest's
hash while writing, and the source's manifest last: the restored checkpoint has the
source's id. A pack of a single-file checkpoint unpacks back to the one file, byte for
byte, and its sidecar manifest, DST naming the file or the folder it goes into
(:func:`~ckptctl.formats.locate.single_target`).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import Finding, FormatError, UsageError
from ..formats.manifest import Manifest
from ..formats.pack import PACK_INDEX, PackStore, is_pack, open_pack
from ..storage import new_hasher, open_store
from ..writing.commit import is_format_marker, write_order
from ..writing.output import OutputDir


@dataclass
class UnpackResult:
    """What ``unpack`` restored: ``manifest_id`` is the source checkpoint's id."""

    src: str
    dst: str
    manifest_id: str
    base: str | None
    depth: int
    bytes: int
    num_files: int
    chunks: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Restored bytes per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """The ``--json`` document: every field, and the rate as ``bytes_per_second``."""
        d = asdict(self)
        d["bytes_per_second"] = round(self.rate)
        return d


def open_pack_url(url: str, storage_options: dict | None = None, *, base: str | None = None,
                  base_storage_options: dict | None = None,
                  workers: int | None = None) -> PackStore:
    """The pack at ``url`` as a :class:`~ckptctl.formats.pack.PackStore` (``base``: the
    base's URL, for a delta pack whose recorded base is elsewhere); a folder that is no
    pack is a usage error.

    >>> open_pack_url("packs/step-2000").index.depth                  # doctest: +SKIP
    1
    """
    raw = open_store(url, storage_options)
    files = raw.list_files()
    if not files:
        from ..errors import NotFoundError

        if not raw.exists():
            raise NotFoundError(url, "no such file or directory")
        raise UsageError("not a pack (empty)", url)
    if not is_pack(files):
        raise UsageError(f"not a pack (no {PACK_INDEX}); use `ckptctl promote` to copy a "
                         "plain checkpoint", url)
    return open_pack(raw, files, base=base, workers=workers,
                     storage_options=base_storage_options if base_storage_options is not None
                     else storage_options)


def unpack(pack_url: str, dst: str, *, base: str | None = None, workers: int | None = None,
           force: bool = False, storage_options: dict | None = None,
           dst_storage_options: dict | None = None, base_storage_options: dict | None = None,
           on_bytes: Callable[[int], None] | None = None,
           on_total: Callable[[int], None] | None = None) -> UnpackResult:
    """Restore the checkpoint a pack holds at ``dst``, byte for byte.

    Every file is checked against the source manifest's hash as it is written; the
    source's manifest (its own bytes) is written last, so the restored checkpoint has the
    source's id. A corrupt chunk stops the run naming the chunk, and whatever was
    written is removed (``.ckptctl-writing`` marks DST meanwhile).

    >>> unpack("packs/step-200", "restore/step-200").manifest_id      # doctest: +SKIP
    'xxh3-128:...'
    """
    from ..writing.commit import commit as commit_manifest

    t0 = time.monotonic()
    workers = max(1, workers or os.cpu_count() or 1)
    ps = open_pack_url(pack_url, storage_options, base=base,
                       base_storage_options=base_storage_options, workers=workers)
    idx = ps.index
    raw_man = ps.read(idx.manifest_name)
    man = Manifest.parse(raw_man, ps.display(idx.manifest_name))
    if man.id != idx.source_id:
        raise FormatError(ps.display(idx.manifest_name), f"restored manifest is checkpoint "
                          f"{man.id}, the pack says {idx.source_id}", code="MANIFEST_MISMATCH")
    names = write_order(list(man.files), {r: f.size for r, f in man.files.items()})
    if on_total:
        on_total(man.total_bytes)
    single = idx.single  # one file, with its sidecars: DST is that file or its folder
    if single:
        from ..formats.locate import single_target

        folder, single = single_target(dst, single)
        dstore = open_store(folder, dst_storage_options)
    else:
        dstore = open_store(dst, dst_storage_options)

    par = max(1, min(workers, 4))  # files at once; each decodes a few chunks ahead
    ahead = max(2, (2 * workers) // par)

    def one(rel):
        h = new_hasher(man.hash)
        with out.open(rel) as f:
            for b in ps.iter_blocks(rel, on_bytes=on_bytes, ahead=ahead):
                f.write(b)
                h.update(b)
        if h.hexdigest() != man.files[rel].hash:
            raise Finding(ps.display(rel), f"restored bytes differ from the source manifest's "
                          f"hash ({man.hash})", code="HASH_MISMATCH")

    try:
        with OutputDir(dstore, command="unpack", force=force, source=ps.url,
                       single_file=single, marker=True) as out:
            data = [n for n in names if not is_format_marker(n)]
            out.map(one, data, par)
            for rel in names[len(data):]:
                one(rel)
            out.commit()
            mid = commit_manifest(dstore, man, data=raw_man, single=single)
    finally:
        ps.close()
    return UnpackResult(ps.url, dstore.display(single) if single else dstore.url, mid,
                        idx.base["id"] if idx.base else None,
                        idx.depth, man.total_bytes + len(raw_man), len(names) + 1, idx.modes(),
                        time.monotonic() - t0)
