"""``pack``: store a checkpoint as a lossless, compressed (optionally delta-encoded) pack
that :func:`~ckptctl.packs.unpack.unpack` restores byte for byte.

``pack`` reads SRC through the logical model: every original file is cut into ``tensor``
and ``raw`` segments, and those into chunks of at most ``CHUNK_SIZE`` bytes (a whole
number of elements; :mod:`ckptctl.packs.segments`), encoded on a thread pool (at most
2 x workers chunks in flight) by :mod:`ckptctl.formats.packcodec`, appended to data files
of at most 256 MiB of source each (cut from the source's sizes alone:
:func:`~ckptctl.packs.encode.data_layout`, so processes under torchrun/srun can write
different ones), and committed like every writer (``.ckptctl-writing`` first, index,
then the pack's manifest last). With a base (:func:`~ckptctl.packs.sources.open_base`), a
tensor segment whose logical tensor (same name, chunk box, dtype and byte length) exists
in the base is stored against the base's bytes (``same``: nothing; else ``xor``).

A single-file checkpoint (``train.pt``) packs into a pack folder like any other (its
index names the file, its sidecar manifest is packed beside it).

>>> import json, pathlib, struct, tempfile
>>> from ckptctl.packs.unpack import unpack
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

import datetime as dt
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

from .. import __version__
from ..errors import UsageError
from ..formats.manifest import MANIFEST, FileEntry, Manifest, control_name
from ..formats.pack import (DEFAULT_MAX_CHAIN, MAX_DEPTH, PACK_INDEX, ChunkRef, PackIndex,
                            Segment, data_name, relative_url)
from ..storage import open_store
from ..writing.commit import commit
from ..writing.output import OutputDir
from .encode import chunk_jobs, data_layout, encode_all
from .segments import plan_segments, tensor_spans
from .sources import note_dependant, open_base, open_source, sibling_url


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
    :func:`~ckptctl.packs.encode.data_layout`) is process ``u % world_size``'s, rank 0
    writes the index and the manifest; the same bytes whatever the number of processes.
    ``base_listing``: a fresh listing of the folder holding ``base`` (see
    :func:`~ckptctl.packs.sources.open_base`).

    >>> pack("ckpt/step-200", "packs/step-200", level=3).ratio        # doctest: +SKIP
    1.43
    """
    from ..formats import packcodec
    from ..formats.detect import open_checkpoint

    t0 = time.monotonic()
    workers = max(1, workers or os.cpu_count() or 1)
    _check_settings(level, max_chain)
    store, files, man, raw_man, sealed, single = open_source(src, storage_options, workers,
                                                             seal_source=seal_source,
                                                             source_manifest=source_manifest)
    mname = control_name(MANIFEST, single)  # a single file's manifest: packed as its sidecar
    if mname not in files and group is not None and group.active:
        raise UsageError("the source is not sealed and was left so: under torchrun/srun every "
                         "process must pack the same manifest; seal it first (`ckptctl seal "
                         f"{src}`) or pack in one process", src)
    store.cache_small_files(files)  # remote: one GET per small file (no effect locally)
    ck = open_checkpoint(src, storage_options, read_step=False, located=(store, files, single))
    delta = _delta_base(src, dst, base, max_chain, storage_options, dst_storage_options,
                        base_storage_options, base_listing)
    layout = _lay_out(ck, store, man, raw_man, mname, delta.map, packcodec.CHUNK_SIZE)
    if on_total:
        on_total(sum(layout.sizes.values()))
    from ..writing.distributed import Group, write_shared

    group = group if group is not None else Group()
    dstore = open_store(dst, dst_storage_options)
    shown = store.display(single) if single else store.url
    out = OutputDir(dstore, command="pack", force=force, source=shown,
                    base=delta.info["id"] if delta.info else None)

    def write() -> dict:
        return encode_all(store, layout.names, layout.jobs, layout.batches, layout.data_of,
                          layout.unit_of, man, delta.store, out, level, workers, on_bytes,
                          packcodec, share=group.mine, manifest_bytes=raw_man,
                          manifest_name=mname)

    def finish(reports: list[dict]):
        return _commit_pack(reports, layout, man, raw_man, delta.info, single, out, dstore)

    planned = [data_name(k) for k in range(len(layout.unit_of))] + [PACK_INDEX]
    done = write_shared(group, out, write, finish, planned=planned)
    if not isinstance(done, tuple):  # another process's share: its own data files
        return _share_result(shown, dstore.url, man, delta, layout, done, t0, sealed)
    return _result(shown, dstore.url, man, delta, layout, done, t0, sealed,
                   unsealed=mname not in files)


