"""``pack`` and ``unpack``: store a checkpoint as a lossless, compressed (optionally
delta-encoded) pack, and restore it byte for byte.

``pack`` reads SRC through the logical model: every original file is cut into ``tensor``
segments (one tensor chunk's element bytes: safetensors extents, the storage records of
DCP chunk zips and torch.save files) and ``raw`` segments (everything else: zip headers,
``.metadata``, JSON headers, pickles). Segments are cut into chunks of at most
``CHUNK_SIZE`` bytes (a whole number of elements), encoded on a thread pool (at most
2 x workers chunks in flight) by :mod:`ckptctl.formats.packcodec`, appended to data files
of at most 256 MiB of source each (cut from the source's sizes alone: :func:`data_layout`,
so processes under torchrun/srun can write different ones), and committed like every
writer (``.ckptctl-writing`` first, index,
then the pack's manifest last). With a base, a tensor segment whose logical tensor (same
name, chunk box, dtype and byte length) exists in the base is stored against the base's
bytes (``same``: nothing; else ``xor``).

``unpack`` writes every original file back, checking each against the source manifest's
hash while writing, and the source's manifest last: the restored checkpoint has the
source's id.

A single-file checkpoint (``train.pt``) packs into a pack folder like any other (its
index names the file, its sidecar manifest is packed beside it) and unpacks back to the
one file, byte for byte, and its sidecar manifest, DST naming the file or the folder it
goes into (:func:`~ckptctl.formats.locate.single_target`).

>>> import json, pathlib, struct, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp()); (d / "ck").mkdir()
>>> hdr = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
>>> _ = (d / "ck" / "model.safetensors").write_bytes(
...     struct.pack("<Q", len(hdr)) + hdr + bytes(range(256)) * 16)
>>> r = pack(str(d / "ck"), str(d / "p"), workers=1)   # seals ck first (it takes writes)
>>> r.chunks, r.sealed_source   # the JSON header and the manifest: zstd; the tensor: planes
({'planes': 1, 'zstd': 2}, True)
>>> unpack(str(d / "p"), str(d / "out")).manifest_id == r.source_id
True

Read in place, a pack is its checkpoint's files (:func:`~ckptctl.formats.pack.pack_view`):

>>> from ckptctl.formats.detect import locate
>>> from ckptctl.formats.pack import pack_view
>>> ps, files, _ = pack_view(locate(str(d / "p")))
>>> sorted(files), list(ps.read_range("model.safetensors", 8 + len(hdr), 8 + len(hdr) + 4))
(['ckptctl.manifest.json', 'model.safetensors'], [0, 1, 2, 3])
"""
from __future__ import annotations

import collections
import datetime as dt
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from .. import __version__
from ..errors import CkptError, Finding, FormatError, StorageError, UsageError
from ..formats.manifest import MANIFEST, FileEntry, Manifest, control_name
from ..formats.pack import (DATA_FILE_SIZE, DEFAULT_MAX_CHAIN, MAX_DEPTH, PACK_INDEX,
                            ChunkRef, PackIndex, PackStore, Segment, data_name, is_pack,
                            open_pack, relative_url)
from ..storage import new_hasher, open_store
from ..writing.commit import commit, is_format_marker, write_order
from ..writing.output import OutputDir

#: Tensors smaller than this stay in the raw bytes around them: each chunk costs ~0.1 ms
#: to encode and decode whatever its size, and a few bytes of planes compress no better
#: (a real model of 1,036 tensors, 848 under 1 KiB: pack 1.75x faster, ratio +1%).
MIN_TENSOR_BYTES = 4096



@dataclass
class PackResult:
    """What ``pack`` did. ``ratio`` = source bytes / pack bytes; ``full_reason`` says
    why a base was given but not used (the chain would grow past ``--max-chain``)."""

    src: str
    dst: str
    source_id: str
    pack_id: str
    base: str | None
    depth: int
    bytes_in: int
    bytes_out: int
    ratio: float
    chunks: dict[str, int]
    num_files: int
    data_files: int
    seconds: float
    sealed_source: bool = False
    full_reason: str | None = None
    tensor_segments: int = 0
    base_segments: int = 0
    #: the source had no manifest and was left without one (read-only, or
    #: ``seal_source=False``): the manifest packed was computed here
    source_unsealed: bool = False
    #: a packed base's content was read from this plain copy of it (same id, every byte
    #: proven against its manifest first) instead of through the base's delta chain
    base_read_from: str | None = None

    @property
    def rate(self) -> float:
        """Source bytes per second."""
        return self.bytes_in / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """The ``--json`` document: ``source_id`` is ``manifest_id`` there (the id of the
        checkpoint the pack holds, the one ``unpack`` restores; ``pack_id`` is the pack's
        own files'), and the rate is ``bytes_per_second`` (README, "JSON vocabulary")."""
        d = {("manifest_id" if k == "source_id" else k): v for k, v in asdict(self).items()}
        d["bytes_per_second"] = round(self.rate)
        return d


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
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_per_second"] = round(self.rate)
        return d


