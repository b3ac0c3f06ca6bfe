"""Megatron legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` per tensor- and
pipeline-parallel rank, ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``, merged into the one
logical model without Megatron and without torch.

The model's shards join by rules that say how each parameter is split (:data:`GPT_RULES`,
Megatron-core's GPT/Llama naming, the layers of ``tensor_parallel/layers.py``):

- ``column``: split on dim 0 (``linear_qkv``: the fused QKV kept as stored, grouped per
  query group), ``vocab``: split on dim 0, the padded vocabulary kept whole (its padding
  rows are the model's: a resume needs them; a note gives the true vocabulary size);
- ``row``: split on dim 1 (``linear_proj``, ``linear_fc2`` weights);
- ``swiglu``: ``linear_fc1`` of a gated MLP: rank t holds ``cat(gate_t, up_t)``, so its
  two halves go to ``gate`` rows ``t`` and ``up`` rows ``t`` of the logical ``[gate; up]``;
- ``replicated``: layer norms, position embeddings, row-parallel biases: read from TP rank
  0, every other rank's copy compared byte for byte;
- ``extra``: ``_extra_state`` (Transformer Engine's bytes, or None): an object, TP rank 0's.

Pipeline stages number their layers from 0; stage ``p`` of ``PP`` holds global layers
``p * L/PP ...`` (``args.num_layers``), renumbered here. What no rule names, and uneven or
virtual pipeline stages are refused by name. The optimizer state (indexed by Megatron's
parameter order, which the file does not name) and the RNG state stay each rank's own:
``optimizer.mp_rank_TT_PPP.*``, ``rng_state.mp_rank_TT_PPP.*``; their numpy parts are
opaque (never rebuilt). The distributed optimizer's ``mp_rank_TT[_PPP]/distrib_optim.pt``
(flat fp32 buckets of ``param``/``exp_avg``/``exp_avg_sq`` in the grad buffer's order, which
the checkpoint does not record) is checked to be one and kept as one opaque object per
rank, ``distrib_optim.mp_rank_TT_PPP``: copies carry it, a conversion refuses it by name.
Every rank folder must hold one when any does (or ``args.use_distributed_optimizer`` is set
and the rank files hold optimizer state), and its ``numel_unpadded`` must fit its flat
buffers and its rank's parameters; the rank folders must make up the TP x PP grid the rank
files' ``args`` record. What is missing is refused by name (``MISSING_FILE``).

>>> rank_of("mp_rank_01_002/model_optim_rng.pt"), rank_of("mp_rank_03/model_optim_rng.pt")
((1, 2), (3, 0))
"""
from __future__ import annotations

import math
import posixpath
import re

from ..errors import (FormatError, ProblemCode, UnsafeInputError, UnsupportedFormatError,
                      layout_refused)
from ..model import DTYPES, Checkpoint, Chunk, Extent, ObjectEntry, TensorEntry
from ..storage import Store
from .safe_pickle import record_class
from .torchfile import EntryBuilder, TorchFile
from .torchzip import StoredTensor

RANK_FILE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?/model_optim_rng\.pt$")
DISTRIB_OPTIM = "distrib_optim.pt"  # beside a rank file: the distributed optimizer's state
#: (pattern on a parameter's name within ``model``, how it is split); first match wins
GPT_RULES: list[tuple[re.Pattern, str]] = [(re.compile(p), kind) for p, kind in [
    (r"_extra_state$", "extra"),
    (r"(^|\.)word_embeddings\.weight$", "vocab"),
    (r"(^|\.)output_layer\.weight$", "vocab"),
    (r"\.linear_fc1\.(weight|bias)$", "fc1"),  # column, or swiglu when args.swiglu
    (r"\.linear_qkv\.(weight|bias)$", "column"),
    (r"\.(linear_proj|linear_fc2)\.weight$", "row"),
    (r"\.(linear_proj|linear_fc2)\.bias$", "replicated"),
    (r"(layer_norm_(weight|bias)|layernorm\.(weight|bias))$", "replicated"),
    (r"(^|\.)position_embeddings\.weight$", "replicated"),
]]
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
OPAQUE = "opaque"  # the composite reader's encoding of a never-unpickled object


