"""``inspect``: what is in a checkpoint, from its metadata alone.

>>> r = inspect("tests/data/some-ckpt")                     # doctest: +SKIP
>>> r.format, r.num_params, r.closure["optim"]              # doctest: +SKIP
('dcp', 1234567, True)
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field

from ..errors import UsageError, shorten
from ..formats import open_checkpoint, read_object
from ..formats.composite import OPAQUE
from ..model import Checkpoint, layout_summary, natural_key
from .closure import OPTIONAL_PARTS, PARTS, classify, is_parameter
from .vocabulary import counted_files


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    num_chunks: int
    bytes: int
    part: str
    sharded_dims: list[int]


@dataclass
class ObjectInfo:
    name: str
    part: str
    bytes: int | None
    type: str | None = None
    value: object = None


@dataclass
class TreeNode:
    prefix: str
    num_tensors: int
    num_params: int
    bytes: int


@dataclass
class InspectResult:
    url: str
    format: str
    step: int | None
    step_source: str | None
    #: the checkpoint's files as stored, ckptctl's markers aside (a pack: its own), as
    #: every verb counts them (:func:`~ckptctl.catalog.vocabulary.counted_files`)
    bytes: int
    num_files: int
    num_tensors: int
    num_objects: int
    num_params: int
    tensor_bytes: int
    num_buffers: int
    dtypes: dict[str, dict]
    layout: dict
    closure: dict[str, bool]
    sealed: bool
    #: the checkpoint's id where it is sealed: its manifest's (a pack: the id of the
    #: checkpoint it holds, as ``pack``/``unpack``/``diff`` say); None when not sealed
    manifest_id: str | None = None
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[ObjectInfo] = field(default_factory=list)
    tree: list[TreeNode] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    #: a pack read as the checkpoint it holds: ratio, base id, chain depth, chunks by mode
    pack: dict | None = None
    #: what another framework's layout is (``DeepSpeed ZeRO-3, 2 ranks, bf16``), and what
    #: its reader could not map (a tied name whose target the files do not record)
    origin: str | None = None
    notes: list[str] = field(default_factory=list)
    #: DeepSpeed ZeRO: each rank's view (its file; per param group the flat partition's
    #: elements and each parameter's [start, count] in it)
    ranks: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _tree(tensors: list[TensorInfo], params: set[str]) -> list[TreeNode]:
    """Totals for every module prefix (``layers``, ``layers.0``, ``layers.0.attention`` ...)."""
    acc: dict[str, list[int]] = {}
    for t in tensors:
        numel = 1
        for s in t.shape:
            numel *= s
        parts = t.name.split(".")
        for i in range(1, len(parts)):
            node = acc.setdefault(".".join(parts[:i]), [0, 0, 0])
            node[0] += 1
            node[1] += numel if t.name in params else 0
            node[2] += t.bytes
    return [TreeNode(p, *acc[p]) for p in sorted(acc, key=natural_key)]


def summarize(ck: Checkpoint, *, filter: str | None = None, show_objects: bool = False,
              tree: bool = False) -> InspectResult:
    """Build the inspect report of an opened checkpoint."""
    def keep(name: str) -> bool:
        return filter is None or fnmatch.fnmatchcase(name, filter)

    tensors = [TensorInfo(t.name, t.dtype.name, list(t.shape), len(t.chunks), t.nbytes,
                          classify(t.name), list(t.sharded_dims()))
               for t in ck.tensors.values()]
    dtypes: dict[str, dict] = {}
    num_params = num_buffers = 0
    params: set[str] = set()
    aliases = ck.info.get("aliases") or {}  # tied weights: two names, one storage
    buffers = ck.info.get("buffers") or set()  # what the format records as buffers
    for ti, t in zip(tensors, ck.tensors.values()):
        d = dtypes.setdefault(ti.dtype, {"tensors": 0, "elements": 0, "bytes": 0})
        d["tensors"] += 1
        d["elements"] += t.numel
        d["bytes"] += t.nbytes
        if ti.part != "model" or t.name in aliases:
            continue
        if is_parameter(t.name, t.dtype) and t.name not in buffers:
            num_params += t.numel
            params.add(t.name)
        else:
            num_buffers += t.numel
    closure = {p: False for p in PARTS if p not in OPTIONAL_PARTS}
    for name in list(ck.tensors) + list(ck.objects):
        closure[classify(name)] = True
    if ck.step is not None and ck.info.get("step_source") in ("manifest", "entry"):
        closure["step"] = True
    objects = []
    for o in ck.objects.values():
        if not keep(o.name):
            continue
        info = ObjectInfo(o.name, classify(o.name), o.extent.length if o.extent and
                          o.extent.encoding != "torch_save" else None, o.type_name)
        if o.extent is not None and o.extent.encoding == OPAQUE:
            info.type = o.type_name  # never unpickled: its size is all we say
        elif show_objects:
            try:
                info.value = _jsonable(read_object(ck, o))
                info.type = info.type or type(info.value).__name__
            except Exception as e:  # noqa: BLE001 - shown, not fatal: objects are opaque
                info.value = None
                info.type = info.type or f"opaque ({getattr(e, 'message', type(e).__name__)})"
        objects.append(info)
    objects.sort(key=lambda o: natural_key(o.name))
    shown = sorted((t for t in tensors if keep(t.name)), key=lambda t: natural_key(t.name))
    lay = layout_summary(ck)
    if ck.info.get("origin"):  # flat partitions cut tensors anywhere: no mesh to guess
        lay.mesh_guess = None
    meta = ck.info.get("metadata") or {}
    man = ck.info.get("manifest")
    counted = counted_files(ck.files, man, store=ck.store)
    return InspectResult(
        url=ck.root, format=ck.format, step=ck.step, step_source=ck.info.get("step_source"),
        bytes=sum(counted.values()), num_files=len(counted), num_tensors=len(ck.tensors),
        num_objects=len(ck.objects), num_params=num_params,
        tensor_bytes=sum(t.nbytes for t in ck.tensors.values()), num_buffers=num_buffers,
        dtypes=dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        layout=asdict(lay), closure=closure, sealed=man is not None,
        manifest_id=man.checkpoint_id if man is not None else None,
        tensors=shown, objects=objects, tree=_tree(shown, params) if tree else [], metadata=meta,
        pack=ck.info.get("pack"), origin=ck.info.get("origin"), notes=list(ck.info.get("notes", [])),
        ranks=list((ck.info.get("deepspeed") or {}).get("ranks", [])))


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return shorten(repr(v), 200)


def inspect(url: str, storage_options: dict | None = None, *, filter: str | None = None,
            show_objects: bool = False, tree: bool = False,
            allow_incomplete: bool = False) -> InspectResult:
    """Open ``url`` (metadata only) and summarise it; a folder a ckptctl writer holds is
    refused unless ``allow_incomplete``.

    >>> inspect("ckpt/step-20").format                       # doctest: +SKIP
    'dcp'
    """
    ck = open_checkpoint(url, storage_options, allow_incomplete=allow_incomplete)
    r = summarize(ck, filter=filter, show_objects=show_objects, tree=tree)
    if filter is not None and not r.tensors and not r.objects:
        raise UsageError(f"--filter {filter!r} matches no entry (a glob over whole names; "
                         f"entries: {few_names(list(ck.tensors) + list(ck.objects))})",
                         ck.root)
    return r


def few_names(names, n: int = 3) -> str:
    """The first ``n`` names, sorted, for an error message.

    >>> few_names(["b", "a", "c", "d"])
    'a, b, c, ... (4 in all)'
    """
    names = sorted(names)
    shown = ", ".join(names[:n])
    return shown + (f", ... ({len(names)} in all)" if len(names) > n else "") if names else "none"