# --------------------------------------------------------------------------- segmenting


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


def tensor_spans(ck, store, files: dict[str, int]) -> dict[str, list[tuple[int, int, int, tuple]]]:
    """Per file, the byte spans that hold tensor elements: (offset, length, itemsize, key),
    sorted, without overlaps. ``key`` identifies the logical tensor chunk (name, box,
    dtype, length) so a base's bytes for it can be found.

    >>> from ckptctl.formats.detect import open_checkpoint         # doctest: +SKIP
    >>> tensor_spans(ck := open_checkpoint("hf/"), ck.store, ck.files)["model.safetensors"][0]  # doctest: +SKIP
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


def _plan_file(rel: str, size: int, spans: list, chunk: int,
               base_map: dict | None) -> list[tuple[Segment, list[int]]]:
    """Segments tiling ``[0, size)``, each with its chunk sizes (no refs yet)."""
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


# --------------------------------------------------------------------------- sources


def _source(src: str, options: dict | None, workers: int, *, seal_source: bool | None = None,
            source_manifest: bytes | None = None):
    """(store, files, manifest, its bytes, sealed by us, single file or None) of a
    complete source checkpoint. An unsealed one is hashed (:func:`~.seal.seal_or_hash`)
    unless ``source_manifest`` (its manifest, computed by the caller) is given; left
    unsealed, its manifest exists in memory only (``files`` has none) and is packed from
    there. A single-file checkpoint's store is the folder holding it, its manifest the
    sidecar beside it."""
    from ..formats.detect import locate
    from ..formats.locate import refuse_save_folder
    from ..formats.pack import pack_view

    located = pack_view(locate(src, options), options)
    refuse_save_folder(located, src, "pack")
    store, files, single = located
    mname = control_name(MANIFEST, single)
    sealed = False
    raw = source_manifest if mname not in files else None
    if mname not in files and raw is None:
        from ..integrity.seal import seal_or_hash

        man, sealed = seal_or_hash(src, options, seal_source=seal_source, workers=workers,
                                   located=located)  # refuses an incomplete source (exit 1)
        if sealed:
            store, files, _ = pack_view(locate(src, options), options)
        else:
            raw = man.to_bytes()
    if raw is None:
        raw = store.read(mname)
    man = Manifest.parse(raw, store.display(mname))
    for rel, rec in man.files.items():
        if files.get(rel) != rec.size:
            what = "missing" if rel not in files else f"{files[rel]} bytes, manifest says {rec.size}"
            raise Finding(store.display(rel), f"source does not match its manifest ({what}); "
                          "run `ckptctl verify` on it",
                          code="MISSING_FILE" if rel not in files else "SIZE_MISMATCH")
    return store, files, man, raw, sealed, single


def _open_base(base: str, options: dict | None, *, plain_copy: str | None = None,
               plain_options: dict | None = None, max_depth: int = MAX_DEPTH,
               listed: tuple | None = None):
    """(store, files, checkpoint, id, depth, read from, chain) of a sealed base (a pack
    works too; ``chain``: the URLs of its own bases, nearest first). ``plain_copy``:
    where a plain copy of a packed base may be (the source's sibling of the same name);
    when it holds the same checkpoint (same id) and its bytes hash to its manifest, the
    base's content is read from there (``read from`` is its URL, else None): a delta chain
    decodes level by level over the network, so reading through it costs time that grows
    with its depth. ``listed``: a listing of the folder holding the base and its chain,
    just made (``--base auto`` chose from it): no level is listed again. The chain's
    small files come from the object cache where it holds them (a level does not change
    once committed; :class:`~ckptctl.formats.pack.ChainWalk`), so a walk costs the same
    at depth 8 as at depth 1."""
    from ..formats.detect import open_checkpoint
    from ..formats.pack import ChainWalk, chain_urls, pack_view

    walk = ChainWalk(listed=listed, persist=True)
    located = pack_view(walk.locate(base, options), options, ahead=walk)
    store, files, single = located
    chain = chain_urls(store.url, store.index) if isinstance(store, PackStore) else []
    if isinstance(store, PackStore) and store.index.depth + 1 <= max_depth:
        from ..integrity.verify import base_unrestorable

        why = base_unrestorable(store, options)  # one listing and two small reads a level
        if why:
            raise Finding(base, f"cannot pack against it: {why}", code="MISSING_BASE")
    if isinstance(store, PackStore) and plain_copy and store.index.depth + 1 <= max_depth:
        bid, depth = store.index.source_id, store.index.depth + 1
        copy = _proven_copy(plain_copy, plain_options, bid)
        if copy is not None:
            return (*copy, bid, depth, plain_copy, chain)
    man = store.manifest if isinstance(store, PackStore) else \
        Manifest.read(store, files, single)  # (a pack's names what it restores)
    if man is None:
        raise UsageError(f"--base must be a sealed checkpoint (run `ckptctl seal "
                         f"{base}` first)", base)
    ck = open_checkpoint(base, options, read_step=False, located=located)
    depth = (store.index.depth + 1) if isinstance(store, PackStore) else 1
    return store, files, ck, man.checkpoint_id, depth, None, chain


def _sibling(src: str, base: str) -> str | None:
    """Where the source's folder would hold a checkpoint of the base's name (a tier's
    copy of it: ``hot/step-8`` for ``src`` ``hot/step-9`` and base ``cold/step-8``).

    >>> _sibling("/nvme/run/step-9", "s3://b/cold/step-8"), _sibling("s3://h/step-9", "x/step-9")
    ('/nvme/run/step-8', None)
    """
    folder, _, name = src.rstrip("/").rpartition("/")
    base_name = base.rstrip("/").rpartition("/")[2]
    if not base_name or base_name == name or base_name in (".", ".."):
        return None
    return f"{folder}/{base_name}" if folder else base_name


def _proven_copy(url: str, options: dict | None, want_id: str):
    """(store, files, checkpoint) of the plain sealed checkpoint at ``url`` if its id is
    ``want_id`` and every file hashes to its manifest (a copy corrupted since it was
    sealed must not become the base a pack's deltas are decoded against), else None."""
    from ..formats.detect import locate, open_checkpoint
    from ..formats.pack import is_pack
    from ..storage.hashing import hash_file

    try:
        store, files, single = locate(url, options)
        if single or is_pack(files) or MANIFEST not in files:
            return None
        man = Manifest.read(store, files)
        if man is None or man.checkpoint_id != want_id:
            return None
        for rel, rec in man.files.items():
            if files.get(rel) != rec.size or hash_file(store, rel, man.hash) != (rec.hash,
                                                                                  rec.size):
                return None
        ck = open_checkpoint(url, options, read_step=False, located=(store, files, single))
    except CkptError:
        return None  # no usable copy: the base is read through its chain
    return store, files, ck


def _note_dependant(base: str, base_options: dict | None, dst: str,
                    dst_options: dict | None, base_id: str) -> None:
    """A delta pack written outside its base's folder leaves a reference there
    (:func:`~ckptctl.catalog.ownership.record_dependant`), before any byte of the pack: gc
    and rm of the base's root cannot list the pack, but they keep what it needs."""
    from ..formats.locate import file_format, single_files, split_file_url
    from ..storage import open_store
    from ..catalog.ownership import record_dependant

    bstore = open_store(base, base_options)
    dstore = open_store(dst, dst_options)
    if bstore.protocol == dstore.protocol and \
            bstore.parent().url.rstrip("/") == dstore.parent().url.rstrip("/"):
        return  # siblings: gc and rm of that root see the pack itself
    folder, name = split_file_url(base)
    if file_format(name) and single_files(open_store(folder, base_options), name):
        raise UsageError(f"a single-file base has no folder to hold the reference that keeps "
                         f"gc from removing it while the pack at {dstore.url} needs it: pack "
                         "against a base beside DST, or pass --base none", base)
    try:
        record_dependant(bstore, dstore.url, base_id)
    except StorageError as e:
        raise StorageError(bstore.url, f"cannot record in the base that the pack at "
                           f"{dstore.url} needs it ({e.message}); gc there could remove it. "
                           "Pack against a base beside DST, or pass --base none",
                           code=e.code) from None


# --------------------------------------------------------------------------- pack


def pack(src: str, dst: str, *, base: str | None = None, level: int = 3,
         workers: int | None = None, max_chain: int = DEFAULT_MAX_CHAIN, force: bool = False,
         storage_options: dict | None = None, dst_storage_options: dict | None = None,
         base_storage_options: dict | None = None,
         on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None, group=None,
         seal_source: bool | None = None, source_manifest: bytes | None = None,
         base_listing: tuple | None = None) -> PackResult:
    """Write checkpoint ``src`` as a pack at ``dst`` (see the module docstring).

    An unsealed but complete source is hashed first (an incomplete one is refused,
    exit 1) and sealed where it takes the write (``seal_source``: True requires that,
    False never writes into it; a read-only source is left as it is, its manifest packed
    from memory; ``source_manifest``: that manifest's bytes, when the caller has them);
    every source file is hashed on the way and must match its manifest.
    ``base``: a sealed earlier checkpoint (or pack) to delta-encode against; when the
    chain of bases would grow past ``max_chain`` a full pack is written instead
    (``full_reason`` says so). ``group``: a :class:`~ckptctl.writing.distributed.Group`
    (``Group.from_env()`` under torchrun/srun): data file unit ``u`` (see
    :func:`data_layout`) is process ``u % world_size``'s, rank 0 writes the index and the
    manifest; the same bytes whatever the number of processes. ``base_listing``: a fresh
    listing of the folder holding ``base`` (see :func:`_open_base`).

    >>> pack("ckpt/step-200", "packs/step-200", level=3).ratio        # doctest: +SKIP
    1.43
    """
    from ..formats import packcodec
    from ..formats.detect import open_checkpoint

    t0 = time.monotonic()
    workers = max(1, workers or os.cpu_count() or 1)
    if not 1 <= level <= 22:
        raise UsageError(f"--level must be 1..22, got {level}")
    if not 0 <= max_chain <= MAX_DEPTH:
        raise UsageError(f"--max-chain must be 0..{MAX_DEPTH}, got {max_chain}")
    store, files, man, raw_man, sealed, single = _source(src, storage_options, workers,
                                                         seal_source=seal_source,
                                                         source_manifest=source_manifest)
    mname = control_name(MANIFEST, single)  # a single file's manifest: packed as its sidecar
    if mname not in files and group is not None and group.active:
        raise UsageError("the source is not sealed and was left so: under torchrun/srun every "
                         "process must pack the same manifest; seal it first (`ckptctl seal "
                         f"{src}`) or pack in one process", src)
    store.cache_small_files(files)  # remote: one GET per small file (no effect locally)
    ck = open_checkpoint(src, storage_options, read_step=False, located=(store, files, single))
    base_map = base_store = None
    base_info = full_reason = base_read = None
    depth = 0
    if base is not None:
        bstore, bfiles, bck, bid, bdepth, base_read, chain = _open_base(
            base, base_storage_options if base_storage_options is not None
            else storage_options, plain_copy=_sibling(src, base), plain_options=storage_options,
            max_depth=max_chain, listed=base_listing)
        if bdepth > max_chain:
            full_reason = (f"base chain would be {bdepth} deep, past --max-chain {max_chain}: "
                           "wrote a full pack")
        else:
            depth = bdepth
            base_store = bstore
            base_store.cache_small_files(bfiles)
            base_map = {}
            for rel, lst in tensor_spans(bck, bstore, bfiles).items():
                for off, n, _, key in lst:
                    base_map.setdefault(key, (rel, off))
            base_info = {"id": bid, "depth": bdepth, "url": relative_url(dst, base)}
            if chain:  # so a reader opens every level at once (formats.pack.chain_urls)
                base_info["chain"] = [relative_url(dst, u) for u in chain]
            _note_dependant(base, base_storage_options if base_storage_options is not None
                            else storage_options, dst, dst_storage_options, bid)
    names = sorted(man.files) + [mname]
    sizes = {rel: man.files[rel].size for rel in man.files}
    sizes[mname] = len(raw_man)
    spans = tensor_spans(ck, store, sizes)
    chunk = packcodec.CHUNK_SIZE
    plans = {rel: _plan_file(rel, sizes[rel], spans.get(rel, []) if rel != mname else [],
                             chunk, base_map) for rel in names}
    if on_total:
        on_total(sum(sizes.values()))
    from ..writing.distributed import Group, write_shared

    group = group if group is not None else Group()
    dstore = open_store(dst, dst_storage_options)
    out = OutputDir(dstore, command="pack", force=force,
                    source=store.display(single) if single else store.url,
                    base=base_info["id"] if base_info else None)
    jobs, batches = _jobs(names, plans, packcodec.CHUNK_SIZE)
    data_of, unit_of = data_layout(jobs, batches, sizes)

    def write() -> dict:
        return _encode_all(store, names, jobs, batches, data_of, unit_of, man, base_store,
                           out, level, workers, on_bytes, packcodec, share=group.mine,
                           manifest_bytes=raw_man, manifest_name=mname)

    def finish(reports: list[dict]):
        data_hashes: dict[str, tuple[str, int]] = {}
        chunks: dict[str, int] = {}
        refs: dict[int, list] = {}
        for rep in reports:
            data_hashes.update((rel, (h, int(n))) for rel, (h, n) in rep["hashes"].items())
            for mode, k in rep["chunks"].items():
                chunks[mode] = chunks.get(mode, 0) + k
            refs.update((int(i), ref) for i, *ref in rep["refs"])
        for i, (_, seg, _, _) in enumerate(jobs):  # in job order: each segment's chunks
            seg.chunks.append(ChunkRef(*refs[i]))
        idx = PackIndex.build(
            _source_doc(raw_man), man.id, chunk,
            {rel: (sizes[rel], [s for s, _ in plans[rel]]) for rel in names}, base_info,
            single)
        blob = idx.to_bytes()
        out.write_atomic(PACK_INDEX, blob)
        from ..storage import digest_bytes

        hashes = dict(data_hashes)
        hashes[PACK_INDEX] = (digest_bytes(blob, "xxh3-128"), len(blob))
        bytes_out = sum(n for _, n in hashes.values())
        bytes_in = sum(sizes.values())
        summary = dict(man.summary)
        summary.update({"pack_bytes": bytes_out, "source_bytes": bytes_in})
        pman = Manifest(files={rel: FileEntry(n, h) for rel, (h, n) in sorted(hashes.items())},
                        hash="xxh3-128", format="pack", step=man.step, tags=list(man.tags),
                        created=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        summary=summary, tool=f"ckptctl {__version__}",
                        base=base_info["id"] if base_info else None,
                        extra={"packs": man.id})
        out.commit()
        return hashes, chunks, pman, commit(dstore, pman)

    planned = [data_name(k) for k in range(len(unit_of))] + [PACK_INDEX]
    done = write_shared(group, out, write, finish, planned=planned)
    if not isinstance(done, tuple):  # another process's share: its own data files
        hashes = {rel: (h, int(n)) for rel, (h, n) in done["hashes"].items()}
        shown = store.display(single) if single else store.url
        return PackResult(shown, dstore.url, man.id, None,
                          base_info["id"] if base_info else None, depth,
                          0, sum(n for _, n in hashes.values()), 0.0,
                          dict(sorted(done["chunks"].items())), len(names), len(hashes),
                          time.monotonic() - t0, sealed, full_reason, 0, 0)
    hashes, chunks, pman, pack_id = done
    unsealed = mname not in files
    bytes_out = sum(n for _, n in hashes.values())
    bytes_in = sum(sizes.values())
    tensors = sum(1 for p in plans.values() for s, _ in p if s.kind == "tensor")
    based = sum(1 for p in plans.values() for s, _ in p if s.base is not None)
    return PackResult(store.display(single) if single else store.url, dstore.url, man.id,
                      pack_id,
                      base_info["id"] if base_info else None, depth, bytes_in,
                      bytes_out + len(pman.to_bytes()),
                      round(bytes_in / (bytes_out + len(pman.to_bytes())), 4),
                      dict(sorted(chunks.items())), len(names),
                      sum(1 for r in hashes if r != PACK_INDEX), time.monotonic() - t0,
                      sealed, full_reason, tensors, based, unsealed,
                      base_read if base_info else None)


def _source_doc(raw: bytes) -> dict:
    import json

    return json.loads(raw)


def _jobs(names, plans, chunk_size: int) -> tuple[list[tuple], list[list[int]]]:
    """Every chunk to encode, ``(file, segment, position in it, bytes)``, in file and
    segment order; and the batches they are read in: consecutive small chunks of one file
    in one request (a DCP file is mostly small segments: on S3 requests cost more than
    bytes)."""
    jobs = []
    for rel in names:
        for seg, sizes in plans[rel]:
            pos = 0
            for n in sizes:
                jobs.append((rel, seg, pos, n))
                pos += n
    batches: list[list[int]] = []
    for i, (rel, seg, pos, n) in enumerate(jobs):
        if batches:
            prev = batches[-1]
            prel, pseg, ppos, pn = jobs[prev[-1]]
            start = jobs[prev[0]][1].offset + jobs[prev[0]][2]
            if prel == rel and pseg.offset + ppos + pn == seg.offset + pos \
                    and seg.offset + pos + n - start <= chunk_size:
                prev.append(i)
                continue
        batches.append([i])
    return jobs, batches


def data_layout(jobs, batches, sizes: dict[str, int],
                limit: int | None = None) -> tuple[list[int], list[int]]:
    """Which data file each batch goes to, and which unit each data file belongs to;
    decided from the source's sizes alone, so several processes can write different data
    files and get the bytes one process writes. A data file holds at most ``limit`` bytes
    of source (whole small files together; a larger file starts a new data file and spans
    several); a unit is the data files that share a source file (one process hashes each
    source file whole). No chunk at all: one empty data file.

    >>> jobs = [("a", None, 0, 6), ("b", None, 0, 3), ("c", None, 0, 5), ("c", None, 5, 5)]
    >>> data_layout(jobs, [[0], [1], [2], [3]], {"a": 6, "b": 3, "c": 10}, limit=9)
    ([0, 0, 1, 2], [0, 1, 1])
    """
    limit = limit or DATA_FILE_SIZE
    data_of: list[int] = []
    unit_of: list[int] = []
    used = 0
    prev = None
    for b in batches:
        rel = jobs[b[0]][0]
        n = sum(jobs[i][3] for i in b)
        if rel != prev:  # a new source file: here, or a new data file and a new unit
            if not unit_of or (used and used + sizes[rel] > limit):
                unit_of.append(unit_of[-1] + 1 if unit_of else 0)
                used = 0
            prev = rel
        elif used and used + n > limit:  # the same file goes on in a new data file
            unit_of.append(unit_of[-1])
            used = 0
        data_of.append(len(unit_of) - 1)
        used += n
    return data_of, unit_of or [0]


def _encode_all(store, names, jobs, batches, data_of, unit_of, man: Manifest, base_store,
                out: OutputDir, level: int, workers: int, on_bytes, codec, *,
                share=None, manifest_bytes: bytes | None = None,
                manifest_name: str = MANIFEST) -> dict:
    """Encode the chunks of this process's data files (``share`` picks its units; None:
    all) on a thread pool (at most 2 x workers batches in flight), append the payloads to
    the data files :func:`data_layout` chose, in order; hash every source file on the way
    against the source manifest. Returns this share's report: ``hashes`` {data file:
    [hash, size]}, ``chunks`` by mode, ``refs`` [[job index, ChunkRef fields...]].
    ``manifest_bytes``: the source manifest, when it is no file of the source (a source
    left unsealed); ``manifest_name``: its name among ``names`` (a single file's sidecar)."""
    units = sorted(set(unit_of))
    mine_units = set(share(units) if share is not None else units)
    mine = [k for k, b in enumerate(batches) if unit_of[data_of[k]] in mine_units]
    files_mine = [k for k, u in enumerate(unit_of) if u in mine_units]
    last_of = {}
    for i, (rel, _, _, _) in enumerate(jobs):
        last_of[rel] = i
    empty = [rel for rel in names if rel not in last_of]

    def encode_batch(batch):
        rel, seg0, pos0, _ = jobs[batch[0]]
        start = seg0.offset + pos0
        _, lseg, lpos, ln = jobs[batch[-1]]
        end = lseg.offset + lpos + ln
        blob = manifest_bytes[start:end] if rel == manifest_name and manifest_bytes is not None \
            else store.read_range(rel, start, end)
        if len(blob) != end - start:
            raise FormatError(store.display(rel), f"file ends before byte {end} (changed "
                              "while packing?)", code="SIZE_MISMATCH")
        mv = memoryview(blob)
        res = []
        for i in batch:
            _, seg, pos, n = jobs[i]
            data = mv[seg.offset + pos - start:seg.offset + pos - start + n]
            b = None
            if seg.base is not None:
                bfile, boff = seg.base
                b = base_store.read_range(bfile, boff + pos, boff + pos + n)
                if len(b) != n:
                    raise FormatError(base_store.display(bfile), "base file is shorter than "
                                      "its metadata says", code="SIZE_MISMATCH")
            mode, payload = codec.encode(data, itemsize=seg.itemsize, base=b, level=level)
            res.append((data, mode, payload, codec.check(data)))
        return res

    hashes: dict[str, list] = {}
    chunks: dict[str, int] = {}
    refs: list[list] = []
    state = {"k": None, "f": None, "h": None, "size": 0, "file_h": None}

    def open_data(k):
        if state["f"] is not None:
            state["f"].close()
            hashes[data_name(state["k"])] = [state["h"].hexdigest(), state["size"]]
        state["k"] = k
        state["f"] = out.open(data_name(k))
        state["h"] = new_hasher("xxh3-128")
        state["size"] = 0

    def check_source(rel, h):
        want = man.files[rel].hash if rel in man.files else None
        if want is not None and h.hexdigest() != want:
            raise Finding(store.display(rel), f"content hash differs from the source manifest "
                          f"({man.hash}); the source is damaged (run `ckptctl verify`)",
                          code="HASH_MISMATCH")

    def consume(i, data, mode, payload, chk):
        rel, seg, pos, n = jobs[i]
        if state["file_h"] is None:
            state["file_h"] = new_hasher(man.hash)
        state["file_h"].update(data)
        refs.append([i, data_name(state["k"]), state["size"], len(payload), mode, n, chk])
        if payload:
            state["f"].write(payload)
            state["h"].update(payload)
            state["size"] += len(payload)
        chunks[mode] = chunks.get(mode, 0) + 1
        if on_bytes:
            on_bytes(n)
        if last_of[rel] == i:
            check_source(rel, state["file_h"])
            state["file_h"] = None

    if 0 in mine_units:
        for rel in empty:
            check_source(rel, new_hasher(man.hash))
    fed = {data_of[b] for b in mine}
    for k in files_mine:  # a data file with no batch (an all-empty source): made, empty
        if k not in fed:
            open_data(k)
    ahead: collections.deque = collections.deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-pack") as pool:
        it = iter(mine)
        try:
            while True:
                while len(ahead) < 2 * workers:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    ahead.append((nxt, pool.submit(encode_batch, batches[nxt])))
                if not ahead:
                    break
                k, fut = ahead.popleft()
                if data_of[k] != state["k"]:
                    open_data(data_of[k])
                for i, res in zip(batches[k], fut.result()):
                    consume(i, *res)
        except BaseException:
            for _, f in ahead:
                f.cancel()
            raise
    if state["f"] is not None:
        state["f"].close()
        hashes[data_name(state["k"])] = [state["h"].hexdigest(), state["size"]]
    return {"hashes": hashes, "chunks": chunks, "refs": refs}


# --------------------------------------------------------------------------- unpack


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


# --------------------------------------------------------------------------- re-root

#: ``command`` in the writing marker of a pack whose files a re-root is replacing
REROOT_COMMAND = "reroot"


@dataclass
class RerootResult:
    """What :func:`reroot` (or :func:`finish_reroot`) did to the pack at ``url``.
    ``action``: ``re-rooted``; ``up-to-date`` (a full pack: no base to lose);
    ``finished`` (a re-root a crash interrupted, completed); ``discarded`` (what an
    interrupted one left that is no longer wanted, removed); ``busy`` (a ckptctl process
    on this host is re-rooting it: left alone); ``none`` (nothing was left).
    ``base``/``depth``: what it is made against now (None, 0: a full pack); ``was``:
    the base id it had."""

    url: str
    action: str
    manifest_id: str | None = None
    base: str | None = None
    base_url: str | None = None
    depth: int = 0
    was: str | None = None
    bytes_before: int = 0
    bytes_after: int = 0
    full_reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _reached(step: str, url: str) -> None:
    """Called after each durable step of a re-root (``staged``, ``marked``, ``cleared``,
    ``placed``, ``committed``, ``unmarked``, ``unsealed-stage``): the seam where the
    crash tests stop a re-root. A no-op."""


def reroot(url: str, *, base: str | None = None, max_chain: int = DEFAULT_MAX_CHAIN,
           storage_options: dict | None = None, workers: int | None = None,
           level: int = 3) -> RerootResult:
    """Write the checkpoint the delta pack at ``url`` holds again, against ``base`` (a
    sealed checkpoint, or pack, beside it; None: a full pack), and put that pack in
    ``url``'s place, so that the old base is no longer needed. The checkpoint keeps its
    id, so the packs made against it stay valid; the new pack is never deeper than the
    old one (nor than ``max_chain``: past it, a full pack), so their chains still get
    shorter towards the root.

    Crash-safe, with a committed, restorable copy of the checkpoint at every moment:

    1. the new pack is written beside it (:func:`~ckptctl.formats.pack.reroot_stage`:
       ``.NAME.ckptctl-reroot``) and committed, manifest last; the old pack is untouched;
    2. ``url`` gets a writing marker (command ``reroot``): from here readers of the packs
       made against it take their base from the staged copy;
    3. the old pack's own files go (manifest first; a pin, references left by packs
       elsewhere and a user's files stay), the staged files are placed (a hard link
       locally, a server-side copy on S3) and checked by size, the manifest written last,
       then the marker removed;
    4. the staged copy is removed, manifest first.

    A rerun after a crash anywhere finishes it (:func:`finish_reroot`); the base it no
    longer needs is then the caller's to remove (``gc``).

    >>> reroot("cold/step-70").depth                                # doctest: +SKIP
    0
    """
    from ..formats.pack import reroot_stage

    if finish_reroot(url, storage_options).action == "busy":
        raise Finding(url, "a ckptctl process on this host is re-rooting it; let it finish")
    old = open_pack_url(url, storage_options)
    try:
        depth, was = old.index.depth, (old.index.base or {}).get("id")
        before = sum(old.raw_files.values())
    finally:
        old.close()
    if was is None:
        return RerootResult(url, "up-to-date", bytes_before=before, bytes_after=before)
    stage = reroot_stage(url)
    r = pack(url, stage, base=base, max_chain=min(max_chain, depth), workers=workers,
             level=level, storage_options=storage_options,
             dst_storage_options=storage_options, seal_source=False)
    _reached("staged", url)
    sstore = open_store(stage, storage_options)
    sfiles = sstore.list_files()
    _install(sstore, sfiles, open_store(url, storage_options))
    _discard_stage(sstore, sfiles, url)
    return RerootResult(url, "re-rooted", r.source_id, r.base,
                        base if r.base else None, r.depth, was, before,
                        sum(sfiles.values()), r.full_reason)


def finish_reroot(url: str, storage_options: dict | None = None) -> RerootResult:
    """Complete, or clear away, what a re-root of the pack at ``url`` that did not finish
    left (see :func:`reroot`); ``action`` ``none`` when there is nothing. The staged copy
    is installed when it is committed and ``url`` holds the same checkpoint or a marked,
    half-replaced one; it is removed when it is not committed (the old pack was never
    touched), when it is installed already, or when ``url`` now holds another checkpoint
    or nothing. A staged copy or a pack that a live ckptctl process on this host is
    writing, or that another command is writing or removing, is left alone (``busy``).

    >>> finish_reroot("cold/step-70").action                        # doctest: +SKIP
    'none'
    """
    from ..formats.manifest import WRITING_MARKER
    from ..formats.pack import reroot_stage

    sstore = open_store(reroot_stage(url), storage_options)
    sfiles = sstore.list_files_if_any()
    if not sfiles:
        return RerootResult(url, "none")
    target = open_store(url, storage_options)
    tfiles = target.list_files_if_any()
    if _held(sstore, sfiles) or _held(target, tfiles):
        return RerootResult(url, "busy")
    staged = _committed(sstore, sfiles)
    there = _committed(target, tfiles) if WRITING_MARKER not in tfiles else None
    ours = WRITING_MARKER in tfiles and _marker_command(target) == REROOT_COMMAND
    if WRITING_MARKER in tfiles and (staged is None) == ours:
        # another command's write there, or (never left by a re-root: the copy goes only
        # once the pack is whole) a half-replaced pack without a whole copy: left alone
        return RerootResult(url, "busy")
    install = staged is not None and (ours or (
        there is not None and there.id != staged.id
        and there.checkpoint_id == staged.checkpoint_id and _restorable(sstore.url,
                                                                        storage_options)))
    if install:
        _install(sstore, sfiles, target)
    _discard_stage(sstore, sfiles, url)
    return RerootResult(url, "finished" if install or (
        there is not None and staged is not None and there.id == staged.id) else "discarded",
        staged.checkpoint_id if staged is not None else None)


def _held(store, files: dict[str, int]) -> bool:
    """Does a ckptctl process on this host, other than this one, hold ``store`` (its
    writing marker names it, and it runs)?"""
    from ..formats.manifest import WRITING_MARKER
    from ..writing.output import live_writer

    if WRITING_MARKER not in files:
        return False
    doc = live_writer(store)
    return doc is not None and int(doc["pid"]) != os.getpid()


def _marker_command(store) -> str | None:
    import json

    from ..formats.manifest import WRITING_MARKER

    try:
        doc = json.loads(store.read(WRITING_MARKER))
    except (CkptError, ValueError):
        return None
    return doc.get("command") if isinstance(doc, dict) else None


def _committed(store, files: dict[str, int]) -> Manifest | None:
    """The manifest of the committed pack at ``store`` (no writing marker, every file it
    lists there at its size), else None."""
    from ..formats.manifest import WRITING_MARKER

    if MANIFEST not in files or PACK_INDEX not in files or WRITING_MARKER in files:
        return None
    try:
        man = Manifest.read(store, files)
    except StorageError:
        raise
    except CkptError:
        return None
    if man is None or any(files.get(rel) != e.size for rel, e in man.files.items()):
        return None
    return man


def _restorable(url: str, storage_options: dict | None) -> bool:
    """Does the pack at ``url`` open, with its whole base chain there and committed?"""
    from ..integrity.verify import base_unrestorable

    try:
        ps = open_pack_url(url, storage_options)
    except StorageError:
        raise
    except CkptError:
        return False
    try:
        return base_unrestorable(ps, storage_options) is None
    finally:
        ps.close()


def _install(stage, sfiles: dict[str, int], target) -> None:
    """Put the committed pack at ``stage`` in place of the pack at ``target`` (steps 2
    and 3 of :func:`reroot`); redone from the start after a crash."""
    import json
    import socket

    from ..formats.manifest import WRITING_MARKER
    from ..formats.pack import DATA_NAME
    from ..storage.localio import sync_dir

    raw = stage.read(MANIFEST)
    man = Manifest.parse(raw, stage.display(MANIFEST))
    doc = {"pid": os.getpid(), "host": socket.gethostname(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": REROOT_COMMAND, "from": stage.url}
    target.write_atomic(WRITING_MARKER, (json.dumps(doc) + "\n").encode())
    _reached("marked", target.url)
    old = target.list_files()
    for rel in (MANIFEST, PACK_INDEX):  # what makes it read as a pack goes first
        if rel in old:
            target.remove_many([rel])
    target.remove_many(sorted(rel for rel in old if DATA_NAME.match(rel)))
    _reached("cleared", target.url)
    for rel in sorted(man.files, key=lambda r: r == PACK_INDEX):  # the index after the data
        _place(stage, target, rel, man)
    _reached("placed", target.url)
    landed = target.list_files()
    wrong = [rel for rel, e in man.files.items() if landed.get(rel) != e.size]
    if wrong:
        raise StorageError(target.display(wrong[0]), "a re-rooted pack's file did not land "
                           f"whole ({landed.get(wrong[0])} bytes, {man.files[wrong[0]].size} "
                           "expected); run gc again")
    if target.is_local:
        sync_dir(target.full())
    commit(target, man, data=raw)
    _reached("committed", target.url)
    target.remove(WRITING_MARKER)
    if target.is_local:
        sync_dir(target.full())
    _reached("unmarked", target.url)


def _place(src, dst, rel: str, man: Manifest) -> None:
    """Copy the committed file ``rel`` from ``src`` to ``dst`` (same name): a hard link
    between local folders, a server-side copy on one S3 server, else streamed and hashed
    against ``man``."""
    from ..storage.multipart import copy_object

    dst.remove(rel)  # a redo after a crash: what an earlier try placed
    if src.is_local and dst.is_local:
        try:
            os.link(src.full(rel), dst.full(rel))
            return
        except OSError:
            pass  # a file system without hard links: copied
    try:
        copy_object(src, rel, dst, rel)
        return
    except StorageError as e:
        if e.code in ("REMOTE_TIMEOUT", "REMOTE_UNREACHABLE"):
            raise
    except UsageError:
        pass  # not the same server
    digest, _ = dst.write_file(rel, src.iter_blocks(rel), algo=man.hash)
    if digest != man.files[rel].hash:
        raise Finding(dst.display(rel), f"copy differs from the staged pack's manifest "
                      f"({man.hash})", code="HASH_MISMATCH")


def _discard_stage(stage, files: dict[str, int], url: str) -> None:
    """Remove a re-root's staged copy, its manifest first (step 4 of :func:`reroot`)."""
    from ..writing.removal import remove_checkpoint

    if MANIFEST in files:
        stage.remove_many([MANIFEST])
        _reached("unsealed-stage", url)
    rest = stage.list_files_if_any()
    if rest:
        remove_checkpoint(stage, rest, force_pinned=True)