class _Opaque:
    """What a pickle builds from numpy (an RNG state's arrays): kept, never rebuilt."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _Bytes:
    """``io.BytesIO`` (Transformer Engine's ``_extra_state``): its contents."""

    def __setstate__(self, state):
        self.data = bytes(state[0]) if isinstance(state, tuple) and state else b""


def _opaque(*args):
    return _Opaque()


def _encode(text, encoding="latin1"):
    return text.encode(encoding) if isinstance(text, str) else bytes(text)


#: the classes a legacy rank file pickles beside tensors and plain values
GLOBALS = {("argparse", "Namespace"): record_class("Namespace"), ("_io", "BytesIO"): _Bytes,
           ("_codecs", "encode"): _encode}
for _mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
    GLOBALS[(_mod, "_reconstruct")] = _opaque
    GLOBALS[(_mod, "scalar")] = _opaque
for _mod in ("numpy", "numpy.dtypes"):
    GLOBALS[(_mod, "ndarray")] = _Opaque
    GLOBALS[(_mod, "dtype")] = _Opaque
    GLOBALS[(_mod, "UInt32DType")] = _Opaque


def rank_of(rel: str) -> tuple[int, int] | None:
    """(tp, pp) of a rank file's path in an iteration folder, or None."""
    m = RANK_FILE.match(rel)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def rank_file(tp: int, pp: int, stages: int) -> str:
    """The rank file of TP rank ``tp`` and stage ``pp`` of ``stages`` (Megatron's
    ``get_checkpoint_name``: no stage part without pipeline parallelism).

    >>> rank_file(1, 0, 1), rank_file(1, 1, 2)
    ('mp_rank_01/model_optim_rng.pt', 'mp_rank_01_001/model_optim_rng.pt')
    """
    return f"mp_rank_{tp:02d}/model_optim_rng.pt" if stages == 1 else \
        f"mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt"


def is_legacy(files: dict[str, int]) -> bool:
    """An iteration folder of rank files (and nothing but ckptctl's own beside them)."""
    return any(RANK_FILE.match(f) for f in files)


def legacy_files(files: dict[str, int]) -> set[str]:
    """The files of ``files`` (an iteration folder's listing) that the legacy layout names:
    each rank folder's ``model_optim_rng.pt`` and the ``distrib_optim.pt`` beside it (what
    the iteration owns); nothing else in a rank folder.

    >>> sorted(legacy_files({"mp_rank_00/model_optim_rng.pt": 9, "mp_rank_00/distrib_optim.pt": 9,
    ...                      "mp_rank_00/NOTES.md": 1, "mp_rank_01/distrib_optim.pt": 9}))
    ['mp_rank_00/distrib_optim.pt', 'mp_rank_00/model_optim_rng.pt']
    """
    ranks = {f for f in files if RANK_FILE.match(f)}
    return ranks | {f for f in files if f.endswith("/" + DISTRIB_OPTIM)
                    and posixpath.dirname(f) + "/model_optim_rng.pt" in ranks}


def _refuse(where: str, what: str) -> UnsupportedFormatError:
    return layout_refused(where, f'Megatron legacy {what}', "Megatron legacy")


def _has_opaque(v) -> bool:
    if isinstance(v, _Opaque):
        return True
    if isinstance(v, dict):
        return any(_has_opaque(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_opaque(x) for x in v)
    return False


def _value(v):
    """A parsed value with ``_Bytes`` as plain bytes (containers walked)."""
    if isinstance(v, _Bytes):
        return getattr(v, "data", b"")
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_value(x) for x in v)
    return v


def read_legacy(store: Store, files: dict[str, int]) -> Checkpoint:
    """Read an iteration folder of legacy rank files into one logical model (the rank
    files' pickles only: a few small reads each; tensor bytes stay where they are).

    >>> ck = read_legacy(open_store("run/iter_0000020"), files)          # doctest: +SKIP
    >>> ck.tensors["model.decoder.layers.3.mlp.linear_fc2.weight"].shape  # doctest: +SKIP
    (16, 32)
    """
    where = store.url
    ranks = {rank_of(f): f for f in files if rank_of(f)}
    tps = sorted({t for t, _ in ranks})
    pps = sorted({p for _, p in ranks})
    tp, pp = len(tps), len(pps)
    if tps != list(range(tp)) or pps != list(range(pp)) or len(ranks) != tp * pp:
        missing = [f"mp_rank_{t:02d}_{p:03d}" for t in range(max(tps) + 1)
                   for p in range(max(pps) + 1) if (t, p) not in ranks]
        raise FormatError(where, f"rank files missing: {', '.join(missing[:4]) or '?'}",
                          code=ProblemCode.MISSING_FILE)
    loaded = {r: TorchFile(store, f, files[f], GLOBALS) for r, f in sorted(ranks.items())}
    _check_degrees(where, loaded, tp, pp)
    for r, tf in loaded.items():
        if not isinstance(tf.obj, dict) or not isinstance(tf.obj.get("model"), dict):
            raise _refuse(tf.where, "a rank file without one 'model' state dict (virtual "
                          "pipeline stages: model0, model1, ...)" if isinstance(tf.obj, dict)
                          and "model0" in tf.obj else "a rank file without a 'model' dict")
    first = loaded[(0, 0)]
    args = first.obj.get("args")
    argv = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    layers = argv.get("num_layers")
    if pp > 1 and (not isinstance(layers, int) or layers % pp):
        raise _refuse(first.where, f"pipeline stages of uneven size ({layers} layers over "
                      f"{pp} stages)")
    per_stage = layers // pp if pp > 1 else None
    swiglu = bool(argv.get("swiglu"))
    ck = Checkpoint(root=store.url, format="megatron-legacy", store=store, files=dict(files))
    ck.info["megatron"] = {"layout": "legacy", "tp": tp, "pp": pp}
    ck.info["zip_files"] = [tf.rel for tf in loaded.values()]
    b = EntryBuilder(ck, default_file=first.rel)
    pieces: dict[str, list] = {}  # global name -> [(tp, kind, stored, tf)]
    for (t, p), tf in loaded.items():
        for name, v in tf.obj["model"].items():
            if not isinstance(name, str):
                raise FormatError(tf.where, f"model key {name!r} is not a string")
            m = _LAYER.match(name)
            if m and pp > 1:
                local = int(m.group(2))
                if local >= per_stage:
                    raise FormatError(tf.where, f"{name}: stage {p} holds layers 0..{per_stage - 1}")
                name = f"{m.group(1)}{p * per_stage + local}{m.group(3)}"
            pieces.setdefault(name, []).append((t, p, v, tf))
    for name, got in pieces.items():
        _merge(b, f"model.{name}", name, got, tp, swiglu)
    for key, value in first.obj.items():
        if key in ("model", "optimizer", "rng_state"):
            continue
        _objects(b, key, value, first)
    beside = {f"{tf.rel.rsplit('/', 1)[0]}/{DISTRIB_OPTIM}" for tf in loaded.values()}
    stray = sorted(f for f in files if f.rsplit("/", 1)[-1] == DISTRIB_OPTIM and f not in beside)
    if stray:
        raise FormatError(store.display(stray[0]), f"{DISTRIB_OPTIM} without a rank file "
                          "beside it")
    buckets = 0
    expected = distrib_optim_expected(files, argv, [tf.obj for tf in loaded.values()])
    for (t, p), tf in loaded.items():
        tag = f"mp_rank_{t:02d}_{p:03d}" if pp > 1 else f"mp_rank_{t:02d}"
        for key in ("optimizer", "rng_state"):
            if tf.obj.get(key) is not None:
                _objects(b, f"{key}.{tag}", tf.obj[key], tf)
        rel = f"{tf.rel.rsplit('/', 1)[0]}/{DISTRIB_OPTIM}"
        if rel in files:
            buckets += _distrib_optim(b, f"distrib_optim.{tag}", store, rel, files[rel],
                                      _param_numel(tf))
        elif expected:
            raise FormatError(store.display(rel), f"missing ({expected}: every rank keeps "
                              "its share of the distributed optimizer's state in its own)",
                              code=ProblemCode.MISSING_FILE)
    vocab = argv.get("vocab_size")
    notes = ck.info.setdefault("notes", [])
    notes.append(f"merged from TP {tp} x PP {pp} rank files by the GPT rules "
                 "(column/vocab dim 0, row dim 1, SwiGLU fc1 as [gate; up], replicated "
                 "copies compared)")
    if isinstance(vocab, int):
        notes.append(f"embeddings keep the padded vocabulary ({argv.get('padded_vocab_size')} "
                     f"rows; the tokenizer's is {vocab})")
    if any(k.startswith("optimizer.") for k in ck.tensors):
        notes.append("optimizer state stays per rank (optimizer.mp_rank_*): it is indexed by "
                     "Megatron's parameter order, which the files do not name")
    if buckets:
        notes.append(f"the distributed optimizer's state ({DISTRIB_OPTIM} per rank, "
                     f"{buckets:,} fp32 elements each of param, exp_avg, exp_avg_sq in all) "
                     "is carried as is (distrib_optim.mp_rank_*): its buckets' parameter "
                     "order is not in the checkpoint, so no conversion rebuilds it")
        ck.info["opaque_reason"] = {n: DISTRIB_REASON for n in ck.objects
                                    if n.startswith("distrib_optim.")}
    ck.info["origin"] = f"Megatron legacy, TP {tp} x PP {pp}"
    it = first.obj.get("iteration")
    if isinstance(it, int) and not isinstance(it, bool):
        ck.step = it
    return ck


def _check_degrees(where: str, loaded: dict, tp: int, pp: int) -> None:
    """The rank folders against the parallel degrees the rank files' ``args`` record
    (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``): a whole rank
    folder gone leaves a smaller grid that would read as a checkpoint of its own."""
    tf = loaded[(0, 0)]
    args = tf.obj.get("args") if isinstance(tf.obj, dict) else None
    argv = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    want = (argv.get("tensor_model_parallel_size"), argv.get("pipeline_model_parallel_size"))
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in want):
        return  # no degrees recorded: the folder names are all there is
    if want != (tp, pp):
        missing = [posixpath.dirname(rank_file(a, c, want[1])) for a in range(want[0])
                   for c in range(want[1]) if (a, c) not in loaded]
        raise FormatError(where, f"{tf.rel}'s args say TP {want[0]} x PP {want[1]}, the "
                          f"folder holds TP {tp} x PP {pp}: rank files missing: "
                          f"{', '.join(missing[:4]) or '?'}", code=ProblemCode.MISSING_FILE)


