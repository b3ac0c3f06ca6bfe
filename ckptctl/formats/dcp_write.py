"""Write PyTorch DCP checkpoints: one ``__<rank>_0.distcp`` file per rank, each chunk a
``torch.save`` zip, and ``.metadata`` written last: the pickle of torch's ``Metadata``,
written without importing torch.

>>> w = DcpWriter(open_store("out/"))                       # doctest: +SKIP
>>> w.add_tensor_chunk(0, "model.w", "float32", (4, 2), (0, 0), (2, 2), blocks)  # doctest: +SKIP
>>> w.commit(planner_data)                                  # doctest: +SKIP
"""
from __future__ import annotations

import pickle
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterable

from ..bulk import paused_gc
from ..storage import HashingWriter, Store, digest_bytes
from .dcp import METADATA
from .torchwrite import (TUPLE_OPS, Global, Instance, Lazy, Pickle4, Reduced, TensorRef,
                         TorchZipWriter, dumps4, int_op, pickle_state)


def _interned(x):
    """``x`` (dicts, lists, tuples of str and numbers) rebuilt with every string interned.

    >>> _interned({"a": ("b", 1)})
    {'a': ('b', 1)}
    """
    if isinstance(x, str):
        return sys.intern(x)
    if isinstance(x, dict):
        return {_interned(k): _interned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_interned(v) for v in x)
    return x


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass
class _Meta:
    tensors: dict = field(default_factory=dict)  # fqn -> (dtype, shape, [(offsets, sizes)])
    objects: set = field(default_factory=set)
    storage: dict = field(default_factory=dict)  # (fqn, offsets|None) -> (file, off, len)


class DcpWriter:
    """Collects what each rank file holds; ``commit`` writes ``.metadata``.

    Rank files are written by :meth:`write_rank`, each in one sequential stream (so S3
    gets one multipart upload per file); different ranks may be written in parallel.
    """

    def __init__(self, store: Store, *, algo: str = "xxh3-128", on_bytes=None, sink=None):
        self.store = store
        # where files are created: ``store`` itself, or anything with the same ``open`` and
        # ``write_atomic`` (ops.output.OutputDir: fsync, cleanup, cancellation)
        self.sink = sink if sink is not None else store
        self.meta = _Meta()
        self.algo = algo
        self.on_bytes = on_bytes
        self.hashes: dict[str, tuple[str, int]] = {}  # file -> (digest, size), for the manifest
        self._lock = threading.Lock()

    def write_rank(self, rank: int, items: Iterable[tuple]) -> int:
        """Write rank ``rank``'s file from ``items``: ``("tensor", fqn, dtype, shape,
        offsets, sizes, blocks)`` or ``("object", fqn, payload_bytes)``. Returns its size."""
        rel = rank_file(rank)
        with self.sink.open(rel, "wb") as f:
            out = HashingWriter(f, self.algo, self.on_bytes)
            for item in items:
                start = out.pos
                if item[0] == "tensor":
                    _, fqn, dtype, shape, offsets, sizes, blocks = item
                    zw = TorchZipWriter(out, pickle_state(TensorRef("0", dtype, tuple(sizes))))
                    zw.write_record("0", blocks)
                    zw.close()
                    key = (fqn, tuple(offsets))
                    with self._lock:
                        entry = self.meta.tensors.setdefault(fqn, (dtype, tuple(shape), []))
                        entry[2].append((tuple(offsets), tuple(sizes)))
                else:
                    _, fqn, payload = item
                    out.write(payload)
                    key = (fqn, None)
                    with self._lock:
                        self.meta.objects.add(fqn)
                with self._lock:
                    self.meta.storage[key] = (rel, start, out.pos - start)
        with self._lock:
            self.hashes[rel] = out.result()
        return out.pos

    def _save_id(self) -> str:
        """DCP's ``save_id``, derived from the data files' hashes (torch uses a random
        uuid; nothing reads it back but as an identifier of this save)."""
        data = "\n".join(f"{rel} {d} {n}" for rel, (d, n) in sorted(self.hashes.items())
                         if rel != METADATA)
        return digest_bytes(data.encode(), "xxh3-128")[:32]

    def commit(self, planner_data: dict | None = None) -> bytes:
        """Write ``.metadata`` (atomically): the DCP commit marker. Returns its bytes."""
        with paused_gc():
            data = self._metadata(planner_data)
        self.sink.write_atomic(METADATA, data)
        self.hashes[METADATA] = (digest_bytes(data, self.algo), len(data))
        return data

    def _metadata(self, planner_data: dict | None) -> bytes:
        # pickle shares repeated objects by identity: interned names give the same bytes
        # whether this process wrote every rank file or merged others' reports
        fqn_ = sys.intern
        sdm: dict = {}
        for fqn, (dtype, shape, chunks) in sorted(self.meta.tensors.items()):
            sdm[fqn_(fqn)] = tensor_storage_metadata(dtype, shape, sorted(chunks))
        for fqn in sorted(self.meta.objects):
            sdm[fqn_(fqn)] = Instance(_BYTES_META)
        storage = {}
        # sorted, and save_id from the data's hashes: the same output gives the same bytes
        # whichever threads or processes wrote which rank file, in whatever order
        for (fqn, offsets), (rel, off, length) in sorted(
                self.meta.storage.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                           kv[0][1] or ())):
            storage[IndexMeta(fqn_(fqn), offsets)] = StorageInfo(fqn_(rel), off, length)
        return metadata_pickle(sdm, _interned(planner_data or {}), storage, self._save_id())


