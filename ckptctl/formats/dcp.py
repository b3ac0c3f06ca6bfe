"""PyTorch Distributed Checkpoint (DCP) reader: ``.metadata`` + ``*.distcp`` files.

``.metadata`` is a pickle; it goes through an allow-list unpickler whose stand-ins import
nothing (no torch). Each chunk's byte range is a ``torch.save`` zip (optionally zstd
compressed, DCP's ``stream.zstd/1`` transform) holding the raw row-major bytes.

>>> from ckptctl.storage import open_store
>>> ck = read_dcp(open_store("tests/data/dcp-tiny"))       # doctest: +SKIP
>>> ck.tensors["model.a.weight"].shape                       # doctest: +SKIP
(4, 3)
"""
from __future__ import annotations

import math

from ..bulk import paused_gc
from ..errors import FormatError, NotFoundError, UnsafeInputError
from ..model import DTYPES, Checkpoint, Chunk, Extent, ObjectEntry, TensorEntry
from ..storage import Store, safe_relpath
from .limits import MAX_METADATA_BYTES, check_shape
from .safe_pickle import (Record, TorchName, dcp_allowed_globals, planner_globals,
                          restricted_loads)

METADATA = ".metadata"
ZSTD_TRANSFORM = "stream.zstd/1"
_ALLOWED = dcp_allowed_globals(DTYPES)
#: ... and Megatron-core's: its ``.metadata`` also carries the ranks' save plans
_ALLOWED_WITH_PLANS = {**_ALLOWED, **planner_globals()}


def is_dcp(files: dict[str, int]) -> bool:
    """A DCP checkpoint has ``.metadata`` or ``.distcp`` files at its root."""
    return METADATA in files or any(f.endswith(".distcp") and "/" not in f for f in files)


def _attr(obj, name, where, types=None):
    if not isinstance(obj, Record) or name not in obj.__dict__:
        raise FormatError(where, f"metadata lacks {name!r}")
    val = obj.__dict__[name]
    if types is not None and not isinstance(val, types):
        raise FormatError(where, f"metadata field {name!r} has type {type(val).__name__}")
    return val


def _ints(val, where, what) -> tuple[int, ...]:
    if not isinstance(val, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in val):
        raise FormatError(where, f"{what} is not a tuple of non-negative integers")
    return tuple(val)


def parse_metadata(data: bytes, *, where: str = METADATA, plans: bool = False) -> Record:
    """Unpickle ``.metadata`` safely; the result is an inert :class:`Record` tree.
    ``plans``: admit the planner classes Megatron-core adds (``all_local_plans``)."""
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeInputError(where, f"{len(data)} bytes is larger than any sane .metadata")
    md = restricted_loads(data, _ALLOWED_WITH_PLANS if plans else _ALLOWED, where=where)
    if type(md).__name__ != "Metadata":
        raise FormatError(where, "not DCP metadata (unexpected top-level object)")
    return md


def _dtype_of(props, where, fqn):
    if not isinstance(props, Record):
        raise FormatError(where, f"{fqn}: tensor properties missing")
    state = props.__dict__.get("_state")
    dtype = state[0] if isinstance(state, tuple) and state else props.__dict__.get("dtype")
    if not isinstance(dtype, TorchName) or str(dtype) not in DTYPES:
        raise FormatError(where, f"{fqn}: unknown dtype {dtype!r}")
    return DTYPES[str(dtype)]


def _extent(info, where, fqn, paths: dict[str, str]) -> Extent:
    """The byte range a storage entry names; ``paths`` caches each checked file name
    (a 10,000-rank checkpoint names each of its files thirty times or more)."""
    d = info.__dict__ if isinstance(info, Record) else {}
    rel, off, length = d.get("relative_path"), d.get("offset"), d.get("length")
    if not (type(rel) is str and type(off) is int and type(length) is int):
        rel = _attr(info, "relative_path", where, str)
        off = _attr(info, "offset", where, int)
        length = _attr(info, "length", where, int)
    if off < 0 or length < 0:
        raise FormatError(where, f"{fqn}: negative byte range")
    safe = paths.get(rel)
    if safe is None:
        safe = paths[rel] = safe_relpath(rel, where=f"{where}: {fqn}")
    transforms = d.get("transform_descriptors") or ()
    encoding = "torch_zip"
    for t in transforms:
        if t == ZSTD_TRANSFORM:
            encoding = "torch_zip+zstd"
        else:
            raise FormatError(where, f"{fqn}: unsupported DCP transform {t!r}")
    return Extent(safe, off, length, encoding)