def distrib_optim_expected(files: dict[str, int], argv: dict, objs: list) -> str | None:
    """Why each rank folder of an iteration must hold a ``distrib_optim.pt`` (any does, or
    the run used the distributed optimizer and saved optimizer state), or None.

    >>> distrib_optim_expected({"mp_rank_00/distrib_optim.pt": 9}, {}, [{}])
    'mp_rank_00/distrib_optim.pt is there'
    >>> distrib_optim_expected({}, {"use_distributed_optimizer": True}, [{"optimizer": {}}])
    'args.use_distributed_optimizer is set and the rank files hold optimizer state'
    >>> distrib_optim_expected({}, {"use_distributed_optimizer": True}, [{}]) is None
    True
    """
    have = sorted(f for f in files if f.endswith("/" + DISTRIB_OPTIM)
                  and rank_of(posixpath.dirname(f) + "/model_optim_rng.pt"))
    if have:
        return f"{have[0]} is there"
    if argv.get("use_distributed_optimizer") is True and any(
            isinstance(o, dict) and o.get("optimizer") is not None for o in objs):
        return "args.use_distributed_optimizer is set and the rank files hold optimizer state"
    return None


def _param_numel(tf) -> int:
    """Elements of the tensors of one rank file's ``model``: what its share of the
    distributed optimizer's buffers can hold at most (frozen parameters have none)."""
    return sum(v.numel for v in tf.obj["model"].values() if isinstance(v, StoredTensor))


