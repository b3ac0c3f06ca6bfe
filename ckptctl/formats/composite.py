"""Folders of model files and other state files as ONE checkpoint with one entry tree.

accelerate's ``save_state`` and the HF Trainer write a folder of several files: the model
(``model.safetensors`` or ``pytorch_model.bin``, maybe sharded with an index), the
optimizer, the scheduler, RNG states, ... Each file's entries go under a prefix that says
what it is; a file that cannot be placed is refused by name, never dropped:

==============================================  =====================================
file                                            entries
==============================================  =====================================
``model*.safetensors``, ``pytorch_model*.bin``  ``model.`` (``model_1.`` for a 2nd model)
``optimizer*.bin`` / ``.pt``                    ``optim.`` (``optim_1.``)
``scheduler*.bin`` / ``.pt``                    ``lr_scheduler.`` (``lr_scheduler_1.``)
``dl_state_dict*.bin``                          ``dataloader.`` (``dataloader_1.``)
``sampler*.bin``                                ``dataloader.sampler.`` (or one opaque
                                                object ``dataloader.sampler`` when it
                                                pickles a sampler object)
``scaler.pt``                                   ``scaler.``
``random_states_N.pkl``, ``rng_state_N.pth``    one opaque object ``rng.N``
``custom_checkpoint_N.pkl``                     one opaque object ``custom.N``
``training_args.bin``                           one opaque object ``meta.training_args``
==============================================  =====================================

Opaque objects are never unpickled: they are reported with their byte size, and
conversions refuse them unless ``--only`` leaves them out.

A folder of model files only (plus JSON and tokenizer side files) is a plain model: its
names stay unprefixed (``lm_head.weight``), as its loader expects.

>>> p = plan_folder({"model.safetensors": 1, "optimizer.bin": 1, "scheduler.bin": 1,
...                  "random_states_0.pkl": 1, "config.json": 1})
>>> p.format, [(x.role, x.prefix, x.files, x.opaque) for x in p.parts]
...                                                  # doctest: +NORMALIZE_WHITESPACE
('composite', [('model', 'model.', ['model.safetensors'], False),
               ('optim', 'optim.', ['optimizer.bin'], False),
               ('rng', 'rng.0', ['random_states_0.pkl'], True),
               ('lr_scheduler', 'lr_scheduler.', ['scheduler.bin'], False)])
>>> [(x.prefix, x.files) for x in plan_folder({"pytorch_model.bin": 1, "config.json": 1}).parts]
[('', ['pytorch_model.bin'])]
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import FormatError, UnsafeInputError, UnsupportedFormatError, UsageError
from ..model import Checkpoint, ObjectEntry
from ..storage import Store

_MODEL_ST = re.compile(r"^model(?:_(\d+))?(?:-\d+-of-\d+)?\.safetensors$")
_MODEL_BIN = re.compile(r"^pytorch_model(?:_(\d+))?(?:-\d+-of-\d+)?\.bin$")
_MODEL_INDEX = re.compile(r"^(model|pytorch_model)(?:_(\d+))?\.(safetensors|bin)\.index\.json$")
#: torch.save weights that a plain model folder may hold besides (or instead of) safetensors.
_WEIGHTS_BIN = re.compile(r"^(pytorch_model|adapter_model|diffusion_pytorch_model)"
                          r"(?:-\d+-of-\d+)?\.bin$")

#: (pattern, role, how) for state files; ``how``: "torch" (load, weights only), "opaque"
#: (never unpickled), "torch-or-opaque" (a state dict, or a pickled object).
_STATE = [
    (re.compile(r"^optimizer(?:_(\d+))?\.(?:bin|pt|pth)$"), "optim", "torch"),
    (re.compile(r"^scheduler(?:_(\d+))?\.(?:bin|pt|pth)$"), "lr_scheduler", "torch"),
    (re.compile(r"^dl_state_dict(?:_(\d+))?\.bin$"), "dataloader", "torch"),
    (re.compile(r"^sampler(?:_(\d+))?\.bin$"), "sampler", "torch-or-opaque"),
    (re.compile(r"^random_states_(\d+)\.pkl$"), "rng", "opaque"),
    (re.compile(r"^rng_state(?:_(\d+))?\.pth$"), "rng", "opaque"),
    (re.compile(r"^custom_checkpoint_(\d+)\.pkl$"), "custom", "opaque"),
    (re.compile(r"^scaler\.pt$"), "scaler", "torch"),
    (re.compile(r"^training_args\.bin$"), "training_args", "opaque"),
]
#: what every _STATE name starts with: most names in a folder are none of them, and one
#: startswith says so (a 1,000-shard folder: 1,000 calls, not 9,000 regex matches)
_STATE_PREFIXES = ("optimizer", "scheduler", "dl_state_dict", "sampler", "random_states_",
                   "rng_state", "custom_checkpoint_", "scaler.pt", "training_args.bin")
#: Roles whose presence makes a folder a multi-file training state.
_TRIGGERS = {"optim", "lr_scheduler", "dataloader", "sampler", "rng", "custom"}
_OPAQUE_TYPES = {"rng": "opaque RNG state (pickle)", "custom": "opaque custom object (pickle)",
                 "training_args": "opaque TrainingArguments (pickle)",
                 "sampler": "opaque sampler object (pickle)"}
KNOWN = ("model*.safetensors, pytorch_model*.bin, optimizer*.bin, scheduler*.bin, "
         "sampler*.bin, dl_state_dict*.bin, random_states_N.pkl, custom_checkpoint_N.pkl")


@dataclass
class Part:
    """One piece of a folder: its role, the prefix (or, opaque, the object name) its
    entries get, its files (an index and shards, or one file) and how to read them."""

    role: str
    prefix: str
    files: list[str]
    fmt: str  # "safetensors", "torch", "opaque", "torch-or-opaque"
    index: str | None = None

    @property
    def opaque(self) -> bool:
        return self.fmt == "opaque"


@dataclass
class FolderPlan:
    format: str  # "composite", "safetensors", "hf-safetensors", "torch"
    parts: list[Part] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)  # file -> why it is not read


def _num(m: re.Match) -> int:
    return int(m.group(1)) if m.group(1) is not None else 0


def _state_role(name: str):
    if not name.startswith(_STATE_PREFIXES):
        return None
    for pat, role, how in _STATE:
        m = pat.match(name)
        if m:
            return role, (_num(m) if m.groups() else 0), how
    return None


def is_state_folder(files) -> bool:
    """True when a folder holds training-state files besides (or without) a model."""
    return any((r := _state_role(f)) and r[0] in _TRIGGERS for f in files if "/" not in f)


def _numbered(base: str, n: int) -> str:
    return base if n == 0 else f"{base}_{n}"


def _model_parts(top: list[str], files, *, prefixed: bool) -> tuple[list[Part], dict, set]:
    """Model groups (by model number): safetensors preferred over .bin; returns the parts,
    the ignored duplicate-weight files and every file the parts claim."""
    groups: dict[int, dict[str, list[str]]] = {}
    indexes: dict[tuple[int, str], str] = {}
    for f in top:
        if m := _MODEL_ST.match(f):
            groups.setdefault(_num(m), {}).setdefault("safetensors", []).append(f)
        elif m := _MODEL_BIN.match(f):
            groups.setdefault(_num(m), {}).setdefault("torch", []).append(f)
        elif m := _MODEL_INDEX.match(f):
            n = int(m.group(2)) if m.group(2) else 0
            indexes[(n, "safetensors" if m.group(3) == "safetensors" else "torch")] = f
            groups.setdefault(n, {}).setdefault(
                "safetensors" if m.group(3) == "safetensors" else "torch", [])
    parts, ignored, claimed = [], {}, set()
    for n in sorted(groups):
        kinds = groups[n]
        fmt = "safetensors" if "safetensors" in kinds else "torch"
        for other in kinds:
            if other != fmt:
                for f in kinds[other]:
                    ignored[f] = "the same weights are read from the safetensors files"
                if (n, other) in indexes:
                    ignored[indexes[(n, other)]] = "index of the ignored .bin weights"
        prefix = _numbered("model", n) + "." if prefixed else ""
        idx = indexes.get((n, fmt))
        parts.append(Part("model", prefix, sorted(kinds[fmt]), fmt, idx))
        claimed.update(kinds[fmt])
        if idx:
            claimed.add(idx)
    return parts, ignored, claimed


def plan_folder(files) -> FolderPlan:
    """Decide what each top-level file of a (non-DCP) folder is; pure, no I/O.

    Raises :class:`UnsupportedFormatError` for a torch.save or pickle file that cannot
    be placed, and for several unrelated torch.save files in one folder.
    """
    top = sorted(f for f in files if "/" not in f)
    torch_files = [f for f in top if f.endswith((".pt", ".pth", ".bin", ".ckpt"))]
    if is_state_folder(top):
        nested = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f and f.rsplit("/", 1)[1]
                         .endswith((".metadata", ".distcp", ".safetensors", ".bin", ".pt"))})
        if nested:  # accelerate's FSDP layout keeps model and optimizer in DCP subfolders
            raise UnsupportedFormatError(
                nested[0] + "/", "a checkpoint inside this multi-file checkpoint's folder "
                "(accelerate's sharded FSDP layout?): ckptctl does not merge it in; open "
                "it on its own")
        plan = FolderPlan("composite")
        parts, plan.ignored, claimed = _model_parts(top, files, prefixed=True)
        plan.parts.extend(parts)
        for f in top:
            if f in claimed or f in plan.ignored:
                continue
            r = _state_role(f)
            if r is None:
                if f.endswith((".pt", ".pth", ".bin", ".ckpt", ".pkl", ".safetensors")):
                    raise UnsupportedFormatError(
                        f, "a state file ckptctl cannot place in this multi-file checkpoint "
                        f"(known: {KNOWN}); refusing rather than leaving it out")
                continue  # JSON, tokenizer and other side files
            role, n, how = r
            if how == "opaque":
                name = {"rng": f"rng.{n}", "custom": f"custom.{n}",
                        "training_args": "meta.training_args"}[role]
                plan.parts.append(Part(role, name, [f], "opaque"))
            elif role == "sampler":
                plan.parts.append(Part(role, _numbered("dataloader", n) + ".sampler.", [f], how))
            else:
                base = {"optim": "optim", "lr_scheduler": "lr_scheduler",
                        "dataloader": "dataloader", "scaler": "scaler"}[role]
                plan.parts.append(Part(role, _numbered(base, n) + ".", [f], how))
        return plan
    if any(f.endswith(".safetensors") for f in top) or "model.safetensors.index.json" in top:
        plan = FolderPlan("hf-safetensors" if "model.safetensors.index.json" in top
                          else "safetensors")
        for f in torch_files:
            if _WEIGHTS_BIN.match(f):
                plan.ignored[f] = "the same weights are read from the safetensors files"
            elif f == "training_args.bin":
                plan.ignored[f] = "trainer configuration, not checkpoint state"
            else:
                raise UnsupportedFormatError(
                    f, "a torch.save file next to safetensors model files that ckptctl "
                    f"cannot place (known: {KNOWN}); refusing rather than leaving it out")
        return plan  # read by safetensors.read_safetensors
    weights = [f for f in torch_files if _WEIGHTS_BIN.match(f)]
    plan = FolderPlan("torch")
    if weights:
        index = next((f for f in top if f.endswith(".bin.index.json")), None)
        plan.parts.append(Part("model", "", weights, "torch", index))
        for f in torch_files:
            if f in weights:
                continue
            if f == "training_args.bin":
                plan.ignored[f] = "trainer configuration, not checkpoint state"
                continue
            raise UnsupportedFormatError(
                f, "a torch.save file next to the model weights that ckptctl cannot place "
                f"(known: {KNOWN}); refusing rather than merging it into the model")
        return plan
    if len(torch_files) > 1:
        shown = ", ".join(torch_files[:4]) + (", ..." if len(torch_files) > 4 else "")
        raise UnsupportedFormatError(None, f"{len(torch_files)} torch.save files that are not "
                                     f"parts of one checkpoint ({shown}): open each file on its own")
    plan.parts.extend(Part("model", "", [f], "torch") for f in torch_files)
    return plan


def read_folder(store: Store, files: dict[str, int], plan: FolderPlan | None = None) -> Checkpoint:
    """Read a non-DCP folder as planned by :func:`plan_folder` into one checkpoint."""
    from . import safetensors

    try:
        plan = plan or plan_folder(files)
    except UnsupportedFormatError as e:  # name the file where the user can find it
        raise UnsupportedFormatError(store.display(e.path) if e.path else store.url,
                                     e.message) from None
    if plan.format in ("safetensors", "hf-safetensors"):
        ck = safetensors.read_safetensors(store, files)
    else:
        ck = Checkpoint(root=store.url, format=plan.format, store=store, files=dict(files))
        for part in plan.parts:
            _read_part(ck, store, files, part)
    if plan.ignored:
        ck.info["ignored_files"] = dict(plan.ignored)
    if plan.format == "composite":
        ck.info["parts"] = {f: p.role for p in plan.parts for f in p.files}
    return ck


def _read_part(ck: Checkpoint, store: Store, files: dict[str, int], part: Part) -> None:
    from . import safetensors, torchsave

    if part.fmt == "safetensors":
        safetensors.add_model_files(ck, store, files, part.files, index=part.index,
                                    prefix=part.prefix)
        return
    if part.opaque:
        _add_opaque(ck, part, files)
        return
    if part.fmt == "torch-or-opaque":
        try:
            torchsave.add_torch_file(ck, store, part.files[0], files[part.files[0]], part.prefix)
        except UnsafeInputError:  # a pickled object, not a state dict: keep it opaque
            _add_opaque(ck, Part(part.role, part.prefix.rstrip("."), part.files, "opaque"), files)
        return
    # torch model weights (maybe sharded, maybe with an index) or one state file
    if part.index is not None:
        wanted = safetensors._read_index(store, files, part.index)
        safetensors.check_shard_set(store, [f for f in files if "/" not in f and f.endswith(".bin")],
                                    index_refs=wanted)
        names = sorted(wanted)
    else:
        safetensors.check_shard_set(store, part.files)
        names = part.files
    before = set(ck.tensors) | set(ck.objects)
    for rel in names:
        torchsave.add_torch_file(ck, store, rel, files[rel], part.prefix)
    if part.index is not None:
        listed = {part.prefix + n for ns in wanted.values() for n in ns}
        got = (set(ck.tensors) | set(ck.objects)) - before
        if listed != got:
            odd = sorted(listed ^ got)
            raise FormatError(store.display(part.index), f"{odd[0]}: weight_map and the shard "
                              f"files disagree ({len(odd)} such names)", code="INDEX_MISMATCH")


def _add_opaque(ck: Checkpoint, part: Part, files: dict[str, int]) -> None:
    from ..model import Extent

    rel = part.files[0]
    name = part.prefix
    if name in ck.tensors or name in ck.objects:
        raise FormatError(ck.store.display(rel), f"{name}: also stored in another file")
    ck.objects[name] = ObjectEntry(name, Extent(rel, 0, files[rel], OPAQUE),
                                   type_name=_OPAQUE_TYPES.get(part.role, "opaque pickle"))


#: Extent encoding of a payload that is never decoded (a plain pickle of arbitrary objects).
OPAQUE = "opaque"


def opaque_objects(ck: Checkpoint, names=None) -> list[str]:
    """Names of the objects (of ``names``, default all) that are opaque pickles."""
    pool = ck.objects if names is None else {n: ck.objects[n] for n in names if n in ck.objects}
    return sorted(n for n, o in pool.items() if o.extent is not None and o.extent.encoding == OPAQUE)


def refuse_opaque(ck: Checkpoint, names=None, *, verb: str,
                  hint: str = "leave {them} out with --only (e.g. --only model,optim)") -> None:
    """Raise :class:`UsageError` when the selection holds opaque objects that a
    conversion cannot carry; the message names a few and suggests ``--only`` (or gives
    the reader's reason, ``ck.info["opaque_reason"][name]``, with its own hint).

    >>> from ckptctl.model import Extent
    >>> ck = Checkpoint("x", "composite", objects={"rng.0": ObjectEntry("rng.0",
    ...     Extent("random_states_0.pkl", 0, 10, OPAQUE))})
    >>> refuse_opaque(ck, verb="consolidate")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: consolidate cannot convert 1 opaque pickled object (rng.0): it is never unpickled; leave it out with --only (e.g. --only model,optim)
    """
    bad = opaque_objects(ck, names)
    if not bad:
        return
    shown = ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else "")
    one = len(bad) == 1
    reasons = ck.info.get("opaque_reason") or {}  # the reader's own words, with a hint
    why = [n for n in bad if n in reasons]
    if why:
        rest = [n for n in bad if n not in reasons]
        also = (f"; and {len(rest)} opaque pickled object{'' if len(rest) == 1 else 's'} "
                f"({', '.join(rest[:4])}{', ...' if len(rest) > 4 else ''}), never "
                "unpickled") if rest else ""
        raise UsageError(f"{verb} cannot convert {', '.join(why[:4])}"
                         f"{', ...' if len(why) > 4 else ''}: {reasons[why[0]]}{also}")
    raise UsageError(f"{verb} cannot convert {len(bad)} opaque pickled object{'' if one else 's'} "
                     f"({shown}): {'it is' if one else 'they are'} never unpickled; "
                     + hint.format(them="it" if one else "them"))
