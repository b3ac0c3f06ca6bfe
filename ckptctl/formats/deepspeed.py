"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3; fp32, bf16 and fp16 runs) read into the
one logical model, without DeepSpeed and without torch: the rank files are ``torch.save``
zips whose pickles are parsed with inert stand-ins for DeepSpeed's classes
(:data:`DEEPSPEED_GLOBALS`), and each parameter becomes chunks that point at byte ranges
of the flat partitions, exactly where DeepSpeed's own ``zero_to_fp32`` finds them:

- ZeRO-1/2: a group's fp32 partitions (``single_partition_of_fp32_groups``), concatenated
  in rank order, hold the group's parameters in ``param_shapes`` order, each followed by
  its alignment padding (``param_alignment_paddings``); checked against every rank's
  ``param_slice_mappings``.
- ZeRO-3: each parameter is split into ``ceil(numel / world)`` elements per rank, in
  ``param_shapes`` order within each rank's flat group (``fp32_flat_groups``); the last
  pieces carry the padding, which is left out.

A piece of a parameter is a flat range; :func:`~ckptctl.boxes.flat_range_boxes` turns it
into at most ``2 * ndim - 1`` boxes, so consolidation and resharding read a parameter as
a set of byte ranges of the rank files, never a whole file.

The entries: ``model.<name>`` (the fp32 master weights, frozen parameters, buffers, tied
names), ``optim.state.<name>.<exp_avg|exp_avg_sq|step>`` and ``optim.param_groups.<g>.*``
(torch DCP's names, padding removed), ``module16.<name>`` (the module's own weights as
saved: 16-bit in bf16/fp16 runs; ZeRO-3 saves none but buffers), ``lr_scheduler.*``,
``step`` (``global_steps``), ``meta.deepspeed.*`` (DeepSpeed's bookkeeping) and
``client_state.*`` (what ``save_checkpoint(client_state=...)`` was given).

Tensor parallel (``mp_rank_00``, ``mp_rank_01``, ...): each TP rank's files are read as one
ZeRO view, and the views are joined by the affine map DeepSpeed's AutoTP records in the
model-states files (:mod:`.autotp`: column- and row-parallel splits, replicated params).

Refused by name: pipeline-parallel layer files, MoE expert files, tensor parallel without
an AutoTP affine map (Megatron-DeepSpeed's name-pattern categories are not read) or with
fused, strided or scaled shards, a tag folder without ZeRO optimizer partitions (stage 0),
AutoEP layouts.

>>> tag_files({"mp_rank_00_model_states.pt": 1, "zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
...            "zero_pp_rank_0_mp_rank_00_optim_states.pt": 1}).optim
['zero_pp_rank_0_mp_rank_00_optim_states.pt', 'zero_pp_rank_1_mp_rank_00_optim_states.pt']
"""
from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import (FormatError, ProblemCode, UnsafeInputError, UnsupportedFormatError,
                      layout_refused)
from ..model import Checkpoint, ObjectEntry, TensorEntry
from ..storage import Store
from .safe_pickle import record_class
from .torchfile import EntryBuilder, plain as _plain
from .torchzip import StoredTensor

#: DeepSpeed's file names: ZeRO-3 model states per dp rank, ZeRO-1/2 model states per mp
#: rank, optimizer partitions per (dp, mp) rank (``bf16_``/``fp16_`` prefixed by BF16 runs).
ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_\d+")
_EXPERT = re.compile(r"expert_\d+|expp_rank_\d+")
#: ``ds_to_universal``'s tree: ``zero/<param>/<state>.pt``, ``zero/optimizer_state.pt``.
UNIVERSAL_FILE = re.compile(r"^zero/([^/]+)/(fp32|exp_avg|exp_avg_sq|step)\.pt$")
UNIVERSAL_OPTIM = "zero/optimizer_state.pt"
_TREE_FILE = re.compile(r"^zero/([^/]+)/([^/]+)$")
_STATE_FILE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.pt$")  # fp32.pt, exp_avg.pt, ...
#: The prefix of the client state's entries (``client_state.epoch``): ``load_checkpoint``
#: returns it as one dict, and the names never meet DeepSpeed's own (``step``).
CLIENT = "client_state"


def _enum_value(value=None, *args):
    return value


#: The DeepSpeed classes its checkpoint pickles name, as inert stand-ins (attributes only).
DEEPSPEED_GLOBALS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): record_class("LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): record_class("DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _enum_value,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): record_class("fragment_address"),
}

#: model-states keys DeepSpeed itself writes (``engine._save_checkpoint``); any other key
#: is the client state, kept under its own name.
_DS_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "ds_autotp_universal_checkpoint_meta",
}
#: what goes to ``meta.deepspeed.*`` (the rest of DeepSpeed's keys are read into entries)
_DS_META_KEYS = ("skipped_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version", "data_sampler",
                 "random_ltd", "sparse_tensor_module_names", "universal_checkpoint_info")
_OPTIM_META_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                    "zero_stage", "partition_count", "group_paddings")


@dataclass
class TagFiles:
    """The DeepSpeed files of one tag folder, by role, in rank order."""

    model: list[str] = field(default_factory=list)  # ZeRO-1/2: mp_rank_00; ZeRO-3: per dp rank
    optim: list[str] = field(default_factory=list)
    mp_ranks: set[int] = field(default_factory=set)
    other: list[str] = field(default_factory=list)  # layer/expert files: refused


def tag_files(files: dict[str, int]) -> TagFiles:
    """Sort a tag folder's top-level files into DeepSpeed's roles (natural rank order)."""
    t = TagFiles()
    zero3: list[tuple[int, str]] = []
    optim: list[tuple[int, str]] = []
    for f in files:
        if "/" in f:
            continue
        if m := ZERO3_MODEL.match(f):
            zero3.append((int(m.group(1)), f))
            t.mp_ranks.add(int(m.group(2)))
        elif m := MODEL_FILE.match(f):
            t.model.append(f)
            t.mp_ranks.add(int(m.group(1)))
        elif m := OPTIM_FILE.match(f):
            optim.append((int(m.group(1)), f))
            t.mp_ranks.add(int(m.group(2)))
        elif f.endswith("_states.pt") and (_LAYER.match(f) or _EXPERT.search(f)):
            t.other.append(f)
    if zero3:
        t.model = [f for _, f in sorted(zero3)]
    t.optim = [f for _, f in sorted(optim)]
    return t


def _refuse(where: str, what: str) -> UnsupportedFormatError:
    return layout_refused(where, what, "DeepSpeed")


def _load(store: Store, rel: str, size: int):
    from .torchfile import TorchFile

    return TorchFile(store, rel, size, DEEPSPEED_GLOBALS)


def _dict(v, where: str, what: str) -> dict:
    if not isinstance(v, dict):
        raise FormatError(where, f"{what} is {type(v).__name__}, not a dict")
    return v


def _shape(v, where: str, name: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise FormatError(where, f"param_shapes: {name} has no shape of non-negative integers")
    return tuple(v)


def _partition_count(osd: dict, where: str, world: int) -> int:
    pc = osd.get("partition_count")
    counts = pc if isinstance(pc, list) else [pc]
    if not counts or not all(isinstance(c, int) for c in counts):
        raise FormatError(where, "optimizer_state_dict: no partition_count")
    if len(set(counts)) != 1:  # expert groups partition over fewer ranks
        raise _refuse(where, f"DeepSpeed MoE (param groups partitioned {sorted(set(counts))} ways)")
    if counts[0] != world:
        raise FormatError(where, f"partition_count says {counts[0]} ranks, the folder holds "
                          f"{world} optimizer files (a rank's file is missing or left over)")
    return counts[0]


def read_deepspeed(store: Store, files: dict[str, int]) -> Checkpoint:
    """Read a DeepSpeed ZeRO tag folder (``global_stepN/``) into the logical model.

    Reads the rank files' pickles only (a few small ranged reads each); tensor bytes stay
    where they are.

    >>> ck = read_deepspeed(open_store("run/global_step2"), files)      # doctest: +SKIP
    >>> ck.tensors["model.lin.weight"].chunks[0].extent.encoding        # doctest: +SKIP
    'raw'
    """
    where = store.url
    tf_ = tag_files(files)
    if tf_.other:
        kind = "pipeline-parallel layer files" if any(_LAYER.match(f) for f in tf_.other) \
            else "MoE expert files"
        raise _refuse(where, f"DeepSpeed {kind} ({tf_.other[0]})")
    tp = len(tf_.mp_ranks)
    if sorted(tf_.mp_ranks) != list(range(tp)):
        raise FormatError(where, f"tensor-parallel ranks {sorted(tf_.mp_ranks)}: a rank's "
                          "files are missing")
    if tp <= 1:
        return _read_mp(store, files, tf_, 0, 1)
    return _read_tp(store, files, tp)


def _mp_files(files: dict[str, int], mp: int) -> dict[str, int]:
    """The files of one tensor-parallel rank (``mp_rank_<mp>``) of a tag folder."""
    out = {}
    for f, size in files.items():
        m = ZERO3_MODEL.match(f) or OPTIM_FILE.match(f)
        rank = int(m.group(2)) if m else int(m2.group(1)) if (m2 := MODEL_FILE.match(f)) else None
        if rank == mp:
            out[f] = size
    return out


def _read_tp(store: Store, files: dict[str, int], tp: int) -> Checkpoint:
    """An AutoTP tag folder: each TP rank's files read as one ZeRO view (its parameters in
    shard shapes), joined by the affine map DeepSpeed records (:mod:`.autotp`)."""
    from .autotp import affine_maps, join

    where = store.url
    views = [_read_mp(store, files, tag_files(_mp_files(files, t)), t, tp) for t in range(tp)]
    first = views[0].info["deepspeed"]
    for t, v in enumerate(views[1:], 1):
        d = v.info["deepspeed"]
        if (d["stage"], d["world"], d["precision"]) != (first["stage"], first["world"],
                                                          first["precision"]):
            raise FormatError(where, f"TP rank {t} is ZeRO-{d['stage']} over {d['world']} "
                              f"ranks, TP rank 0 ZeRO-{first['stage']} over {first['world']}")
    uc = [v.info.pop("autotp") for v in views]
    if any(u != uc[0] for u in uc[1:]):
        raise FormatError(where, "the TP ranks' model-states files record different "
                          "AutoTP affine maps")
    maps = affine_maps(uc[0], tp, where)
    ck = views[0]
    ck.files = dict(files)
    ck.tensors = join(views, maps, where, ck.info.get("aliases", {}),
                      ck.info.get("buffers", set()))
    dp = first["world"]
    ck.info["deepspeed"].update(
        tp=tp, dp=dp, world=tp * dp, model_file=first["model_file"],
        optim_files=[f for v in views for f in v.info["deepspeed"]["optim_files"]],
        ranks=[{**r, "mp_rank": t} for t, v in enumerate(views)
               for r in v.info["deepspeed"].get("ranks", [])])
    ck.info["zip_files"] = [f for v in views for f in v.info["zip_files"]]
    notes = ck.info.setdefault("notes", [])  # TP rank 0's (the others lack shared_params)
    replicated = sorted(n for n, pl in maps.items() if pl[0].replicated)
    if replicated:
        notes.append(f"{_few(replicated)}: replicated on every TP rank; read from TP rank 0 "
                     "(the other ranks' copies are not compared)")
    ck.info["origin"] = describe(ck)
    return ck


def _read_mp(store: Store, files: dict[str, int], tf_: TagFiles, mp: int, tp: int
             ) -> Checkpoint:
    """TP rank ``mp``'s ZeRO view (of ``tp``): every parameter as that rank holds it."""
    where = store.url
    if not tf_.model:
        raise FormatError(where, "DeepSpeed tag folder without a *_model_states.pt file")
    if not tf_.optim:
        raise _refuse(where, "DeepSpeed without ZeRO optimizer partitions (stage 0, or a "
                      "save without optimizer state)")
    world = len(tf_.optim)
    optim = _parallel(lambda f: _load(store, f, files[f]), tf_.optim)
    osds = [_dict(_dict(o.obj, o.where, "the optimizer file").get("optimizer_state_dict"),
                  o.where, "optimizer_state_dict") for o in optim]
    stage = osds[0].get("zero_stage")
    bf16_optimizer = stage is None and "single_partition_of_fp32_groups" in osds[0]
    if bf16_optimizer:  # DeepSpeed's BF16_Optimizer (bf16, fp32 grad accumulation): ZeRO-1
        stage = 1
        osds = [{**o, "zero_stage": 1} for o in osds]
    if stage not in (1, 2, 3):
        raise FormatError(optim[0].where, f"zero_stage is {stage!r}, not 1, 2 or 3")
    if any(o.get("zero_stage") != stage for o in osds):
        raise FormatError(where, "the optimizer files disagree on the ZeRO stage")
    _partition_count(osds[0], optim[0].where, world)
    if stage == 3:
        if len(tf_.model) != world:
            raise FormatError(where, f"{len(tf_.model)} ZeRO-3 model-states files for "
                              f"{world} optimizer files")
        models = _parallel(lambda f: _load(store, f, files[f]), tf_.model)
    else:
        if tf_.model != [f"mp_rank_{mp:02d}_model_states.pt"]:
            raise FormatError(where, f"ZeRO-{stage} folder with model files {tf_.model}")
        models = [_load(store, tf_.model[0], files[tf_.model[0]])]
    msd = _dict(models[0].obj, models[0].where, "the model-states file")
    for key in ("ds_autoep_layers", "autoep_layers"):
        if msd.get(key):
            raise _refuse(where, "DeepSpeed AutoEP (expert-parallel layers)")
    ck = Checkpoint(root=store.url, format="deepspeed", store=store, files=dict(files))
    mp_world = msd.get("mp_world_size")
    if isinstance(mp_world, int) and mp_world != tp:
        raise FormatError(where, f"mp_world_size says {mp_world} tensor-parallel ranks, the "
                          f"folder holds {tp} (a rank's files are missing)")
    if tp > 1:
        ck.info["autotp"] = _plain(msd.get("universal_checkpoint_info"))
    ds_cfg = msd.get("ds_config") if isinstance(msd.get("ds_config"), dict) else {}
    precision = "bf16" if (ds_cfg.get("bf16") or {}).get("enabled") else \
        "fp16" if (ds_cfg.get("fp16") or {}).get("enabled") else "fp32"
    if bf16_optimizer:
        precision = "bf16, BF16_Optimizer"
    ck.info["deepspeed"] = {"stage": stage, "world": world, "precision": precision,
                            "ds_version": msd.get("ds_version"), "model_file": models[0].rel,
                            "optim_files": list(tf_.optim)}
    b = EntryBuilder(ck, default_file=models[0].rel)
    shapes = msd.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise FormatError(models[0].where, "param_shapes is not a list of groups")
    shapes = [{n: _shape(s, models[0].where, n) for n, s in g.items()} for g in shapes]
    if stage == 3:
        _zero3_params(b, shapes, optim, osds, world)
    else:
        _zero12_params(b, shapes, optim, osds, world)
    _frozen(b, msd, models, stage, world)
    _buffers_and_module(b, msd, models[0], stage)
    _param_groups(b, shapes, osds[0], optim[0].where, stage)
    _rest(b, msd, osds[0], models[0], optim[0])
    ck.info["origin"] = describe(ck)
    ck.info["zip_files"] = [m.rel for m in models] + [o.rel for o in optim]  # CRC-checked
    return ck


def _parallel(fn, items):
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(8, len(items))) as pool:
        return list(pool.map(fn, items))


