"""``consolidate --to deepspeed-universal``: a DeepSpeed universal checkpoint from any
checkpoint ckptctl reads (torch DCP from FSDP2, a ZeRO checkpoint at any world size, HF
safetensors), which DeepSpeed's ``load_checkpoint`` resumes at any world size with
``"checkpoint": {"load_universal": true}``.

What DeepSpeed 0.19's universal loaders read, and what is written for it:

- ``zero/<param>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (every other optimizer state
  tensor of the parameter under its own name): ``{"param": full tensor}``; ``step.pt``: the
  bare step tensor. 16-bit weights become fp32 master weights (exact widening).
  Buffers and frozen parameters get an ``fp32.pt`` too, as ``ds_to_universal`` writes
  (DeepSpeed does not load them: its universal load restores trainable parameters only).
- ``zero/optimizer_state.pt``: ``param_groups`` (hyper-parameters, copied into the engine's
  groups in order), ``ds_version``, and ZeRO-3's ``optimizer_state_dict`` (the step).
- ``mp_rank_00_model_states.pt`` (ZeRO-1/2 engines) and
  ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3 engines): ``global_steps``,
  ``skipped_steps``, ``dp_world_size``, ``mp_world_size``, ``lr_scheduler``,
  ``param_shapes``, ``buffer_names``, the non-tensor rest of the source as client state.
- ``latest_universal`` beside DST (DeepSpeed's own convention, as ``ds_to_universal``
  writes it), once DST is committed: ``engine.load_checkpoint(parent)`` finds it.

Tensors stream one file at a time through the consolidation planner (bounded memory);
the folder is committed and sealed like every ckptctl output.

>>> r = write_universal(open_checkpoint("fsdp/step-20"), "uni/global_step20_universal")  # doctest: +SKIP
"""
from __future__ import annotations

import posixpath
import struct

from ..errors import UsageError
from ..formats.deepspeed import CLIENT, is_param_name, universal_tree
from ..formats.locate import LATEST_UNIVERSAL
from ..model import Checkpoint
from ..storage import HashingWriter, open_store
from ..catalog.closure import classify
from ..writing.commit import commit_written
from .copier import BlockStream, decode_object, dtype_converter, nest, stream_depth

#: The version DeepSpeed's universal loader asserts is present (``ds_version``).
DS_VERSION = "0.19.8"
UNIVERSAL_VERSION = 0.4
MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def universal_layout(ck: Checkpoint, tensors: list[str], objects: list[str]) -> dict:
    """Which source entry goes to which universal file: ``files`` (rel -> (entry, out
    dtype, wrap in {"param": ...})), the param names, the step entry, param groups and
    the client state (name -> entry). Refuses what a universal checkpoint cannot hold.

    >>> from ckptctl.model import DTYPES, TensorEntry
    >>> ck = Checkpoint("x", "dcp", tensors={"model.w": TensorEntry("model.w", DTYPES["bfloat16"], (2,)),
    ...     "optim.state.w.exp_avg": TensorEntry("optim.state.w.exp_avg", DTYPES["float32"], (2,))})
    >>> sorted(universal_layout(ck, list(ck.tensors), [])["files"])
    ['zero/w/exp_avg.pt', 'zero/w/fp32.pt']
    """
    model = {n: n[len("model."):] if n.startswith("model.") else n
             for n in tensors if classify(n) == "model"}
    params = {p: n for n, p in model.items()}
    if len(params) != len(model):
        raise UsageError("two model entries map to one DeepSpeed parameter name")
    files: dict[str, tuple[str, str, bool]] = {}
    for p, n in params.items():
        if not is_param_name(p) or p == "optimizer_state.pt":
            raise UsageError(f"{n}: not a name a universal checkpoint folder can hold")
        d = ck.tensors[n].dtype
        out = "float32" if d.name in ("bfloat16", "float16") else d.name
        files[f"zero/{p}/fp32.pt"] = (n, out, True)
    steps: dict[str, str] = {}
    client: dict[str, str] = {}
    for n in tensors:
        if n in model:
            continue
        if classify(n) == "optim" and n.startswith("optim.state."):
            rest = n[len("optim.state."):]
            p, _, key = rest.rpartition(".")
            if p not in params:
                raise UsageError(f"{n}: optimizer state of no model parameter in the selection")
            t = ck.tensors[n]
            if key == "step":
                if t.numel != 1:
                    raise UsageError(f"{n}: a step of {t.numel} elements")
                files[f"zero/{p}/step.pt"] = (n, t.dtype.name, False)
                steps[p] = n
                continue
            if t.shape != ck.tensors[params[p]].shape:
                raise UsageError(f"{n}: shape {list(t.shape)} is not its parameter's")
            files[f"zero/{p}/{key}.pt"] = (n, t.dtype.name, True)
        elif classify(n) == "optim":
            raise UsageError(f"{n}: optimizer tensor a universal checkpoint has no place for")
        else:
            client[n] = n
    groups: dict[int, dict] = {}
    for n in objects:
        if n.startswith("optim.param_groups."):
            g, _, key = n[len("optim.param_groups."):].partition(".")
            if not g.isdigit() or not key:
                raise UsageError(f"{n}: not optim.param_groups.<index>.<key>")
            groups.setdefault(int(g), {})[key] = n
        elif n.startswith("optim.state."):
            p, _, key = n[len("optim.state."):].rpartition(".")
            if key == "step" and p in params:
                steps[p] = n
            else:
                raise UsageError(f"{n}: optimizer state a universal checkpoint has no place for")
        elif classify(n) == "optim":
            raise UsageError(f"{n}: optimizer entry a universal checkpoint has no place for")
        else:
            client[n] = n
    _same_states(files)
    return {"files": files, "params": params, "steps": steps, "groups": groups,
            "client": client}