DISTRIB_REASON = ("Megatron's distributed-optimizer buckets, whose parameter order the "
                  "checkpoint does not record; leave them out with --only model or "
                  "--drop 'distrib_optim.*'")


def _distrib_optim(b: EntryBuilder, name: str, store: Store, rel: str, size: int,
                   limit: int) -> int:
    """Check ``rel`` is a ``distrib_optim.pt`` (``{"buckets_coalesced": True, <buffer>:
    {<dtype>: {"param", "exp_avg", ...: flat tensor, "numel_unpadded": int}}}``) whose
    ``numel_unpadded`` fit its flat tensors and, summed, the ``limit`` elements of its
    rank's parameters; add it as one opaque object; returns its element count (per state
    key)."""
    tf = TorchFile(store, rel, size, GLOBALS)
    obj = tf.obj
    if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
        raise FormatError(tf.where, "not Megatron's distributed-optimizer state "
                          "(no buckets_coalesced: the per-bucket layout of an older release "
                          "is not read)")
    numel = 0
    for key, per_dtype in obj.items():
        if key == "buckets_coalesced":
            continue
        if not isinstance(key, int) or not isinstance(per_dtype, dict):
            raise FormatError(tf.where, f"distributed-optimizer buffer {key!r} is not "
                              "{dtype: tensors}")
        for state in per_dtype.values():
            numel += _bucket_numel(tf.where, key, state)
    if numel > limit:
        raise FormatError(tf.where, f"numel_unpadded sums to {numel:,} elements, the rank's "
                          f"parameters hold {limit:,}")
    b.name_free(name, tf.where)
    b.ck.objects[name] = ObjectEntry(name, Extent(rel, 0, 0, OPAQUE), type_name=DISTRIB_OPTIM)
    b.ck.info["zip_files"].append(rel)  # verify --level full checks its CRCs
    return numel


