"""The structure level of ``verify``, on top of the quick one
(:class:`~ckptctl.catalog.checks.QuickCheck`): :class:`StructureCheck` reads metadata and
the heads and tails of chunk files, never whole tensors: chunks tile each tensor exactly,
DCP chunk zips are well-formed and hold what the metadata says (dtype x elements = bytes),
object entries hold nothing the safe loader refuses, the state closure against
``require``, the manifest's format and logical digest against the files.

>>> c = StructureCheck("ckpt/", require="model,optim")     # doctest: +SKIP
>>> c.quick(); c.structure()                                # doctest: +SKIP
>>> [p.code for p in c.problems]                            # doctest: +SKIP
['MISSING_STATE']
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

from ..catalog.checks import QuickCheck
from ..catalog.closure import classify, parse_parts
from ..errors import CkptError, StorageError
from ..model import TensorEntry

#: Object entries up to this size are scanned for globals the safe loader refuses.
OBJECT_SCAN_LIMIT = 64 << 20
#: Bytes the structure check reads per DCP chunk when it reads only the zip's tail and head;
#: a file no larger than that times its chunks is read whole, in one request.
STRUCTURE_READ_PER_CHUNK = 16 << 10


class StructureCheck(QuickCheck):
    """The quick level's checks, then the structure level's (:meth:`structure`, once
    :meth:`quick` has opened the checkpoint). ``level``: the level verify runs at (the
    structure reads keep what the full level reads again); ``require``: state that must
    be there (``"model,optim"`` or a list); ``workers``: files read at once. The other
    arguments are :class:`~ckptctl.catalog.checks.QuickCheck`'s."""

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 level: str = "structure", require: str | list[str] | None = None,
                 workers: int = 4, **quick):
        super().__init__(url, storage_options, **quick)
        self.level, self.workers = level, workers
        self.require = parse_parts(require) if isinstance(require, str) else list(require or [])

    def structure(self):
        """Run the structure level's checks (module docstring) on the opened checkpoint."""
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
