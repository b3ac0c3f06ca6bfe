"""A ``torch.save`` zip read without torch and without running code: its ``data.pkl``
unpickled with inert stand-ins (tensors become :class:`~.torchzip.StoredTensor`, the
globals a caller allows become records), and the byte range of any tensor's storage
found from the zip's directory. Three small reads (the tail, ``data.pkl``, a record's
local header) instead of loading the file: what lets ``inspect`` of a DeepSpeed
checkpoint on S3 download no tensor data, and a consolidation read a parameter as byte
ranges of the rank files.

>>> import io, tempfile, torch, pathlib
>>> from ckptctl.storage import open_store
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> torch.save({"w": torch.arange(6.0).view(2, 3)[1], "n": 7}, d / "x.pt")
>>> tf = TorchFile(open_store(str(d)), "x.pt", (d / "x.pt").stat().st_size)
>>> tf.obj["n"], tf.obj["w"].size, tf.obj["w"].storage_offset
(7, (3,), 3)
>>> e = tf.extent(tf.obj["w"], "w"); e.length
12
"""
from __future__ import annotations

import io
import math
import threading

from ..boxes import flat_range_boxes
from ..errors import FormatError, UnsafeInputError
from ..model import DTYPES, Checkpoint, Chunk, Extent, ObjectEntry, TensorEntry
from ..storage import Store
from .limits import MAX_NEST_DEPTH
from .safe_pickle import GraphBoundError, Record, check_graph
from .torchzip import (LOCAL_HEADER_LEN, TAIL_GUESS, StoredTensor, ZipEntry, StorageRef,
                       StorageType, tensor_globals, central_directory, local_data_offset)

#: Largest ``data.pkl`` read: a DeepSpeed model-states pickle of a 1,000-layer model is a
#: few MB (names and shapes); past this it is no checkpoint of ours to parse in memory.
MAX_PICKLE_BYTES = 256 << 20


class _StateDict(dict):
    """``collections.OrderedDict`` as a plain dict that takes a pickled state: a module's
    state dict carries ``_metadata`` (module versions), which no reader here needs."""

    def __setstate__(self, state):
        pass


def _from_type_v2(func, new_type, args, state=None):
    """``torch._tensor._rebuild_from_type_v2``: a plain tensor or parameter rebuilt, its
    Python attributes (DeepSpeed's ``ds_id``) left out; a tensor subclass is refused."""
    if new_type is not _PLAIN_TENSOR:
        raise UnsafeInputError(None, "a tensor subclass, not a plain tensor")
    return func(*args)


_PLAIN_TENSOR = object()


