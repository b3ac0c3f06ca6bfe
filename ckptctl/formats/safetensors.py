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

import re
import struct

from ..errors import FormatError, NotFoundError, UnsafeInputError
from ..model import SAFETENSORS_DTYPES, Checkpoint, Chunk, Extent, TensorEntry
from ..storage import Store, safe_relpath
from .limits import MAX_SAFETENSORS_HEADER, check_shape, load_json

INDEX = "model.safetensors.index.json"
#: ``__metadata__`` key of torch's ``HuggingFaceStorageWriter(save_distributed=True)`` files
#: (``torch/distributed/checkpoint/_hf_utils.py``), and the per-tensor key inside it.
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<k>\d{1,6})-of-(?P<n>\d{1,6})\.(?P<ext>safetensors|bin)$")
FIRST_READ = 1 << 16  # most headers fit: one GET per file


def is_safetensors(files: dict[str, int]) -> bool:
    return any(f.endswith(".safetensors") and "/" not in f for f in files) or INDEX in files


_INDEX_NAME = re.compile(r"^(?P<stem>.+)\.safetensors\.index\.json$")


def split_exports(names) -> tuple[list[str], list[str]]:
    """The one rule for a folder of safetensors files, by the names of its top-level files
    alone (a listing decides, nothing is read): which files make up the folder's one model
    (its index included), and which are exports of their own beside it.

    * an index ``<stem>.safetensors.index.json`` and the shards named after it,
      ``<stem>-<k>-of-<n>.safetensors`` (``<stem>.safetensors`` when there are none), are
      the model; HF's ``save_pretrained`` and torch's consolidation write just that;
    * shard-named files without their index are one model too, never n exports: HF shards
      whose index is missing (complete while all n are there: the files say which
      tensors they hold; a missing shard makes it incomplete), torch's
      ``HuggingFaceStorageWriter(save_distributed=True)`` rank files
      ``shard-<r>-model-<k>-of-<n>.safetensors`` (placed by ``DCP_SHARDING_INFO``);
    * any other ``*.safetensors`` file is complete on its own: an export of its own when
      the folder holds a model besides it or another such file (``model.safetensors``
      beside ``model-bf16.safetensors``); a lone one is the folder's model.

    Returns (model files, exports), each sorted; both empty without safetensors files.

    >>> split_exports(["model.safetensors", "model-bf16.safetensors", "config.json"])
    ([], ['model-bf16.safetensors', 'model.safetensors'])
    >>> split_exports(["model.safetensors", "config.json"])
    (['model.safetensors'], [])
    >>> split_exports(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ...                INDEX, "consolidated.safetensors"])[1]
    ['consolidated.safetensors']
    >>> split_exports([INDEX, "model.safetensors", "model-fp8.safetensors"])
    (['model.safetensors', 'model.safetensors.index.json'], ['model-fp8.safetensors'])
    """
    top = [n for n in names if "/" not in n]
    indexes = {m["stem"]: n for n in top if (m := _INDEX_NAME.match(n))}
    shards = [n for n in top if n.endswith(".safetensors") and _SHARD_NAME.match(n)]
    sharded = set(shards)
    whole = [n for n in top if n.endswith(".safetensors") and n not in sharded]
    stems = {_SHARD_NAME.match(n)["stem"] for n in shards}
    claimed = [f"{s}.safetensors" for s in indexes if s not in stems
               and f"{s}.safetensors" in whole]
    if not indexes and not shards and len(whole) == 1:
        claimed = whole
    model = sorted([*indexes.values(), *shards, *claimed])
    return model, sorted(n for n in whole if n not in claimed)