def _box(c, where, fqn, sizes_seen: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chunk record's (offsets, sizes), checked; equal sizes tuples are shared."""
    d = c.__dict__ if isinstance(c, Record) else {}
    offs, sizes = d.get("offsets"), d.get("sizes")
    if type(offs) is tuple and type(sizes) is tuple:  # torch.Size unpickles to a tuple
        shared = sizes_seen.get(sizes)
        if shared is not None and all(type(v) is int and v >= 0 for v in offs):
            return offs, shared
    offs = _ints(_attr(c, "offsets", where), where, f"{fqn}: chunk offsets")
    sizes = _ints(_attr(c, "sizes", where), where, f"{fqn}: chunk sizes")
    return offs, sizes_seen.setdefault(sizes, sizes)


def checkpoint_from_metadata(md: Record, root: str, *, where: str = METADATA) -> Checkpoint:
    """Map DCP metadata onto the logical model (no I/O)."""
    sdm = _attr(md, "state_dict_metadata", where, dict)
    storage = _attr(md, "storage_data", where, dict) if md.__dict__.get("storage_data") is not None else {}
    by_key: dict[tuple, Extent] = {}
    paths: dict[str, str] = {}
    for idx, info in storage.items():
        d = idx.__dict__ if isinstance(idx, Record) else {}
        fqn = d.get("fqn")
        if type(fqn) is not str:
            fqn = _attr(idx, "fqn", where, str)
        offset = d.get("offset")
        key = (fqn, tuple(offset) if offset is not None else None)
        by_key[key] = _extent(info, where, fqn, paths)
    ck = Checkpoint(root=root, format="dcp")
    ck.info["version"] = md.__dict__.get("version")
    pd = md.__dict__.get("planner_data")
    if isinstance(pd, dict):  # flattened key -> path in the original nested state dict
        ck.info["paths"] = {k: tuple(v) for k, v in pd.items()
                            if isinstance(k, str) and isinstance(v, (tuple, list))
                            and all(isinstance(p, (str, int)) and not isinstance(p, bool)
                                    for p in v)}  # a hint only: anything else is ignored
    sizes_seen: dict[tuple, tuple] = {}
    for fqn, meta in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError(where, "state dict key is not a string")
        kind = type(meta).__name__
        if kind == "BytesStorageMetadata":
            ck.objects[fqn] = ObjectEntry(fqn, by_key.get((fqn, None)))
            continue
        if kind != "TensorStorageMetadata":
            raise FormatError(where, f"{fqn}: unexpected storage metadata {kind}")
        dtype = _dtype_of(meta.__dict__.get("properties"), where, fqn)
        shape = _ints(_attr(meta, "size", where), where, f"{fqn}: size")
        check_shape(shape, dtype, where=f"{where}: {fqn}")
        chunks = []
        seen: set[tuple[int, ...]] = set()
        nd = len(shape)
        for c in _attr(meta, "chunks", where, list):
            offs, sizes = _box(c, where, fqn, sizes_seen)
            if len(offs) != nd or len(sizes) != nd:
                raise FormatError(where, f"{fqn}: chunk rank differs from the tensor's")
            if offs in seen:  # one storage entry per offset: a second listing overlaps it
                # (stop here: a pickle's memo makes a million listings cost a 2 MB file)
                raise FormatError(where, f"{fqn}: chunk at {list(offs)} is listed more than once",
                                  code="CHUNK_OVERLAP")
            seen.add(offs)
            ext = by_key.get((fqn, offs))
            if ext is None:
                raise FormatError(where, f"{fqn}: chunk at {list(offs)} has no storage entry")
            chunks.append(Chunk(offs, sizes, ext))
        ck.tensors[fqn] = TensorEntry(fqn, dtype, shape, chunks)
    return ck


def read_dcp(store: Store, files: dict[str, int] | None = None, *,
             strict: bool = True, plans: bool = False) -> Checkpoint:
    """Read a DCP checkpoint's metadata: one GET of ``.metadata``.

    ``strict``: a data file that the metadata names but the place lacks is an error
    (``verify`` passes False and reports it as a finding instead). ``plans``: Megatron-
    core's ``.metadata`` (see :func:`parse_metadata`).
    """
    where = store.display(METADATA)
    ck_files = dict(files) if files is not None else store.list_files()
    if METADATA not in ck_files:
        raise FormatError(where, "missing: the checkpoint was never committed",
                          code="NOT_COMMITTED")
    data = store.read(METADATA)
    with paused_gc():
        ck = checkpoint_from_metadata(parse_metadata(data, where=where, plans=plans), store.url,
                                      where=where)
    ck.files = ck_files
    ck.store = store
    if strict:
        for rel in sorted(referenced_files(ck)):
            if rel not in ck_files:
                raise NotFoundError(store.display(rel), "referenced by .metadata but missing")
    return ck


def referenced_files(ck: Checkpoint) -> set[str]:
    """Every data file the checkpoint's entries point into."""
    out = {c.extent.file for t in ck.tensors.values() for c in t.chunks}
    out.update(o.extent.file for o in ck.objects.values() if o.extent is not None)
    return out


def step_from_objects(ck: Checkpoint, reader) -> int | None:
    """The ``step`` entry's value if it is a plain integer (decoded without code; a
    value the reader already holds, Megatron's ``iteration``, needs no read)."""
    for name in ("step", "train_state.step", "trainer.step", "global_step", "iteration"):
        entry = ck.objects.get(name)
        if entry is not None and entry.extent is None and isinstance(entry.value, int) \
                and not isinstance(entry.value, bool):
            return entry.value
        if entry is not None and entry.extent is not None and entry.extent.length < (1 << 16):
            try:
                value = reader(ck, entry)
            except (FormatError, UnsafeInputError):
                return None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def chunk_nbytes(t: TensorEntry, c: Chunk) -> int:
    return t.dtype.nbytes(math.prod(c.sizes))