def _bucket_numel(where: str, key, state) -> int:
    """One buffer's ``numel_unpadded``, bounded by its flat tensors: the ``param`` buffer
    holds at least that many elements, each other state (``exp_avg``...) as many as it."""
    n = state.get("numel_unpadded") if isinstance(state, dict) else None
    param = state.get("param") if isinstance(state, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or not isinstance(param, StoredTensor):
        raise FormatError(where, f"distributed-optimizer buffer {key}: no flat param tensor "
                          "and numel_unpadded")
    if not 0 <= n <= param.numel:
        raise UnsafeInputError(where, f"distributed-optimizer buffer {key}: numel_unpadded "
                               f"{n:,} does not fit its param buffer of {param.numel:,} elements")
    for k, v in state.items():
        if isinstance(v, StoredTensor) and v.numel != param.numel:
            raise FormatError(where, f"distributed-optimizer buffer {key}: {k} holds "
                              f"{v.numel:,} elements, param {param.numel:,}")
    return n


def _objects(b: EntryBuilder, prefix: str, value, tf) -> None:
    """Entries of a nested value; a part that holds numpy objects becomes one opaque
    object (kept, never rebuilt: a conversion refuses it unless dropped)."""
    if _has_opaque(value) and not isinstance(value, dict):
        b.name_free(prefix, tf.where)
        b.ck.objects[prefix] = ObjectEntry(prefix, Extent(tf.rel, 0, 0, OPAQUE),
                                           type_name=type(value).__name__)
        return
    if isinstance(value, dict) and _has_opaque(value):
        for k, v in value.items():
            _objects(b, f"{prefix}.{k}", v, tf)
        return
    if isinstance(value, (list, tuple)) and any(isinstance(x, dict) for x in value):
        for i, v in enumerate(value):
            _objects(b, f"{prefix}.{i}", v, tf)
        return
    b.objects(prefix, _value(value), tf)


def rule_of(name: str, swiglu: bool) -> str | None:
    """How Megatron splits parameter ``name`` over TP ranks (:data:`GPT_RULES`; ``fc1`` is
    ``swiglu`` in a gated MLP), or None when no rule names it.

    >>> rule_of("decoder.layers.0.mlp.linear_fc1.weight", True), rule_of("x.w", False)
    ('swiglu', None)
    """
    for pat, kind in GPT_RULES:
        if pat.search(name):
            return ("swiglu" if swiglu else "column") if kind == "fc1" else kind
    return None


def _merge(b: EntryBuilder, entry: str, name: str, got: list, tp: int, swiglu: bool) -> None:
    """One logical entry from the TP ranks' pieces of one (global) parameter."""
    got.sort(key=lambda x: x[0])
    tf0 = got[0][3]
    kind = rule_of(name, swiglu)
    if kind == "extra" or not isinstance(got[0][2], StoredTensor):
        if kind not in ("extra", None) and got[0][2] is not None:
            raise FormatError(tf0.where, f"model.{name}: {type(got[0][2]).__name__}, not a tensor")
        b.objects(entry, _value(got[0][2]), tf0)
        return
    if kind is None:
        raise _refuse(tf0.where, f"parameter {name}: no rule says how Megatron splits it "
                      "over tensor-parallel ranks")
    if [t for t, *_ in got] != list(range(tp)):
        raise FormatError(tf0.where, f"{name}: held by TP ranks {[t for t, *_ in got]}, "
                          f"not all {tp}")
    sts = [st for _, _, st, _ in got]
    if any(not isinstance(st, StoredTensor) for st in sts) or len({st.size for st in sts}) != 1 \
            or len({st.dtype for st in sts}) != 1:
        raise FormatError(tf0.where, f"{name}: the TP ranks hold different shapes or dtypes")
    shape, dtype = sts[0].size, sts[0].dtype
    if kind == "replicated" or tp == 1:
        want = _bytes(got[0])
        for t, p, st, tf in got[1:]:
            if _bytes((t, p, st, tf)) != want:
                raise FormatError(tf.where, f"{name}: replicated, but TP rank {t}'s copy "
                                  "differs from TP rank 0's")
        b.stored(entry, tf0, sts[0])
        return
    dim = 1 if kind == "row" else 0
    if len(shape) <= dim:
        raise FormatError(tf0.where, f"{name}: {len(shape)}-dim, split on dim {dim}?")
    full = list(shape)
    full[dim] *= tp
    b.name_free(entry, tf0.where)
    t_entry = TensorEntry(entry, DTYPES[dtype], tuple(full), [])
    for t, p, st, tf in got:
        rows = shape[0]
        if kind == "swiglu":
            if rows % 2:
                raise FormatError(tf.where, f"{name}: SwiGLU fc1 with an odd row count")
            half = rows // 2
            for part in (0, 1):  # gate rows, then up rows
                n = half * _inner(shape)
                ext = tf.extent(st, name, start=part * n, count=n)
                t_entry.chunks.append(Chunk((part * half * tp + t * half,)
                                            + (0,) * (len(shape) - 1),
                                            (half,) + tuple(shape[1:]), ext))
        else:
            offs = [0] * len(shape)
            offs[dim] = t * shape[dim]
            t_entry.chunks.append(Chunk(tuple(offs), tuple(shape), tf.extent(st, name)))
    b.ck.tensors[entry] = t_entry


def _inner(shape) -> int:
    return math.prod(shape[1:])


def _bytes(piece) -> bytes:
    t, p, st, tf = piece
    ext = tf.extent(st, "")
    return tf.store.read_range(ext.file, ext.offset, ext.offset + ext.length)