def parse_header(head: bytes, file_size: int, *, where: str) -> tuple[dict, int]:
    """Validate and decode a header from the first bytes of a file.

    Returns ``(header dict, data start)``. ``head`` must hold at least the whole header
    (see :func:`header_length`).
    """
    n = header_length(head, file_size, where=where)
    raw = head[8:8 + n]
    if len(raw) < n:
        raise FormatError(where, "header is truncated")
    header = load_json(raw, where, "header")
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
        spans.append((offs[0], offs[1], name))
    spans.sort()
    end = max((e for _, e, _ in spans), default=0)
    if end > data_size:  # the data runs past the end of the file: cut short
        raise FormatError(where, f"truncated safetensors: the header says the data ends at "
                          f"byte {data_start + end}, past the end of the file ({file_size} "
                          "bytes)", code="SIZE_MISMATCH")
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
    """The declared JSON header length, bounded before anything is allocated. Bytes that
    are no safetensors file (no ``{`` opening a JSON header after the length) say so.

    >>> header_length(b"\\x3f\\x9a" * 8, 16, where="x.safetensors")
    Traceback (most recent call last):
    ckptctl.errors.FormatError: x.safetensors: not a safetensors file (what follows the 8-byte header length is not valid JSON: it does not open with '{'; the first bytes are 3f 9a 3f 9a 3f 9a 3f 9a 3f 9a ...)
    >>> header_length(b"\\x40" + bytes(7) + b"{}", 10, where="x.safetensors")
    Traceback (most recent call last):
    ckptctl.errors.FormatError: x.safetensors: truncated safetensors: header length 64 is larger than the file (10 bytes)
    """
    if len(head) < 8 or file_size < 8:
        raise FormatError(where, "file is too short to be safetensors "
                          f"({file_size} byte{'s' if file_size != 1 else ''})")
    if len(head) > 8 and head[8:9] != b"{":  # the format's spec: the header opens with "{"
        shown = " ".join(f"{b:02x}" for b in head[:10]) + (" ..." if len(head) > 10 else "")
        raise FormatError(where, "not a safetensors file (what follows the 8-byte header "
                          "length is not valid JSON: it does not open with '{'; the first "
                          f"bytes are {shown})")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_SAFETENSORS_HEADER:
        raise UnsafeInputError(where, f"header length {n} exceeds the 100 MB limit")
    if 8 + n > file_size:
        raise FormatError(where, f"truncated safetensors: header length {n} is larger than "
                          f"the file ({file_size} bytes)", code="SIZE_MISMATCH")
    return n


def read_header(store: Store, rel: str, size: int) -> tuple[dict, int]:
    """Read and validate one file's header: one ranged read, two if it is large."""
    where = store.display(rel)
    head = store.read_range(rel, 0, min(size, FIRST_READ))
    n = header_length(head, size, where=where)
    if 8 + n > len(head):
        head = head + store.read_range(rel, len(head), 8 + n)
    return parse_header(head, size, where=where)


def _sharding_info(meta: dict | None, where: str) -> dict | None:
    """torch's ``HuggingFaceStorageWriter(save_distributed=True)`` records where each
    tensor of a rank's file sits in the global tensor: ``__metadata__["DCP_SHARDING_INFO"]``
    is JSON ``{name: {"saved_offsets": [...]}}``."""
    raw = (meta or {}).get(DCP_SHARDING_INFO)
    if raw is None:
        return None
    info = load_json(raw, where, f"__metadata__.{DCP_SHARDING_INFO}")
    if not isinstance(info, dict):
        raise FormatError(where, f"__metadata__.{DCP_SHARDING_INFO} is not a JSON object")
    return info


