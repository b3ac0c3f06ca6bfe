"""Read tensor and object bytes of any checkpoint through the logical model.

Bytes are handled as numpy arrays of an opaque element type (``V<itemsize>``), so any
dtype (bfloat16, float8, complex) is copied exactly without interpreting it.

>>> from ckptctl.model import DTYPES
>>> byte_dtype(DTYPES["bfloat16"])
dtype('V2')
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import FormatError
from ..model import Checkpoint, Chunk, DType, Extent, ObjectEntry, TensorEntry
from .safe_pickle import loads_primitive
from .torchzip import central_directory, payload_span

#: Chunks up to this size are read in one request (zip and all) rather than located
#: first (two small requests) and then sliced: on S3 requests cost more than bytes.
SMALL_CHUNK = 4 << 20
#: A DCP chunk zip adds ~1.5 KiB around the tensor bytes; decompression stops well past that.
ZIP_OVERHEAD_BOUND = 1 << 20


def byte_dtype(dtype: DType) -> np.dtype:
    """An opaque numpy element type of the right width (``V2`` for bf16)."""
    return np.dtype(f"V{dtype.itemsize}")


def _decompress(blob: bytes, where: str, limit: int) -> bytes:
    """Decompress a zstd stream, refusing to produce more than ``limit`` bytes (a bomb)."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True) as r:
            out = r.read(limit + 1)
    except zstandard.ZstdError as e:
        raise FormatError(where, f"zstd stream is corrupt ({e})") from None
    if len(out) > limit:
        raise FormatError(where, f"zstd stream expands past {limit} bytes")
    return out


def extent_payload(ck: Checkpoint, ext: Extent, *, record: str = "data/0",
                   expect: int | None = None) -> memoryview:
    """The payload an extent encodes: raw bytes, or the ``record`` inside a DCP chunk zip.
    ``expect``: the payload's expected size, bounding decompression."""
    store = ck.store
    where = store.display(ext.file)
    blob = store.read_range(ext.file, ext.offset, ext.offset + ext.length)
    if len(blob) != ext.length:
        raise FormatError(where, f"file ends {ext.length - len(blob)} bytes short of a "
                          f"chunk at offset {ext.offset}")
    if ext.encoding == "raw":
        return memoryview(blob)
    if ext.encoding == "torch_zip+zstd":
        blob = _decompress(blob, where, (expect if expect is not None else 1 << 30)
                           + ZIP_OVERHEAD_BOUND)
    if ext.encoding not in ("torch_zip", "torch_zip+zstd"):
        raise FormatError(where, f"cannot read encoding {ext.encoding!r}")
    if record == "data/0":
        off, n = payload_span(blob, where=where)
        return memoryview(blob)[off:off + n]
    return memoryview(_zip_record(blob, record, where))


def _zip_record(blob: bytes, suffix: str, where: str) -> bytes:
    from .torchzip import local_data_offset

    entries, _ = central_directory(blob, len(blob), where=where)
    for en in entries:
        if en.name.endswith("/" + suffix) and en.method == 0:
            off = local_data_offset(blob[en.header_offset:en.header_offset + 512], en, where=where)
            return blob[off:off + en.usize]
    raise FormatError(where, f"zip has no stored {suffix} record")


def chunk_bytes(ck: Checkpoint, t: TensorEntry, c: Chunk) -> memoryview:
    """The row-major bytes of one chunk, length-checked."""
    want = t.dtype.nbytes(c.numel)
    if c.extent.encoding == "torch_save":
        from .torchsave import tensor_bytes

        data = tensor_bytes(ck, t.name)
    else:
        data = extent_payload(ck, c.extent, expect=want)
    if len(data) != want:
        raise FormatError(ck.store.display(c.extent.file),
                          f"{t.name}: chunk holds {len(data)} bytes, {want} expected")
    return data


def payload_location(ck: Checkpoint, ext: Extent) -> tuple[int, int]:
    """(absolute offset, length) of an uncompressed extent's tensor bytes in its file.

    For a DCP chunk zip this costs two small reads (the zip's tail, then one local
    header), cached per checkpoint; the tensor bytes themselves are not read.
    """
    if ext.encoding == "raw":
        return ext.offset, ext.length
    if ext.encoding != "torch_zip":
        raise FormatError(ck.store.display(ext.file), f"{ext.encoding} bytes cannot be sliced")
    cache = ck.info.setdefault("payload_locations", {})
    if ext in cache:
        return cache[ext]
    from .torchzip import TAIL_GUESS, payload_entry

    where = ck.store.display(ext.file)
    end = ext.offset + ext.length
    tail = ck.store.read_range(ext.file, max(ext.offset, end - TAIL_GUESS), end)
    entries, need = central_directory(tail, ext.length, where=where)
    if need:
        tail = ck.store.read_range(ext.file, end - need, end)
        entries, _ = central_directory(tail, ext.length, where=where)
    en = payload_entry(entries, where=where)
    from .torchzip import local_data_offset

    head = ck.store.read_range(ext.file, ext.offset + en.header_offset,
                               ext.offset + en.header_offset + 512)
    off = local_data_offset(head, en, where=where)
    if off + en.usize > ext.length:
        raise FormatError(where, "tensor record runs past the end of its zip")
    cache[ext] = (ext.offset + off, en.usize)
    return cache[ext]