def _flat_state(osd: dict, stage: int, where: str) -> tuple[list, list[dict]]:
    """(fp32 flat partitions per group, base optimizer state per group) of one rank."""
    if stage == 3:
        flat = osd.get("fp32_flat_groups")
        base = osd.get("optimizer_state_dict")
    else:
        flat = osd.get("single_partition_of_fp32_groups")
        base = osd.get("base_optimizer_state")
    if not isinstance(flat, list) or not all(isinstance(t, StoredTensor) for t in flat):
        raise FormatError(where, "no fp32 flat partitions (fp32_flat_groups / "
                          "single_partition_of_fp32_groups)")
    base = _dict(base, where, "the base optimizer state")
    state = _dict(base.get("state", {}), where, "the base optimizer state's state")
    groups = [state.get(g, state.get(str(g), {})) for g in range(len(flat))]
    return flat, [_dict(s, where, f"optimizer state of group {g}") for g, s in enumerate(groups)]


def _moment_keys(states: list[dict], where: str) -> list[str]:
    keys = sorted(k for k, v in states[0].items() if isinstance(v, StoredTensor) and v.size)
    for k, v in states[0].items():
        if k not in keys and k != "step" and not (isinstance(v, StoredTensor) and not v.size):
            raise _refuse(where, f"optimizer state {k!r} that is neither a flat moment nor a step")
    return keys


