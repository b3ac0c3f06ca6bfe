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


class Global:
    """A module attribute written as a pickle global without importing the module, so
    ``data.pkl`` and DCP's ``.metadata`` are written without importing torch. Pickled as
    Python pickles a class or function: ``GLOBAL`` (protocols 0-3) or the module and name
    strings then ``STACK_GLOBAL`` (protocol 4 and up), memoized: one instance per global
    makes its later uses memo references, as the real object's would be.

    >>> ref_dumps(Global("collections", "OrderedDict"), 2)
    b'\\x80\\x02ccollections\\nOrderedDict\\nq\\x00.'
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # the pickler wants a callable; it is never called here
        raise TypeError(f"{self.module}.{self.name} is only a pickle reference")


class Instance:
    """An instance of class ``cls`` (a :class:`Global`) pickled as Python pickles a plain
    class's instance at protocol 2 and up: ``cls``, an empty tuple, ``NEWOBJ``, then
    ``state`` and ``BUILD`` (no ``BUILD`` when ``state`` is None: an instance with no
    attributes).

    >>> import argparse
    >>> ref = Instance(Global("argparse", "Namespace"), {"a": 1})
    >>> dumps4(ref) == pickle.dumps(argparse.Namespace(a=1), protocol=4)
    True
    """

    __slots__ = ("cls", "state")

    def __init__(self, cls: Global, state=None):
        self.cls, self.state = cls, state


class Reduced:
    """``func(*args)`` pickled as ``REDUCE`` (what ``__reduce__`` returning ``(func,
    args)`` gives), e.g. ``torch.Size([2, 3])``; ``func`` a :class:`Global`.

    >>> import fractions
    >>> from ckptctl.formats.safe_pickle import restricted_loads
    >>> ref = Reduced(Global("fractions", "Fraction"), ("1/3",))
    >>> restricted_loads(dumps4(ref), {("fractions", "Fraction"): fractions.Fraction})
    Fraction(1, 3)
    """

    __slots__ = ("func", "args")

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, args


class _StorageId:
    __slots__ = ("pid",)

    def __init__(self, pid):
        self.pid = pid


class RefPickler(pickle._Pickler):  # the Python pickler: its dispatch can be extended
    """A pickler for object trees that stand in for classes it cannot import
    (:class:`Global`, :class:`Instance`, :class:`Reduced`): the same opcodes, memo
    included, as pickling the real objects would give.

    >>> import argparse
    >>> ref = Instance(Global("argparse", "Namespace"), {"a": 1})
    >>> ref_dumps(ref, protocol=2) == pickle.dumps(argparse.Namespace(a=1), protocol=2)
    True
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Lazy):
            obj = obj.expand()
        super().save(obj, save_persistent_id)

    def _save_global_ref(self, obj: Global) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_reduced(self, obj: Reduced) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[Global] = _save_global_ref
    dispatch[Instance] = _save_instance
    dispatch[Reduced] = _save_reduced


def ref_dumps(obj, protocol: int) -> bytes:
    """``pickle.dumps(obj, protocol)`` for a tree with :class:`RefPickler`'s stand-ins.

    >>> od = Global("collections", "OrderedDict")
    >>> ref_dumps([od, od], 3) == pickle.dumps([collections.OrderedDict] * 2, 3)
    True
    """
    buf = io.BytesIO()
    RefPickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