def _check_settings(level: int, max_chain: int) -> None:
    """Refuse a compression level or a ``--max-chain`` out of range (exit 2)."""
    if not 1 <= level <= 22:
        raise UsageError(f"--level must be 1..22, got {level}")
    if not 0 <= max_chain <= MAX_DEPTH:
        raise UsageError(f"--max-chain must be 0..{MAX_DEPTH}, got {max_chain}")


@dataclass
class _DeltaBase:
    """The base a pack is delta-encoded against; without one (no ``base``, or a chain that
    would grow past ``--max-chain``: ``full_reason``) the pack is a full one."""

    store: object = None  #: where the base's bytes are read (a pack: through its chain)
    map: dict | None = None  #: logical tensor key -> (file, offset) of its bytes there
    info: dict | None = None  #: the index's ``base``: id, depth, url (and chain)
    depth: int = 0  #: the pack's depth: the base's + 1
    full_reason: str | None = None
    read_from: str | None = None  #: a plain copy the base's bytes are read from


def _delta_base(src: str, dst: str, base: str | None, max_chain: int,
                storage_options: dict | None, dst_storage_options: dict | None,
                base_storage_options: dict | None, listed: tuple | None) -> _DeltaBase:
    """Open ``base`` for a pack of ``src`` at ``dst``: where each of its logical tensors'
    bytes are, and the index's record of it; a reference is left in a base outside DST's
    folder (:func:`~ckptctl.packs.sources.note_dependant`)."""
    if base is None:
        return _DeltaBase()
    base_options = base_storage_options if base_storage_options is not None \
        else storage_options
    bstore, bfiles, bck, bid, bdepth, base_read, chain = open_base(
        base, base_options, plain_copy=sibling_url(src, base), plain_options=storage_options,
        max_depth=max_chain, listed=listed)
    if bdepth > max_chain:
        return _DeltaBase(full_reason=f"base chain would be {bdepth} deep, past --max-chain "
                          f"{max_chain}: wrote a full pack", read_from=base_read)
    bstore.cache_small_files(bfiles)
    base_map: dict = {}
    for rel, lst in tensor_spans(bck, bstore, bfiles).items():
        for off, n, _, key in lst:
            base_map.setdefault(key, (rel, off))
    info = {"id": bid, "depth": bdepth, "url": relative_url(dst, base)}
    if chain:  # so a reader opens every level at once (formats.pack.chain_urls)
        info["chain"] = [relative_url(dst, u) for u in chain]
    note_dependant(base, base_options, dst, dst_storage_options, bid)
    return _DeltaBase(bstore, base_map, info, bdepth, None, base_read)


@dataclass
class _Layout:
    """What a pack holds, decided before a byte is written: the files in pack order (the
    source manifest last), their sizes, segments, every chunk to encode
    (:func:`~ckptctl.packs.encode.chunk_jobs`) and the data file of each batch
    (:func:`~ckptctl.packs.encode.data_layout`)."""

    names: list[str]
    sizes: dict[str, int]
    plans: dict[str, list[tuple[Segment, list[int]]]]
    chunk: int
    jobs: list[tuple]
    batches: list[list[int]]
    data_of: list[int]
    unit_of: list[int]


def _lay_out(ck, store, man: Manifest, raw_man: bytes, mname: str, base_map: dict | None,
             chunk: int) -> _Layout:
    """The :class:`_Layout` of a pack of checkpoint ``ck`` (manifest ``man``, its bytes
    ``raw_man`` packed as ``mname``), against ``base_map`` (None: a full pack)."""
    names = sorted(man.files) + [mname]
    sizes = {rel: man.files[rel].size for rel in man.files}
    sizes[mname] = len(raw_man)
    spans = tensor_spans(ck, store, sizes)
    plans = {rel: plan_segments(rel, sizes[rel], spans.get(rel, []) if rel != mname else [],
                                chunk, base_map) for rel in names}
    jobs, batches = chunk_jobs(names, plans, chunk)
    data_of, unit_of = data_layout(jobs, batches, sizes)
    return _Layout(names, sizes, plans, chunk, jobs, batches, data_of, unit_of)