def _add_param(b: EntryBuilder, name: str, shape, pieces: dict[str, list], steps, where: str) -> None:
    """model.<name> and its optimizer state from (key -> [(first, extent)]) pieces."""
    b.tensor(f"model.{name}", "float32", shape, pieces.pop("fp32"), where)
    for key, ps in pieces.items():
        b.tensor(f"optim.state.{name}.{key}", "float32", shape, ps, where)
    if steps is not None:
        tf, st = steps
        if isinstance(st, StoredTensor):
            b.stored(f"optim.state.{name}.step", tf, st)
        else:
            b.name_free(f"optim.state.{name}.step", where)
            b.ck.objects[f"optim.state.{name}.step"] = ObjectEntry(
                f"optim.state.{name}.step", None, value=st, type_name=type(st).__name__)


def _rank_view(b: EntryBuilder, rank: int, group: int, name: str, start: int, count: int, tf,
               flat: int) -> None:
    """Record where a parameter's piece sits in one rank's flat partition: each rank's
    view (``inspect --json``'s ``ranks``: per rank its file and, per param group, the
    partition's elements and each parameter's ``[start, count]`` in it)."""
    ranks = b.ck.info["deepspeed"].setdefault("ranks", [])
    while len(ranks) <= rank:
        ranks.append({"rank": len(ranks), "file": None, "groups": []})
    view = ranks[rank]
    view["file"] = tf.rel
    while len(view["groups"]) <= group:
        view["groups"].append({"elements": 0, "params": {}})
    view["groups"][group]["elements"] = flat
    view["groups"][group]["params"][name] = [start, count]