def read_rows(ck: Checkpoint, t: TensorEntry, c: Chunk, start: int, stop: int) -> memoryview:
    """Rows ``[start, stop)`` (along dim 0, relative to the chunk) of a chunk's bytes,
    reading only those bytes where the encoding allows (raw, DCP zip); zstd chunks and
    torch.save entries are read whole and sliced."""
    if not c.sizes:
        return chunk_bytes(ck, t, c)
    row = t.dtype.nbytes(c.numel // c.sizes[0]) if c.sizes[0] else 0
    whole = start == 0 and stop == c.sizes[0]
    if c.extent.encoding in ("raw", "torch_zip") and not (
            whole or (c.extent.encoding == "torch_zip" and c.extent.length <= SMALL_CHUNK
                      and c.extent not in ck.info.get("payload_locations", {}))):
        off, length = payload_location(ck, c.extent)
        if length != t.dtype.nbytes(c.numel):
            raise FormatError(ck.store.display(c.extent.file),
                              f"{t.name}: chunk holds {length} bytes, {t.dtype.nbytes(c.numel)} expected")
        data = ck.store.read_range(c.extent.file, off + start * row, off + stop * row)
        if len(data) != (stop - start) * row:
            raise FormatError(ck.store.display(c.extent.file), f"{t.name}: file is truncated")
        return memoryview(data)
    return chunk_bytes(ck, t, c)[start * row:stop * row]


def read_rows_into(ck: Checkpoint, t: TensorEntry, c: Chunk, start: int, stop: int,
                   out: memoryview) -> None:
    """Like :func:`read_rows`, into ``out`` (exactly that many bytes): straight from the
    file where the encoding allows, without intermediate copies."""
    direct = (c.sizes and c.extent.encoding in ("raw", "torch_zip") and t.dtype.bits % 8 == 0
              and (ck.store.is_local or c.extent.encoding == "raw" or c.extent.length > SMALL_CHUNK
                   or c.extent in ck.info.get("payload_locations", {})))
    if not direct:
        out[:] = read_rows(ck, t, c, start, stop)
        return
    row = t.dtype.nbytes(c.numel // c.sizes[0]) if c.sizes[0] else 0
    off, length = payload_location(ck, c.extent)
    if length != t.dtype.nbytes(c.numel):
        raise FormatError(ck.store.display(c.extent.file),
                          f"{t.name}: chunk holds {length} bytes, {t.dtype.nbytes(c.numel)} expected")
    if ck.store.read_into(c.extent.file, off + start * row, out) != len(out):
        raise FormatError(ck.store.display(c.extent.file), f"{t.name}: file is truncated")


def read_tensor(ck: Checkpoint, name: str, *, workers: int = 4) -> np.ndarray:
    """The whole tensor as a numpy array of opaque elements, shaped like the tensor.

    Sub-byte dtypes (fp4, fp6) come back as a flat ``uint8`` array of the packed bytes.
    """
    t = ck.tensors[name]
    if t.dtype.bits % 8:
        if len(t.chunks) != 1:
            raise FormatError(ck.root, f"{name}: sharded sub-byte tensors are not supported")
        return np.frombuffer(chunk_bytes(ck, t, t.chunks[0]), dtype=np.uint8)
    vt = byte_dtype(t.dtype)
    if len(t.chunks) == 1 and tuple(t.chunks[0].sizes) == t.shape:
        return np.frombuffer(chunk_bytes(ck, t, t.chunks[0]), dtype=vt).reshape(t.shape)
    out = np.empty(t.shape, dtype=vt)

    def place(c: Chunk) -> None:
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
        out[box] = np.frombuffer(chunk_bytes(ck, t, c), dtype=vt).reshape(c.sizes)

    if workers > 1 and len(t.chunks) > 1:
        with ThreadPoolExecutor(min(workers, len(t.chunks))) as pool:
            list(pool.map(place, t.chunks))
    else:
        for c in t.chunks:
            place(c)
    return out


def tensor_bytes(ck: Checkpoint, name: str) -> bytes:
    """The whole tensor's row-major bytes."""
    return read_tensor(ck, name).tobytes()


def read_object(ck: Checkpoint, entry: ObjectEntry) -> object:
    """An object's value if it is plain data (numbers, strings, lists, dicts).

    DCP objects are ``torch.save`` zips of arbitrary pickles: they are decoded with an
    unpickler that allows no globals, so anything but plain data is refused, not run.
    """
    if entry.value is not None or entry.extent is None:
        return entry.value
    if entry.extent.encoding == "torch_save":
        return entry.value
    data = extent_payload(ck, entry.extent, record="data.pkl")
    return loads_primitive(bytes(data), where=f"{ck.store.display(entry.extent.file)}: {entry.name}")