# ----------------------------------------------------------------------- .metadata
#
# ``.metadata`` is written without importing torch (1-2 s and ~200 MB): its objects are
# stand-ins that pickle to the very bytes ``pickle.dumps`` gives for the real
# ``torch.distributed.checkpoint`` objects (tests compare the two): the same globals,
# states in the same order, and the same sharing, since pickle memoizes by identity. Even
# which of torch's strings are interned is mirrored (as measured with torch 2.13): an
# entry named "torch" shares its string with torch.Size's module, not with a dtype's.


def _fresh(s: str) -> str:
    """A copy of ``s`` that is not the interned one (pickle will not share it)."""
    return (" " + s)[1:]


_MD = sys.intern("torch.distributed.checkpoint.metadata")
_METADATA = Global(_MD, "Metadata")
_TENSOR_META = Global(_MD, "TensorStorageMetadata")
_BYTES_META = Global(_MD, "BytesStorageMetadata")
_CHUNK_META = Global(_MD, "ChunkStorageMetadata")
_PROPERTIES = Global(_MD, "TensorProperties")
_INDEX = Global(_MD, "MetadataIndex")
_STORAGE_META = Global(_MD, "StorageMeta")
_STORAGE_INFO = Global(_fresh("torch.distributed.checkpoint.filesystem"), "_StorageInfo")
_SIZE = Global(sys.intern("torch"), _fresh("Size"))
# a dtype is pickled by name (``dtype.__reduce__`` gives "float32"), its module found in
# sys.modules: two strings of torch's own, neither interned
_DTYPE_MODULE = _fresh("torch")
_DTYPES: dict[str, Global] = {}
_STRIDED = Reduced(Global(_fresh("torch.serialization"), "_get_layout"), ("torch.strided",))
# TensorProperties pickles its memory format as this enum (torch.contiguous_format)
_CONTIGUOUS = Reduced(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))


def torch_size(dims) -> Reduced:
    """``torch.Size(dims)`` as pickle writes it: a fresh tuple each time, never shared.

    >>> torch_size([2, 3]).args
    ((2, 3),)
    """
    return Reduced(_SIZE, (tuple([int(d) for d in dims]),))


def torch_dtype(name: str) -> Global:
    """``torch.<name>``: one reference per dtype, so its later uses are memo lookups.

    >>> torch_dtype("bfloat16") is torch_dtype("bfloat16"), torch_dtype("bfloat16").name
    (True, 'bfloat16')
    """
    ref = _DTYPES.get(name)
    if ref is None:
        ref = _DTYPES.setdefault(name, Global(_DTYPE_MODULE, _fresh(name)))
    return ref


def tensor_storage_metadata(dtype: str, shape, chunks) -> Instance:
    """``TensorStorageMetadata(TensorProperties(torch.<dtype>), torch.Size(shape),
    [ChunkStorageMetadata(offsets, sizes) ...])``: ``chunks`` is ``[(offsets, sizes)]``.

    >>> tensor_storage_metadata("float32", (4, 2), [((0, 0), (4, 2))]).cls.name
    'TensorStorageMetadata'
    """
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory_format, pin_memory)
    props = Instance(_PROPERTIES, (torch_dtype(dtype), _STRIDED, False, _CONTIGUOUS, False))
    return Instance(_TENSOR_META, {"properties": props, "size": torch_size(shape),
                                   "chunks": [ChunkMeta(o, s) for o, s in chunks]})


# The three objects of every chunk (100,000s of them) write their opcodes in one go
# (Lazy.emit); their first uses, and any that a frame might end inside, go the slow way.
_NEWOBJ_STATE = (pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.MEMOIZE + pickle.EMPTY_DICT
                 + pickle.MEMOIZE + pickle.MARK)  # cls(), then its state dict's items
_BUILD = pickle.SETITEMS + pickle.BUILD


def _size_ops(p: Pickle4, dims: tuple) -> tuple[bytes, int] | None:
    """:func:`torch_size`'s opcodes and how many memo entries they add, once
    ``torch.Size`` is in the memo."""
    ref = p.ref(_SIZE)
    if ref is None:
        return None
    if not dims:  # the empty tuple is never memoized
        return ref + pickle.EMPTY_TUPLE + pickle.TUPLE1 + pickle.MEMOIZE + pickle.REDUCE \
            + pickle.MEMOIZE, 2
    body = b"".join([int_op(d) for d in dims])
    inner = body + TUPLE_OPS[len(dims) - 1] if len(dims) <= 3 else pickle.MARK + body + pickle.TUPLE
    return ref + inner + pickle.MEMOIZE + pickle.TUPLE1 + pickle.MEMOIZE + pickle.REDUCE \
        + pickle.MEMOIZE, 3


