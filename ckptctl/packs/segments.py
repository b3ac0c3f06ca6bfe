"""Where a checkpoint's tensor bytes lie, and how ``pack`` cuts each file into segments.

Every original file is tiled by ``tensor`` segments (one tensor chunk's element bytes:
safetensors extents, the storage records of DCP chunk zips and torch.save files; at least
:data:`MIN_TENSOR_BYTES`) and ``raw`` segments (everything else: zip headers,
``.metadata``, JSON headers, pickles); :func:`plan_segments` then cuts each segment into
chunks of a whole number of elements.
"""
from __future__ import annotations

import collections

from ..errors import CkptError
from ..formats.pack import Segment

#: Tensors smaller than this stay in the raw bytes around them: each chunk costs ~0.1 ms
#: to encode and decode whatever its size, and a few bytes of planes compress no better
#: (a real model of 1,036 tensors, 848 under 1 KiB: pack 1.75x faster, ratio +1%).
MIN_TENSOR_BYTES = 4096


def _torch_records(store, rel: str, size: int) -> list[tuple[int, int, int, tuple]]:
    """(offset, length, itemsize, key) of every storage record of a torch.save zip, read
    without torch: the zip directory, then ``data.pkl`` for each storage's dtype (a
    storage whose dtype cannot be told is packed with itemsize 1)."""
    from ..formats.torchzip import TAIL_GUESS, central_directory, local_data_offset

    if size < 22 or store.read_range(rel, 0, 4) != b"PK\x03\x04":
        return []  # legacy (non-zip) torch.save: one raw segment
    where = store.display(rel)
    try:
        tail = store.read_range(rel, max(0, size - TAIL_GUESS), size)
        entries, need = central_directory(tail, size, where=where)
        if need:
            entries, _ = central_directory(store.read_range(rel, size - need, size), size,
                                           where=where)
    except CkptError:
        return []
    dtypes = _storage_dtypes(store, rel, entries, where)
    out = []
    for en in entries:
        parts = en.name.split("/")
        if len(parts) < 3 or parts[-2] != "data" or en.method != 0 or en.usize == 0:
            continue
        try:
            hdr = store.read_range(rel, en.header_offset, en.header_offset + 30 + 1024)
            off = local_data_offset(hdr, en, where=where)
        except CkptError:
            continue
        if off + en.usize > size:
            continue
        itemsize = _itemsize(dtypes.get(parts[-1]))
        if en.usize % itemsize:
            itemsize = 1
        out.append((off, en.usize, itemsize, ("torch", rel, parts[-1], dtypes.get(parts[-1]),
                                              en.usize)))
    return out


def _itemsize(dtype: str | None) -> int:
    from ..model import DTYPES

    d = DTYPES.get(dtype or "")
    return d.itemsize if d is not None and d.bits % 8 == 0 and d.itemsize in (1, 2, 4, 8) \
        else 1


def _storage_dtypes(store, rel: str, entries, where: str) -> dict[str, str]:
    """Storage key -> dtype, from the persistent ids in a torch.save ``data.pkl`` (never
    running code: an allow-list unpickler; what it refuses leaves the keys seen so far)."""
    from ..formats.torchzip import local_data_offset, storage_dtypes

    pkl = [e for e in entries if e.name.endswith("/data.pkl") and e.method == 0]
    if len(pkl) != 1 or pkl[0].usize > 64 << 20:
        return {}
    e = pkl[0]
    try:
        hdr = store.read_range(rel, e.header_offset, e.header_offset + 30 + 1024)
        off = local_data_offset(hdr, e, where=where)
        data = store.read_range(rel, off, off + e.usize)
    except CkptError:
        return {}
    return storage_dtypes(data, where=where)