_FRAME = 64 * 1024  # pickle's _FRAME_SIZE_TARGET: a frame ends at the first save past it
TUPLE_OPS = (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_BININT1 = [pickle.BININT1 + bytes((i,)) for i in range(256)]


def int_op(v: int) -> bytes:
    """How pickle (protocol 2+) writes int ``v``.

    >>> [int_op(v).hex() for v in (7, 300, -1, 2 ** 40)]
    ['4b07', '4d2c01', '4affffffff', '8a06000000000001']
    """
    if 0 <= v < 256:
        return _BININT1[v]
    if 0 <= v < 65536:
        return pickle.BININT2 + v.to_bytes(2, "little")
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return pickle.BININT + v.to_bytes(4, "little", signed=True)
    enc = pickle.encode_long(v)
    if len(enc) >= 256:
        raise _Unsupported
    return pickle.LONG1 + bytes((len(enc),)) + enc


def get_op(i: int) -> bytes:
    """A memo reference to entry ``i``.

    >>> get_op(3), get_op(256)
    (b'h\\x03', b'j\\x00\\x01\\x00\\x00')
    """
    return pickle.BINGET + bytes((i,)) if i < 256 else pickle.LONG_BINGET + struct.pack("<I", i)


class _Unsupported(Exception):
    """A value :class:`Pickle4` leaves to :class:`RefPickler`."""


class Lazy:
    """A stand-in pickled by the hundred thousand (a DCP chunk's metadata): ``emit``
    writes its bytes into a :class:`Pickle4` straight from its fields (False to decline:
    a class it names is not in the memo yet, or a frame could end inside it), ``expand``
    gives the stand-in tree that any pickler writes the slow way, to the same bytes
    (:class:`~ckptctl.formats.dcp_write.ChunkMeta`).

    >>> from ckptctl.formats.dcp_write import ChunkMeta
    >>> chunks = [ChunkMeta((0,), (2,)), ChunkMeta((2,), (2,))]
    >>> dumps4(chunks) == ref_dumps([c.expand() for c in chunks], 4)
    True
    """

    __slots__ = ()

    def emit(self, p: "Pickle4") -> bool:
        return False

    def expand(self):
        raise NotImplementedError


class Pickle4:
    """``pickle.dumps(obj, protocol=4)`` for plain data (str, int, float, bool, None,
    tuple, list, dict) and stand-ins (:class:`Global`, :class:`Instance`,
    :class:`Reduced`, :class:`Lazy`), byte for byte (frames and memo included), several
    times faster than Python's own pickler: a 300,000-chunk DCP ``.metadata`` is 40 MB.
    Anything else is left to :class:`RefPickler` (:func:`dumps4`).

    >>> Pickle4().dump({"a": [1, ("b", None)], "c": 2.5}) == pickle.dumps(
    ...     {"a": [1, ("b", None)], "c": 2.5}, protocol=4)
    True
    """

    def __init__(self):
        self.done = bytearray()  # the stream up to the frame being filled
        self.cur = bytearray()  # that frame
        self.memo: dict[int, int] = {}  # id(obj) -> memo index
        self.n = 0  # memo entries so far (a Lazy's own objects are counted, not kept)
        self.keep: list = []  # what the memo names stays alive (ids stay unique)
        self._ops: dict[int, bytes] = {}  # memo index -> its reference, for Lazy.emit

    def dump(self, obj) -> bytes:
        self.done += pickle.PROTO + b"\x04"
        self.save(obj)
        self.cur += pickle.STOP
        self._commit()
        return bytes(self.done)

    def _commit(self) -> None:
        cur = self.cur
        if len(cur) >= 4:  # pickle's _FRAME_SIZE_MIN
            self.done += pickle.FRAME + struct.pack("<Q", len(cur))
        self.done += cur
        cur.clear()

    def _memoize(self, obj) -> None:
        self.memo[id(obj)] = self.n
        self.n += 1
        self.keep.append(obj)
        self.cur += pickle.MEMOIZE

    def ref(self, obj) -> bytes | None:
        """The memo reference to ``obj``, or None when it was not pickled yet."""
        i = self.memo.get(id(obj))
        if i is None:
            return None
        op = self._ops.get(i)
        if op is None:
            op = self._ops[i] = get_op(i)
        return op

    def put(self, data: bytes, fresh: int) -> bool:
        """Write ``data`` (one object's opcodes, ``fresh`` of them ``MEMOIZE`` of objects
        nothing refers to again) unless a frame would end inside it: pickle ends a frame
        at the first object that starts past 64 KiB."""
        if len(self.cur) + len(data) > _FRAME:
            return False
        self.cur += data
        self.n += fresh
        return True

    def save(self, obj) -> None:
        cur = self.cur
        if len(cur) >= _FRAME:
            self._commit()
        t = type(obj)
        if t is int:
            cur += int_op(obj)
            return
        if obj is None or t is bool:
            cur += pickle.NONE if obj is None else pickle.NEWTRUE if obj else pickle.NEWFALSE
            return
        i = self.memo.get(id(obj))
        if i is not None:
            cur += get_op(i)
        elif t is str:
            self._save_str(obj)
        elif t is tuple:
            self._save_tuple(obj)
        elif isinstance(obj, Lazy):
            if not obj.emit(self):
                self.save(obj.expand())
        elif t is Instance:
            self.save(obj.cls)
            self.save(())
            cur += pickle.NEWOBJ
            self._memoize(obj)
            if obj.state is not None:
                self.save(obj.state)
                cur += pickle.BUILD
        elif t is Reduced:
            self.save(obj.func)
            self.save(obj.args)
            cur += pickle.REDUCE
            self._memoize(obj)
        elif t is dict:
            cur += pickle.EMPTY_DICT
            self._memoize(obj)
            self._batch(list(obj.items()), pickle.SETITEMS, pickle.SETITEM)
        elif t is list:
            cur += pickle.EMPTY_LIST
            self._memoize(obj)
            self._batch(obj, pickle.APPENDS, pickle.APPEND)
        elif t is Global:
            self.save(obj.module)
            self.save(obj.name)
            cur += pickle.STACK_GLOBAL
            self._memoize(obj)
        elif t is float:
            cur += pickle.BINFLOAT + struct.pack(">d", obj)
        else:
            raise _Unsupported

    def _save_str(self, obj: str) -> None:
        enc = obj.encode("utf-8", "surrogatepass")
        if len(enc) < 256:
            self.cur += pickle.SHORT_BINUNICODE + bytes((len(enc),)) + enc
        elif len(enc) < _FRAME:
            self.cur += pickle.BINUNICODE + struct.pack("<I", len(enc)) + enc
        else:  # written outside the frames: RefPickler does that
            raise _Unsupported
        self._memoize(obj)

    def _save_tuple(self, obj: tuple) -> None:
        n = len(obj)
        if not n:
            self.cur += pickle.EMPTY_TUPLE  # a singleton: never memoized
            return
        if n > 3:
            self.cur += pickle.MARK
        for x in obj:
            self.save(x)
        self.cur += TUPLE_OPS[n - 1] if n <= 3 else pickle.TUPLE
        self._memoize(obj)

    def _batch(self, items: list, many: bytes, one: bytes) -> None:
        """List items or dict (key, value) pairs, by 1000 (pickle's _BATCHSIZE)."""
        pairs = one == pickle.SETITEM
        for at in range(0, len(items), 1000):
            batch = items[at:at + 1000]
            if len(batch) > 1:
                self.cur += pickle.MARK
            for x in batch:
                if pairs:
                    self.save(x[0])
                    self.save(x[1])
                else:
                    self.save(x)
            self.cur += many if len(batch) > 1 else one


def dumps4(obj) -> bytes:
    """``pickle.dumps(obj, protocol=4)`` of a tree with stand-ins (:class:`Pickle4`,
    or :class:`RefPickler` for what it leaves out).

    >>> dumps4(("x" * 300, 2 ** 70)) == pickle.dumps(("x" * 300, 2 ** 70), protocol=4)
    True
    """
    try:
        return Pickle4().dump(obj)
    except _Unsupported:
        return ref_dumps(obj, protocol=4)


class _StateDictPickler(RefPickler):
    """Pickles :class:`TensorRef` exactly the way ``torch.save`` pickles a tensor."""

    dispatch = RefPickler.dispatch.copy()

    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageId) else None

    def reducer_override(self, obj):
        if isinstance(obj, TorchSize):
            return (Global("torch", "Size"), (list(obj),))
        if not isinstance(obj, TensorRef):
            return NotImplemented
        stride = _strides(obj.shape)
        hooks = collections.OrderedDict()
        typed = TYPED_STORAGE.get(obj.dtype)
        if typed is not None:
            pid = ("storage", Global("torch", typed), obj.key, "cpu", obj.numel)
            return (Global("torch._utils", "_rebuild_tensor_v2"),
                    (_StorageId(pid), 0, obj.shape, stride, False, hooks))
        from ..model import DTYPES

        nbytes = DTYPES[obj.dtype].nbytes(obj.numel)
        pid = ("storage", Global("torch.storage", "UntypedStorage"), obj.key, "cpu", nbytes)
        return (Global("torch._utils", "_rebuild_tensor_v3"),
                (_StorageId(pid), 0, obj.shape, stride, False, hooks, Global("torch", obj.dtype)))


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
