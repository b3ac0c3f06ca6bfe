"""DeepSpeed AutoTP: where each tensor-parallel rank's shard of a parameter sits in the
logical tensor, read from the affine map DeepSpeed records in every model-states file
(``universal_checkpoint_info["affine_map"]``, format version 1), and the join of the TP
ranks' views into one logical view.

A map gives, per TP rank, the pieces of the shard: a piece's ``source`` (offset and strides
in the logical tensor), its ``dest`` (offset and strides in the shard), its shape, the
ranks holding it (``locations``) and the factor it is held by (``scale``). ckptctl reads the
two layouts AutoTP's training path writes for plain linear layers, where every shard is one
piece in row-major order: a contiguous split (column-parallel: dim 0; row-parallel: dim 1)
and a replicated parameter (every rank holds all of it). Fused sub-parameters (several
pieces per shard), block-gathered layouts and scaled pieces (a row-parallel bias held
divided by the TP degree) are refused by name: rebuilding those is either strided or not
exact in floating point.

>>> m = {"logical_shape": [4, 3], "ranks": {
...     0: {"shard_shape": [2, 3], "pieces": [{"shape": [2, 3], "source": [0, [3, 1]],
...                                            "dest": [0, [3, 1]], "locations": [0]}]},
...     1: {"shard_shape": [2, 3], "pieces": [{"shape": [2, 3], "source": [6, [3, 1]],
...                                            "dest": [0, [3, 1]], "locations": [1]}]}}}
>>> [p.offsets for p in placements("w", m, 2, "x").values()]
[(0, 0), (2, 0)]
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..boxes import intersect
from ..errors import FormatError, UnsupportedFormatError, layout_refused
from ..model import Checkpoint, Chunk, TensorEntry

#: The affine map format version this reader knows (DeepSpeed's AFFINE_MAP_FORMAT_VERSION).
AFFINE_VERSION = 1
#: Entry names that belong to parameter ``X``: its weights, its 16-bit copy, its moments.
_PARAM_ENTRY = re.compile(r"^(?:model|module16)\.(.+)$|^optim\.state\.(.+)\.(?:exp_avg|exp_avg_sq)$")


@dataclass(frozen=True)
class Placement:
    """One TP rank's shard of a parameter: its shape and its origin in the logical tensor;
    ``replicated`` when every rank holds the whole tensor."""

    logical: tuple[int, ...]
    shard: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool


def _refuse(where: str, what: str) -> UnsupportedFormatError:
    return layout_refused(where, what, "DeepSpeed")


def _ints(v, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise FormatError(where, f"AutoTP affine map: {what} is not a list of integers")
    return tuple(v)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _unravel(offset: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(offset % n if n else 0)
        offset = offset // n if n else 0
    return tuple(reversed(out))


def param_name(pattern: str) -> str | None:
    """The parameter name an AutoTP pattern (``^re.escape(name)$``) stands for, or None
    for a pattern that names more than one.

    >>> param_name(r"^layers\\.0\\.up_proj\\.weight$")
    'layers.0.up_proj.weight'
    >>> param_name(r".*\\.experts\\.w1$") is None
    True
    """
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    name = re.sub(r"\\(.)", r"\1", pattern[1:-1])
    return name if re.escape(name) == pattern[1:-1] else None


def placements(name: str, entry, tp: int, where: str) -> dict[int, Placement]:
    """Each TP rank's :class:`Placement` of parameter ``name`` from its affine-map entry;
    refuses (by name) every layout but a one-piece row-major shard, and checks that the
    split shards tile the logical tensor exactly once."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), dict):
        raise FormatError(where, f"AutoTP affine map of {name}: no ranks")
    logical = _ints(entry.get("logical_shape"), where, f"{name}'s logical_shape")
    ranks = entry["ranks"]
    if sorted(ranks) != list(range(tp)):
        raise FormatError(where, f"AutoTP affine map of {name}: ranks {sorted(ranks)}, "
                          f"the tag holds {tp} TP ranks")
    out: dict[int, Placement] = {}
    for t in range(tp):
        r = ranks[t]
        shard = _ints(r.get("shard_shape"), where, f"{name}'s shard_shape")
        pieces = r.get("pieces")
        if not isinstance(pieces, list) or len(pieces) != 1:
            n = len(pieces) if isinstance(pieces, list) else 0
            raise _refuse(where, f"AutoTP parameter {name} held as {n} pieces on TP rank "
                          f"{t} (fused sub-parameters)")
        p = pieces[0]
        scale = p.get("scale", 1.0)
        if scale != 1.0:
            raise _refuse(where, f"AutoTP parameter {name} held scaled by {scale} (a "
                          "row-parallel bias divided by the TP degree)")
        shape = _ints(p.get("shape"), where, f"{name}'s piece shape")
        src, dst = p.get("source"), p.get("dest")
        if not (isinstance(src, list) and isinstance(dst, list) and len(src) == len(dst) == 2):
            raise FormatError(where, f"AutoTP affine map of {name}: a piece without source/dest")
        if (shape != shard or dst[0] != 0 or tuple(dst[1]) != _row_major(shard)
                or tuple(src[1]) != _row_major(logical) or len(shard) != len(logical)):
            raise _refuse(where, f"AutoTP parameter {name}: a strided shard on TP rank {t} "
                          "(not one row-major block of the logical tensor)")
        holders = _ints(p.get("locations"), where, f"{name}'s locations")
        offsets = _unravel(int(src[0]), logical)
        if any(o + s > n for o, s, n in zip(offsets, shard, logical)):
            raise FormatError(where, f"AutoTP affine map of {name}: TP rank {t}'s shard "
                              f"{list(shard)} at {list(offsets)} leaves {list(logical)}")
        replicated = set(holders) == set(range(tp)) and shard == logical
        if not replicated and set(holders) != {t}:
            raise _refuse(where, f"AutoTP parameter {name}: a shard held by ranks "
                          f"{sorted(holders)} (partly replicated)")
        out[t] = Placement(logical, shard, offsets, replicated)
    split = [p for p in out.values() if not p.replicated]
    if split and len(split) != tp:
        raise _refuse(where, f"AutoTP parameter {name}: replicated on some TP ranks only")
    if split:
        boxes = [(p.offsets, p.shard) for p in split]
        if sum(math.prod(s) for _, s in boxes) != math.prod(logical) or any(
                intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            raise FormatError(where, f"AutoTP affine map of {name}: the TP shards do not "
                              "cover the tensor exactly once")
    return out


def affine_maps(uc_info, tp: int, where: str) -> dict[str, dict[int, Placement]]:
    """Parameter name -> TP rank -> :class:`Placement`, from a model-states file's
    ``universal_checkpoint_info``; refuses a TP checkpoint that records no affine map
    (older DeepSpeed, Megatron-DeepSpeed: the split dims are not in the files)."""
    amap = uc_info.get("affine_map") if isinstance(uc_info, dict) else None
    if not isinstance(amap, dict):
        if isinstance(uc_info, dict) and any(k.endswith("_patterns") for k in uc_info):
            raise _refuse(where, f"DeepSpeed tensor parallel ({tp} TP ranks) without an AutoTP "
                          "affine map, described by name patterns only (Megatron-DeepSpeed's "
                          "universal_checkpoint_info)")
        raise _refuse(where, f"DeepSpeed tensor parallel ({tp} TP ranks) without an AutoTP "
                      "affine map: the files do not record the split dims")
    if amap.get("version") != AFFINE_VERSION:
        raise _refuse(where, f"AutoTP affine map version {amap.get('version')!r} (ckptctl "
                      f"reads version {AFFINE_VERSION})")
    unsupported = uc_info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        pattern, why = next(iter(unsupported.items()))
        raise _refuse(where, f"AutoTP parameter {param_name(pattern) or pattern}: {why}")
    params = amap.get("params")
    if not isinstance(params, dict):
        raise FormatError(where, "AutoTP affine map without params")
    out = {}
    for pattern, entry in params.items():
        name = param_name(pattern) if isinstance(pattern, str) else None
        if name is None:
            raise _refuse(where, f"AutoTP affine map pattern {pattern!r} (not one parameter)")
        out[name] = placements(name, entry, tp, where)
    return out


def _param_of(entry: str) -> str | None:
    m = _PARAM_ENTRY.match(entry)
    return (m.group(1) or m.group(2)) if m else None


def join(views: list[Checkpoint], maps: dict[str, dict[int, Placement]], where: str,
         aliases: dict[str, str], buffers: set[str]) -> dict[str, TensorEntry]:
    """The logical tensors of TP ranks' views (``views[t]``: rank ``t``'s entries in shard
    shapes): a split parameter's chunks moved to its shard's origin, a replicated one (and
    every entry no map names: buffers, steps, client state) taken from TP rank 0, tied
    names (``aliases``: alias -> target) re-pointed at the joined target. A parameter no
    map names (``buffers``, the ``model.*`` names of buffers, are not parameters) is
    refused: its shards might be split, and nothing says how."""
    tensors: dict[str, TensorEntry] = {}
    for t, view in enumerate(views):
        for name, e in view.tensors.items():
            if name in aliases:
                continue
            param = _param_of(name)
            pl = maps.get(param, {}).get(t) if param is not None else None
            if pl is None or pl.replicated:
                if pl is None and name.startswith("model.") and name not in buffers:
                    raise _refuse(where, f"AutoTP checkpoint whose affine map does not name "
                                  f"parameter {param}")
                if t == 0:
                    tensors[name] = e
                elif name not in views[0].tensors or views[0].tensors[name].shape != e.shape:
                    raise FormatError(where, f"{name}: TP rank {t} holds it as "
                                      f"{list(e.shape)}, TP rank 0 does not")
                continue
            if e.shape != pl.shard:
                raise FormatError(where, f"{name}: TP rank {t} holds {list(e.shape)}, the "
                                  f"affine map says {list(pl.shard)}")
            joined = tensors.get(name)
            if joined is None:
                joined = tensors[name] = TensorEntry(name, e.dtype, pl.logical, [])
            elif joined.dtype != e.dtype:
                raise FormatError(where, f"{name}: {joined.dtype.name} on TP rank 0, "
                                  f"{e.dtype.name} on TP rank {t}")
            joined.chunks.extend(
                Chunk(tuple(o + p for o, p in zip(c.offsets, pl.offsets)), c.sizes, c.extent)
                for c in e.chunks)
    for name, joined in tensors.items():
        param = _param_of(name)
        if param in maps and not maps[param][0].replicated:
            held = sum(math.prod(c.sizes) for c in joined.chunks)
            if held != math.prod(joined.shape):
                raise FormatError(where, f"{name}: the TP ranks hold {held} of its "
                                  f"{math.prod(joined.shape)} elements")
    for alias, target in aliases.items():
        t = tensors.get(target)
        if t is not None:
            tensors[alias] = TensorEntry(alias, t.dtype, t.shape, list(t.chunks))
    return tensors
