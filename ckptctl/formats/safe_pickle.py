"""Unpicklers that run no code: every global a pickle names is looked up in an allow-list
of inert stand-ins, so a hostile pickle is refused before anything executes.

>>> loads_primitive(b"\\x80\\x02K\\x07.")
7
>>> import pickle, os
>>> loads_primitive(pickle.dumps(os.getcwd))
Traceback (most recent call last):
ckptctl.errors.UnsafeInputError: pickle refers to global posix.getcwd, which is not allowed
"""
from __future__ import annotations

import io
import pickle

from ..errors import FormatError, ProblemCode, UnsafeInputError
from .limits import MAX_NEST_DEPTH, MAX_SHARED_NODES


class Record:
    """An inert object rebuilt from a pickled class instance: attributes only, no methods.

    Its state goes into ``__dict__`` by the C unpickler itself (no ``__setstate__``): a
    10,000-rank ``.metadata`` holds about a million such records."""

    _cls_name = "Record"

    def __init__(self, *args, **kwargs):  # only reached through REDUCE of a hostile pickle
        self._args = args

    def __repr__(self):
        return f"{self._cls_name}({self.__dict__})"


class StateRecord(Record):
    """A :class:`Record` of a class that pickles a non-dict state (kept as ``_state``)."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (
                state[0] is None or isinstance(state[0], dict)) and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


def record_class(name: str, *, state: bool = False) -> type:
    """A :class:`Record` subclass named ``name``; ``state``: the class pickles a
    non-dict state (a tuple from ``__getstate__``)."""
    return type(name, (StateRecord if state else Record,), {"_cls_name": name})


class TorchName(str):
    """A torch object referred to by name (``torch.float32``, ``torch.strided``)."""


class RestrictedUnpickler(pickle.Unpickler):
    """Resolve globals only through ``allowed``: ``(module, name) -> object``."""

    def __init__(self, file, allowed: dict[tuple[str, str], object]):
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeInputError(None, f"pickle refers to global {module}.{name}, "
                                   "which is not allowed") from None

    def persistent_load(self, pid):
        raise UnsafeInputError(None, "pickle refers to external storage")


def restricted_loads(data: bytes, allowed: dict, *, where: str = "") -> object:
    """Unpickle ``data`` with only ``allowed`` globals; any failure is a one-line error."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed).load()
    except UnsafeInputError as e:
        raise UnsafeInputError(where or None, e.message) from None
    except RecursionError:
        raise FormatError(where or None, "pickle nests too deeply") from None
    except MemoryError:
        raise FormatError(where or None, "pickle asks for absurd amounts of memory") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        kind = "truncated" if isinstance(e, EOFError) else "malformed"
        raise FormatError(where or None, f"{kind} pickle ({type(e).__name__})") from None


def loads_primitive(data: bytes, *, where: str = "") -> object:
    """Unpickle a pickle of plain values (numbers, strings, lists, dicts): no globals at
    all; one whose walk would expand through shared references is refused
    (:func:`check_graph`): a caller walks what it gets (to show it, to compare it)."""
    obj = restricted_loads(data, {}, where=where)
    check_graph(obj, where or None)
    return obj


# --------------------------------------------------------------------------- object graphs

class GraphBoundError(FormatError):
    """An unpickled object whose walk would cost more than its file's bytes pay for
    (:func:`check_graph`). A :class:`FormatError` (exit 3), not an
    :class:`UnsafeInputError`: no reader falls back to another loader on it (torch would
    build the same graph), nor keeps the file as an opaque object."""

    default_code: str = ProblemCode.UNSAFE_INPUT


#: What a walk descends into; anything else (a string, a number, a tensor) is a leaf.
_CONTAINERS = (dict, list, tuple, set, frozenset, Record)
#: Values a short sequence may hold and still cost a walk what a string does.
_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def _like_a_leaf(v) -> bool:
    """A short tuple or list of plain values (a shape, Adam's ``betas``): one entry
    wherever it is named, like a string, so naming it again costs what its reference's
    bytes pay for (Python shares such constants, and a pickle keeps the sharing).

    >>> _like_a_leaf((0.9, 0.999)), _like_a_leaf([{"a": 1}]), _like_a_leaf(tuple(range(99)))
    (True, False, False)
    """
    return isinstance(v, (list, tuple)) and len(v) <= 16 and all(
        isinstance(x, _SCALARS) for x in v)


def _kids(v) -> list:
    if isinstance(v, dict):
        return list(v.values())
    if isinstance(v, Record):
        return list(vars(v).values())
    return list(v)


