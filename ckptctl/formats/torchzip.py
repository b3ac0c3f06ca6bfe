"""Find the raw tensor bytes inside a ``torch.save`` zip without loading it.

DCP writes each chunk as a complete ``torch.save`` zip whose ``<archive>/data/0`` record
holds the row-major bytes, stored (not deflated). torch's writer uses data descriptors, so
local headers carry no sizes: we read the central directory from the zip's tail, then the
one local header of the payload.

>>> import io, zipfile
>>> b = io.BytesIO()
>>> with zipfile.ZipFile(b, "w") as z:
...     z.writestr("archive/data.pkl", b"x"); z.writestr("archive/data/0", b"\\x01\\x02")
>>> blob = b.getvalue(); off, n = payload_span(blob)
>>> blob[off:off + n]
b'\\x01\\x02'
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ..errors import FormatError

EOCD_SIG = b"PK\x05\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
ZIP64_EOCD_SIG = b"PK\x06\x06"
CDIR_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"
LOCAL_HEADER_LEN = 30
#: How much of a zip's tail to read to find its central directory: a DCP chunk zip has
#: seven records (~0.9 KiB of directory and end records); larger tails are read again.
TAIL_GUESS = 1280


class ZipEntry:
    """One central-directory record: name, compression method, sizes, the offset of its
    local header (relative to the zip's start) and the CRC-32 the writer recorded."""

    __slots__ = ("name", "method", "csize", "usize", "header_offset", "crc")

    def __init__(self, name, method, csize, usize, header_offset, crc=0):
        self.name, self.method, self.csize, self.usize, self.header_offset, self.crc = (
            name, method, csize, usize, header_offset, crc)


def _zip64_extra(extra: bytes, need: list[str], vals: dict) -> None:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            body, j = extra[i + 4:i + 4 + size], 0
            for k in need:
                if j + 8 <= len(body):
                    vals[k] = struct.unpack_from("<Q", body, j)[0]
                    j += 8
            return
        i += 4 + size


#: A central-directory record's fixed 46 bytes: signature, method, CRC-32, compressed and
#: uncompressed sizes, name/extra/comment lengths, local header offset (one unpack each).
_CDIR = struct.Struct("<4s6xH4xIIIHHH8xI")


def central_directory(tail: bytes, zip_len: int, *, where: str = "") -> tuple[list[ZipEntry], int]:
    """Parse the central directory from the last bytes of a zip of length ``zip_len``.

    Returns the entries and, if ``tail`` did not reach back far enough, how many bytes of
    tail are needed (else 0).
    """
    base = zip_len - len(tail)  # offset of tail[0] within the zip
    e = tail.rfind(EOCD_SIG)
    if e < 0 or len(tail) - e < 22:
        raise FormatError(where or None, "not a torch.save zip (no end of central directory)")
    _, _, _, _, total, cd_size, cd_off = struct.unpack_from("<IHHHHII", tail, e)
    if cd_off == 0xFFFFFFFF or total == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc = tail.rfind(ZIP64_LOCATOR_SIG, 0, e)
        if loc < 0:
            raise FormatError(where or None, "zip64 locator missing")
        (z64_off,) = struct.unpack_from("<Q", tail, loc + 8)
        i = z64_off - base
        if i < 0:
            return [], zip_len - z64_off
        if tail[i:i + 4] != ZIP64_EOCD_SIG:
            raise FormatError(where or None, "zip64 end of central directory is corrupt")
        total, _, cd_size, cd_off = struct.unpack_from("<QQQQ", tail, i + 24)
    if cd_off + cd_size > zip_len or total > 1_000_000:
        raise FormatError(where or None, "central directory lies outside the zip")
    i = cd_off - base
    if i < 0:
        return [], zip_len - cd_off
    entries = []
    for _ in range(total):
        if i + 46 > len(tail):
            if tail[i:i + 4] != CDIR_SIG:
                raise FormatError(where or None, "central directory is corrupt")
            raise FormatError(where or None, "central directory is truncated")
        sig, method, crc, csize, usize, nlen, xlen, clen, hoff = _CDIR.unpack_from(tail, i)
        if sig != CDIR_SIG:
            raise FormatError(where or None, "central directory is corrupt")
        name = tail[i + 46:i + 46 + nlen].decode("utf-8", "replace")
        if 0xFFFFFFFF in (usize, csize, hoff):
            vals = {"usize": usize, "csize": csize, "hoff": hoff}
            need = [k for k in ("usize", "csize", "hoff") if vals[k] == 0xFFFFFFFF]
            _zip64_extra(tail[i + 46 + nlen:i + 46 + nlen + xlen], need, vals)
            usize, csize, hoff = vals["usize"], vals["csize"], vals["hoff"]
        entries.append(ZipEntry(name, method, csize, usize, hoff, crc))
        i += 46 + nlen + xlen + clen
    return entries, 0


def payload_entry(entries: list[ZipEntry], *, where: str = "") -> ZipEntry:
    """The ``*/data/0`` record of a one-storage torch.save zip."""
    hits = [en for en in entries if en.name.endswith("/data/0") or en.name == "data/0"]
    if len(hits) != 1:
        raise FormatError(where or None, "torch.save zip has no single data/0 record")
    en = hits[0]
    if en.method != 0:
        raise FormatError(where or None, "tensor record is compressed inside the zip")
    return en


def local_data_offset(header: bytes, entry: ZipEntry, *, where: str = "") -> int:
    """Offset of the payload, given the bytes at ``entry.header_offset``."""
    if len(header) < LOCAL_HEADER_LEN or header[:4] != LOCAL_SIG:
        raise FormatError(where or None, "zip local header is corrupt")
    nlen, xlen = struct.unpack_from("<HH", header, 26)
    return entry.header_offset + LOCAL_HEADER_LEN + nlen + xlen


def payload_span(blob: bytes | memoryview, *, where: str = "") -> tuple[int, int]:
    """(offset, length) of the tensor bytes inside a whole torch.save zip in memory."""
    mv = memoryview(blob)
    tail = bytes(mv[-min(len(mv), 1 << 20):])
    entries, need = central_directory(tail, len(mv), where=where)
    if need:
        entries, _ = central_directory(bytes(mv), len(mv), where=where)
    en = payload_entry(entries, where=where)
    off = local_data_offset(bytes(mv[en.header_offset:en.header_offset + 512]), en, where=where)
    if off + en.usize > len(mv):
        raise FormatError(where or None, "tensor record runs past the end of its zip")
    return off, en.usize


# --------------------------------------------------------------------------- data.pkl


@dataclass(frozen=True)
class StoredTensor:
    """How a ``torch.save`` zip stores one tensor, read from its ``data.pkl`` without torch:
    the tensor is a view (``size``, ``stride``, ``storage_offset`` in elements) of storage
    record ``data/<key>`` holding ``storage_numel`` elements of ``dtype``.

    >>> st = StoredTensor("float32", "0", 12, 0, (4, 3), (1, 4))
    >>> st.is_row_major(), StoredTensor("float32", "0", 12, 0, (4, 3), (3, 1)).is_row_major()
    (False, True)
    """

    dtype: str
    key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def shape(self) -> tuple[int, ...]:
        """``size`` under torch's other name: nested values are walked alike whether
        their tensors are loaded or stand-ins (a list of them is descended into)."""
        return self.size

    def is_row_major(self) -> bool:
        """Dense row-major from ``storage_offset`` on (torch's ``is_contiguous``: strides
        of size-1 dims do not matter)."""
        expect = 1
        for s, st in zip(reversed(self.size), reversed(self.stride)):
            if s != 1 and st != expect:
                return False
            expect *= s
        return True

    def span(self) -> int:
        """Storage elements the view reaches: ``storage_offset`` + the farthest index + 1."""
        if self.numel == 0:
            return self.storage_offset
        return self.storage_offset + sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1


class StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: str | None):
        self.dtype = dtype  # None: UntypedStorage (bytes; the dtype comes with the tensor)


class StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype, key, numel):
        self.dtype, self.key, self.numel = dtype, key, numel


def _ints(v, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise FormatError(where or None, f"data.pkl: {what} is not a tuple of non-negative integers",
                          code="MALFORMED_CHUNK")
    return tuple(v)


def _rebuild(storage, storage_offset, size, stride, *rest, dtype=None, where=""):
    if not isinstance(storage, StorageRef):
        raise FormatError(where or None, "data.pkl: tensor without a storage", code="MALFORMED_CHUNK")
    dt = storage.dtype or dtype
    if dt is None:
        raise FormatError(where or None, "data.pkl: tensor of unknown dtype", code="MALFORMED_CHUNK")
    numel = storage.numel
    if storage.dtype is None:  # UntypedStorage counts bytes
        from ..model import DTYPES

        d = DTYPES.get(dt)
        if d is None or d.bits % 8:
            raise FormatError(where or None, f"data.pkl: unsupported dtype {dt}", code="MALFORMED_CHUNK")
        numel = numel // d.itemsize
    if not isinstance(storage_offset, int) or storage_offset < 0:
        raise FormatError(where or None, "data.pkl: bad storage offset", code="MALFORMED_CHUNK")
    size, stride = _ints(size, "size", where), _ints(stride, "stride", where)
    if len(size) != len(stride):
        raise FormatError(where or None, "data.pkl: size and stride differ in length",
                          code="MALFORMED_CHUNK")
    return StoredTensor(dt, str(storage.key), numel, storage_offset, size, stride)


def tensor_globals(where: str) -> dict:
    from ..model import DTYPES
    from .torchwrite import TYPED_STORAGE

    def v2(storage, storage_offset, size, stride, *rest):
        return _rebuild(storage, storage_offset, size, stride, where=where)

    def v3(storage, storage_offset, size, stride, requires_grad=False, hooks=None, dtype=None,
           *rest):
        return _rebuild(storage, storage_offset, size, stride, dtype=str(dtype) if dtype else None,
                        where=where)

    def parameter(data, *rest):
        return data

    allowed: dict = {("torch._utils", "_rebuild_tensor_v2"): v2,
                     ("torch._utils", "_rebuild_tensor_v3"): v3,
                     ("torch._utils", "_rebuild_parameter"): parameter,
                     ("torch._utils", "_rebuild_parameter_with_state"): parameter,
                     ("collections", "OrderedDict"): dict,
                     ("torch.storage", "UntypedStorage"): StorageType(None)}
    for dtype, cls in TYPED_STORAGE.items():
        allowed[("torch", cls)] = StorageType(dtype)
    for name in DTYPES:
        allowed[("torch", name)] = name
    return allowed


def storage_dtypes(data: bytes, *, where: str = "") -> dict[str, str]:
    """Storage key -> dtype for the typed storages a torch.save ``data.pkl`` references,
    read without torch and without running code. What the allow-list refuses ends the
    walk: the keys seen so far are returned (a caller that needs all of them checks).

    >>> import io, torch, zipfile
    >>> buf = io.BytesIO(); torch.save({"a": torch.zeros(2, dtype=torch.bfloat16)}, buf)
    >>> storage_dtypes(zipfile.ZipFile(buf).read("archive/data.pkl"))
    {'0': 'bfloat16'}
    """
    import io as _io

    from .safe_pickle import RestrictedUnpickler

    found: dict[str, str] = {}

    class _Unpickler(RestrictedUnpickler):
        def persistent_load(self, pid):
            if isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[1], StorageType):
                if pid[1].dtype:
                    found.setdefault(str(pid[2]), pid[1].dtype)
                return StorageRef(pid[1].dtype, pid[2], pid[4] if isinstance(pid[4], int) else 0)
            raise FormatError(where or None, "data.pkl: unexpected storage reference",
                              code="MALFORMED_CHUNK")

    try:
        _Unpickler(_io.BytesIO(data), tensor_globals(where)).load()
    except Exception:  # noqa: BLE001 - what was seen before the refusal is the answer
        pass
    return found


