"""torch.save files (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): loaded with
``torch.load(weights_only=True, mmap=True)`` (``mmap=False`` for the legacy non-zip format,
which torch cannot map) and flattened to dotted names the way DCP flattens a state dict
(``optim.param_groups.0.lr``).

This is the one reader that imports torch; it does so only when called, through
:func:`ckptctl._deps.require_torch` (without torch: one line with the install hint, exit 3).

>>> flatten({"a": {"b": 1, "c": [2, 3], "d": [{"e": 4}]}})
{'a.b': 1, 'a.c': [2, 3], 'a.d.0.e': 4}
>>> deep = []
>>> for _ in range(300):
...     deep = [deep]
>>> flatten({"x": deep})
Traceback (most recent call last):
ckptctl.errors.FormatError: x.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0...: nests too deeply (more than 256 levels of dicts and lists)
"""
from __future__ import annotations

import os
import tempfile

from ..errors import FormatError, UnsafeInputError, shorten
from ..model import DTYPES, Checkpoint, Chunk, Extent, ObjectEntry, TensorEntry
from ..storage import Store
from .limits import MAX_NEST_DEPTH
from .safe_pickle import check_graph

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
INDEX_SUFFIX = ".bin.index.json"
ZIP_MAGIC = b"PK\x03\x04"
#: ``torch.serialization.MAGIC_NUMBER`` as the legacy format pickles it first (LONG1, 10
#: bytes little-endian), right after the protocol opcode (and a frame, from protocol 4).
LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
#: How many bytes :func:`torch_bytes_problem` reads first (a tar's ``ustar`` at 257).
SNIFF_BYTES = 512


def is_torch_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and "/" not in name


def _container_or_tensor(v) -> bool:
    return isinstance(v, (dict, list, tuple)) or (hasattr(v, "dtype") and hasattr(v, "shape"))