def check_graph(obj, where: str | None = None, *, shared_limit: int = MAX_SHARED_NODES,
                max_depth: int | None = None) -> int:
    """How many nodes a full walk of ``obj`` visits, every reference to a shared
    container expanded again (a flattening names each one): found without that walk,
    each container counted once, so this costs what the pickle's bytes cost. Refuses
    (:class:`GraphBoundError`) an object whose shared references would make a walk
    reach more than ``shared_limit`` nodes again (:data:`~.limits.MAX_SHARED_NODES`),
    one that contains itself, and, with ``max_depth``, non-empty containers nested that
    deep. Dict keys are not walked (a name is a leaf).

    >>> d = {"w": 1}
    >>> for _ in range(3):
    ...     d = {"x": d, "y": d}
    >>> check_graph(d)  # 15 dicts and 8 leaves, as a flattening walks them
    23
    >>> for _ in range(20):
    ...     d = {"x": d, "y": d}
    >>> check_graph(d, "bomb.pt")
    Traceback (most recent call last):
    ckptctl.formats.safe_pickle.GraphBoundError: bomb.pt: object graph expands past 65,536 nodes through shared references (one dict or list named again and again)
    """
    if not isinstance(obj, _CONTAINERS) or not obj:
        return 1
    done: dict[int, int] = {}  # id of a walked container -> nodes its walk visits
    open_: set[int] = set()  # containers on the current path: reaching one again is a cycle
    stack: list[list] = []  # [container, its kids left, nodes so far]
    shared = 0

    def enter(x, depth: int) -> int | None:
        """Nodes of a container of leaves (counted at C speed: RNG states hold long
        lists); None after pushing any other container to walk."""
        if max_depth is not None and depth >= max_depth:
            raise GraphBoundError(where, f"nests too deeply (more than {max_depth} "
                                  "levels of containers)")
        kids = _kids(x)
        if not any(issubclass(t, _CONTAINERS) for t in set(map(type, kids))):
            done[id(x)] = len(kids) + 1
            return len(kids) + 1
        open_.add(id(x))
        stack.append([x, iter(kids), 1])
        return None

    if (flat := enter(obj, 0)) is not None:
        return flat
    while stack:
        frame = stack[-1]
        for x in frame[1]:
            if not isinstance(x, _CONTAINERS) or not x:  # a leaf (an empty one too)
                frame[2] += 1
                continue
            n = done.get(id(x))
            if n is not None:  # a shared reference: a walk goes through it all again
                shared += 0 if _like_a_leaf(x) else n
                if shared > shared_limit:
                    raise GraphBoundError(where, f"object graph expands past "
                                          f"{shared_limit:,} nodes through shared references "
                                          "(one dict or list named again and again)")
                frame[2] += n
            elif id(x) in open_:
                raise GraphBoundError(where, "object graph contains itself (a dict or list "
                                      "inside its own contents)")
            elif (n := enter(x, len(stack))) is not None:
                frame[2] += n
            else:
                break  # walk x first; this frame's iterator resumes after it
        else:
            stack.pop()
            open_.discard(id(frame[0]))
            done[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
    return done[id(obj)]


# --------------------------------------------------------------------------- DCP metadata

def _path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise UnsafeInputError(None, "path with unexpected arguments")
    return "/".join(parts)


def _enum_value(value=None, *args):
    return value


def _layout(name=None, *args):
    return TorchName(str(name))


def dcp_allowed_globals(dtype_names) -> dict[tuple[str, str], object]:
    """The globals a DCP ``.metadata`` pickle may name, mapped to inert stand-ins."""
    allowed: dict[tuple[str, str], object] = {}
    md = "torch.distributed.checkpoint.metadata"
    for cls in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "StorageMeta"):
        allowed[(md, cls)] = record_class(cls, state=cls == "TensorProperties")
    allowed[("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")] = (
        allowed[(md, "TensorProperties")])
    allowed[("torch.distributed._shard.metadata", "ShardMetadata")] = record_class("ShardMetadata")
    allowed[(md, "_MEM_FORMAT_ENCODING")] = _enum_value
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = record_class(
        "_StorageInfo")
    # torch.Size(list) -> a plain tuple, built in C (a 10,000-rank .metadata has about a
    # million); what it holds is checked where it is used, like any other field
    allowed[("torch", "Size")] = tuple
    allowed[("torch.serialization", "_get_layout")] = _layout
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", cls)] = _path
    allowed[("collections", "OrderedDict")] = dict
    for name in dtype_names:
        allowed[("torch", name)] = TorchName(name)
    return allowed


def planner_globals() -> dict[tuple[str, str], object]:
    """The DCP planner classes Megatron-core pickles into ``.metadata`` (its
    ``all_local_plans``: each rank's ``SavePlan`` of ``WriteItem`` s), as inert stand-ins;
    no DCP reader needs them, only an unpickler that does not choke on them."""
    pl = "torch.distributed.checkpoint.planner"
    allowed: dict[tuple[str, str], object] = {
        (pl, cls): record_class(cls) for cls in ("SavePlan", "WriteItem", "TensorWriteData")}
    allowed[(pl, "WriteItemType")] = _enum_value
    return allowed

# --------------------------------------------------------------------------- weights-only scan

