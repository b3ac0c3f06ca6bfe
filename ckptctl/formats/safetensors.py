"""safetensors reader: single files and HF sharded models (``model.safetensors.index.json``).

Layout of a file: ``u64 LE header length | JSON header | data``; each header entry gives
``dtype``, ``shape`` and ``data_offsets`` relative to the data start. The header is read
with one ranged read (two if it is larger than the first guess), and validated like
safetensors itself does (size bounds, offsets tiling the data) before anything is used.

>>> import json, struct
>>> hdr = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> blob = struct.pack("<Q", len(hdr)) + hdr + bytes(8)
>>> parse_header(blob, len(blob), where="m.safetensors")[0]["w"]["shape"]
[2]
"""
from __future__ import annotations

import json
import struct

from ..errors import FormatError, NotFoundError, UnsafeInputError
from ..model import SAFETENSORS_DTYPES, Checkpoint, Chunk, Extent, TensorEntry
from ..storage import Store, safe_relpath
from .limits import MAX_SAFETENSORS_HEADER, check_shape

INDEX = "model.safetensors.index.json"
FIRST_READ = 1 << 16  # most headers fit: one GET per file


def is_safetensors(files: dict[str, int]) -> bool:
    return any(f.endswith(".safetensors") and "/" not in f for f in files) or INDEX in files


def parse_header(head: bytes, file_size: int, *, where: str) -> tuple[dict, int]:
    """Validate and decode a header from the first bytes of a file.

    Returns ``(header dict, data start)``. ``head`` must hold at least the whole header
    (see :func:`header_length`).
    """
    n = header_length(head, file_size, where=where)
    raw = head[8:8 + n]
    if len(raw) < n:
        raise FormatError(where, "header is truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise FormatError(where, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise FormatError(where, "header is not a JSON object")
    data_start = 8 + n
    data_size = file_size - data_start
    spans = []
    for name, e in header.items():
        if name == "__metadata__":
            if not isinstance(e, dict) or not all(isinstance(v, str) for v in e.values()):
                raise FormatError(where, "__metadata__ must map strings to strings")
            continue
        if not isinstance(e, dict) or e.get("dtype") not in SAFETENSORS_DTYPES:
            raise FormatError(where, f"{name}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise FormatError(where, f"{name}: shape is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offs) or offs[1] < offs[0]):
            raise FormatError(where, f"{name}: data_offsets must be [begin, end]")
        nbytes = check_shape(shape, SAFETENSORS_DTYPES[e["dtype"]], where=f"{where}: {name}")
        if offs[1] - offs[0] != nbytes:
            raise FormatError(where, f"{name}: {offs[1] - offs[0]} bytes stored, "
                              f"{nbytes} expected for {e['dtype']}{shape}")
        if offs[1] > data_size:
            raise FormatError(where, f"{name}: data_offsets run past the end of the file",
                              code="OUT_OF_BOUNDS")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            what = "overlaps the previous tensor" if b < pos else "leaves a gap before it"
            raise FormatError(where, f"{name}: data {what}",
                              code="CHUNK_OVERLAP" if b < pos else "CHUNK_GAP")
        pos = e
    if pos != data_size:
        raise FormatError(where, f"{data_size - pos} trailing bytes after the last tensor",
                          code="CHUNK_GAP")
    return header, data_start


def header_length(head: bytes, file_size: int, *, where: str) -> int:
    """The declared JSON header length, bounded before anything is allocated."""
    if len(head) < 8 or file_size < 8:
        raise FormatError(where, "file is too short to be safetensors")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_SAFETENSORS_HEADER:
        raise UnsafeInputError(where, f"header length {n} exceeds the 100 MB limit")
    if 8 + n > file_size:
        raise FormatError(where, f"header length {n} is larger than the file ({file_size} bytes)",
                          code="SIZE_MISMATCH")
    return n


def read_header(store: Store, rel: str, size: int) -> tuple[dict, int]:
    """Read and validate one file's header: one ranged read, two if it is large."""
    where = store.display(rel)
    head = store.read_range(rel, 0, min(size, FIRST_READ))
    n = header_length(head, size, where=where)
    if 8 + n > len(head):
        head = head + store.read_range(rel, len(head), 8 + n)
    return parse_header(head, size, where=where)


def _add_file(ck: Checkpoint, store: Store, rel: str, size: int, only: set[str] | None) -> None:
    header, data_start = read_header(store, rel, size)
    meta = header.pop("__metadata__", None)
    if meta:
        ck.info.setdefault("metadata", {})[rel] = meta
    for name, e in header.items():
        if only is not None and name not in only:
            raise FormatError(store.display(rel), f"{name}: not listed for this file in {INDEX}",
                              code="INDEX_MISMATCH")
        if name in ck.tensors:
            raise FormatError(store.display(rel), f"{name}: also stored in another file")
        b, end = e["data_offsets"]
        dtype = SAFETENSORS_DTYPES[e["dtype"]]
        shape = tuple(e["shape"])
        ext = Extent(rel, data_start + b, end - b, "raw")
        ck.tensors[name] = TensorEntry(name, dtype, shape, [Chunk((0,) * len(shape), shape, ext)])


def read_safetensors(store: Store, files: dict[str, int], only_file: str | None = None) -> Checkpoint:
    """Read every safetensors file of a checkpoint (or just ``only_file``)."""
    ck = Checkpoint(root=store.display(only_file) if only_file else store.url,
                    format="safetensors", store=store)
    if only_file:
        ck.files = {only_file: files[only_file]}
        _add_file(ck, store, only_file, files[only_file], None)
        return ck
    ck.files = dict(files)
    if INDEX in files:
        ck.format = "hf-safetensors"
        wanted = _read_index(store, files)
        for rel, names in wanted.items():
            if rel not in files:
                raise NotFoundError(store.display(rel), f"shard referenced by {INDEX} is missing")
            _add_file(ck, store, rel, files[rel], names)
        missing = {n for names in wanted.values() for n in names} - set(ck.tensors)
        if missing:
            raise FormatError(store.display(INDEX), f"{sorted(missing)[0]}: listed in weight_map "
                              f"but in no shard ({len(missing)} such)", code="INDEX_MISMATCH")
        return ck
    for rel, size in files.items():
        if rel.endswith(".safetensors") and "/" not in rel:
            _add_file(ck, store, rel, size, None)
    return ck


def _read_index(store: Store, files: dict[str, int]) -> dict[str, set[str]]:
    where = store.display(INDEX)
    if files[INDEX] > MAX_SAFETENSORS_HEADER:
        raise UnsafeInputError(where, "index file is absurdly large")
    try:
        index = json.loads(store.read(INDEX))
    except (UnicodeDecodeError, ValueError):
        raise FormatError(where, "not valid JSON") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        raise FormatError(where, "no weight_map")
    wanted: dict[str, set[str]] = {}
    for name, rel in wm.items():
        if not isinstance(rel, str):
            raise FormatError(where, f"{name}: weight_map value is not a file name")
        rel = safe_relpath(rel, where=f"{where}: {name}")
        wanted.setdefault(rel, set()).add(name)
    return wanted