def parse_tensor_pickle(data: bytes, *, where: str = "") -> StoredTensor:
    """The one tensor a DCP chunk's ``data.pkl`` describes, read without torch and without
    running code (an allow-list of inert stand-ins). Anything else in the pickle (a
    tensor subclass, a quantized or sparse tensor, several tensors) is refused by name.

    >>> import io, torch
    >>> buf = io.BytesIO(); torch.save(torch.zeros(3, 2).t(), buf)
    >>> import zipfile; pkl = zipfile.ZipFile(buf).read("archive/data.pkl")
    >>> st = parse_tensor_pickle(pkl); (st.dtype, st.size, st.stride, st.storage_numel)
    ('float32', (2, 3), (1, 2), 6)
    """
    import io as _io

    from ..errors import UnsafeInputError
    from .safe_pickle import RestrictedUnpickler

    class _Unpickler(RestrictedUnpickler):
        def persistent_load(self, pid):
            if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                    or not isinstance(pid[1], StorageType) or not isinstance(pid[4], int)
                    or pid[4] < 0):
                raise FormatError(where or None, "data.pkl: unexpected storage reference",
                                  code="MALFORMED_CHUNK")
            return StorageRef(pid[1].dtype, pid[2], pid[4])

    try:
        obj = _Unpickler(_io.BytesIO(data), tensor_globals(where)).load()
    except (FormatError, UnsafeInputError) as e:
        if isinstance(e, UnsafeInputError):
            raise UnsafeInputError(where or None, f"data.pkl: {e.message} (not a plain tensor)") from None
        raise
    except RecursionError:
        raise FormatError(where or None, "data.pkl nests too deeply", code="MALFORMED_CHUNK") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad record
        raise FormatError(where or None, f"data.pkl does not parse ({type(e).__name__})",
                          code="MALFORMED_CHUNK") from None
    if not isinstance(obj, StoredTensor):
        raise FormatError(where or None, f"data.pkl holds {type(obj).__name__}, not one plain "
                          "tensor", code="MALFORMED_CHUNK")
    return obj