#: Globals torch's ``weights_only`` loader admits by default (torch 2.x
#: ``_weights_only_unpickler._get_allowed_globals``), as (module, name) predicates.
_WO_EXACT = {
    ("collections", "OrderedDict"), ("collections", "Counter"), ("torch", "Size"),
    ("torch", "Tensor"), ("torch", "device"), ("torch.nn.parameter", "Parameter"),
    ("torch.serialization", "_get_layout"), ("_codecs", "encode"), ("builtins", "bytearray"),
    ("builtins", "set"), ("builtins", "complex"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
}
_WO_TORCH_MODULES = ("torch", "torch.cuda", "torch.cuda.sparse", "torch.sparse")
#: numpy arrays and scalars are data: rebuilding one makes an array from a dtype name and
#: bytes, and runs nothing (an object array's items are in the same pickle, scanned the
#: same way). torch refuses them by default and offers ``safe_globals`` for exactly these;
#: ckptctl admits them (:func:`numpy_globals`), since every RNG state Megatron and
#: DeepSpeed save holds numpy's.
NUMPY_DATA = {(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray")
              for n in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype")}


def numpy_globals() -> list:
    """The numpy objects of :data:`NUMPY_DATA` (and numpy 2's dtype classes), for
    ``torch.serialization.safe_globals`` around a weights-only ``torch.load``.

    >>> import numpy as np; np.ndarray in numpy_globals()
    True
    """
    import importlib

    import numpy as np

    out = [np.ndarray, np.dtype]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        out += [m._reconstruct, m.scalar]
        break
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")
                and isinstance(getattr(dtypes, n), type)]
    return out


def _weights_only_allowed(module: str, name: str) -> bool:
    if (module, name) in _WO_EXACT or (module, name) in NUMPY_DATA:
        return True
    if module == "numpy.dtypes":
        return name.endswith("DType")
    if module == "torch._utils":
        return name.startswith("_rebuild_")
    if module in _WO_TORCH_MODULES:
        return (name.endswith(("Tensor", "Storage")) or name.startswith(("float", "int", "uint",
                "bfloat", "complex", "bool", "bits", "qint", "quint", "per_"))
                or name in ("half", "double", "long", "short", "cfloat", "cdouble", "strided",
                            "sparse_coo", "channels_last", "contiguous_format"))
    return False


class _Inert:
    """Stands for any allowed global while scanning: accepts every call and state."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass


_SAFE_BUILTINS = {("collections", "OrderedDict"): dict, ("collections", "Counter"): dict,
                  ("builtins", "set"): set, ("builtins", "bytearray"): bytearray,
                  ("builtins", "complex"): complex, ("_codecs", "encode"): lambda *a: b""}


#: plain-record classes a format reader may admit for one entry (``ObjectEntry.admitted``):
#: a pickle rebuilds them by setting attributes, nothing of theirs runs
ADMITTABLE = {"argparse.Namespace": ("argparse", "Namespace")}


def admitted_classes(names) -> list:
    """The classes of :data:`ADMITTABLE` names, for ``torch.serialization.safe_globals``.

    >>> admitted_classes(("argparse.Namespace",))
    [<class 'argparse.Namespace'>]
    """
    import importlib

    return [getattr(importlib.import_module(ADMITTABLE[n][0]), ADMITTABLE[n][1]) for n in names]


def scan_weights_only(data: bytes, *, where: str = "", admitted=()) -> None:
    """Refuse (UnsafeInputError) a pickle naming any global that torch's ``weights_only``
    loader would refuse; nothing in it runs (every allowed global is an inert stand-in).
    The error's ``global_name`` is the refused global (``posix.system``). ``admitted``:
    :data:`ADMITTABLE` names it may also name.

    >>> import pickle, collections
    >>> scan_weights_only(pickle.dumps(collections.OrderedDict(a=1)))
    >>> scan_weights_only(pickle.dumps(print))
    Traceback (most recent call last):
    ckptctl.errors.UnsafeInputError: pickle names builtins.print, which the weights-only loader refuses
    """
    refused: list[str] = []

    class _Scanner(pickle.Unpickler):
        def find_class(self, module, name):
            if _weights_only_allowed(module, name):
                return _SAFE_BUILTINS.get((module, name)) or _Inert()
            if f"{module}.{name}" in admitted and f"{module}.{name}" in ADMITTABLE:
                return record_class(name)  # a class: NEWOBJ needs one
            refused.append(f"{module}.{name}")
            raise UnsafeInputError(None, f"pickle names {module}.{name}, which the "
                                   "weights-only loader refuses")

        def persistent_load(self, pid):
            return _Inert()

    try:
        _Scanner(io.BytesIO(data)).load()
    except UnsafeInputError as e:
        err = UnsafeInputError(where or None, e.message)
        err.global_name = refused[-1] if refused else None
        raise err from None
    except RecursionError:
        raise FormatError(where or None, "pickle nests too deeply") from None
    except Exception as e:  # noqa: BLE001 - malformed pickle
        raise FormatError(where or None, f"malformed pickle ({type(e).__name__})") from None