def _zero12_params(b: EntryBuilder, shapes, optim, osds, world: int) -> None:
    """ZeRO-1/2: each group's partitions, concatenated in rank order, hold its params."""
    per_rank = [_flat_state(o, 1, tf.where) for o, tf in zip(osds, optim)]
    groups = len(shapes)
    for r, (flat, _) in enumerate(per_rank):
        if len(flat) != groups:
            raise FormatError(optim[r].where, f"{len(flat)} fp32 partitions for {groups} "
                              "param groups")
    pads = osds[0].get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        sizes = [per_rank[r][0][g].numel for r in range(world)]
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        gpads = pads[g] if isinstance(pads, list) and g < len(pads) else None
        if gpads is not None and (not isinstance(gpads, list) or len(gpads) != len(group)):
            raise FormatError(optim[0].where, f"param group {g}: {len(group)} params but "
                              "param_alignment_paddings say otherwise")
        keys = _moment_keys(per_rank[0][1][g:g + 1] or [{}], optim[0].where)
        slices = [osds[r].get("param_slice_mappings") for r in range(world)]
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            pieces: dict[str, list] = {"fp32": [], **{k: [] for k in keys}}
            for r in range(world):
                lo, hi = max(offset, bounds[r]), min(offset + n, bounds[r + 1])
                if lo >= hi:
                    continue
                local = lo - bounds[r]
                _check_mapping(slices[r], g, name, local, hi - lo, optim[r].where)
                tf = optim[r]
                _rank_view(b, r, g, name, local, hi - lo, tf, per_rank[r][0][g].numel)
                pieces["fp32"].append((lo - offset, tf.extent(per_rank[r][0][g], name,
                                                              start=local, count=hi - lo)))
                for k in keys:
                    st = per_rank[r][1][g].get(k)
                    if not isinstance(st, StoredTensor):
                        raise FormatError(tf.where, f"group {g}: no {k}")
                    pieces[k].append((lo - offset, tf.extent(st, f"{name}.{k}", start=local,
                                                             count=hi - lo)))
            if offset + n > bounds[-1]:
                raise FormatError(optim[-1].where, f"{name}: the partitions hold "
                                  f"{bounds[-1]} elements of group {g}, {name} needs "
                                  f"[{offset}, {offset + n})")
            step = per_rank[0][1][g].get("step")
            _add_param(b, name, shape, pieces, (optim[0], step) if step is not None else None,
                       optim[0].where)
            offset += n + (gpads[i] if gpads is not None else 0)
        align = 2 * world  # zero_to_fp32's own sanity check: all of the group consumed
        if "param_alignment_paddings" not in osds[0]:  # BF16_Optimizer: padding at the end
            pad = sum(_group_padding(o, g) for o in osds)
            if offset + pad != bounds[-1]:
                raise FormatError(optim[0].where, f"param group {g}: params take {offset} "
                                  f"elements and padding {pad}, the partitions hold {bounds[-1]}")
        elif math.ceil(offset / align) * align != math.ceil(bounds[-1] / align) * align:
            raise FormatError(optim[0].where, f"param group {g}: params take {offset} "
                              f"elements, the partitions hold {bounds[-1]}")


def _group_padding(osd: dict, g: int) -> int:
    pads = osd.get("group_paddings")
    v = pads[g] if isinstance(pads, list) and g < len(pads) else 0
    return v if isinstance(v, int) and v >= 0 else 0


def _check_mapping(mappings, g: int, name: str, start: int, numel: int, where: str) -> None:
    """The rank's own record of where ``name``'s piece is must agree with the walk."""
    if not isinstance(mappings, list) or g >= len(mappings) or not isinstance(mappings[g], dict):
        return
    fa = mappings[g].get(name)
    if fa is None:
        return  # DeepSpeed leaves out params that never got a gradient
    got = (getattr(fa, "start", None), getattr(fa, "numel", None))
    if got != (start, numel):
        raise FormatError(where, f"{name}: param_slice_mappings say elements {got[0]}+{got[1]} "
                          f"of this rank's partition, param_shapes say {start}+{numel}")