class TorchFile:
    """One ``torch.save`` zip: ``obj`` is its unpickled structure, tensors as
    :class:`~.torchzip.StoredTensor`; :meth:`extent` gives a tensor's bytes as a raw
    :class:`~ckptctl.model.Extent` of the file.

    ``allowed``: extra ``(module, name) -> stand-in`` globals the pickle may name (a
    framework's classes, rebuilt as inert records); anything else is refused by name.
    ``base``: where the zip starts in ``rel`` (a ``torch.save`` stored as a byte range of a
    larger file, as DCP stores a bytes entry); ``size`` is the zip's own length.
    """

    def __init__(self, store: Store, rel: str, size: int, allowed: dict | None = None, *,
                 base: int = 0):
        self.store, self.rel, self.size, self.base = store, rel, size, base
        self.where = store.display(rel)
        tail = self._read(max(0, size - TAIL_GUESS), size)
        entries, need = central_directory(tail, size, where=self.where)
        if need:
            if need > 64 << 20:
                raise FormatError(self.where, f"zip directory of {need} bytes is absurdly large")
            entries, _ = central_directory(self._read(size - need, size), size,
                                           where=self.where)
        pkl = [e for e in entries if e.name.endswith("/data.pkl") or e.name == "data.pkl"]
        if len(pkl) != 1:
            raise FormatError(self.where, "not a torch.save zip (no single data.pkl record)")
        self.prefix = pkl[0].name[:-len("data.pkl")]
        self.records: dict[str, ZipEntry] = {e.name: e for e in entries}
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self.obj = self._unpickle(self._record_bytes(pkl[0], MAX_PICKLE_BYTES), allowed or {})

    def _read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the zip (offsets from its start)."""
        return self.store.read_range(self.rel, self.base + start, self.base + end)

    def _record_bytes(self, en: ZipEntry, limit: int) -> bytes:
        if en.method != 0:
            raise FormatError(self.where, f"{en.name}: compressed inside the zip")
        if en.usize > limit:
            raise FormatError(self.where, f"{en.name} is {en.usize} bytes, past the "
                              f"{limit >> 20} MiB this reader parses")
        start = self._data_offset(en)
        data = self._read(start, start + en.usize)
        if len(data) != en.usize:
            raise FormatError(self.where, f"{en.name}: file is truncated", code="SIZE_MISMATCH")
        return data

    def _data_offset(self, en: ZipEntry) -> int:
        with self._lock:
            off = self._offsets.get(en.name)
        if off is None:
            head = self._read(en.header_offset, en.header_offset + LOCAL_HEADER_LEN + 512)
            off = local_data_offset(head, en, where=self.where)
            if off + en.usize > self.size:
                raise FormatError(self.where, f"{en.name} runs past the end of the file",
                                  code="SIZE_MISMATCH")
            with self._lock:
                self._offsets[en.name] = off
        return off

    def _unpickle(self, data: bytes, extra: dict):
        from .safe_pickle import RestrictedUnpickler

        where = self.where
        allowed = {**tensor_globals(where), ("torch", "Size"): tuple,
                   ("torch", "device"): str, ("collections", "OrderedDict"): _StateDict,
                   ("torch._tensor", "_rebuild_from_type_v2"): _from_type_v2,
                   ("torch", "Tensor"): _PLAIN_TENSOR,
                   ("torch.nn.parameter", "Parameter"): _PLAIN_TENSOR, **extra}

        class _Unpickler(RestrictedUnpickler):
            def persistent_load(self, pid):
                if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                        or not isinstance(pid[1], StorageType) or not isinstance(pid[4], int)
                        or pid[4] < 0):
                    raise FormatError(where, "data.pkl: unexpected storage reference",
                                      code="MALFORMED_CHUNK")
                return StorageRef(pid[1].dtype, pid[2], pid[4])

        try:
            obj = _Unpickler(io.BytesIO(data), allowed).load()
        except UnsafeInputError as e:
            raise UnsafeInputError(where, e.message) from None
        except FormatError:
            raise
        except RecursionError:
            raise FormatError(where, "data.pkl nests too deeply") from None
        except MemoryError:
            raise FormatError(where, "data.pkl asks for absurd amounts of memory") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            kind = "truncated" if isinstance(e, EOFError) else "malformed"
            raise FormatError(where, f"{kind} data.pkl ({type(e).__name__})") from None
        # every reader walks what it gets (flattening, plain): bounded here, once, for all
        check_graph(obj, where, max_depth=MAX_NEST_DEPTH)
        return obj

    def extent(self, st: StoredTensor, name: str = "", *, start: int = 0,
               count: int | None = None) -> Extent:
        """The raw bytes of elements ``[start, start + count)`` of a row-major tensor's
        flat view (all of it by default). A strided view is refused by name: its elements
        are not one byte range."""
        dtype = DTYPES.get(st.dtype)
        what = f"{self.where}: {name}" if name else self.where
        if dtype is None or dtype.bits % 8:
            raise FormatError(what, f"unsupported dtype {st.dtype}")
        if not st.is_row_major():
            raise FormatError(what, f"a strided tensor (stride {list(st.stride)}), not one "
                              "byte range")
        count = st.numel - start if count is None else count
        if start < 0 or count < 0 or start + count > st.numel:
            raise FormatError(what, f"elements [{start}, {start + count}) lie outside a "
                              f"tensor of {st.numel}", code="OUT_OF_BOUNDS")
        if st.span() > st.storage_numel:
            raise FormatError(what, "view reaches past its storage", code="OUT_OF_BOUNDS")
        en = self.records.get(f"{self.prefix}data/{st.key}")
        if en is None:
            raise FormatError(what, f"storage data/{st.key} is not in the zip",
                              code="MALFORMED_CHUNK")
        if en.method != 0:
            raise FormatError(what, "storage is compressed inside the zip", code="MALFORMED_CHUNK")
        if en.usize != dtype.nbytes(st.storage_numel):
            raise FormatError(what, f"storage data/{st.key} holds {en.usize} bytes, its "
                              f"data.pkl declares {dtype.nbytes(st.storage_numel)}",
                              code="DTYPE_SIZE_MISMATCH")
        base = self._data_offset(en) if count else 0
        return Extent(self.rel, self.base + base + dtype.nbytes(st.storage_offset + start),
                      dtype.nbytes(count), "raw")


def plain(v):
    """A stand-in record as a dict of its attributes; containers walked (no tensors).

    >>> plain({"a": [1, (2, 3)]})
    {'a': [1, (2, 3)]}
    """
    if isinstance(v, Record):
        return {k: plain(x) for k, x in vars(v).items() if not k.startswith("_")}
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(plain(x) for x in v)
    return v


class EntryBuilder:
    """Adds entries to a checkpoint from parsed :class:`TorchFile` s: tensors from byte
    ranges of the files, nested plain values flattened into object entries.

    >>> b = EntryBuilder(Checkpoint("x", "torch"))                  # doctest: +SKIP
    >>> b.objects("args", tf.obj["args"], tf); sorted(b.ck.objects)  # doctest: +SKIP
    ['args.hidden_size', 'args.num_layers']
    """

    def __init__(self, ck: Checkpoint, default_file: str | None = None):
        self.ck = ck
        self.default_file = default_file  # where an empty tensor's (0-byte) chunk points

    def name_free(self, name: str, where: str) -> None:
        if name in self.ck.tensors or name in self.ck.objects:
            raise FormatError(where, f"{name}: two entries of this name")

    def tensor(self, name: str, dtype: str, shape: tuple[int, ...],
               pieces: list[tuple[int, Extent]], where: str) -> TensorEntry:
        """A tensor from flat pieces: (first flat element, raw extent of the piece)."""
        self.name_free(name, where)
        dt = DTYPES[dtype]
        chunks = []
        for first, ext in pieces:
            count = ext.length // dt.itemsize
            for (off, sz), base in flat_range_boxes(shape, first, first + count):
                n = math.prod(sz)
                chunks.append(Chunk(off, sz, Extent(ext.file, ext.offset + (base - first)
                                                    * dt.itemsize, n * dt.itemsize, "raw")))
        if not chunks:  # no elements: one empty chunk keeps the tensor's place
            f = pieces[0][1].file if pieces else self.default_file
            chunks.append(Chunk((0,) * len(shape), shape, Extent(f, 0, 0, "raw")))
        t = TensorEntry(name, dt, shape, chunks)
        self.ck.tensors[name] = t
        return t

    def stored(self, name: str, tf, st: StoredTensor, shape: tuple[int, ...] | None = None):
        """A tensor stored whole in one rank file (a buffer, a 16-bit weight, a step)."""
        shape = st.size if shape is None else shape
        if math.prod(shape) != st.numel:
            raise FormatError(tf.where, f"{name}: {st.numel} elements stored for shape "
                              f"{list(shape)}")
        return self.tensor(name, st.dtype, shape, [(0, tf.extent(st, name))], tf.where)

    def objects(self, prefix: str, value, tf, *, tensors: bool = True) -> None:
        """Flattened entries of a nested value; tensors in it become tensor entries."""
        from .torchsave import flatten

        for sub, v in flatten({"": value} if not isinstance(value, dict) else value,
                              where=tf.where).items():
            name = f"{prefix}.{sub}" if prefix and sub else (prefix or sub)
            if isinstance(v, StoredTensor):
                if not tensors:
                    raise FormatError(tf.where, f"{name}: a tensor where plain values belong")
                self.stored(name, tf, v)
            else:
                self.name_free(name, tf.where)
                v = plain(v)
                self.ck.objects[name] = ObjectEntry(name, None, value=v, type_name=type(v).__name__)


def read_torch_zip(store: Store, files: dict[str, int], rel: str) -> Checkpoint | None:
    """The torch.save zip ``rel`` read without torch (:class:`~.torchfile.TorchFile`: its
    ``data.pkl`` with inert stand-ins, each tensor a byte range of its zip record, the
    record CRCs checked by ``verify --level full``): what ``verify`` needs, in
    milliseconds instead of an import of torch. None where only torch reads it: the
    legacy non-zip format, a strided view, a global the stand-ins do not cover; the
    caller then loads it with :func:`read_torch`.

    >>> import io, tempfile, torch, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> torch.save({"model": {"w": torch.ones(2, 3)}, "step": 7}, d / "x.pt")
    >>> ck = read_torch_zip(open_store(str(d)), {"x.pt": (d / "x.pt").stat().st_size}, "x.pt")
    >>> ck.tensors["model.w"].shape, ck.objects["step"].value, ck.info["zip_files"]
    ((2, 3), 7, ['x.pt'])
    """
    from .torchsave import ZIP_MAGIC

    size = files[rel]
    try:
        if store.read_range(rel, 0, 4) != ZIP_MAGIC:
            return None
        ck = Checkpoint(root=store.display(rel), format="torch", store=store,
                        files={rel: size})
        tf = TorchFile(store, rel, size)
        EntryBuilder(ck, rel).objects("", tf.obj, tf)
    except GraphBoundError:
        raise  # torch would build the same graph: no second loader for it
    except (FormatError, UnsafeInputError):  # torch's own loader says it, or reads it
        return None
    ck.info["zip_files"] = [rel]
    ck.info["torch_free"] = True
    return ck