def _emit(p: Pickle4, cls: Global, items: list, fresh: int) -> bool:
    """Write ``cls()`` with state ``{key: value}`` from ``items``: each a key (a str
    already in the memo) and its value's opcodes; False when something is not in the memo."""
    head = p.ref(cls)
    refs = [p.ref(k) for k in items[::2]]
    if head is None or None in refs or None in items[1::2]:
        return False
    body = b"".join([k + v for k, v in zip(refs, items[1::2])])
    return p.put(head + _NEWOBJ_STATE + body + _BUILD, fresh + 2)


class ChunkMeta(Lazy):
    """``ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))``.

    >>> ChunkMeta((0, 0), (4, 2)).expand().state["sizes"].args
    ((4, 2),)
    """

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = tuple(map(int, offsets)), tuple(map(int, sizes))

    def expand(self) -> Instance:
        return Instance(_CHUNK_META, {"offsets": torch_size(self.offsets),
                                      "sizes": torch_size(self.sizes)})

    def emit(self, p: Pickle4) -> bool:
        a, b = _size_ops(p, self.offsets), _size_ops(p, self.sizes)
        if a is None or b is None:
            return False
        return _emit(p, _CHUNK_META, ["offsets", a[0], "sizes", b[0]], a[1] + b[1])


class IndexMeta(Lazy):
    """``MetadataIndex(fqn, torch.Size(offsets))``; ``offsets`` None for an object entry
    (its ``__init__`` then sets no ``offset`` attribute: the state leaves it out).

    >>> IndexMeta("step", None).expand().state
    {'fqn': 'step', 'index': None}
    """

    __slots__ = ("fqn", "offsets")

    def __init__(self, fqn: str, offsets):
        self.fqn = fqn
        self.offsets = None if offsets is None else tuple(map(int, offsets))

    def expand(self) -> Instance:
        state = {"fqn": self.fqn, "index": None}
        if self.offsets is not None:
            state["offset"] = torch_size(self.offsets)
        return Instance(_INDEX, state)

    def emit(self, p: Pickle4) -> bool:
        items = ["fqn", p.ref(self.fqn), "index", pickle.NONE]
        size = (b"", 0) if self.offsets is None else _size_ops(p, self.offsets)
        if size is None:
            return False
        if self.offsets is not None:
            items += ["offset", size[0]]
        return _emit(p, _INDEX, items, size[1])


class StorageInfo(Lazy):
    """``_StorageInfo(relative_path, offset, length)`` (its ``__getstate__`` leaves out
    ``transform_descriptors`` when None).

    >>> StorageInfo("__0_0.distcp", 0, 64).expand().state
    {'relative_path': '__0_0.distcp', 'offset': 0, 'length': 64}
    """

    __slots__ = ("rel", "offset", "length")

    def __init__(self, rel: str, offset: int, length: int):
        self.rel, self.offset, self.length = rel, offset, length

    def expand(self) -> Instance:
        return Instance(_STORAGE_INFO, {"relative_path": self.rel, "offset": self.offset,
                                        "length": self.length})

    def emit(self, p: Pickle4) -> bool:
        return _emit(p, _STORAGE_INFO, ["relative_path", p.ref(self.rel), "offset",
                                        int_op(self.offset), "length", int_op(self.length)], 0)


def metadata_pickle(state_dict_metadata: dict, planner_data: dict, storage_data: dict,
                    save_id: str) -> bytes:
    """The bytes of ``pickle.dumps(Metadata(...), protocol=4)`` (what torch writes: pickle's
    default before Python 3.14, where protocol 5 gives the same opcodes) for DCP
    ``.metadata``, from the stand-ins above; ``StorageMeta(checkpoint_id=None,
    save_id=save_id)``, ``version="1.0.0"``.

    >>> from ckptctl.formats.dcp import parse_metadata
    >>> info = {IndexMeta("step", None): StorageInfo("__0_0.distcp", 0, 9)}
    >>> md = parse_metadata(metadata_pickle({"step": Instance(_BYTES_META)}, {}, info, "id"))
    >>> md.storage_meta.save_id, list(md.storage_data.values())[0].length
    ('id', 9)
    """
    storage_meta = Instance(_STORAGE_META, {"checkpoint_id": None, "save_id": save_id,
                                            "load_id": None, "modules": []})
    md = Instance(_METADATA, {"state_dict_metadata": state_dict_metadata,
                              "planner_data": planner_data, "storage_data": storage_data,
                              "storage_meta": storage_meta, "version": "1.0.0"})
    return dumps4(md)
