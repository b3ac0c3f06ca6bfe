"""``diff``: compare two checkpoints entry by entry through the logical model, across
formats and layouts (a 4-rank FSDP DCP checkpoint, its 2-D reshard and its consolidated
safetensors compare identical).

Each entry of A is matched with the entry of B of the same name (after ``maps``: prefix
renames applied to A's names) and gets one :data:`STATUSES` status:

* ``identical``: every byte equal. Proven without reading when both checkpoints are
  sealed, the tensor's chunks are the same boxes at the same extents, and each file's
  content hash is the same in both manifests (``proof: "hashes"``); else the bytes are
  read and compared block by block (``proof: "bytes"``); objects decoded as plain data
  compare by value (``proof: "values"``);
* ``equal_within_tolerance``: bytes differ, but every element satisfies numpy's
  ``isclose``: ``|a - b| <= atol + rtol * |b|`` (B is the reference); NaN equals NaN only
  at the same positions, +-Inf equal only themselves, ``-0.0`` equals ``0.0``;
* ``different``: with ``max_abs_diff`` (over positions where both values are finite),
  ``rel_l2`` (``||a - b|| / ||b||`` over those positions; None when ``||b|| = 0``),
  ``fraction_changed`` (elements whose values differ) and ``nonfinite_mismatch``
  (positions where one side is NaN/Inf and the other is not the same);
* ``dtype_mismatch``, ``shape_mismatch``, ``kind_mismatch`` (a tensor against an
  object): nothing is read;
* ``only_in_a``, ``only_in_b``.

``only`` selects entries by state part (``model``, ``optim``, ...: :func:`ckptctl.parts.classify`
of A's name, else B's) or by glob (over the name after ``maps`` or A's own name), so
``maps=["model.="], only=["model"]`` compares a checkpoint's model with its HF export.
``common``: the entries only one side holds are counted but do not make the two unequal.
The result's ``verdict`` is the whole comparison in one status word, ``parts`` the counts
per state part, ``differing`` what makes the two unequal, largest change first
(:func:`ranked`).

Tensors stream in row blocks over the intersection of the two chunk layouts (each chunk
of A is assembled from B's chunks, the way reshard assembles a target chunk), so memory
stays within ``max_memory`` whatever the tensor sizes. Blocks are compared as bytes
first; only blocks that differ are decoded to float64 (bf16 by a bit shift, fp8 by a
table: no torch) for the statistics.

Objects: compared by value when both decode safely as plain data (numbers, strings,
lists, dicts: DCP pickles through the no-globals loader, torch.save values as loaded);
else by their payload bytes (a DCP object's ``data.pkl`` and storages, an opaque file's
bytes), which may call the same value "different" across formats (the note says so).

>>> r = diff("run/step-100", "export/", maps=["model.="], only=["model"])  # doctest: +SKIP
>>> r.equal, r.verdict, r.counts                                           # doctest: +SKIP
(True, 'identical', {'identical': 36})
"""
from __future__ import annotations

import fnmatch
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import CkptError, StorageError, UsageError
from ..parts import PARTS, classify

#: Every status an entry can get, in the order summaries list them.
STATUSES = ("identical", "equal_within_tolerance", "different", "dtype_mismatch",
            "shape_mismatch", "kind_mismatch", "only_in_a", "only_in_b")
#: The statuses that make two checkpoints equal (exit 0).
EQUAL = ("identical", "equal_within_tolerance")
#: The statuses of an entry only one side holds (with ``common``: counted, not decisive).
ONE_SIDED = ("only_in_a", "only_in_b")
#: Differences of structure, listed before any difference of values.
STRUCTURAL = ("kind_mismatch", "shape_mismatch", "dtype_mismatch")
#: Elements decoded to float64 at once (a few such arrays live per worker).
SUB_ELEMENTS = 1 << 17


@dataclass
class EntryDiff:
    """One entry's comparison. ``name`` is the matching name (A's after ``maps``);
    ``name_a``/``name_b`` the names on each side. ``proof`` says what was shown:
    ``hashes`` (manifest content hashes, bytes not read), ``bytes`` (read and compared),
    ``values`` (decoded plain values), ``tolerance`` (values within atol/rtol)."""

    name: str
    kind: str  # "tensor" or "object"
    status: str
    name_a: str | None = None
    name_b: str | None = None
    dtype: str | None = None
    dtype_b: str | None = None
    shape: list[int] | None = None
    shape_b: list[int] | None = None
    bytes: int = 0
    proof: str | None = None
    numel: int | None = None
    changed: int | None = None
    outside_tolerance: int | None = None
    nonfinite_mismatch: int | None = None
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    fraction_changed: float | None = None
    #: ``||a - b||`` and ``||b||`` over the positions finite on both sides (set with
    #: ``rel_l2``): what a layer's relative change is summed from (:func:`by_layer`)
    l2_diff: float | None = None
    l2_b: float | None = None
    note: str | None = None
    part: str | None = None


@dataclass
class DiffResult:
    """What :func:`diff` found. ``a``/``b``: each side's ``url``, ``format``, ``step``,
    ``manifest_id``. ``entries``: every compared entry, in natural name order.
    ``bytes``: tensor bytes of the entries present on both sides with the same dtype and
    shape; ``bytes_fast_pathed``: of those, proven by manifest hashes without reading;
    ``bytes_compared``: read from each side and compared; ``bytes_decoded``: in blocks
    that differed, decoded for statistics. ``verdict``: ``identical``,
    ``equal_within_tolerance`` or ``different``; ``common``: whether entries on one side
    only were left out of it; ``parts``: ``{part: {status: n}}``; ``differing``: the names
    that make the two unequal, largest change first."""

    equal: bool
    a: dict
    b: dict
    atol: float
    rtol: float
    entries: list[EntryDiff] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    bytes_identical: int = 0
    bytes_fast_pathed: int = 0
    bytes_compared: int = 0
    bytes_decoded: int = 0
    seconds: float = 0.0
    proven: str = ""
    verdict: str = ""
    common: bool = False
    parts: dict[str, dict[str, int]] = field(default_factory=dict)
    differing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["entries"] = [{k: v for k, v in e.items() if v is not None} for e in d["entries"]]
        d["layers"] = [asdict(x) for x in by_layer(self.entries)]
        return {"equal": d.pop("equal"), "verdict": d.pop("verdict"), **d}