def _commit_pack(reports: list[dict], layout: _Layout, man: Manifest, raw_man: bytes,
                 base_info: dict | None, single: str | None, out: OutputDir, dstore):
    """Rank 0's end of a pack, every share's data files written (``reports``: what
    :func:`~ckptctl.packs.encode.encode_all` returned for each): the index, then the
    pack's manifest last. Returns (pack file hashes, chunks by mode, the pack's manifest,
    its id)."""
    data_hashes, chunks, refs = _merge_reports(reports)
    for i, (_, seg, _, _) in enumerate(layout.jobs):  # in job order: each segment's chunks
        seg.chunks.append(ChunkRef(*refs[i]))
    idx = PackIndex.build(
        _source_doc(raw_man), man.id, layout.chunk,
        {rel: (layout.sizes[rel], [s for s, _ in layout.plans[rel]]) for rel in layout.names},
        base_info, single)
    blob = idx.to_bytes()
    out.write_atomic(PACK_INDEX, blob)
    from ..storage import digest_bytes

    hashes = dict(data_hashes)
    hashes[PACK_INDEX] = (digest_bytes(blob, "xxh3-128"), len(blob))
    pman = _pack_manifest(man, hashes, sum(layout.sizes.values()), base_info)
    out.commit()
    return hashes, chunks, pman, commit(dstore, pman)


def _merge_reports(reports: list[dict]) -> tuple[dict, dict, dict]:
    """Every share's data file hashes, chunk counts by mode and chunk refs (by job), in
    one: ``({data file: (hash, size)}, {mode: chunks}, {job: ChunkRef fields})``."""
    data_hashes: dict[str, tuple[str, int]] = {}
    chunks: dict[str, int] = {}
    refs: dict[int, list] = {}
    for rep in reports:
        data_hashes.update((rel, (h, int(n))) for rel, (h, n) in rep["hashes"].items())
        for mode, k in rep["chunks"].items():
            chunks[mode] = chunks.get(mode, 0) + k
        refs.update((int(i), ref) for i, *ref in rep["refs"])
    return data_hashes, chunks, refs


def _pack_manifest(man: Manifest, hashes: dict[str, tuple[str, int]], bytes_in: int,
                   base_info: dict | None) -> Manifest:
    """The pack's own manifest: its files (``hashes``), the source's step, tags and
    summary (plus pack and source bytes), and the id of the checkpoint it packs."""
    bytes_out = sum(n for _, n in hashes.values())
    summary = dict(man.summary)
    summary.update({"pack_bytes": bytes_out, "source_bytes": bytes_in})
    return Manifest(files={rel: FileEntry(n, h) for rel, (h, n) in sorted(hashes.items())},
                    hash="xxh3-128", format="pack", step=man.step, tags=list(man.tags),
                    created=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    summary=summary, tool=f"ckptctl {__version__}",
                    base=base_info["id"] if base_info else None,
                    extra={"packs": man.id})


def _source_doc(raw: bytes) -> dict:
    import json

    return json.loads(raw)


def _share_result(shown: str, dst_url: str, man: Manifest, delta: _DeltaBase,
                  layout: _Layout, report: dict, t0: float, sealed: bool) -> PackResult:
    """What a process that wrote only its share of the data files did (``report``: its
    :func:`~ckptctl.packs.encode.encode_all` report; rank 0 commits the pack)."""
    hashes = {rel: (h, int(n)) for rel, (h, n) in report["hashes"].items()}
    return PackResult(shown, dst_url, man.id, None,
                      delta.info["id"] if delta.info else None, delta.depth,
                      0, sum(n for _, n in hashes.values()), 0.0,
                      dict(sorted(report["chunks"].items())), len(layout.names), len(hashes),
                      time.monotonic() - t0, sealed, delta.full_reason, 0, 0)


def _result(shown: str, dst_url: str, man: Manifest, delta: _DeltaBase, layout: _Layout,
            committed: tuple, t0: float, sealed: bool, unsealed: bool) -> PackResult:
    """What the process that committed the pack did (``committed``: what
    :func:`_commit_pack` returned)."""
    hashes, chunks, pman, pack_id = committed
    bytes_out = sum(n for _, n in hashes.values())
    bytes_in = sum(layout.sizes.values())
    tensors = sum(1 for p in layout.plans.values() for s, _ in p if s.kind == "tensor")
    based = sum(1 for p in layout.plans.values() for s, _ in p if s.base is not None)
    return PackResult(shown, dst_url, man.id,
                      pack_id,
                      delta.info["id"] if delta.info else None, delta.depth, bytes_in,
                      bytes_out + len(pman.to_bytes()),
                      round(bytes_in / (bytes_out + len(pman.to_bytes())), 4),
                      dict(sorted(chunks.items())), len(layout.names),
                      sum(1 for r in hashes if r != PACK_INDEX), time.monotonic() - t0,
                      sealed, delta.full_reason, tensors, based, unsealed,
                      delta.read_from if delta.info else None)