def tensor_spans(ck, store,
                 files: dict[str, int]) -> dict[str, list[tuple[int, int, int, tuple]]]:
    """Per file, the byte spans that hold tensor elements: (offset, length, itemsize, key),
    sorted, without overlaps. ``key`` identifies the logical tensor chunk (name, box,
    dtype, length) so a base's bytes for it can be found.

    >>> from ckptctl.formats.detect import open_checkpoint         # doctest: +SKIP
    >>> ck = open_checkpoint("hf/")                                 # doctest: +SKIP
    >>> tensor_spans(ck, ck.store, ck.files)["model.safetensors"][0]  # doctest: +SKIP
    (104, 16, 4, ('w', (0,), (4,), 'float32', 16))
    """
    from ..formats.tensorio import locate_payload

    spans: dict[str, list] = collections.defaultdict(list)
    torch_files = set()
    for t in ck.tensors.values():
        for c in t.chunks:
            e = c.extent
            if e.encoding == "torch_save":
                torch_files.add(e.file)
                continue
            if e.encoding == "raw":
                off, n = e.offset, e.length
            elif e.encoding == "torch_zip":
                try:
                    p = locate_payload(ck, e)
                except CkptError:
                    continue
                off, n = p.offset, p.length
            else:  # compressed already (DCP stream.zstd): raw bytes
                continue
            if n <= 0 or e.file not in files or off + n > files[e.file]:
                continue
            k = t.dtype.itemsize if t.dtype.bits % 8 == 0 else 1
            if n % k or k not in (1, 2, 4, 8):
                k = 1
            spans[e.file].append((off, n, k, (t.name, tuple(c.offsets), tuple(c.sizes),
                                              t.dtype.name, n)))
    for o in ck.objects.values():
        if o.extent is not None and o.extent.encoding == "torch_save":
            torch_files.add(o.extent.file)
    for rel in sorted(torch_files):
        if rel in files:
            spans[rel].extend(_torch_records(store, rel, files[rel]))
    out = {}
    for rel, lst in spans.items():
        lst.sort(key=lambda s: (s[0], -s[1]))
        kept, end = [], 0
        for s in lst:
            if s[0] >= end:  # a second name on the same bytes (an alias) is stored once
                kept.append(s)
                end = s[0] + s[1]
        out[rel] = kept
    return out


def plan_segments(rel: str, size: int, spans: list, chunk: int,
                  base_map: dict | None) -> list[tuple[Segment, list[int]]]:
    """Segments tiling file ``rel``'s ``[0, size)``, each with its chunk sizes (no refs
    yet): a ``tensor`` segment per span of at least :data:`MIN_TENSOR_BYTES` (against
    ``base_map[key]``, the base's (file, offset) for the same tensor chunk, where there is
    one), cut into chunks of at most ``chunk`` bytes and a whole number of elements; a
    ``raw`` segment for each gap.

    >>> plan = plan_segments("m.safetensors", 10000, [(100, 8192, 4, ("w",))], 4096,
    ...                      {("w",): ("m.safetensors", 96)})
    >>> [(s.kind, s.offset, s.length, s.base, sizes)
    ...  for s, sizes in plan]  # doctest: +NORMALIZE_WHITESPACE
    [('raw', 0, 100, None, [100]), ('tensor', 100, 8192, ('m.safetensors', 96), [4096, 4096]),
     ('raw', 8292, 1708, None, [1708])]
    """
    segs = []
    pos = 0

    def add(kind, off, n, k, base):
        sizes = []
        step = max(k, chunk - chunk % k)
        left = n
        while left:
            sizes.append(min(step, left))
            left -= sizes[-1]
        segs.append((Segment(kind, off, n, k, base, []), sizes))

    for off, n, k, key in spans:
        if n < MIN_TENSOR_BYTES:  # left in the raw bytes around it (see MIN_TENSOR_BYTES)
            continue
        if off > pos:
            add("raw", pos, off - pos, 1, None)
        base = base_map.get(key) if base_map else None
        add("tensor", off, n, k, base)
        pos = off + n
    if pos < size:
        add("raw", pos, size - pos, 1, None)
    return segs