@dataclass
class LayerChange:
    """The change of one layer (:func:`layer_of`) between A and B, summed over its tensors
    present on both sides with the same dtype and shape. ``rel_l2``: ``sqrt(sum ||a-b||^2)
    / sqrt(sum ||b||^2)`` over the tensors whose values differ (tensors proven identical
    add nothing above, and are not read for the norm below: 0.0 when none differ; None
    when B's norm is 0 or NaN/Inf sits on one side only); ``fraction_changed``: values
    changed over every value of the layer's tensors; ``nonfinite_mismatch``: positions
    NaN/Inf on one side only; ``structural``: tensors whose dtype or shape differ (not
    counted above)."""

    layer: str
    part: str
    tensors: int = 0
    tensors_changed: int = 0
    numel: int = 0
    changed: int = 0
    fraction_changed: float = 0.0
    rel_l2: float | None = 0.0
    max_abs_diff: float = 0.0
    nonfinite_mismatch: int = 0
    structural: int = 0


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numbered component (a
    transformer block), else its module (the name less its last component).

    >>> layer_of("model.layers.3.self_attn.q_proj.weight"), layer_of("model.norm.weight")
    ('model.layers.3', 'model.norm')
    >>> layer_of("optim.state.model.layers.0.weight.exp_avg"), layer_of("step")
    ('optim.state.model.layers.0', 'step')
    """
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def by_layer(entries: list[EntryDiff]) -> list[LayerChange]:
    """The tensors compared on both sides, grouped by :func:`layer_of`, in natural name
    order: what ``diff --plot``, ``diff --json``'s ``layers`` and ``ckptctl report``'s
    change strip show.

    >>> rows = [EntryDiff("l.0.w", "tensor", "different", numel=4, changed=1, l2_diff=3.0,
    ...                   l2_b=4.0, rel_l2=0.75, max_abs_diff=3.0, part="model"),
    ...         EntryDiff("l.0.b", "tensor", "identical", shape=[4], part="model")]
    >>> x = by_layer(rows)[0]
    >>> x.layer, x.tensors, x.tensors_changed, x.rel_l2, x.fraction_changed
    ('l.0', 2, 1, 0.75, 0.125)
    """
    from ..model import natural_key

    layers: dict[str, LayerChange] = {}
    d2: dict[str, float] = {}
    b2: dict[str, float] = {}
    unbounded: set[str] = set()
    for e in entries:
        if e.kind != "tensor" or e.status in ONE_SIDED:
            continue
        key = layer_of(e.name)
        x = layers.setdefault(key, LayerChange(key, e.part or part_of(e.name)))
        x.tensors += 1
        if e.status in STRUCTURAL:
            x.structural += 1
            continue
        x.numel += e.numel if e.numel is not None else math.prod(e.shape or [])
        if e.status == "different" and e.changed is None:  # a dtype not decoded
            x.tensors_changed += 1
            unbounded.add(key)
            continue
        if not e.changed:
            continue
        x.tensors_changed += 1
        x.changed += e.changed
        x.nonfinite_mismatch += e.nonfinite_mismatch or 0
        x.max_abs_diff = max(x.max_abs_diff, e.max_abs_diff or 0.0)
        if e.l2_diff is None or e.l2_b is None or e.nonfinite_mismatch:
            unbounded.add(key)  # undecoded, or NaN/Inf on one side: no finite ratio
            continue
        d2[key] = d2.get(key, 0.0) + e.l2_diff ** 2
        b2[key] = b2.get(key, 0.0) + e.l2_b ** 2
    for key, x in layers.items():
        x.fraction_changed = x.changed / x.numel if x.numel else 0.0
        if key in unbounded or (d2.get(key) and not b2.get(key)):
            x.rel_l2 = None
        elif key in d2:
            x.rel_l2 = math.sqrt(d2[key]) / math.sqrt(b2[key])
    return [layers[k] for k in sorted(layers, key=natural_key)]


# --------------------------------------------------------------------------- names


def parse_maps(maps: list[str] | None) -> list[tuple[str, str]]:
    """``OLD=NEW`` prefix renames (``model.=`` strips ``model.``); a text without ``=``
    or with an empty OLD is a usage error.

    >>> parse_maps(["model.=", "a.b=c."])
    [('model.', ''), ('a.b', 'c.')]
    >>> parse_maps(["model."])
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --map expects OLD=NEW (a name prefix and its replacement), got 'model.'
    """
    out = []
    for m in maps or ():
        old, sep, new = m.partition("=")
        if not sep or not old:
            raise UsageError(f"--map expects OLD=NEW (a name prefix and its replacement), got {m!r}")
        out.append((old, new))
    return out


def map_name(name: str, maps: list[tuple[str, str]]) -> str:
    """``name`` with the first matching prefix replaced.

    >>> map_name("model.layers.0.w", [("model.", "")]), map_name("optim.x", [("model.", "")])
    ('layers.0.w', 'optim.x')
    """
    for old, new in maps:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def part_of(name: str, name_a: str | None = None) -> str:
    """The state part of an entry: of A's own name when A holds it (an export's names,
    stripped of ``model.``, say less), else of ``name``.

    >>> part_of("layers.0.w", "model.layers.0.w"), part_of("optim.state.w.exp_avg")
    ('model', 'optim')
    """
    return classify(name_a if name_a is not None else name)


@dataclass(frozen=True)
class Selection:
    """What ``--only`` selects: the entries of ``parts``, and those whose name after
    ``--map`` or A's own name before it matches one of ``globs``; every entry when both
    are empty.

    >>> sel = Selection.parse(["optimizer", "layers.0.*"])
    >>> sel
    Selection(parts=frozenset({'optim'}), globs=('layers.0.*',))
    >>> sel("optim.state.w.step"), sel("layers.0.w"), sel("norm.w", "model.norm.w")
    (True, True, False)
    >>> Selection.parse(["model.*"])("layers.0.w", "model.layers.0.w")
    True
    """

    parts: frozenset = frozenset()
    globs: tuple = ()

    @classmethod
    def parse(cls, only: list[str] | None) -> "Selection":
        """``--only`` values: a comma list of state parts (``model``, ``optim,rng``, with
        :func:`~ckptctl.catalog.closure.parse_parts`' spellings), else a glob."""
        from ..catalog.closure import parse_parts

        parts, globs = set(), []
        for value in only or ():
            try:
                parts.update(parse_parts(value))
            except UsageError:
                globs.append(value)
        return cls(frozenset(parts), tuple(globs))

    def __bool__(self) -> bool:
        return bool(self.parts or self.globs)

    def __call__(self, name: str, name_a: str | None = None) -> bool:
        if not self:
            return True
        if self.parts and part_of(name, name_a) in self.parts:
            return True
        return any(fnmatch.fnmatchcase(n, g) for g in self.globs
                   for n in (name, name_a) if n is not None)


def selected(name: str, only: list[str] | None, name_a: str | None = None) -> bool:
    """Whether ``--only`` values ``only`` select the entry matched as ``name`` (A's own
    name ``name_a``): see :class:`Selection`.

    >>> selected("model.layers.0.w", ["model.*"]), selected("optim.x", ["model.*", "step"])
    (True, False)
    >>> selected("layers.0.w", ["model"], "model.layers.0.w"), selected("optim.x", ["model"])
    (True, False)
    """
    return Selection.parse(only)(name, name_a)


def _change(e: EntryDiff) -> tuple:
    """Sort key of a differing entry, largest change first: differences of structure,
    then values by relative L2 change (infinite where B is all zeros or a NaN/Inf sits on
    one side only; max |a-b| breaks ties), then differences without numbers (objects,
    undecoded dtypes), then entries one side lacks; by name within each."""
    from ..model import natural_key

    if e.status in STRUCTURAL:
        return (0, STRUCTURAL.index(e.status), 0.0, natural_key(e.name))
    if e.status in ONE_SIDED:
        return (3, ONE_SIDED.index(e.status), 0.0, natural_key(e.name))
    if e.max_abs_diff is None:
        return (2, 0, 0.0, natural_key(e.name))
    rel = math.inf if e.nonfinite_mismatch or e.rel_l2 is None else e.rel_l2
    return (1, -rel, -e.max_abs_diff, natural_key(e.name))


def ranked(entries: list[EntryDiff]) -> list[EntryDiff]:
    """The entries that are not equal, largest change first (see :func:`_change`).

    >>> rows = [EntryDiff("a", "tensor", "different", max_abs_diff=0.1, rel_l2=0.001),
    ...         EntryDiff("b", "tensor", "identical"),
    ...         EntryDiff("c", "tensor", "only_in_a"),
    ...         EntryDiff("d", "tensor", "different", max_abs_diff=0.01, rel_l2=0.5),
    ...         EntryDiff("e", "tensor", "shape_mismatch")]
    >>> [e.name for e in ranked(rows)]
    ['e', 'd', 'a', 'c']
    """
    return sorted((e for e in entries if e.status not in EQUAL), key=_change)


# --------------------------------------------------------------------------- decoding


def _minifloat_table(exp: int, man: int, bias: int, *, special: str, bits: int = 8):
    """float64 value of every code of a small float format. ``special``: ``ieee`` (all-ones
    exponent: Inf/NaN), ``fn`` (only all-ones exponent and mantissa: NaN, no Inf),
    ``fnuz`` (only the negative-zero code is NaN), ``none`` (every code finite)."""
    import numpy as np

    out = np.empty(1 << bits, dtype=np.float64)
    top = (1 << exp) - 1
    for v in range(1 << bits):
        s, e, m = v >> (bits - 1), (v >> man) & top, v & ((1 << man) - 1)
        if special == "fnuz" and v == 1 << (bits - 1):
            x = math.nan
        elif special == "ieee" and e == top:
            x = math.inf if m == 0 else math.nan
        elif special == "fn" and e == top and m == (1 << man) - 1:
            x = math.nan
        elif e == 0:
            x = m / (1 << man) * 2.0 ** (1 - bias)
        else:
            x = (1 + m / (1 << man)) * 2.0 ** (e - bias)
        out[v] = -x if s else x
    return out


#: exponent bits, mantissa bits, bias, special codes of each 8-bit float
_FP8 = {"float8_e4m3fn": (4, 3, 7, "fn"), "float8_e5m2": (5, 2, 15, "ieee"),
        "float8_e4m3fnuz": (4, 3, 8, "fnuz"), "float8_e5m2fnuz": (5, 2, 16, "fnuz")}
_TABLES: dict[str, object] = {}
_TABLES_LOCK = threading.Lock()


def _table(name: str):
    with _TABLES_LOCK:
        if name not in _TABLES:
            import numpy as np

            if name == "float8_e8m0fnu":  # exponent only, no sign: 2**(e-127), 0xFF NaN
                t = np.array([2.0 ** (e - 127) for e in range(256)])
                t[255] = math.nan
            elif name in ("float4_e2m1fn_x2", "float4_e2m1"):
                t = _minifloat_table(2, 1, 1, special="none", bits=4)
            else:
                exp, man, bias, special = _FP8[name]
                t = _minifloat_table(exp, man, bias, special=special)
            _TABLES[name] = t
        return _TABLES[name]


_NATIVE = {"bool": "u1", "uint8": "u1", "int8": "i1", "uint16": "<u2", "int16": "<i2",
           "uint32": "<u4", "int32": "<i4", "uint64": "<u8", "int64": "<i8",
           "qint8": "i1", "quint8": "u1", "qint32": "<i4",
           "float16": "<f2", "float32": "<f4", "float64": "<f8",
           "complex64": "<c8", "complex128": "<c16"}


def decodable(dtype) -> bool:
    """Whether :func:`decode` gives values for ``dtype`` (packed fp4/fp6 it does not).

    >>> from ckptctl.model import DTYPES
    >>> decodable(DTYPES["bfloat16"]), decodable(DTYPES["float8_e4m3fn"]), decodable(DTYPES["float6_e2m3"])
    (True, True, False)
    """
    return dtype.name in _NATIVE or dtype.name in ("bfloat16", "complex32") or (
        dtype.kind == "float8")


def decode(raw, dtype):
    """Little-endian element bytes as numbers: float64 for real types (exact for every
    float type; integers wider than 53 bits are rounded), complex128 for complex ones.
    bf16 is widened by a bit shift and fp8/fp4 through a code table, without torch.

    >>> import numpy as np
    >>> from ckptctl.model import DTYPES
    >>> decode(np.array([0x3f80, 0xc040], dtype="<u2").tobytes(), DTYPES["bfloat16"]).tolist()
    [1.0, -3.0]
    >>> decode(bytes([0x38, 0x7f, 0xfe]), DTYPES["float8_e4m3fn"]).tolist()
    [1.0, nan, -448.0]
    """
    import numpy as np

    u8 = np.frombuffer(raw, dtype=np.uint8)
    name = dtype.name
    if name == "bfloat16":  # widening a NaN is exact; numpy warns about it all the same
        with np.errstate(invalid="ignore"):
            return (u8.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if name == "complex32":
        f = u8.view("<f2").astype(np.float64)
        return f[0::2] + 1j * f[1::2]
    if name == "float4_e2m1fn_x2":  # two values a byte, low nibble first
        t = _table(name)
        return np.stack([t[u8 & 0xF], t[u8 >> 4]], axis=-1).reshape(-1)
    if dtype.kind == "float8":
        return _table(name)[u8]
    native = u8.view(_NATIVE[name])
    if native.dtype.kind == "c":
        return native.astype(np.complex128)
    return native.astype(np.float64)


def _bytes_equal(a, b) -> bool:
    """memcmp-speed equality of two equal-length byte buffers (numpy, widest word)."""
    import numpy as np

    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    if len(x) != len(y):
        return False
    n = len(x)
    for w in (8, 4, 2):
        if n % w == 0:
            x, y = x.view(f"u{w}"), y.view(f"u{w}")
            break
    return bool(np.array_equal(x, y))


# --------------------------------------------------------------------------- statistics


class _Stats:
    """Running statistics of one tensor over the blocks that differ."""

    def __init__(self):
        self.lock = threading.Lock()
        self.numel = 0
        self.changed = 0
        self.outside = 0
        self.nonfinite = 0
        self.max_abs = 0.0
        self.sum_d2 = 0.0
        self.sum_b2 = 0.0
        self.diff_bytes = 0
        self.same_blocks: list[tuple] = []  # (chunk, r0, r1): ||b|| still owed
        self.undecoded = False

    def merge(self, o: "_Stats") -> None:
        with self.lock:
            self.changed += o.changed
            self.outside += o.outside
            self.nonfinite += o.nonfinite
            self.max_abs = max(self.max_abs, o.max_abs)
            self.sum_d2 += o.sum_d2
            self.sum_b2 += o.sum_b2
            self.diff_bytes += o.diff_bytes
            self.same_blocks += o.same_blocks
            self.undecoded |= o.undecoded

    def feed(self, a, b, dtype, atol: float, rtol: float) -> None:
        """Add a differing block (raw bytes of A and B), decoded in sub-blocks."""
        import numpy as np

        self.diff_bytes += len(a)
        if not decodable(dtype):
            self.undecoded = True
            return
        item = dtype.itemsize
        step = SUB_ELEMENTS * item
        native = _NATIVE.get(dtype.name)
        exact_ints = native is not None and np.dtype(native).kind in "iub"
        for s in range(0, len(a), step):
            ra, rb = a[s:s + step], b[s:s + step]
            x, y = decode(ra, dtype), decode(rb, dtype)
            if exact_ints:  # wide integers round in float64: |a-b| from the integers
                ia, ib = np.frombuffer(ra, dtype=native), np.frombuffer(rb, dtype=native)
                same = ia == ib
                wide = np.int64 if np.dtype(native).kind == "i" else np.uint64
                ua, ub = ia.astype(wide).view(np.uint64), ib.astype(wide).view(np.uint64)
                d = np.where(ia >= ib, ua - ub, ub - ua).astype(np.float64)  # exact mod 2**64
                close = same | (d <= atol + rtol * np.abs(y))
                self.changed += int(np.count_nonzero(~same))
                self.outside += int(np.count_nonzero(~close))
                if d.size:
                    self.max_abs = max(self.max_abs, float(d.max()))
                    self.sum_d2 += float(np.dot(d, d))
                    self.sum_b2 += float(np.dot(y, y))
                continue
            self._values(x, y, atol, rtol)

    def feed_cast(self, a, dta, b, dtb, atol: float, rtol: float) -> None:
        """Add a block of A in ``dta`` against the same elements of B in ``dtb`` (``diff
        --cast``): both decoded to float64 and compared as values."""
        self.diff_bytes += len(a)
        ia, ib = dta.itemsize, dtb.itemsize
        for s in range(0, len(a) // ia, SUB_ELEMENTS):
            e = min(len(a) // ia, s + SUB_ELEMENTS)
            self._values(decode(a[s * ia:e * ia], dta), decode(b[s * ib:e * ib], dtb),
                         atol, rtol)

    def _values(self, x, y, atol: float, rtol: float) -> None:
        """Add decoded values ``x`` (A) against ``y`` (B, the reference)."""
        import numpy as np

        with np.errstate(invalid="ignore", over="ignore"):
            d = np.subtract(x, y)
            d = np.abs(d, out=d) if d.dtype.kind == "f" else np.abs(d)
            top = d.max() if d.size else 0.0
        if np.isfinite(top):  # the common case, in few passes: d == 0 iff a == b
            changed = int(np.count_nonzero(d))
            self.changed += changed
            if atol == 0 and rtol == 0:
                self.outside += changed
            else:
                tol = np.abs(y) * rtol + atol if rtol else atol
                self.outside += int(np.count_nonzero(d > tol))
            self.max_abs = max(self.max_abs, float(top))
            self.sum_d2 += float(np.dot(d, d))
            self.sum_b2 += float(np.real(np.vdot(y, y)))  # sum |y|^2, complex too
            return
        with np.errstate(invalid="ignore", over="ignore"):
            # NaN where either is NaN or both are the same Inf
            same = x == y
            if not np.isfinite(d).all():  # NaN equals NaN at the same position
                same |= np.isnan(x) & np.isnan(y)
                fin = np.isfinite(d)  # both finite (an overflow aside)
                self.nonfinite += int(np.count_nonzero(~same & ~fin))
                d, y = d[fin], y[fin]
                same_fin = same[fin]
            else:
                same_fin = same
            tol = atol + rtol * np.abs(y) if rtol else atol
            outside = ~same_fin & ~(d <= tol)
        self.changed += int(same.size - np.count_nonzero(same))
        self.outside += int(np.count_nonzero(outside))
        # non-finite positions that differ are outside any tolerance
        self.outside += int(np.count_nonzero(~same)) - int(np.count_nonzero(~same_fin))
        if d.size:
            self.max_abs = max(self.max_abs, float(d.max()))
            self.sum_d2 += float(np.dot(d, d))
            self.sum_b2 += float(np.real(np.vdot(y, y)))  # sum |y|^2, complex too

    def feed_norm(self, raw, dtype) -> None:
        """Add an identical block's share of ``||b||``."""
        import numpy as np

        step = SUB_ELEMENTS * dtype.itemsize
        for s in range(0, len(raw), step):
            y = decode(raw[s:s + step], dtype)
            with np.errstate(invalid="ignore", over="ignore"):
                n2 = float(np.real(np.vdot(y, y)))
            if not math.isfinite(n2):  # NaN/Inf (or an overflow): finite values only
                y = y[np.isfinite(y)]
                n2 = float(np.real(np.vdot(y, y)))
            self.sum_b2 += n2


# --------------------------------------------------------------------------- tensors


def _hash_proven(cka, ckb, ta, tb) -> bool:
    """Same boxes at the same extents, and every file they live in has the same content
    hash in both manifests (and its listed size): the bytes are equal without reading
    them, as far as the manifests are true to their files."""
    ma, mb = cka.info.get("manifest"), ckb.info.get("manifest")
    if ma is None or mb is None or ma.hash != mb.hash or not ta.chunks:
        return False
    key = lambda c: (c.offsets, c.sizes)  # noqa: E731
    ca, cb = sorted(ta.chunks, key=key), sorted(tb.chunks, key=key)
    if [(c.offsets, c.sizes, c.extent) for c in ca] != [(c.offsets, c.sizes, c.extent) for c in cb]:
        return False
    for c in ca:  # the listing's sizes must agree too (a cheap sanity check; verify
        rel = c.extent.file  # --level full is what re-proves a manifest against its files)
        fa, fb = ma.files.get(rel), mb.files.get(rel)
        if fa is None or fa != fb or cka.files.get(rel) != fa.size or ckb.files.get(rel) != fb.size:
            return False
    return True


def _target(pair: "_Pair", ca):
    """Chunk ``ca`` of A as a reshard target assembled from B's chunks."""
    from .planner import TargetChunk, pieces_for

    tb = pair.tb
    return TargetChunk(tb.name, tb.dtype, 0, ca.offsets, ca.sizes,
                       pieces_for(tb, ca.offsets, ca.sizes, pair.index))


#: Files whose chunks average less than this are compared whole first (see _equal_files).
SMALL_CHUNKS = 1 << 20


def _equal_files(cka, ckb, pairs: list["_Pair"], workers: int) -> set[tuple[int, tuple]]:
    """Chunks proven identical by comparing whole files: where A and B hold a tensor's box
    at the same extent of a file of the same size, and the two files are byte-equal, every
    chunk stored there is identical, so nothing is decoded. Only for files of many small
    chunks (thousands of ranks), where per-chunk work dominates; a file that differs is left
    to the chunk-by-chunk comparison. Returns ``(id(pair), offsets)`` of the proven chunks.
    """
    same: dict[str, list[tuple[int, tuple]]] = {}
    count: dict[str, int] = {}
    for p in pairs:
        at_b = {c.offsets: c for c in p.tb.chunks}
        for ca in p.ta.chunks:
            count[ca.extent.file] = count.get(ca.extent.file, 0) + 1
            cb = at_b.get(ca.offsets)
            if cb is not None and cb.sizes == ca.sizes and cb.extent == ca.extent:
                same.setdefault(ca.extent.file, []).append((id(p), ca.offsets))
    files = [rel for rel, keys in same.items()
             if cka.files.get(rel) is not None and cka.files.get(rel) == ckb.files.get(rel)
             and cka.files[rel] < SMALL_CHUNKS * count[rel]]

    def equal(rel: str) -> bool:
        a = cka.store.iter_blocks(rel)
        b = ckb.store.iter_blocks(rel)
        for x in a:
            x = bytes(x)  # blocks are only valid until the next one of the same thread
            pos = 0
            while pos < len(x):
                y = next(b, None)
                if y is None or x[pos:pos + len(y)] != y:
                    return False
                pos += len(y)
        return next(b, None) is None

    out: set[tuple[int, tuple]] = set()
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for rel, ok in zip(files, pool.map(equal, files)):
            if ok:
                out.update(same[rel])
    return out


def _check_cover(ck, t) -> None:
    """Chunks that hold fewer elements than the tensor leave a gap nothing would compare
    (``verify`` says where); refuse rather than call the rest identical."""
    from ..errors import FormatError

    held = sum(c.numel for c in t.chunks)
    if held < t.numel:
        raise FormatError(ck.root, f"{t.name}: chunks hold {held} of {t.numel} elements "
                          "(run ckptctl verify)", code="CHUNK_GAP")


class _Pair:
    """One tensor present on both sides with the same dtype and shape."""

    def __init__(self, row: EntryDiff, ta, tb):
        from .planner import chunk_index

        self.row, self.ta, self.tb = row, ta, tb
        self.cast = ta.dtype.name != tb.dtype.name  # diff --cast: compared as values
        self.atol: float | None = None  # --cast without a tolerance: the dtypes' (cast_rtol)
        self.rtol: float | None = None
        self.index = chunk_index(tb)  # B's chunks, found per box of A without a scan
        self.stats = _Stats()
        self.compared = 0
        self.differs = False  # a block differed: later identical blocks add ||b|| at once


def _compare_chunk(job, cka, ckb, budget, atol, rtol, on_bytes) -> None:
    """Compare chunk ``ca`` of A with the same box of B, row block by row block."""
    import numpy as np

    from ..formats.tensorio import byte_dtype, chunk_bytes, read_rows_into
    from .copier import fill_rows, row_ranges

    pair, ca = job
    ta, tb, dtype = pair.ta, pair.tb, pair.ta.dtype
    if pair.cast:
        _compare_cast(pair, ca, cka, ckb, budget, pair.atol if pair.atol is not None else atol,
                      pair.rtol if pair.rtol is not None else rtol, on_bytes)
        return
    st = _Stats()
    if not ca.sizes or dtype.bits % 8:  # a scalar, or packed sub-byte: whole, small
        a = chunk_bytes(cka, ta, ca)
        tc = _target(pair, ca)
        if len(tc.pieces) != 1 or tc.pieces[0].sizes != tc.pieces[0].src.sizes:
            from ..errors import UnsupportedFormatError

            raise UnsupportedFormatError(cka.root, f"{ta.name}: sub-byte tensors split "
                                         "differently cannot be compared")
        b = chunk_bytes(ckb, tb, tc.pieces[0].src)
        if not _bytes_equal(a, b):
            st.feed(a, b, dtype, atol, rtol)
        with pair.stats.lock:
            pair.compared += len(a)
        pair.stats.merge(st)
        if on_bytes:
            on_bytes(len(a))
        return
    tc = _target(pair, ca)
    inner = math.prod(ca.sizes[1:])
    row = dtype.nbytes(inner)
    brow = max([dtype.nbytes(math.prod(p.src.sizes[1:])) for p in tc.pieces] or [row])
    vt = byte_dtype(dtype)
    abuf = bbuf = None
    for r0, r1 in row_ranges(ca.sizes[0], row_bytes=max(row, brow), budget=budget):
        n = (r1 - r0) * row
        if abuf is None or abuf.nbytes < n:
            abuf, bbuf = np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
        a = memoryview(abuf[:n])
        read_rows_into(cka, ta, ca, r0, r1, a)
        out = bbuf[:n].view(vt).reshape((r1 - r0, *ca.sizes[1:]))
        fill_rows(ckb, tc, r0, r1, out)
        b = memoryview(bbuf[:n])
        if not _bytes_equal(a, b):
            pair.differs = True
            st.feed(a, b, dtype, atol, rtol)
        elif pair.differs and decodable(dtype):  # in memory now: no second read
            st.feed_norm(a, dtype)
        else:  # owed only if the tensor turns out to differ elsewhere
            st.same_blocks.append((ca, r0, r1))
        if on_bytes:
            on_bytes(n)
    with pair.stats.lock:
        pair.compared += ca.numel * dtype.itemsize
    pair.stats.merge(st)


def _compare_cast(pair, ca, cka, ckb, budget, atol, rtol, on_bytes) -> None:
    """``diff --cast``: chunk ``ca`` of A (its dtype) against the same box of B (another
    dtype), row block by row block, as float64 values."""
    import numpy as np

    from ..formats.tensorio import byte_dtype, chunk_bytes, read_rows_into
    from .copier import fill_rows, row_ranges

    ta, tb = pair.ta, pair.tb
    st = _Stats()
    tc = _target(pair, ca)
    sizes = tuple(ca.sizes)
    inner = math.prod(sizes[1:]) if sizes else 1
    row_a, row_b = ta.dtype.nbytes(inner), tb.dtype.nbytes(inner)
    blocks = row_ranges(sizes[0], row_bytes=max(row_a, row_b), budget=budget) if sizes \
        else [(0, 1)]
    for r0, r1 in blocks:
        if sizes:
            a = np.empty((r1 - r0) * row_a, dtype=np.uint8)
            b = np.empty((r1 - r0) * row_b, dtype=np.uint8)
            read_rows_into(cka, ta, ca, r0, r1, memoryview(a))
            fill_rows(ckb, tc, r0, r1, b.view(byte_dtype(tb.dtype)).reshape((r1 - r0,
                                                                             *sizes[1:])))
        else:  # a scalar: one element each
            a = np.frombuffer(bytes(chunk_bytes(cka, ta, ca)), dtype=np.uint8)
            b = np.frombuffer(bytes(chunk_bytes(ckb, tb, tc.pieces[0].src)), dtype=np.uint8)
        st.feed_cast(memoryview(a), ta.dtype, memoryview(b), tb.dtype, atol, rtol)
        if on_bytes:
            on_bytes(len(a))
    with pair.stats.lock:
        pair.compared += ta.nbytes if not sizes else ca.numel * ta.dtype.itemsize
    pair.stats.merge(st)


#: Significand bits of the float types ``--cast`` compares (integers: exact).
_MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7,
             "float8_e4m3fn": 3, "float8_e4m3fnuz": 3, "float8_e5m2": 2,
             "float8_e5m2fnuz": 2, "float8_e8m0fnu": 0}


def castable(dtype) -> bool:
    """Can ``diff --cast`` compare ``dtype`` as real values?

    >>> from ckptctl.model import DTYPES
    >>> castable(DTYPES["bfloat16"]), castable(DTYPES["int64"]), castable(DTYPES["complex64"])
    (True, True, False)
    """
    return decodable(dtype) and dtype.kind in ("float", "float8", "int", "uint", "bool") \
        and not dtype.bits % 8


def cast_rtol(da, db) -> float:
    """The relative tolerance ``--cast`` uses when none is given: one unit in the last
    place of the narrower float type (bf16: 2**-7; fp32 against fp64: 2**-23), what
    rounding to it may change; 0 between integer types.

    >>> from ckptctl.model import DTYPES
    >>> cast_rtol(DTYPES["float32"], DTYPES["bfloat16"])
    0.0078125
    >>> cast_rtol(DTYPES["int32"], DTYPES["int64"])
    0.0
    """
    bits = [_MANTISSA[d.name] for d in (da, db) if d.name in _MANTISSA]
    return 2.0 ** -min(bits) if bits else 0.0


def _owed_norm(job, cka) -> _Stats:
    """``||b||`` over blocks found identical in a tensor that differs elsewhere: re-read
    from A (the same bytes)."""
    from ..formats.tensorio import read_rows

    pair, (ca, r0, r1) = job
    st = _Stats()
    st.feed_norm(read_rows(cka, pair.ta, ca, r0, r1), pair.ta.dtype)
    return st


def _finish(pair: _Pair) -> None:
    row, s = pair.row, pair.stats
    if s.diff_bytes == 0:
        row.status, row.proof = "identical", "bytes"
        return
    if s.undecoded:
        row.status = "different"
        row.note = f"bytes differ; {row.dtype} values are not decoded"
        return
    # the number of values compared: torch's fp4 x2 holds two in each element
    row.numel = pair.ta.numel * (2 if pair.ta.dtype.name == "float4_e2m1fn_x2" else 1)
    row.changed, row.outside_tolerance, row.nonfinite_mismatch = s.changed, s.outside, s.nonfinite
    row.l2_diff, row.l2_b = math.sqrt(s.sum_d2), math.sqrt(s.sum_b2)
    if s.outside == 0:
        row.status, row.proof = "equal_within_tolerance", "tolerance"
        if s.changed == 0:
            row.note = "values equal, bytes differ (-0.0 against 0.0, or NaN payloads)"
        return
    row.status = "different"
    row.max_abs_diff = s.max_abs
    row.rel_l2 = math.sqrt(s.sum_d2) / math.sqrt(s.sum_b2) if s.sum_b2 > 0 else None
    row.fraction_changed = s.changed / row.numel if row.numel else 0.0
    if s.nonfinite:
        row.note = f"{s.nonfinite} positions NaN/Inf on one side only"


# --------------------------------------------------------------------------- objects


def _plain(v, depth: int = 0) -> bool:
    if depth > 50:
        return False
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    return False


def _object_value(ck, o):
    """(True, value) when the object decodes safely as plain data, else (False, None)."""
    from ..formats.tensorio import read_object

    if o.extent is not None and o.extent.encoding == "opaque":
        return False, None
    if o.extent is not None and o.extent.encoding == "torch_save":
        return (True, o.value) if _plain(o.value) else (False, None)
    try:
        v = read_object(ck, o)
    except StorageError:
        raise
    except CkptError:  # not plain data: compare the bytes
        return False, None
    return (True, v) if _plain(v) else (False, None)


def _object_bytes(ck, o) -> bytes | None:
    """The bytes an object's payload is made of: a DCP zip's ``data.pkl`` and storage
    records (not its name or serialization id), an opaque file's bytes; None when the
    object lives only in memory."""
    from ..formats.tensorio import decompress_bounded
    from ..formats.torchzip import central_directory, local_data_offset

    ext = o.extent
    if ext is None or ext.encoding == "torch_save":
        return None
    where = ck.store.display(ext.file)
    blob = ck.store.read_range(ext.file, ext.offset, ext.offset + ext.length)
    if ext.encoding in ("raw", "opaque"):
        return blob
    if ext.encoding == "torch_zip+zstd":
        blob = decompress_bounded(blob, where, 1 << 30)
    entries, _ = central_directory(blob, len(blob), where=where)
    parts = []
    for en in sorted(entries, key=lambda e: e.name.split("/", 1)[-1]):
        rec = en.name.split("/", 1)[-1]
        if rec == "data.pkl" or rec.startswith("data/"):
            off = local_data_offset(blob[en.header_offset:en.header_offset + 512], en, where=where)
            parts.append(rec.encode() + b"\0" + blob[off:off + en.csize])
    return b"\1".join(parts)


def _compare_object(row: EntryDiff, cka, oa, ckb, ob) -> None:
    ok_a, va = _object_value(cka, oa)
    ok_b, vb = _object_value(ckb, ob)
    if ok_a and ok_b:
        same = va == vb or (isinstance(va, float) and isinstance(vb, float)
                            and math.isnan(va) and math.isnan(vb))
        row.status, row.proof = ("identical", "values") if same else ("different", None)
        if not same:
            from ..errors import shorten

            row.note = shorten(f"values differ: {va!r} against {vb!r}", 200)
        return
    ba, bb = _object_bytes(cka, oa), _object_bytes(ckb, ob)
    if ba is None or bb is None:
        row.status = "different"
        row.note = "not comparable: one side decodes as plain data, the other not"
        return
    row.bytes = len(ba)
    if ba == bb:
        row.status, row.proof = "identical", "bytes"
    else:
        row.status = "different"
        row.note = "payload bytes differ (not decodable as plain data)"


# --------------------------------------------------------------------------- diff


def _side(ck) -> dict:
    man = ck.info.get("manifest")
    return {"url": ck.root, "format": ck.format, "step": ck.step,
            "num_tensors": len(ck.tensors), "num_objects": len(ck.objects),
            "manifest_id": man.checkpoint_id if man is not None else None}


def diff(a: str, b: str, a_options: dict | None = None, b_options: dict | None = None, *,
         atol: float = 0.0, rtol: float = 0.0, only: list[str] | None = None,
         maps: list[str] | None = None, max_memory: int | str = 1 << 30, workers: int = 4,
         cast: bool = False, common: bool = False,
         on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None) -> DiffResult:
    """Compare checkpoint ``a`` with ``b`` (any formats, layouts, places).

    ``maps``: ``OLD=NEW`` prefix renames applied to A's names before matching; ``only``:
    state parts or globs (any may match, see :class:`Selection`); ``common``: entries on
    one side only are counted, not held against equality (a checkpoint against its
    model-only export). ``atol``/``rtol``: numpy ``isclose``
    tolerance, B the reference. Memory for tensor data stays within about
    ``max_memory``; ``workers`` chunks are compared at once. ``on_bytes(n)``: n more
    bytes of each side compared; ``on_total(n)``: called once with the total.
    ``cast``: a tensor stored in another dtype on each side (an export cast to bf16
    against its fp32 source) is compared as values, within ``atol``/``rtol`` or, with
    neither given, within :func:`cast_rtol` of B (its note says so); without ``cast``
    such a pair is ``dtype_mismatch``.

    >>> diff("a/", "b/", atol=-1)
    Traceback (most recent call last):
    ckptctl.errors.UsageError: --atol and --rtol must be finite and >= 0
    """
    from ..formats.detect import open_checkpoint

    pairs, max_memory = _check_args(atol, rtol, workers, maps, max_memory)
    t0 = time.monotonic()
    cka = open_checkpoint(a, a_options)
    ckb = open_checkpoint(b, b_options)
    for ck in (cka, ckb):  # remote: small files in one GET each, within the budget
        ck.store.cache_small_files(ck.files, budget=min(256 << 20, max_memory // 4))
    names_a, names_b, keys = _matched(cka, ckb, pairs, only, common)
    res = DiffResult(False, _side(cka), _side(ckb), atol, rtol)
    rows, pairs_todo, objects = _classify(res, cka, ckb, keys, names_a, names_b,
                                          cast=cast, atol=atol, rtol=rtol)
    jobs = _chunk_jobs(cka, ckb, pairs_todo, workers, on_bytes)
    with one_blas_thread():
        _compare_all(cka, ckb, jobs, pairs_todo, objects, workers=workers,
                     max_memory=max_memory, atol=atol, rtol=rtol, on_bytes=on_bytes,
                     on_total=on_total)
    _tally(res, rows, pairs_todo, common)
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def one_blas_thread():
    """numpy's BLAS limited to one thread while blocks are compared (``threadpoolctl``):
    the sums of squares are ``np.dot`` of 131,072 values, which OpenBLAS spreads over a
    thread per core that spin against the comparing workers. The CLI sets
    ``OPENBLAS_NUM_THREADS=1`` before numpy loads; a library caller (a notebook, ``ckptctl
    report`` from Python) has numpy loaded already: a 10-checkpoint report took 2.5-4.7 s
    there against 0.4-0.5 s on 2 busy cores.

    >>> with one_blas_thread():
    ...     pass
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _check_args(atol: float, rtol: float, workers: int, maps: list[str] | None,
                max_memory: int | str) -> tuple[list[tuple[str, str]], int]:
    """(parsed ``maps``, ``max_memory`` in bytes); a value out of range is a usage error."""
    from ..units import parse_size

    if not all(math.isfinite(x) and x >= 0 for x in (atol, rtol)):
        raise UsageError("--atol and --rtol must be finite and >= 0")
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    pairs = parse_maps(maps)
    max_memory = parse_size(max_memory)
    if max_memory < 1 << 20:
        raise UsageError("--max-memory must be at least 1MiB")
    return pairs, max_memory


def _matched(cka, ckb, maps: list[tuple[str, str]], only: list[str] | None,
             common: bool) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(A's names by matching name, B's, the matching names ``only`` selects in natural
    order); a ``--map`` that merges two names of A, or a selection that leaves nothing to
    compare, is a usage error."""
    from ..model import natural_key

    names_a: dict[str, str] = {}
    for n in list(cka.tensors) + list(cka.objects):
        key = map_name(n, maps)
        if key in names_a:
            raise UsageError(f"--map makes {names_a[key]!r} and {n!r} of A the same name {key!r}")
        names_a[key] = n
    names_b = {n: n for n in list(ckb.tensors) + list(ckb.objects)}
    everything = sorted(set(names_a) | set(names_b), key=natural_key)
    pick = Selection.parse(only)
    keys = [k for k in everything if pick(k, names_a.get(k))]
    if only and not keys:
        raise UsageError(f"--only {' '.join(only)} selects no entry of either checkpoint "
                         f"(state parts: {', '.join(PARTS)}; or a glob over names such as "
                         f"{everything[0]!r})" if everything else
                         f"--only {' '.join(only)}: neither checkpoint holds an entry")
    if common and not any(k in names_a and k in names_b for k in keys):
        raise UsageError("--common: A and B have no entry name in common"
                         + (" among those --only selects" if only else "")
                         + " (--map OLD=NEW renames A's names)")
    return names_a, names_b, keys


def _classify(res: DiffResult, cka, ckb, keys: list[str], names_a: dict[str, str],
              names_b: dict[str, str], *, cast: bool, atol: float,
              rtol: float) -> tuple[list[EntryDiff], list[_Pair], list[tuple]]:
    """(a row per entry of ``keys``, the tensor pairs to read, the (row, object of A,
    object of B) to compare): a row gets its status here when no bytes need reading."""
    rows: list[EntryDiff] = []
    pairs_todo: list[_Pair] = []
    objects: list[tuple] = []
    for k in keys:
        na, nb = names_a.get(k), names_b.get(k)
        ta = cka.tensors.get(na) if na else None
        tb = ckb.tensors.get(nb) if nb else None
        kind = "tensor" if (ta or tb) else "object"
        row = EntryDiff(k, kind, "", name_a=na, name_b=nb, part=part_of(k, na))
        rows.append(row)
        if na is None or nb is None:
            row.status = "only_in_a" if nb is None else "only_in_b"
            t = ta or tb
            if t is not None:
                row.dtype, row.shape, row.bytes = t.dtype.name, list(t.shape), t.nbytes
        elif (ta is None) != (tb is None):
            row.status = "kind_mismatch"
            row.note = (f"A holds {'a tensor' if ta else 'an object'}, "
                        f"B {'a tensor' if tb else 'an object'}")
        elif ta is None:
            objects.append((row, cka.objects[na], ckb.objects[nb]))
        else:
            pair = _tensor_pair(res, row, cka, ckb, ta, tb, cast=cast, atol=atol, rtol=rtol)
            if pair is not None:
                pairs_todo.append(pair)
    return rows, pairs_todo, objects


def _tensor_pair(res: DiffResult, row: EntryDiff, cka, ckb, ta, tb, *, cast: bool,
                 atol: float, rtol: float) -> _Pair | None:
    """The pair to read and compare for tensor ``row``, or None where its status needs no
    reading (dtype or shape mismatch, no bytes, manifest hashes equal); counts its bytes
    into ``res``."""
    row.dtype, row.shape, row.bytes = ta.dtype.name, list(ta.shape), ta.nbytes
    if ta.dtype.name != tb.dtype.name:
        row.dtype_b = tb.dtype.name
        if not (cast and castable(ta.dtype) and castable(tb.dtype)) \
                or tuple(ta.shape) != tuple(tb.shape):
            row.status = "dtype_mismatch"
            return None
        p = _Pair(row, ta, tb)
        if atol == 0 and rtol == 0:
            p.atol, p.rtol = 0.0, cast_rtol(ta.dtype, tb.dtype)
            row.note = f"cast: values compared within rtol={p.rtol:g} of B"
        res.bytes += ta.nbytes
        return p
    if tuple(ta.shape) != tuple(tb.shape):
        row.status, row.shape_b = "shape_mismatch", list(tb.shape)
        return None
    res.bytes += ta.nbytes
    if ta.nbytes == 0:
        row.status, row.proof = "identical", "bytes"
    elif _hash_proven(cka, ckb, ta, tb):
        row.status, row.proof = "identical", "hashes"
        res.bytes_fast_pathed += ta.nbytes
    else:
        return _Pair(row, ta, tb)
    return None


def _chunk_jobs(cka, ckb, pairs: list[_Pair], workers: int, on_bytes) -> list[tuple]:
    """The (pair, chunk of A) to compare, once both sides are known to cover each tensor;
    chunks in files proven equal whole (:func:`_equal_files`) count as compared."""
    jobs = []
    for p in pairs:
        _check_cover(cka, p.ta)
        _check_cover(ckb, p.tb)
    proven = _equal_files(cka, ckb, [p for p in pairs if not p.cast], workers)
    for p in pairs:
        for c in p.ta.chunks:
            if (id(p), c.offsets) in proven:
                p.compared += c.numel * p.ta.dtype.itemsize
                if on_bytes:
                    on_bytes(c.numel * p.ta.dtype.itemsize)
            elif c.numel:
                jobs.append((p, c))
    return jobs


def _compare_all(cka, ckb, jobs: list[tuple], pairs: list[_Pair], objects: list[tuple], *,
                 workers: int, max_memory: int, atol: float, rtol: float, on_bytes,
                 on_total) -> None:
    """Compare the chunk ``jobs``, then the owed ``||b||`` of tensors that differ
    (:func:`_owed_norm`), then the ``objects``, on threads within ``max_memory``."""
    workers = max(1, min(workers, len(jobs) or 1, max_memory // (4 << 20) or 1))
    budget = max(64 << 10, min(16 << 20, max_memory // (4 * workers)))
    if on_total:
        on_total(sum(p.ta.nbytes for p in pairs))

    def run(job):
        _compare_chunk(job, cka, ckb, budget, atol, rtol, on_bytes)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, jobs))
        owed = [(p, blk) for p in pairs if p.stats.diff_bytes and not p.stats.undecoded
                for blk in p.stats.same_blocks]
        for st, (p, _) in zip(pool.map(lambda j: _owed_norm(j, cka), owed), owed):
            p.stats.merge(st)
        for row, oa, ob in objects:
            _compare_object(row, cka, oa, ckb, ob)


def _tally(res: DiffResult, rows: list[EntryDiff], pairs: list[_Pair], common: bool) -> None:
    """Settle the compared tensors' statuses, then fill in ``res``: byte and status counts,
    parts, what differs, the verdict and what was proven."""
    for p in pairs:
        _finish(p)
        res.bytes_compared += p.compared
        res.bytes_decoded += p.stats.diff_bytes
    counts = {s: 0 for s in STATUSES}
    for row in rows:
        counts[row.status] += 1
        if row.status == "identical" and row.kind == "tensor":
            res.bytes_identical += row.bytes
    res.counts = {s: n for s, n in counts.items() if n}
    res.parts = part_counts(rows)
    res.entries = rows
    res.common = common
    decisive = [r for r in rows if not (common and r.status in ONE_SIDED)]
    res.differing = [r.name for r in ranked(decisive)]
    res.equal = not res.differing
    res.verdict = ("different" if res.differing else "identical"
                   if all(r.status == "identical" for r in decisive) else "equal_within_tolerance")
    res.proven = _proven(rows, res.atol, res.rtol)


def part_counts(rows: list[EntryDiff]) -> dict[str, dict[str, int]]:
    """``{part: {status: n}}``, parts in :data:`ckptctl.parts.PARTS` order, statuses in
    :data:`STATUSES` order, only those that occur.

    >>> part_counts([EntryDiff("w", "tensor", "identical", part="model"),
    ...              EntryDiff("s", "object", "only_in_a", part="step"),
    ...              EntryDiff("v", "tensor", "different", part="model")])
    {'model': {'identical': 1, 'different': 1}, 'step': {'only_in_a': 1}}
    """
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        per = out.setdefault(row.part or "model", {})
        per[row.status] = per.get(row.status, 0) + 1
    order = {p: i for i, p in enumerate(PARTS)}
    return {p: {s: out[p][s] for s in STATUSES if s in out[p]}
            for p in sorted(out, key=lambda p: order.get(p, len(order)))}


def _proven(rows: list[EntryDiff], atol: float, rtol: float) -> str:
    """What the equal entries were shown to be, in words.

    >>> _proven([EntryDiff("w", "tensor", "identical", proof="hashes"),
    ...          EntryDiff("x", "tensor", "equal_within_tolerance", proof="tolerance")], 0.1, 0)
    '1 byte-identical (manifest hashes); 1 values within atol=0.1, rtol=0'
    """
    n = {k: sum(1 for r in rows if r.proof == k) for k in ("bytes", "hashes", "values", "tolerance")}
    parts = []
    if n["bytes"] or n["hashes"]:
        how = [w for w, k in (("read and compared", "bytes"), ("manifest hashes", "hashes")) if n[k]]
        parts.append(f"{n['bytes'] + n['hashes']} byte-identical ({', '.join(how)})")
    if n["values"]:
        parts.append(f"{n['values']} objects equal as plain values")
    if n["tolerance"]:
        parts.append(f"{n['tolerance']} values within atol={atol:g}, rtol={rtol:g}")
    return "; ".join(parts) or "nothing equal"