def _zero3_params(b: EntryBuilder, shapes, optim, osds, world: int) -> None:
    """ZeRO-3: each param is ceil(numel / world) elements on every rank, in order."""
    per_rank = [_flat_state(o, 3, tf.where) for o, tf in zip(osds, optim)]
    for r, (flat, _) in enumerate(per_rank):
        if len(flat) != len(shapes):
            raise FormatError(optim[r].where, f"{len(flat)} flat groups for {len(shapes)} "
                              "param groups")
    for g, group in enumerate(shapes):
        keys = _moment_keys([per_rank[0][1][g]], optim[0].where)
        offset = 0
        for name, shape in group.items():
            n = math.prod(shape)
            part = math.ceil(n / world)
            pieces: dict[str, list] = {"fp32": [], **{k: [] for k in keys}}
            for r in range(world):
                count = max(0, min(part, n - r * part))
                if not count:
                    continue
                tf = optim[r]
                _rank_view(b, r, g, name, offset, count, tf, per_rank[r][0][g].numel)
                pieces["fp32"].append((r * part, tf.extent(per_rank[r][0][g], name,
                                                           start=offset, count=count)))
                for k in keys:
                    st = per_rank[r][1][g].get(k)
                    if not isinstance(st, StoredTensor):
                        raise FormatError(tf.where, f"group {g}: no {k}")
                    pieces[k].append((r * part, tf.extent(st, f"{name}.{k}", start=offset,
                                                          count=count)))
            step = per_rank[0][1][g].get("step")
            _add_param(b, name, shape, pieces, (optim[0], step) if step is not None else None,
                       optim[0].where)
            offset += part
        for r in range(world):
            have = per_rank[r][0][g].numel
            if have != offset:
                raise FormatError(optim[r].where, f"flat group {g} holds {have} elements, its "
                                  f"params take {offset} per rank")


def _frozen(b: EntryBuilder, msd: dict, models, stage: int, world: int) -> None:
    shapes = msd.get("frozen_param_shapes") or {}
    if not shapes:
        return
    where = models[0].where
    shapes = {n: _shape(s, where, n) for n, s in _dict(shapes, where, "frozen_param_shapes").items()}
    frags = [_dict(m.obj.get("frozen_param_fragments") or {}, m.where, "frozen_param_fragments")
             for m in models]
    for name, shape in shapes.items():
        n = math.prod(shape)
        if stage != 3:
            st = frags[0].get(name)
            if not isinstance(st, StoredTensor) or st.numel != n:
                raise FormatError(where, f"frozen param {name}: no fragment of {n} elements")
            b.tensor(f"model.{name}", st.dtype, shape, [(0, models[0].extent(st, name))], where)
            continue
        part = math.ceil(n / world)
        pieces, dtype = [], None
        for r, m in enumerate(models):
            count = max(0, min(part, n - r * part))
            st = frags[r].get(name)
            if not isinstance(st, StoredTensor) or st.numel < count:
                raise FormatError(m.where, f"frozen param {name}: no fragment of {count} elements")
            dtype = dtype or st.dtype
            if count:
                pieces.append((r * part, m.extent(st, name, count=count)))
        b.tensor(f"model.{name}", dtype or "float32", shape, pieces, where)


def _buffers_and_module(b: EntryBuilder, msd: dict, model, stage: int) -> None:
    """model.<buffer>, tied names, and module16.* (the module's weights as saved)."""
    where = model.where
    module = _dict(msd.get("module") or {}, where, "module")
    buffers = msd.get("buffer_names") or []
    for name in buffers:
        st = module.get(name)
        if isinstance(st, StoredTensor) and f"model.{name}" not in b.ck.tensors:
            b.stored(f"model.{name}", model, st)
    b.ck.info.setdefault("buffers", set()).update(f"model.{n}" for n in buffers)
    shared = msd.get("shared_params") or {}
    aliases = b.ck.info.setdefault("aliases", {})
    for alias, target in _dict(shared, where, "shared_params").items():
        t = b.ck.tensors.get(f"model.{target}")
        if t is None:
            raise FormatError(where, f"shared param {alias} is tied to {target}, which is not saved")
        b.name_free(f"model.{alias}", where)
        b.ck.tensors[f"model.{alias}"] = TensorEntry(f"model.{alias}", t.dtype, t.shape,
                                                     list(t.chunks))
        aliases[f"model.{alias}"] = f"model.{target}"
    untracked, module_only = [], []
    for name, st in module.items():
        if not isinstance(st, StoredTensor):
            continue
        if stage == 3 and st.numel == 0 and name not in buffers:
            if f"model.{name}" not in b.ck.tensors:
                untracked.append(name)  # a tied name ZeRO-3 does not record the target of
            continue
        b.stored(f"module16.{name}", model, st)
        if f"model.{name}" not in b.ck.tensors:
            # ZeRO-1 saves frozen parameters in the module only: that copy is the value
            b.ck.tensors[f"model.{name}"] = TensorEntry(
                f"model.{name}", b.ck.tensors[f"module16.{name}"].dtype, st.size,
                list(b.ck.tensors[f"module16.{name}"].chunks))
            module_only.append(name)
    b.ck.info["deepspeed"]["untracked"] = untracked
    notes = b.ck.info.setdefault("notes", [])
    if untracked:
        notes.append(f"{_few(untracked)}: in the module as ZeRO-3 placeholders only (tied "
                     "names whose target DeepSpeed does not record); not in model.*, as in "
                     "zero_to_fp32")
    if module_only:
        notes.append(f"{_few(module_only)}: in no partition (frozen: ZeRO-{stage} keeps them in "
                     "the module only); model.* holds the module's copy, which zero_to_fp32 "
                     "leaves out")
    if stage == 3:
        notes.append("ZeRO-3 saves no module weights (placeholders): module16.* holds the "
                     "buffers only")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _param_groups(b: EntryBuilder, shapes, osd: dict, where: str, stage: int) -> None:
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
    groups = base.get("param_groups") or []
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise FormatError(where, f"param group {g} is not a dict")
        for k, v in group.items():
            name = f"optim.param_groups.{g}.{k}"
            value = list(shapes[g]) if k == "params" and g < len(shapes) else _plain(v)
            b.name_free(name, where)
            b.ck.objects[name] = ObjectEntry(name, None, value=value, type_name=type(value).__name__)