def _add_file(ck: Checkpoint, store: Store, rel: str, size: int, only: set[str] | None,
              prefix: str = "", index: str = INDEX) -> None:
    where = store.display(rel)
    header, data_start = read_header(store, rel, size)
    meta = header.pop("__metadata__", None)
    if meta:
        ck.info.setdefault("metadata", {})[rel] = meta
    sharding = _sharding_info(meta, where)
    sharded = ck.info.setdefault("dcp_sharded", set())
    head = (prefix.rstrip("."),) if prefix else ()
    for orig, e in header.items():
        name = prefix + orig
        if only is not None and orig not in only:
            raise FormatError(where, f"{orig}: not listed for this file in {index}",
                              code="INDEX_MISMATCH")
        b, end = e["data_offsets"]
        dtype = SAFETENSORS_DTYPES[e["dtype"]]
        shape = tuple(e["shape"])
        ext = Extent(rel, data_start + b, end - b, "raw")
        if head:
            ck.info.setdefault("paths", {})[name] = head + (orig,)
        if sharding is None:
            if name in ck.tensors:
                raise FormatError(where, f"{orig}: also stored in another file")
            ck.tensors[name] = TensorEntry(name, dtype, shape, [Chunk((0,) * len(shape), shape, ext)])
            continue
        offs = (sharding.get(orig) or {}).get(SAVED_OFFSETS) if isinstance(
            sharding.get(orig), dict) else None
        if (not isinstance(offs, list) or len(offs) != len(shape)
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
            raise FormatError(where, f"{orig}: {DCP_SHARDING_INFO} gives no valid {SAVED_OFFSETS} "
                              f"for this {len(shape)}-d shard")
        chunk = Chunk(tuple(offs), shape, ext)
        t = ck.tensors.get(name)
        if t is None:
            box = tuple(o + s for o, s in zip(offs, shape))
            check_shape(box, dtype, where=f"{where}: {orig}")  # offsets are bounded too
            ck.tensors[name] = TensorEntry(name, dtype, box, [chunk])
            sharded.add(name)
            continue
        if name not in sharded:
            raise FormatError(where, f"{orig}: also stored whole in another file")
        if t.dtype != dtype:
            raise FormatError(where, f"{orig}: shard is {dtype.name}, other shards are {t.dtype.name}")
        # the global shape is the bounding box of the shards, as torch's own reader computes it
        t.shape = tuple(max(g, o + s) for g, o, s in zip(t.shape, offs, shape))
        check_shape(t.shape, dtype, where=f"{where}: {orig}")
        t.chunks.append(chunk)


def check_shard_set(store: Store, present, *, index_refs=()) -> None:
    """HF shard names (``model-00003-of-00019.safetensors``) say how many shards there
    are: every one must be here, with or without an index. Also every file the index
    names. Raises :class:`NotFoundError` (``MISSING_FILE``) naming the first missing
    shard and how many are missing.

    >>> from ckptctl.storage import open_store
    >>> check_shard_set(open_store("."), ["m-00001-of-00003.safetensors",
    ...                                   "m-00003-of-00003.safetensors"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.NotFoundError: ...m-00002-of-00003.safetensors: shard 2 of 3 is missing (1 of 3 shards missing)
    """
    present = set(present)
    groups: dict[tuple, set[int]] = {}
    width: dict[tuple, int] = {}
    for rel in present:
        m = _SHARD_NAME.match(rel)
        if not m:
            continue
        k, n = int(m["k"]), int(m["n"])
        key = (m["stem"], m["n"], m["ext"])
        if not 1 <= k <= n:
            raise FormatError(store.display(rel), f"shard number {k} is outside 1..{n}")
        groups.setdefault(key, set()).add(k)
        width[key] = len(m["k"])
    for key in sorted(groups):
        stem, n_text, ext = key
        have, n = groups[key], int(n_text)
        if len(have) == n:
            continue
        k = 1
        while k in have:  # bounded by len(have) + 1
            k += 1
        missing = f"{stem}-{k:0{width[key]}d}-of-{n_text}.{ext}"
        raise NotFoundError(store.display(missing), f"shard {k} of {n} is missing "
                            f"({n - len(have)} of {n} shards missing)")
    gone = sorted(set(index_refs) - present)
    if gone:
        raise NotFoundError(store.display(gone[0]), f"shard referenced by the index is missing "
                            f"({len(gone)} of {len(set(index_refs))} files missing)")


def add_model_files(ck: Checkpoint, store: Store, files: dict[str, int], names: list[str],
                    *, index: str | None = None, prefix: str = "") -> None:
    """Add one model's safetensors files (``names``, or those ``index`` lists) to ``ck``,
    each tensor named ``prefix + name``; shards are checked complete first."""
    if index is not None:
        wanted = _read_index(store, files, index)
        check_shard_set(store, [f for f in files if "/" not in f and f.endswith(".safetensors")],
                        index_refs=wanted)
        loaded = set()
        for rel, listed in sorted(wanted.items()):
            _add_file(ck, store, rel, files[rel], listed, prefix, index)
            loaded.update(listed)
        missing = {n for listed in wanted.values() for n in listed} - loaded
        if missing:
            raise FormatError(store.display(index), f"{min(missing)}: listed in weight_map "
                              f"but in no shard ({len(missing)} such)", code="INDEX_MISMATCH")
    else:
        check_shard_set(store, names)
        for rel in sorted(names):
            _add_file(ck, store, rel, files[rel], None, prefix)
    if ck.info.pop("dcp_sharded", None):
        ck.info["sharded_by"] = DCP_SHARDING_INFO


def read_safetensors(store: Store, files: dict[str, int], only_file: str | None = None) -> Checkpoint:
    """Read every safetensors file of a checkpoint (or just ``only_file``)."""
    ck = Checkpoint(root=store.display(only_file) if only_file else store.url,
                    format="safetensors", store=store)
    if only_file:
        ck.files = {only_file: files[only_file]}
        _add_file(ck, store, only_file, files[only_file], None)  # one shard may be opened alone
        if ck.info.pop("dcp_sharded", None):
            ck.info["sharded_by"] = DCP_SHARDING_INFO
        return ck
    ck.files = dict(files)
    if INDEX in files:
        ck.format = "hf-safetensors"
        add_model_files(ck, store, files, [], index=INDEX)
    else:
        add_model_files(ck, store, files,
                        [f for f in files if f.endswith(".safetensors") and "/" not in f])
    return ck


def _read_index(store: Store, files: dict[str, int], index: str = INDEX) -> dict[str, set[str]]:
    where = store.display(index)
    if files[index] > MAX_SAFETENSORS_HEADER:
        raise UnsafeInputError(where, "index file is absurdly large")
    index = load_json(store.read(index), where, "index")
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