def _same_states(files: dict) -> None:
    """Every parameter with optimizer state has the same state files as the others (the
    universal reader, and DeepSpeed's loader, want each of them for each parameter); one
    without any (frozen, a buffer) has its ``fp32.pt`` alone.

    >>> _same_states({"zero/a/fp32.pt": 0, "zero/a/exp_avg.pt": 0, "zero/b/fp32.pt": 0})
    >>> _same_states({"zero/a/fp32.pt": 0, "zero/a/0.pt": 0})
    Traceback (most recent call last):
    ckptctl.errors.UsageError: zero/a/0.pt: not a file a universal checkpoint holds (zero/<param>/<state>.pt)
    >>> _same_states({"zero/a/exp_avg.pt": 0, "zero/a/exp_avg_sq.pt": 0, "zero/b/exp_avg.pt": 0})
    Traceback (most recent call last):
    ckptctl.errors.UsageError: optim.state.b.exp_avg_sq: missing, though other parameters have theirs (a universal checkpoint holds the same states for each)
    """
    extra = universal_tree(dict.fromkeys(files, 0))[1]
    if extra:  # a state key that is no file name (optim.state.w.0)
        raise UsageError(f"{extra[0]}: not a file a universal checkpoint holds "
                         "(zero/<param>/<state>.pt)")
    keys: dict[str, set] = {}
    for rel in files:
        _, p, state = rel.split("/")
        if state != "fp32.pt":
            keys.setdefault(p, set()).add(state[:-len(".pt")])
    every = set().union(*keys.values()) if keys else set()
    for p in sorted(keys):
        if keys[p] != every:
            raise UsageError(f"optim.state.{p}.{sorted(every - keys[p])[0]}: missing, though "
                             "other parameters have theirs (a universal checkpoint holds the "
                             "same states for each)")


def _value(ck: Checkpoint, name: str):
    return decode_object(ck, name)


def _nested(ck: Checkpoint, names: dict[str, str], strip: str = "") -> dict:
    return nest([(tuple(int(p) if p.isdigit() else p for p in n[len(strip):].split(".")),
                  _value(ck, n)) for n in names.values()])