def _rest(b: EntryBuilder, msd: dict, osd: dict, model, optim) -> None:
    """step, lr_scheduler, DeepSpeed's bookkeeping and the client state."""
    steps = msd.get("global_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):
        b.ck.objects["step"] = ObjectEntry("step", None, value=steps, type_name="int")
    if msd.get("lr_scheduler") is not None:
        b.objects("lr_scheduler", msd["lr_scheduler"], model)
    for k in _DS_META_KEYS:
        if msd.get(k) is not None:
            b.objects(f"meta.deepspeed.{k}", msd[k], model, tensors=False)
    for k in _OPTIM_META_KEYS:
        if osd.get(k) is not None:
            b.objects(f"meta.deepspeed.optimizer.{k}", osd[k], optim, tensors=False)
    for k, v in msd.items():  # what save_checkpoint(client_state=...) was given
        if k not in _DS_MODEL_KEYS:
            b.objects(f"{CLIENT}.{k}", v, model)


def is_universal(files: dict[str, int]) -> bool:
    """A ``ds_to_universal`` output folder: ``zero/<param>/fp32.pt`` beside model states."""
    return any(UNIVERSAL_FILE.match(f) for f in files)


def is_param_name(name: str) -> bool:
    """Can ``name`` be a parameter's folder under ``zero/``: dotted parts, none empty, no
    path separator or control character (``..evil`` and ``a/b`` cannot).

    >>> is_param_name("layers.0.attn.weight"), is_param_name("..evil"), is_param_name("x.")
    (True, False, False)
    """
    return bool(name) and all(part and part.isprintable() and "\\" not in part
                              and "/" not in part for part in name.split("."))


def universal_tree(files: dict[str, int]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """(param -> state -> file) of a universal checkpoint's ``zero/`` tree, and the sorted
    files under ``zero/`` that are no part of that layout (deeper folders, a folder whose
    name is no parameter name, a file that is no ``<state>.pt``).

    >>> universal_tree({"zero/w/fp32.pt": 8, "zero/w/exp_avg.pt": 8, "zero/optimizer_state.pt": 1,
    ...                 "zero/..evil/fp32.pt": 8, "mp_rank_00_model_states.pt": 9})
    ({'w': {'exp_avg': 'zero/w/exp_avg.pt', 'fp32': 'zero/w/fp32.pt'}}, ['zero/..evil/fp32.pt'])
    """
    tree: dict[str, dict[str, str]] = {}
    extra = []
    for f in sorted(files):
        if not f.startswith("zero/") or f == UNIVERSAL_OPTIM:
            continue
        m = _TREE_FILE.match(f)
        state = _STATE_FILE.match(m.group(2)) if m and is_param_name(m.group(1)) else None
        if state:
            tree.setdefault(m.group(1), {})[state.group(1)] = f
        else:
            extra.append(f)
    return tree, extra


def universal_files(files: dict[str, int]) -> set[str]:
    """The files of ``files`` (a folder's listing) that a universal checkpoint's layout
    names below its top: ``zero/optimizer_state.pt`` and ``zero/<param>/<state>.pt``
    (what the folder owns beside its top-level model states); empty for other folders.

    >>> sorted(universal_files({"zero/w/fp32.pt": 8, "zero/w/NOTES.md": 1, "NOTES.md": 1}))
    ['zero/w/fp32.pt']
    """
    if not is_universal(files):
        return set()
    tree, _ = universal_tree(files)
    own = {f for states in tree.values() for f in states.values()}
    return own | ({UNIVERSAL_OPTIM} & set(files))


def _missing(where: str, message: str) -> FormatError:
    """A piece the format's own index names that is not there (``MISSING_FILE``: verify
    and ls call the checkpoint incomplete)."""
    return FormatError(where, message, code=ProblemCode.MISSING_FILE)


def _universal_index(store: Store, tf_: TagFiles, msd: dict, model
                     ) -> tuple[dict[str, tuple], set[str], dict[str, tuple]]:
    """What the model-states file says the ``zero/`` tree holds: (param -> shape of the
    trainable parameters, each of which must have its folder; the names that may have one
    too (frozen parameters, buffers, tied names, the module's); name -> shape of those)."""
    mp = sorted(tf_.mp_ranks)
    want_mp = msd.get("mp_world_size")
    if mp != list(range(len(mp))) or (isinstance(want_mp, int) and want_mp != len(mp)):
        raise _missing(store.url, f"model states of tensor-parallel ranks {mp}, mp_world_size "
                       f"says {want_mp}: a rank's *_model_states.pt is missing")
    dp = msd.get("dp_world_size")
    zero3 = [f for f in tf_.model if ZERO3_MODEL.match(f)]
    if zero3 and isinstance(dp, int) and len(zero3) != dp * len(mp):
        raise _missing(store.url, f"{len(zero3)} ZeRO-3 model-states files, dp_world_size {dp} "
                       f"x mp_world_size {len(mp)} says {dp * len(mp)}: a rank's file is missing")
    groups = msd.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise FormatError(model.where, "param_shapes is not a list of groups")
    params = {n: _shape(s, model.where, n) for g in groups for n, s in g.items()}
    frozen = msd.get("frozen_param_shapes") or {}
    shapes = {n: _shape(s, model.where, n)
              for n, s in _dict(frozen, model.where, "frozen_param_shapes").items()}
    module = msd.get("module") if isinstance(msd.get("module"), dict) else {}
    for n, st in module.items():  # buffers, and ZeRO-1/2's frozen params (ZeRO-3: placeholders)
        if isinstance(n, str) and isinstance(st, StoredTensor) and st.numel and n not in shapes:
            shapes[n] = st.size
    buffers = [n for n in msd.get("buffer_names") or [] if isinstance(n, str)]
    shared = _dict(msd.get("shared_params") or {}, model.where, "shared_params")
    for alias, target in shared.items():
        if target in params or target in shapes:
            shapes[alias] = params.get(target, shapes.get(target))
    shapes.update(params)
    return params, set(shapes) | set(buffers) | set(shared) | set(module), shapes


def _check_tree(store: Store, tree: dict[str, dict[str, str]], extra: list[str],
                params: dict[str, tuple], allowed: set[str], index: str) -> None:
    """The ``zero/`` tree against the index (``index``: the model-states file): a folder
    for every trainable parameter, none for a name it does not know, and each trainable
    parameter's folder holding the same optimizer states as the others (or none: a
    parameter without optimizer state has its ``fp32.pt`` only). Refuses the first piece
    missing or extra by name."""
    for f in extra:
        folder = f.split("/")[1]
        if not is_param_name(folder):
            raise UnsafeInputError(store.display(f"zero/{folder}/"), "not a parameter name: a "
                                   "universal checkpoint's zero/ holds one folder per parameter")
        raise FormatError(store.display(f), "not a file of a universal checkpoint "
                          "(zero/<param>/<state>.pt)")
    for name in sorted(tree):
        if name not in allowed:
            raise FormatError(store.display(f"zero/{name}/"), f"a parameter folder that "
                              f"param_shapes in {index} does not list")
    for name in params:
        if name not in tree:
            raise _missing(store.display(f"zero/{name}/"), f"missing: param_shapes in {index} "
                           f"lists {name}")
    for name in sorted(tree):
        if "fp32" not in tree[name]:
            raise _missing(store.display(f"zero/{name}/fp32.pt"), "missing: every parameter's "
                           "folder holds its fp32.pt")
    states = set().union(*(set(tree[n]) for n in params)) - {"fp32"} if params else set()
    for name in params:
        lacks = sorted(states - set(tree[name]))
        if lacks and set(tree[name]) != {"fp32"}:
            held = ", ".join(f"{k}.pt" for k in sorted(states | {"fp32"}))
            raise _missing(store.display(f"zero/{name}/{lacks[0]}.pt"), "missing: the other "
                           f"parameters' folders hold {held}")


def _shape_agrees(got: tuple, want: tuple, tp: int) -> bool:
    """Does a ``zero/`` file's tensor shape ``got`` agree with the index's ``want``: the
    same; ZeRO-3's flat copy of it; or (``tp`` tensor-parallel ranks, whose index holds
    rank 0's shard) ``tp`` shards joined on one dimension.

    >>> _shape_agrees((8, 4), (8, 4), 1), _shape_agrees((32,), (8, 4), 1)
    (True, True)
    >>> _shape_agrees((8, 4), (4, 8), 1)
    False
    >>> _shape_agrees((28, 13), (14, 13), 2), _shape_agrees((28, 26), (14, 13), 2)
    (True, False)
    """
    if tuple(got) == tuple(want) or (len(got) == 1 and got[0] == math.prod(want)):
        return True
    if tp <= 1 or len(got) != len(want):
        return False
    diff = [d for d, (g, w) in enumerate(zip(got, want)) if g != w]
    return len(diff) == 1 and got[diff[0]] == want[diff[0]] * tp


def read_universal(store: Store, files: dict[str, int]) -> Checkpoint:
    """Read a universal checkpoint (``ds_to_universal`` output, or ckptctl's): one folder
    per parameter under ``zero/`` holding ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``
    (and ``step.pt``), each a tensor or ``{"param": tensor, ...}``; 1-D ones (ZeRO-3's)
    take the shape ``param_shapes`` gives. The tree is checked against the index the
    model-states file keeps (``param_shapes`` and the frozen, buffer and tied names, the
    rank counts): a piece missing, extra or of another shape is refused by name.

    >>> ck = read_universal(open_store("uni/global_step3_universal"), files)  # doctest: +SKIP
    >>> ck.tensors["model.fc1.weight"].shape                                 # doctest: +SKIP
    (29, 13)
    """
    where = store.url
    tf_ = tag_files(files)
    tree, extra = universal_tree(files)
    if not tf_.model:
        raise _missing(where, "no *_model_states.pt: the universal checkpoint's index "
                       "(param_shapes) is not there")
    model = _load(store, tf_.model[0], files[tf_.model[0]])
    msd = _dict(model.obj, model.where, "the model-states file")
    params, allowed, shapes = _universal_index(store, tf_, msd, model)
    _check_tree(store, tree, extra, params, allowed, model.rel)
    tp = max(1, len(tf_.mp_ranks))
    ck = Checkpoint(root=store.url, format="deepspeed-universal", store=store, files=dict(files))
    ck.info["deepspeed"] = {"universal": True, "model_file": model.rel}
    b = EntryBuilder(ck, default_file=model.rel)
    names = sorted(tree)
    loaded = _parallel(lambda f: _load(store, f, files[f]),
                       [f for n in names for f in tree[n].values()])
    by_file = {t.rel: t for t in loaded}
    for name in names:
        for key in ["fp32"] + sorted(set(tree[name]) - {"fp32"}):
            _universal_state(b, by_file[tree[name][key]], name, key, shapes.get(name), tp)
    if UNIVERSAL_OPTIM in files:
        _universal_optimizer(b, store, files, names)
    _universal_rest(b, store, files, tf_, msd, model)
    _rest(b, msd, {}, model, model)
    ck.info["origin"] = describe(ck)
    ck.info["zip_files"] = sorted(t.rel for t in loaded) + [model.rel]
    return ck


def _universal_state(b: EntryBuilder, tf, name: str, key: str, want: tuple | None,
                     tp: int) -> None:
    """One ``zero/<name>/<key>.pt``: ``model.<name>`` (``fp32``) or
    ``optim.state.<name>.<key>``, its shape checked against the index's ``want``."""
    obj = tf.obj
    if isinstance(obj, dict):
        # cat_dim says how TP slices join; the file holds the joined tensor
        extra = sorted(str(k) for k in obj if k not in ("param", "cat_dim"))
        if extra:
            raise _refuse(tf.where, f"a universal checkpoint with tensor-parallel "
                          f"slicing metadata ({', '.join(extra)})")
        obj = obj.get("param")
    entry = f"model.{name}" if key == "fp32" else f"optim.state.{name}.{key}"
    if key == "step" and isinstance(obj, (int, float)) and not isinstance(obj, bool):
        b.ck.objects[entry] = ObjectEntry(entry, None, value=obj, type_name=type(obj).__name__)
        return
    if not isinstance(obj, StoredTensor):
        raise FormatError(tf.where, f"holds {type(obj).__name__}, not a tensor")
    if key == "step":
        b.stored(entry, tf, obj, None)
        return
    if want is not None and not _shape_agrees(obj.size, want, tp):
        raise FormatError(tf.where, f"holds shape {tuple(obj.size)} but param_shapes says "
                          f"{tuple(want)}")
    shape = want if want is not None and math.prod(want) == obj.numel else obj.size
    b.stored(entry, tf, obj, shape)


def _universal_optimizer(b: EntryBuilder, store: Store, files: dict[str, int],
                         names: list[str]) -> None:
    """``zero/optimizer_state.pt``: the param groups, and ZeRO-3's one step for all."""
    tf = _load(store, UNIVERSAL_OPTIM, files[UNIVERSAL_OPTIM])
    osd = _dict(tf.obj, tf.where, "optimizer_state.pt")
    inner = osd.get("optimizer_state_dict")  # ZeRO-3's: the step lives here, one for all
    state0 = ((inner or {}).get("state") or {}).get(0) if isinstance(inner, dict) else None
    step = state0.get("step") if isinstance(state0, dict) else None
    if isinstance(step, StoredTensor):
        for name in names:
            if f"optim.state.{name}.step" not in b.ck.tensors and f"model.{name}" in b.ck.tensors \
                    and f"optim.state.{name}.exp_avg" in b.ck.tensors:
                b.stored(f"optim.state.{name}.step", tf, step)
    for g, group in enumerate(osd.get("param_groups") or []):
        for k, v in _dict(group, tf.where, f"param group {g}").items():
            b.ck.objects[f"optim.param_groups.{g}.{k}"] = ObjectEntry(
                f"optim.param_groups.{g}.{k}", None, value=_plain(v), type_name="object")


def _universal_rest(b: EntryBuilder, store: Store, files: dict[str, int], tf_: TagFiles,
                    msd: dict, model) -> None:
    """What the copied model-states files hold that ``zero/`` may not: frozen parameters
    (ZeRO-3: in every rank's file), buffers and tied names."""
    shapes = msd.get("frozen_param_shapes") or {}
    missing = {n: s for n, s in _dict(shapes, model.where, "frozen_param_shapes").items()
               if f"model.{n}" not in b.ck.tensors}
    if missing:
        zero3 = ZERO3_MODEL.match(model.rel) is not None
        models = _parallel(lambda f: _load(store, f, files[f]), tf_.model) if zero3 else [model]
        _frozen(b, {**msd, "frozen_param_shapes": missing}, models, 3 if zero3 else 1,
                len(models))
    module = _dict(msd.get("module") or {}, model.where, "module")
    for name in msd.get("buffer_names") or []:
        st = module.get(name)
        if isinstance(st, StoredTensor) and f"model.{name}" not in b.ck.tensors:
            b.stored(f"model.{name}", model, st)
    b.ck.info.setdefault("buffers", set()).update(f"model.{n}" for n in msd.get("buffer_names") or [])
    aliases = b.ck.info.setdefault("aliases", {})
    for alias, target in _dict(msd.get("shared_params") or {}, model.where, "shared_params").items():
        t = b.ck.tensors.get(f"model.{target}")
        if t is not None and f"model.{alias}" not in b.ck.tensors:
            b.ck.tensors[f"model.{alias}"] = TensorEntry(f"model.{alias}", t.dtype, t.shape,
                                                         list(t.chunks))
            aliases[f"model.{alias}"] = f"model.{target}"


def describe(ck: Checkpoint) -> str:
    """One line of what a DeepSpeed checkpoint is (inspect's format line).

    >>> ck = Checkpoint("x", "deepspeed", info={"deepspeed": {"stage": 3, "world": 2, "precision": "bf16"}})
    >>> describe(ck)
    'ZeRO-3, 2 ranks, bf16'
    """
    d = ck.info.get("deepspeed", {})
    if d.get("universal"):
        return "universal checkpoint"
    if d.get("tp"):
        return (f"ZeRO-{d.get('stage')}, TP {d['tp']} x DP {d.get('dp')} "
                f"({d.get('world')} ranks), {d.get('precision')}")
    return f"ZeRO-{d.get('stage')}, {d.get('world')} ranks, {d.get('precision')}"
