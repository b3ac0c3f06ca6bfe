"""Write ``torch.save``-compatible zips by streaming, one storage at a time.

``torch.save`` needs every tensor in memory; ckptctl writes the same file layout (records
``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/<key>``,
``version``, ``.data/serialization_id``; data records 64-byte aligned; zip64 with data
descriptors, as torch writes them) while the tensor bytes arrive in blocks. ``data.pkl``
is pickled exactly as torch pickles tensors (``_rebuild_tensor_v2`` over typed storages,
``_rebuild_tensor_v3`` over untyped ones), so ``torch.load(weights_only=True, mmap=True)``
reads the result.

>>> import io, torch
>>> buf = io.BytesIO()
>>> w = TorchZipWriter(buf, pickle_state({"w": TensorRef("0", "float32", (2,))}))
>>> w.write_record("0", [torch.tensor([1.0, 2.0]).numpy().tobytes()])
>>> _ = w.close()
>>> torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
{'w': tensor([1., 2.])}
"""
from __future__ import annotations

import collections
import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterable

try:  # ISA-L's CRC-32 runs ~3x faster than zlib's; same polynomial, same values
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; keep working without it
    from zlib import crc32

ALIGN = 64
ARCHIVE = "archive"
_ZIP64_EXTRA_LOCAL = struct.pack("<HHQQ", 1, 16, 0, 0)  # sizes follow in the descriptor


@dataclass(frozen=True)
class TensorRef:
    """A tensor whose bytes will be record ``data/<key>``: contiguous, row-major."""

    key: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TorchSize(tuple):
    """A shape pickled as ``torch.Size`` (what DeepSpeed's ``param_shapes`` hold)."""


def _strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


#: torch's typed storage class per dtype (``torch.storage._dtype_to_storage_type_map``);
#: other dtypes are pickled over ``UntypedStorage`` with ``_rebuild_tensor_v3``, as torch does.
TYPED_STORAGE = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage",
    "qint8": "QInt8Storage", "qint32": "QInt32Storage", "quint8": "QUInt8Storage",
    "quint4x2": "QUInt4x2Storage", "quint2x4": "QUInt2x4Storage",
}


class _Global:
    """A module attribute written as a pickle GLOBAL without importing the module, so
    ``data.pkl`` is written without importing torch."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # the pickler wants a callable; it is never called here
        raise TypeError(f"{self.module}.{self.name} is only a pickle reference")


class _StorageId:
    __slots__ = ("pid",)

    def __init__(self, pid):
        self.pid = pid


class _StateDictPickler(pickle._Pickler):  # the Python pickler: its dispatch can be extended
    """Pickles :class:`TensorRef` exactly the way ``torch.save`` pickles a tensor."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = _save_global_ref

    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageId) else None

    def reducer_override(self, obj):
        if isinstance(obj, TorchSize):
            return (_Global("torch", "Size"), (list(obj),))
        if not isinstance(obj, TensorRef):
            return NotImplemented
        stride = _strides(obj.shape)
        hooks = collections.OrderedDict()
        typed = TYPED_STORAGE.get(obj.dtype)
        if typed is not None:
            pid = ("storage", _Global("torch", typed), obj.key, "cpu", obj.numel)
            return (_Global("torch._utils", "_rebuild_tensor_v2"),
                    (_StorageId(pid), 0, obj.shape, stride, False, hooks))
        from ..model import DTYPES

        nbytes = DTYPES[obj.dtype].nbytes(obj.numel)
        pid = ("storage", _Global("torch.storage", "UntypedStorage"), obj.key, "cpu", nbytes)
        return (_Global("torch._utils", "_rebuild_tensor_v3"),
                (_StorageId(pid), 0, obj.shape, stride, False, hooks, _Global("torch", obj.dtype)))


def lift_tensors(value, keys: Iterable[str]):
    """``value`` (a decoded object entry) with every real ``torch.Tensor`` in it replaced by
    a :class:`TensorRef` taking the next key of ``keys``, and the bytes of each, ``[(key,
    bytes)]``: a tensor inside an object (an RNG state) becomes a storage record as
    ``torch.save`` writes it, not Python pickling's fallback (``torch.storage.
    _load_from_bytes``, which ``weights_only`` loading refuses).

    >>> import torch
    >>> v, records = lift_tensors({"rng": [torch.tensor([7], dtype=torch.uint8)]}, iter("k"))
    >>> v, records
    ({'rng': [TensorRef(key='k', dtype='uint8', shape=(1,))]}, [('k', b'\\x07')])
    """
    records: list[tuple[str, bytes]] = []
    keys = iter(keys)

    def walk(v):
        if isinstance(v, dict):
            out = {k: walk(x) for k, x in v.items()}
            return out if type(v) is dict else type(v)(out)  # an OrderedDict stays one
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple) and type(v) is tuple:
            return tuple(walk(x) for x in v)
        if type(v).__module__.startswith("torch") and hasattr(v, "untyped_storage"):
            import torch

            t = v.detach().cpu().contiguous()
            key = next(keys)
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            records.append((key, data))
            return TensorRef(key, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        return v

    return walk(value), records


def pickle_state(obj) -> bytes:
    """``data.pkl`` for an object tree whose tensors are :class:`TensorRef` s."""
    buf = io.BytesIO()
    _StateDictPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


class TorchZipWriter:
    """Stream a torch.save zip into ``out`` (any writable binary stream; it need not be
    seekable). Offsets inside the zip are relative to where it starts, so several zips
    can follow each other in one file, as in a DCP ``.distcp`` file."""

    def __init__(self, out: BinaryIO, data_pkl: bytes, *, serialization_id: str = "0" * 40):
        self.out = out
        self.pos = 0
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset
        self.serialization_id = serialization_id
        self._record("data.pkl", [data_pkl])
        self._record(".format_version", [b"1"])
        self._record(".storage_alignment", [str(ALIGN).encode()])
        self._record("byteorder", [b"little"])

    def _write(self, b) -> None:
        self.out.write(b)
        self.pos += len(b)

    def _record(self, name: str, blocks: Iterable, *, align: bool = False) -> None:
        bname = f"{ARCHIVE}/{name}".encode()
        extra = _ZIP64_EXTRA_LOCAL
        if align:  # pad with an "FB" extra field so the data starts on a 64-byte boundary
            start = self.pos + 30 + len(bname) + len(extra) + 4
            pad = (-start) % ALIGN
            extra += struct.pack("<HH", 0x4246, pad) + b"\0" * pad
        header_offset = self.pos
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0x0808, 0, 0, 0x21, 0,
                                0xFFFFFFFF, 0xFFFFFFFF, len(bname), len(extra)) + bname + extra)
        crc, size = 0, 0
        for b in blocks:
            crc = crc32(b, crc)
            size += len(b)
            self._write(b)
        self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        self.entries.append((bname, crc, size, header_offset))

    def write_record(self, key: str, blocks: Iterable) -> None:
        """Write storage ``data/<key>`` from an iterable of byte blocks (row-major)."""
        self._record(f"data/{key}", blocks, align=True)

    def close(self) -> int:
        """Write the trailing records and the central directory; returns the zip's length."""
        self._record("version", [b"3\n"])
        self._record(".data/serialization_id", [self.serialization_id.encode()])
        cd_start = self.pos
        for name, crc, size, off in self.entries:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, off)
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0x0808, 0, 0,
                                    0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0,
                                    0, 0, 0, 0xFFFFFFFF) + name + extra)
        cd_size = self.pos - cd_start
        z64 = self.pos
        n = len(self.entries)
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size,
                                cd_start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, z64, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                                0xFFFFFFFF, 0))
        return self.pos
