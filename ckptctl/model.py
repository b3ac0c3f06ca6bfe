"""The logical checkpoint model: pure dataclasses, no I/O, no torch.

Every format reader maps its files onto a :class:`Checkpoint`: a set of entries keyed by
flattened dotted names. A :class:`TensorEntry` has a dtype, a global shape and chunks; each
:class:`Chunk` is an N-D box of the global tensor plus the :class:`Extent` of bytes that
holds it. An :class:`ObjectEntry` is an opaque payload (pickled scalars, RNG state, ...).

>>> t = TensorEntry("w", DTYPES["float32"], (4, 2), [
...     Chunk((0, 0), (2, 2), Extent("a", 0, 16)), Chunk((2, 0), (2, 2), Extent("b", 0, 16))])
>>> t.numel, t.nbytes, t.sharded_dims()
(8, 32, (0,))
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

# --------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class DType:
    """One element type. ``name`` is torch's name (``bfloat16``); ``bits`` per element."""

    name: str
    bits: int
    safetensors: str | None  # the safetensors header code, None if it has none
    kind: str  # "float", "int", "uint", "bool", "complex", "float8", "sub-byte"

    @property
    def itemsize(self) -> int:
        """Bytes per element; sub-byte types are packed, so this is 1 for them."""
        return max(1, self.bits // 8)

    def nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` packed elements (exact for sub-byte types too)."""
        return (numel * self.bits + 7) // 8

    @property
    def is_floating(self) -> bool:
        return self.kind in ("float", "float8", "complex")


_DTYPE_TABLE = [
    # name, bits, safetensors code, kind
    ("bool", 8, "BOOL", "bool"),
    ("uint8", 8, "U8", "uint"),
    ("int8", 8, "I8", "int"),
    ("uint16", 16, "U16", "uint"),
    ("int16", 16, "I16", "int"),
    ("uint32", 32, "U32", "uint"),
    ("int32", 32, "I32", "int"),
    ("uint64", 64, "U64", "uint"),
    ("int64", 64, "I64", "int"),
    ("float16", 16, "F16", "float"),
    ("bfloat16", 16, "BF16", "float"),
    ("float32", 32, "F32", "float"),
    ("float64", 64, "F64", "float"),
    ("complex32", 32, None, "complex"),
    ("complex64", 64, "C64", "complex"),
    ("complex128", 128, None, "complex"),
    ("float8_e4m3fn", 8, "F8_E4M3", "float8"),
    ("float8_e5m2", 8, "F8_E5M2", "float8"),
    ("float8_e4m3fnuz", 8, "F8_E4M3FNUZ", "float8"),
    ("float8_e5m2fnuz", 8, "F8_E5M2FNUZ", "float8"),
    ("float8_e8m0fnu", 8, "F8_E8M0", "float8"),
    ("float4_e2m1fn_x2", 8, None, "float8"),  # torch packs two fp4 values in one byte
    ("float4_e2m1", 4, "F4", "sub-byte"),  # safetensors-only packed fp4
    ("float6_e2m3", 6, "F6_E2M3", "sub-byte"),
    ("float6_e3m2", 6, "F6_E3M2", "sub-byte"),
    ("qint8", 8, None, "int"),
    ("quint8", 8, None, "uint"),
    ("qint32", 32, None, "int"),
]

DTYPES: dict[str, DType] = {n: DType(n, b, s, k) for n, b, s, k in _DTYPE_TABLE}
SAFETENSORS_DTYPES: dict[str, DType] = {d.safetensors: d for d in DTYPES.values() if d.safetensors}

#: Short spellings a user may type (``--dtype bf16``).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "fp64": "float64", "double": "float64"}


def dtype_from_name(name: str) -> DType:
    """Look a dtype up by torch name, alias or safetensors code.

    >>> dtype_from_name("bf16").name, dtype_from_name("F8_E4M3").name
    ('bfloat16', 'float8_e4m3fn')
    """
    key = name.removeprefix("torch.")
    key = DTYPE_ALIASES.get(key.lower(), key)
    if key in DTYPES:
        return DTYPES[key]
    if key in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[key]
    raise KeyError(name)


# --------------------------------------------------------------------------- entries


class Extent(NamedTuple):
    """Where bytes live: a file (relative to the checkpoint root), a byte range in it and
    how those bytes are encoded.

    ``encoding`` is one of ``raw`` (the row-major bytes themselves), ``torch_zip`` (the range
    is a complete ``torch.save`` zip holding one storage, as DCP writes), ``torch_zip+zstd``
    (that zip compressed with zstd, DCP's ``stream.zstd/1``) or ``torch_save`` (an entry of a
    ``torch.save`` file, read through torch; ``offset``/``length`` are the whole file)
    or ``zarr`` (one chunk of an Orbax zarr array, decoded by tensorstore: ``file`` is its
    key under the checkpoint, a file of a per-array folder or a key inside OCDBT).

    Extents and chunks are named tuples, not dataclasses: a 10,000-rank checkpoint has
    hundreds of thousands of each, and a tuple is the most compact immutable record.
    """

    file: str
    offset: int
    length: int
    encoding: str = "raw"


class Chunk(NamedTuple):
    """An N-D box of a tensor (``offsets``, ``sizes`` in elements) and its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    extent: Extent

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorEntry:
    """A logical tensor: dtype, global shape and the chunks that tile it."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.numel)

    def sharded_dims(self) -> tuple[int, ...]:
        """Dims along which the chunks split the tensor (empty: stored whole)."""
        if len(self.chunks) <= 1:
            return ()
        return tuple(d for d in range(len(self.shape))
                     if len({c.offsets[d] for c in self.chunks}) > 1)


@dataclass
class ObjectEntry:
    """An opaque payload. ``extent`` is where its bytes are (None: known only in memory);
    ``value`` holds a plain Python value when the format gives it without unpickling.
    ``admitted``: globals (``"argparse.Namespace"``) its pickle may name beyond torch's
    weights-only set, because the format's reader parsed it with them as inert records
    (:data:`~ckptctl.formats.safe_pickle.ADMITTABLE`)."""

    name: str
    extent: Extent | None = None
    value: object = None
    type_name: str | None = None
    admitted: tuple[str, ...] = ()


Entry = TensorEntry | ObjectEntry


@dataclass
class Checkpoint:
    """One checkpoint at one place: its format, files, entries and what is known about it.

    ``files`` maps each file (relative to the root) to its size in bytes. ``root`` is the
    URL the checkpoint was opened from; readers keep a store handle in ``store``.
    """

    root: str
    format: str
    files: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    step: int | None = None
    info: dict = field(default_factory=dict)  # format-specific extras (version, metadata)
    store: object = field(default=None, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def entries(self) -> Iterable[Entry]:
        yield from self.tensors.values()
        yield from self.objects.values()


# --------------------------------------------------------------------------- layout


@dataclass
class LayoutSummary:
    """What the chunks say about how the checkpoint was sharded."""

    world_size: int  # number of distinct data files holding chunks (DCP: ranks)
    sharded_tensors: int
    replicated_tensors: int  # stored whole, once
    dims: dict[str, int]  # "dim 0" -> number of tensors sharded on it
    max_chunks: int
    mesh_guess: str | None


def layout_summary(ckpt: Checkpoint) -> LayoutSummary:
    """Derive the layout from the chunks.

    >>> ck = Checkpoint("x", "dcp", tensors={"w": TensorEntry("w", DTYPES["float32"], (4,), [
    ...     Chunk((0,), (2,), Extent("__0_0.distcp", 0, 8)),
    ...     Chunk((2,), (2,), Extent("__1_0.distcp", 0, 8))])})
    >>> s = layout_summary(ck); (s.world_size, s.sharded_tensors, s.mesh_guess)
    (2, 1, 'dp=2')

    The mesh guess reads the split patterns: a tensor split on two dims (FSDP on dim 0,
    row-wise tensor parallel on dim 1) names a 2-D mesh ``dp=A,tp=B``; a 1-D split on
    dim 1 anywhere names tensor parallel ``tp=N``; else ``dp=N`` (FSDP shards dim 0).

    >>> def box(r, c, f): return Chunk((r, c), (2, 2), Extent(f"__{f}_0.distcp", 0, 16))
    >>> ck.tensors["v"] = TensorEntry("v", DTYPES["float32"], (4, 4), [
    ...     box(0, 0, 0), box(0, 2, 1), box(2, 0, 2), box(2, 2, 3)])
    >>> layout_summary(ck).mesh_guess
    'dp=2,tp=2'
    """
    files: set[str] = set()
    sharded = replicated = max_chunks = 0
    dims: dict[str, int] = {}
    splits: dict[tuple[int, ...], int] = {}
    for t in ckpt.tensors.values():
        files.update(c.extent.file for c in t.chunks)
        max_chunks = max(max_chunks, len(t.chunks))
        sd = t.sharded_dims()
        if not sd:
            replicated += 1
            continue
        sharded += 1
        for d in sd:
            dims[f"dim {d}"] = dims.get(f"dim {d}", 0) + 1
        counts = tuple(len({c.offsets[d] for c in t.chunks}) for d in sd)
        splits[counts] = splits.get(counts, 0) + 1
    return LayoutSummary(len(files), sharded, replicated, dict(sorted(dims.items())),
                         max_chunks, _mesh_guess(splits, dims, len(files)))


def _mesh_guess(splits: dict[tuple[int, ...], int], dims: dict[str, int],
                nfiles: int) -> str | None:
    """Name the mesh from the split patterns (counts of distinct offsets per sharded dim)."""
    if not splits:
        return None
    two = {k: v for k, v in splits.items() if len(k) == 2}
    if two:  # FSDP splits dim 0 over dp, row-wise TP dim 1 over tp (DeviceMesh order)
        dp, tp = max(two.items(), key=lambda kv: kv[1])[0]
        return f"dp={dp},tp={tp}"
    common = max(splits.items(), key=lambda kv: kv[1])[0]
    total = math.prod(common)
    if len(common) > 1:
        return "x".join(str(c) for c in common)
    if total != nfiles:
        return f"{total}-way"
    return f"tp={total}" if any(d != "dim 0" for d in dims) else f"dp={total}"


# --------------------------------------------------------------------------- names


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key of a dotted name in natural order, the one order every listing uses
    (``inspect``'s tensors, objects and tree, ``ls``): numbers compare as numbers, dotted
    parts one by one, so a module comes right before what it holds.

    >>> sorted(["layers.10.w", "layers.2.w", "layers", "layers.2", "embed"], key=natural_key)
    ['embed', 'layers', 'layers.2', 'layers.2.w', 'layers.10.w']
    >>> sorted(["step-100", "step-20", "step-3"], key=natural_key)
    ['step-3', 'step-20', 'step-100']
    """
    return tuple(tuple((0, int(p), p) if p.isdigit() else (1, 0, p)
                       for p in _DIGITS.split(part) if p)
                 for part in name.split("."))