def write_universal(ck: Checkpoint, dst: str, *, tensors: list[str], objects: list[str],
                    plan, max_memory: int, opts: dict | None, force: bool = False,
                    on_bytes=None) -> tuple[dict, str]:
    """Write the universal checkpoint of the selected entries of ``ck`` into ``dst`` (a
    new or empty folder), then ``latest_universal`` beside it. ``plan``: consolidate's
    (one whole target chunk per tensor), streamed in row blocks within ``max_memory``.
    Returns (file -> (digest, size), manifest id)."""
    from ..formats.torchwrite import TensorRef, TorchSize, TorchZipWriter, pickle_state
    from ..writing.output import OutputDir

    lay = universal_layout(ck, tensors, objects)
    files = lay["files"]
    step_value = None
    if lay["steps"]:
        values = {_step_number(ck, n) for n in lay["steps"].values()}
        if len(values) > 1:
            raise UsageError(f"the parameters' optimizer steps differ ({sorted(values)[:4]}): "
                             "DeepSpeed keeps one step per param group")
        step_value = values.pop()
    client = dict(lay["client"])
    tensor_client = [n for n in client if n in ck.tensors]
    if tensor_client:
        raise UsageError(f"{', '.join(tensor_client[:3])}: tensors outside the model and "
                         "optimizer, which a universal checkpoint has no place for; leave "
                         "them out with --drop")
    scheduler = {k: v for k, v in client.items() if classify(k) == "lr_scheduler"}
    step_entry = client.pop("step", None)
    for k in scheduler:
        client.pop(k)
    for k in [k for k in client if k.startswith("meta.deepspeed.")]:
        client.pop(k)  # the source's DeepSpeed bookkeeping: this writer's own is below
    global_steps = ck.step if ck.step is not None else (
        _value(ck, step_entry) if step_entry else 0)
    groups = []
    for g in sorted(lay["groups"]):
        keys = lay["groups"][g]
        group = {k: _value(ck, n) for k, n in keys.items() if k != "params"}
        names = _value(ck, keys["params"]) if "params" in keys else None
        group["params"] = names if isinstance(names, list) else []  # DeepSpeed: unread
        groups.append(group)
    if not groups:
        raise UsageError("the source holds no optimizer param groups (optim.param_groups.*): "
                         "DeepSpeed's universal loader needs their hyper-parameters")
    if step_value is None:
        raise UsageError("the source holds no optimizer step (optim.state.<param>.step)")
    shapes = {p: TorchSize(ck.tensors[n].shape) for p, n in lay["params"].items()}
    model_states = {
        "module": {}, "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": _nested(ck, scheduler, "lr_scheduler.") if scheduler else None,
        "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": [],
        "skipped_steps": 0, "global_steps": int(global_steps), "global_samples": 0,
        "dp_world_size": 1, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {}, "ds_version": DS_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_VERSION},
        **_nested(ck, {k: n for k, n in client.items() if not k.startswith(CLIENT + ".")}),
        **_nested(ck, {k: n for k, n in client.items() if k.startswith(CLIENT + ".")},
                  CLIENT + "."),  # a DeepSpeed source's client state: top-level again
    }
    step_ref = TensorRef("0", "float32", ())
    optimizer_state = {"param_groups": groups, "ds_version": DS_VERSION,
                       "optimizer_state_dict": {"state": {0: {"step": step_ref}},
                                                "param_groups": groups}}
    od = OutputDir(open_store(dst, opts), command="consolidate --to deepspeed-universal",
                   force=force, source=ck.root)
    order = sorted(files)
    by_name = {tc.name: tc for tc in plan.chunks}
    out_dtype = {entry: dtype for entry, dtype, _ in files.values()}

    def convert_for(tc):  # 16-bit weights widen to fp32 master weights (exact)
        return dtype_converter(tc.dtype.name, out_dtype[tc.name])

    s = BlockStream(ck, [by_name[files[rel][0]] for rel in order],
                    depth=stream_depth(max_memory, 1), convert_for=convert_for)

    def one(rel: str) -> tuple[str, tuple]:
        entry, dtype, wrap = files[rel]
        ref = TensorRef("0", dtype, ck.tensors[entry].shape)
        with od.open(rel) as f:
            w = HashingWriter(f, on_bytes=on_bytes)
            zw = TorchZipWriter(w, pickle_state({"param": ref} if wrap else ref))
            zw.write_record("0", s.blocks(entry))
            zw.close()
        return rel, w.result()

    def small(rel: str, obj, records: dict | None = None) -> tuple[str, tuple]:
        with od.open(rel) as f:
            w = HashingWriter(f, on_bytes=on_bytes)
            zw = TorchZipWriter(w, pickle_state(obj))
            for key, data in (records or {}).items():
                zw.write_record(key, [data])
            zw.close()
        return rel, w.result()

    with od:
        hashes = dict(one(rel) for rel in order)  # in the stream's order: one reader
        hashes.update([small("zero/optimizer_state.pt", optimizer_state,
                             {"0": struct.pack("<f", float(step_value))})])
        for rel in MODEL_FILES:
            hashes.update([small(rel, model_states)])
        od.commit()
        mid = commit_written(od.store, hashes, step=ck.step)
    parent, tag = posixpath.split(dst.rstrip("/"))
    if tag and parent:  # DeepSpeed's convention: the save folder names its universal tag
        open_store(parent, opts).write_atomic(LATEST_UNIVERSAL, tag.encode())
    return hashes, mid


def _step_number(ck: Checkpoint, name: str) -> float:
    """An optimizer step's value (a 0-d tensor or a plain number)."""
    if name in ck.objects:
        v = _value(ck, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise UsageError(f"{name}: step is {type(v).__name__}, not a number")
        return float(v)
    from ..formats.tensorio import read_tensor

    import numpy as np

    t = ck.tensors[name]
    raw = read_tensor(ck, name).reshape(-1).view(np.uint8)
    kinds = {"float32": "<f4", "float64": "<f8", "int64": "<i8", "int32": "<i4",
             "bfloat16": None, "float16": "<f2"}
    if t.dtype.name not in kinds:
        raise UsageError(f"{name}: step of dtype {t.dtype.name}")
    if t.dtype.name == "bfloat16":
        return float(np.frombuffer(b"\0\0" + bytes(raw), "<f4")[0])
    return float(np.frombuffer(bytes(raw), kinds[t.dtype.name])[0])