def _walk(obj, where: str | None = None):
    """(path, leaf) pairs of a nested object in insertion order, without recursion;
    refuses nesting deeper than :data:`~.limits.MAX_NEST_DEPTH` and shared references
    that would make the walk outgrow the file (:func:`~.safe_pickle.check_graph`):
    hostile files."""
    check_graph(obj, where)
    stack = [((), obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict) and v:
            kids = list(v.items())
        elif isinstance(v, (list, tuple)) and v and any(_container_or_tensor(x) for x in v):
            kids = list(enumerate(v))
        else:
            yield path, v
            continue
        if len(path) >= MAX_NEST_DEPTH:
            shown = ".".join(str(p) for p in path[:16])
            raise FormatError(where, f"{shown}...: nests too deeply (more than "
                              f"{MAX_NEST_DEPTH} levels of dicts and lists)")
        stack.extend((path + (k,), x) for k, x in reversed(kids))


def flatten_paths(obj, path: tuple = (), *, where: str | None = None) -> dict[str, tuple]:
    """Flattened name -> path of keys/indices in the nested object (DCP's planner_data)."""
    return {".".join(str(p) for p in path + sub): path + sub for sub, _ in _walk(obj, where)}


def flatten(obj, prefix: str = "", *, where: str | None = None) -> dict[str, object]:
    """Flatten nested dicts to dotted keys, as DCP does. Lists and tuples are descended
    into when they hold tensors or containers (DCP would pickle those whole); lists of
    plain values stay one entry, as in DCP (``optim.param_groups.0.params``)."""
    out: dict[str, object] = {}
    for path, v in _walk(obj, where):
        out[(prefix + ".".join(str(p) for p in path)) if path else prefix[:-1]] = v
    return out


def _hex(head: bytes, n: int = 8) -> str:
    return " ".join(f"{b:02x}" for b in head[:n]) + (" ..." if len(head) > n else "")


def _zip_problem(store: Store, rel: str, size: int) -> str | None:
    """Why a file that starts as a zip is no readable torch.save zip (cut short or damaged
    before its central directory, or no ``data.pkl`` record in it), or None."""
    from .torchzip import EOCD_SIG, TAIL_GUESS, central_directory

    tail = store.read_range(rel, max(0, size - TAIL_GUESS), size)
    if EOCD_SIG not in tail:  # a zip ends with this record: a torch.save file cut short
        return (f"a zip cut short or damaged (no end of central directory record at its "
                f"end; the file has {size:,} bytes): not a readable torch.save file")
    try:
        entries, need = central_directory(tail, size)
        if need:
            if need > 64 << 20:
                return f"a zip whose directory claims {need:,} bytes: not a torch.save file"
            entries, _ = central_directory(store.read_range(rel, size - need, size), size)
    except FormatError as e:
        return f"a damaged zip ({e.message}): not a readable torch.save file"
    if any(e.name == "data.pkl" or e.name.endswith("/data.pkl") for e in entries):
        return None
    shown = ", ".join(e.name for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
    return (f"not a torch.save file (a zip archive without a data.pkl record: "
            f"{len(entries)} record{'s' if len(entries) != 1 else ''}"
            f"{': ' + shown if shown else ''})")


def torch_bytes_problem(store: Store, rel: str, size: int) -> str | None:
    """What the torch-suffixed file ``rel`` is not, from its first bytes (and a zip's
    central directory), before anything imports torch; None when the bytes may be a
    torch.save file: a zip with a ``data.pkl`` record, a legacy torch pickle (a pickle
    protocol opcode, then torch's magic number) or a pre-1.0 tar. One or two small reads.

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "x.pt").write_bytes(b"?\\x9a junk!!")
    >>> torch_bytes_problem(open_store(str(d)), "x.pt", 9)
    'not a torch.save file (neither a zip with data.pkl nor a legacy torch pickle: the first bytes are 3f 9a 20 6a 75 6e 6b 21 ...)'
    """
    if size == 0:
        return "not a torch.save file (the file is empty)"
    head = store.read_range(rel, 0, min(size, SNIFF_BYTES))
    if head.startswith(ZIP_MAGIC):
        return _zip_problem(store, rel, size)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        if LEGACY_MAGIC in head[:32]:
            return None
        return ("not a torch.save file (a Python pickle without torch's magic number: "
                f"torch.load cannot read it; the first bytes are {_hex(head)})")
    if head.startswith(b"L%dL\n" % int.from_bytes(LEGACY_MAGIC[2:], "little")):
        return ("a legacy torch.save file of pickle protocol 0 or 1, which weights-only "
                "loading cannot read (load it with torch and save it again)")
    if head[257:262] == b"ustar":  # torch's pre-1.0 tar format: torch.load reads it
        return None
    return ("not a torch.save file (neither a zip with data.pkl nor a legacy torch pickle: "
            f"the first bytes are {_hex(head)})")


def check_torch_bytes(store: Store, rel: str, size: int | None = None) -> None:
    """Raise :class:`~ckptctl.errors.FormatError` with :func:`torch_bytes_problem`'s
    answer, if any: garbage is refused in ckptctl's words before torch is imported.

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "e.bin").write_bytes(b"")
    >>> check_torch_bytes(open_store(str(d)), "e.bin")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.FormatError: ...e.bin: not a torch.save file (the file is empty)
    """
    if size is None:
        size = store.size(rel)
    why = torch_bytes_problem(store, rel, size)
    if why:
        raise FormatError(store.display(rel), why)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == ZIP_MAGIC


def load_torch_file(store: Store, rel: str, size: int | None = None):
    """``torch.load`` a file safely: weights only, memory-mapped when it is a local zip
    (the legacy non-zip format cannot be mapped: it is read into memory). Bytes that are
    no torch.save file are refused first, without torch (:func:`check_torch_bytes`)."""
    import pickle

    from .._deps import require_torch
    from .safe_pickle import numpy_globals

    where = store.display(rel)
    check_torch_bytes(store, rel, size)
    torch = require_torch(where)
    path = store.local_path(rel)
    tmp = None
    try:
        if path is None:  # remote: torch needs a seekable local file to mmap
            fd, tmp = tempfile.mkstemp(prefix="ckptctl-", suffix=".pt")
            with os.fdopen(fd, "wb") as out, store.open(rel) as src:
                while block := src.read(8 << 20):
                    out.write(block)
            path = tmp
        try:
            with torch.serialization.safe_globals(numpy_globals()):
                return torch.load(path, weights_only=True, mmap=_is_zip(path),
                                  map_location="cpu")
        except pickle.UnpicklingError as e:
            if "Unsupported global" in str(e) or "not an allowed global" in str(e) or "GLOBAL" in str(e):
                raise UnsafeInputError(where, "refused: the pickle needs globals that "
                                       "weights_only loading does not allow") from None
            raise FormatError(where, "not a loadable torch.save file "
                              f"({shorten(e, 120) or 'refused'})") from None
        except RecursionError:
            raise FormatError(where, "nests too deeply to load") from None
        except (RuntimeError, EOFError, ValueError, OSError) as e:
            raise FormatError(where, "not a loadable torch.save file "
                              f"({shorten(e, 120) or type(e).__name__})") from None
        except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as e:
            # torch's weights-only unpickler trips over malformed opcode streams this way
            raise FormatError(where, "not a loadable torch.save file (malformed pickle: "
                              f"{type(e).__name__})") from None
    finally:
        if tmp:
            os.unlink(tmp)


def _alias_key(value) -> tuple | None:
    """Identity of a tensor's view of its storage: equal keys are one tensor saved
    under two names (tied weights)."""
    if value.numel() == 0:
        return None
    try:
        ptr = value.untyped_storage().data_ptr()
        return ptr, value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype
    except (RuntimeError, NotImplementedError):  # sparse and other layouts: no plain storage
        return None


def add_torch_file(ck: Checkpoint, store: Store, rel: str, size: int, prefix: str = "") -> None:
    """Load one torch.save file into ``ck``, its entries named ``prefix + flattened name``.

    Tensors stay memory-mapped (``ck.info["loaded"]``); names that share one storage view
    are recorded in ``ck.info["aliases"]`` (alias -> the first name), so tied weights
    count once.
    """
    from .._deps import require_torch

    where = store.display(rel)
    obj = load_torch_file(store, rel, size)  # garbage is refused before torch is imported
    torch = require_torch(where)
    flat = flatten(obj, where=where)
    head = tuple(prefix.rstrip(".").split(".")) if prefix else ()
    loaded = ck.info.setdefault("loaded", {}).setdefault(rel, {})
    paths = ck.info.setdefault("paths", {})
    aliases = ck.info.setdefault("aliases", {})
    seen: dict[tuple, str] = {}
    ext = Extent(rel, 0, size, "torch_save")
    for sub, path in flatten_paths(obj, where=where).items():
        value = flat[sub]
        name = prefix + sub if sub else prefix.rstrip(".")  # a bare value: "" (or the prefix)
        if name in ck.tensors or name in ck.objects:
            raise FormatError(where, f"{name}: also stored in another file")
        paths[name] = head + path
        if isinstance(value, torch.Tensor):
            dtype = DTYPES.get(str(value.dtype).removeprefix("torch."))
            if dtype is None:
                raise FormatError(where, f"{name}: unsupported dtype {value.dtype}")
            shape = tuple(value.shape)
            ck.tensors[name] = TensorEntry(name, dtype, shape,
                                           [Chunk((0,) * len(shape), shape, ext)])
            loaded[name] = value
            key = _alias_key(value)
            if key is not None:
                if key in seen:
                    aliases[name] = seen[key]
                else:
                    seen[key] = name
        else:
            ck.objects[name] = ObjectEntry(name, ext, value=value, type_name=type(value).__name__)


def read_torch(store: Store, files: dict[str, int], only_file: str | None = None) -> Checkpoint:
    """Read one torch.save file (``only_file``, or the folder's only torch file) into the
    logical model; tensors stay memory-mapped. Folders with several state files are read
    by :mod:`ckptctl.formats.composite`."""
    names = [only_file] if only_file else [f for f in files if is_torch_file(f)]
    ck = Checkpoint(root=store.display(only_file) if only_file else store.url,
                    format="torch", store=store,
                    files={f: files[f] for f in names} if only_file else dict(files))
    for rel in names:
        add_torch_file(ck, store, rel, files[rel])
    return ck


def tensor_bytes(ck: Checkpoint, name: str) -> memoryview:
    """Row-major bytes of a tensor of a torch.save checkpoint."""
    import torch

    t = ck.tensors[name]
    value = ck.info["loaded"][t.chunks[0].extent.file][name].contiguous()
    if value.numel() == 0:
        return memoryview(b"")
    return memoryview(value.view(-1).view(torch.uint8).numpy())
