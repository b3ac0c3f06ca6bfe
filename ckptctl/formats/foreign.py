"""What is at a place that ckptctl does not open as one checkpoint: another framework's
layout (DeepSpeed, Megatron-core, Orbax), or a run folder holding several checkpoints.
The layouts that have a reader (DeepSpeed ZeRO and universal, Megatron-core ``torch_dist``
and legacy, Orbax step and item folders) are named here and handed to it.

Such a place is refused by name (exit 3 "not a format ckptctl reads: looks like ...",
exit 2 for a run folder given where one checkpoint is expected), never read in part: a
DeepSpeed ZeRO-3 ``*_model_states.pt`` holds 0-element placeholders where its parameters
would be, a universal checkpoint keeps its tensors in ``zero/<param>/`` folders a
torch.save reader would skip, a Megatron ``.metadata`` pickles planner objects.

The names of the files decide (:func:`recognise`); one small read (Megatron's
``metadata.json``) names a backend or tells a stray ``metadata.json`` beside DCP files
apart (:func:`refuse_if_foreign`).

>>> recognise({"zero_pp_rank_0_mp_rank_00_model_states.pt": 9,
...            "zero_pp_rank_0_mp_rank_00_optim_states.pt": 9})
'DeepSpeed ZeRO-3 (model and optimizer partitions)'
>>> recognise({"mp_rank_00_model_states.pt": 9, "zero/w/fp32.pt": 9, "zero/w/exp_avg.pt": 9})
'DeepSpeed universal checkpoint'
>>> recognise({"metadata.json": 9, ".metadata": 9, "__0_0.distcp": 9, "common.pt": 9})
'Megatron-core torch_dist'
>>> recognise({"_CHECKPOINT_METADATA": 9, "default/manifest.ocdbt": 9, "default/_METADATA": 9})
'Orbax (OCDBT)'
>>> recognise({".metadata": 9, "__0_0.distcp": 9}) is None
True
"""
from __future__ import annotations

import posixpath
import re

from ..errors import CkptError, FormatError, StorageError, UnsupportedFormatError
from ..model import natural_key
from .deepspeed import ZERO3_MODEL
from .locate import DEEPSPEED_SAVE_SIDE, LATEST, LATEST_UNIVERSAL
from .megatron import COMMON, CONFIG, CONFIG_LIMIT
from .megatron_legacy import is_legacy

#: DeepSpeed's own globs: ``*_model_states.pt`` (``mp_rank_XX_``, ZeRO-3's
#: ``zero_pp_rank_D_mp_rank_XX_``, pipeline ``layer_XX-...-``, MoE ``..._expert_E_...``)
#: and ``*optim_states.pt`` (``[bf16_]zero_pp_rank_D_mp_rank_XX_``, MoE ``expp_rank_X_...``).
_DS_MODEL = re.compile(r"(?:(?:^|_)mp_rank_\d+_|^layer_\d+-.*)model_states\.pt$")
_DS_OPTIM = re.compile(r"(?:^|_)mp_rank_\d+_?optim_states\.pt$")
_DS_LAYER = re.compile(r"^layer_\d+-.*model_states\.pt$")
_DS_EXPERT = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$")
_DS_SCRIPT = "zero_to_fp32.py"
_DS_LATEST = (LATEST, LATEST_UNIVERSAL)
#: What DeepSpeed (and ckptctl) put at a save folder's top beside the tag folders.
_DS_SAVE_SIDE = {*DEEPSPEED_SAVE_SIDE, "ckptctl.manifest.json"}
#: ``ds_to_universal``'s output: ``zero/<param>/fp32.pt`` (+ ``exp_avg``, ``exp_avg_sq``,
#: ``step``) and ``zero/optimizer_state.pt``, beside the copied ``*_model_states.pt``.
_DS_UNIVERSAL = re.compile(r"^zero/(?:[^/]+/(?:fp32|exp_avg|exp_avg_sq|step)|optimizer_state)"
                           r"\.pt$")

#: Megatron: ``iter_NNNNNNN/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt`` (+ distrib_optim.pt)
_MEG_RANK_DIR = re.compile(r"^mp_rank_\d+(?:_\d+){0,2}$")
_MEG_FILES = {"model_optim_rng.pt", "distrib_optim.pt"}
#: NeMo 1's per-rank weights (``.nemo`` / ``.ckpt`` with TP or PP > 1): flat state dicts
_NEMO_RANK = re.compile(r"^(?:mp_rank_\d+|tp_rank_\d+_pp_rank_\d+)/model_weights\.ckpt$")
_MEG_TRACKER = "latest_checkpointed_iteration.txt"
#: what may sit beside the rank folders of a legacy iteration folder that ckptctl reads
_LEGACY_SIDE = {"ckptctl.manifest.json", ".ckptctl-pinned"}
_MEG_CONFIG = CONFIG
_MEG_COMMON = COMMON

#: Orbax: a step folder holds ``_CHECKPOINT_METADATA`` and one folder per item, each
#: with ``_METADATA``, ``_sharding``, and (OCDBT) ``manifest.ocdbt``, ``d/``, ``ocdbt.process_N/``.
_ORBAX_STEP = "_CHECKPOINT_METADATA"
_ORBAX_ITEM = {"_METADATA", "_sharding", "manifest.ocdbt"}

#: detect_format's name for each framework (the first word of the human name)
_FORMATS = {"DeepSpeed": "deepspeed", "Megatron-core": "megatron", "Megatron": "megatron",
            "Orbax": "orbax", "NeMo": "nemo"}

MEGATRON_DIST = "Megatron-core torch_dist"


def _deepspeed(names: set[str]) -> str | None:
    """The DeepSpeed kind that a tag folder's file names make up, or None."""
    model = {n for n in names if _DS_MODEL.search(n)}
    optim = {n for n in names if _DS_OPTIM.search(n)}
    if not model and not optim:
        return None
    if any(ZERO3_MODEL.match(n) for n in model):
        return "DeepSpeed ZeRO-3 (model and optimizer partitions)" if optim else \
            "DeepSpeed ZeRO-3 (model partitions)"
    if any(_DS_LAYER.match(n) for n in model):
        return "DeepSpeed pipeline (per-layer model states)"
    if any(_DS_EXPERT.match(n) for n in model):
        return "DeepSpeed MoE (expert model states)"
    if optim:
        return "DeepSpeed ZeRO-1/2 (optimizer partitions)"
    return "DeepSpeed (model states)"


def _orbax(top: set[str], paths) -> str | None:
    if _ORBAX_STEP not in top and not top & _ORBAX_ITEM:
        return None
    ocdbt = any(p.rsplit("/", 1)[-1] == "manifest.ocdbt" or p.startswith("ocdbt.process_")
                or "/ocdbt.process_" in p for p in paths)
    return "Orbax (OCDBT)" if ocdbt else "Orbax"


def recognise(files: dict[str, int]) -> str | None:
    """The framework layout a folder's listing (paths relative to the folder, as deep as
    listed) makes up, from the names alone, or None for anything else.

    A DeepSpeed tag folder (``*_model_states.pt``, ``*_optim_states.pt``), universal
    checkpoint (``zero/<param>/fp32.pt``) or save folder (``latest`` beside tag folders);
    Megatron-core's ``metadata.json`` beside DCP files or ``common.pt``, its legacy
    ``mp_rank_TT_PPP/model_optim_rng.pt`` folders, or a run folder
    (``latest_checkpointed_iteration.txt``); Orbax's ``_CHECKPOINT_METADATA``,
    ``_METADATA``, ``manifest.ocdbt``. A file given alone is named by its path's last
    parts (``zero/w/fp32.pt``, ``mp_rank_00/model_optim_rng.pt``).

    >>> recognise({"latest": 1, "zero_to_fp32.py": 9, "global_step5/mp_rank_00_model_states.pt": 9,
    ...            "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt": 9})
    'DeepSpeed ZeRO-1/2 (optimizer partitions), a save folder of 1 checkpoint (global_step5)'
    >>> recognise({"mp_rank_00/model_optim_rng.pt": 9})
    'Megatron legacy (mp_rank_TT_PPP/model_optim_rng.pt)'
    >>> recognise({"model.pt": 9, "optimizer.pt": 9}) is None
    True
    """
    top = {f for f in files if "/" not in f}
    if kind := _deepspeed(top):
        return "DeepSpeed universal checkpoint" if any(map(_DS_UNIVERSAL.match, files)) \
            else kind
    if any(map(_DS_UNIVERSAL.match, files)):
        return "DeepSpeed universal checkpoint"
    if any(map(_NEMO_RANK.match, files)):
        return "NeMo 1 per-rank model weights (mp_rank_TT/model_weights.ckpt)"
    if top & _MEG_FILES or any(f.count("/") == 1 and _MEG_RANK_DIR.match(f.split("/")[0])
                               and f.split("/")[1] in _MEG_FILES for f in files):
        return "Megatron legacy (mp_rank_TT_PPP/model_optim_rng.pt)"
    if _MEG_CONFIG in top and (".metadata" in top or _MEG_COMMON in top
                               or any(f.endswith(".distcp") for f in top)):
        return MEGATRON_DIST
    if kind := _orbax(top, files):
        return kind
    if top & set(_DS_LATEST) or _DS_SCRIPT in top or _MEG_TRACKER in top:  # a save folder
        tags: dict[str, set[str]] = {}
        for f in files:
            if f.count("/") >= 1:
                d, rest = f.split("/", 1)
                tags.setdefault(d, set()).add(rest)
        found = {d: recognise({r: 0 for r in rest}) for d, rest in tags.items()}
        found = {d: k for d, k in found.items() if k}
        if found:
            kinds = sorted(set(found.values()))
            names = sorted(found, key=natural_key)
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            return (f"{' / '.join(kinds)}, a save folder of {len(names)} "
                    f"checkpoint{'s' if len(names) != 1 else ''} ({shown})")
    return None


def format_of(files: dict[str, int]) -> str | None:
    """``deepspeed``, ``megatron`` or ``orbax`` for a listing :func:`recognise` names,
    else None: what :func:`~ckptctl.formats.detect.detect_format` says.

    >>> format_of({"mp_rank_00_model_states.pt": 9}), format_of({"model.pt": 9})
    ('deepspeed', None)
    """
    name = recognise(files)
    return _FORMATS[name.split(" ", 1)[0]] if name else None


def _file_listing(url: str, single: str, size: int) -> dict[str, int]:
    """A lone file's name with the parts of its path that name a layout (the
    ``zero/<param>/`` of a universal checkpoint, Megatron's ``mp_rank_TT/``)."""
    parts = url.rstrip("/").split("/")
    tail = "/".join(parts[-3:]) if len(parts) >= 3 else single
    if _DS_UNIVERSAL.match(tail):
        return {tail: size}
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else single
    if tail.count("/") == 1 and _MEG_RANK_DIR.match(tail.split("/")[0]):
        return {tail: size}
    return {single: size}


def not_read(url: str, name: str) -> UnsupportedFormatError:
    """The refusal of a place that holds ``name``'s layout (exit 3); its ``framework``
    is ``name``.

    >>> str(not_read("ck/", "Orbax (OCDBT)"))
    'ck/: not a format ckptctl reads: looks like Orbax (OCDBT)'
    """
    e = UnsupportedFormatError(url, f"not a format ckptctl reads: looks like {name}")
    e.framework = name  # verify and ls tell this refusal from "nothing recognised"
    return e


def _megatron_backend(store, size: int) -> str | None:
    """``sharded_backend`` of Megatron's ``metadata.json`` (one small read), or None when
    the file says nothing of the kind (someone's own ``metadata.json`` beside DCP files)."""
    from .limits import load_json

    if size > CONFIG_LIMIT:
        return None
    try:
        doc = load_json(store.read(_MEG_CONFIG), store.display(_MEG_CONFIG))
    except StorageError:
        raise
    except CkptError:
        return None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    return str(backend) if backend else None


def refuse_if_foreign(url: str, files: dict[str, int], store=None,
                      single: str | None = None) -> str | None:
    """Raise :class:`~ckptctl.errors.UnsupportedFormatError` (exit 3, "not a format
    ckptctl reads: looks like <framework>") when the place at ``url`` (its listing
    ``files``, or the one file ``single``) is another framework's layout.

    With ``store``, Megatron's ``metadata.json`` is read (one small read) to name the
    backend; when it is no Megatron config the folder is plain DCP: returns ``"dcp"``,
    the format to read it as. Otherwise returns None.

    >>> refuse_if_foreign("ck/global_step2", {"mp_rank_00_model_states.pt": 9})
    Traceback (most recent call last):
    ckptctl.errors.UnsupportedFormatError: ck/global_step2: not a format ckptctl reads: looks like DeepSpeed (model states)
    >>> refuse_if_foreign("ck/step-2", {".metadata": 9, "__0_0.distcp": 9}) is None
    True
    """
    listing = _file_listing(url, single, files[single]) if single else files
    name = recognise(listing)
    if name is None:
        return None
    if single and _deepspeed_read(name):  # one rank's file of a layout read as a folder
        raise not_read(url, f"{name}: one file of a DeepSpeed checkpoint; open the folder "
                       "that holds it")
    if not single and (read := _deepspeed_read(name)):
        top = {f for f in files if "/" not in f}
        if read != "deepspeed-save" or top <= _DS_SAVE_SIDE:
            return read  # a save folder with other checkpoint files at its top stays refused
    if name.startswith("Megatron") and ", a save folder of " in name and store is not None:
        from .locate import pointers  # a run root whose tracker names no folder it holds

        for p in pointers(store, files):
            if p["file"] == _MEG_TRACKER and not p["present"]:
                what = f"names {p['names']}, which this folder does not hold" if p["names"] \
                    else "names no iteration"
                raise FormatError(store.display(_MEG_TRACKER), f"{what} (Megatron's resume "
                                  "would fail): name an iteration folder")
    if name.startswith("Orbax"):  # read: formats/orbax.py (a folder, never one file)
        if single:
            raise not_read(url, f"{name}: one file of an Orbax checkpoint; open the step or "
                           "item folder that holds it")
        return "orbax"
    if name.startswith("Megatron legacy") and single:
        raise not_read(url, f"{name}: one rank's file; open the iteration folder that holds "
                       "them all")
    if name.startswith("Megatron legacy") and is_legacy(files) and not any(
            "/" not in f and f not in _LEGACY_SIDE for f in files):
        return "megatron-legacy"  # read: formats/megatron_legacy.py
    if name == MEGATRON_DIST and store is not None and not single:
        backend = _megatron_backend(store, files[_MEG_CONFIG])
        if backend == "torch_dist" and ".metadata" in files:
            return "megatron-dist"  # read: formats/megatron.py
        if backend:
            name = f"Megatron-core {backend}"
        elif _MEG_COMMON not in files and ".metadata" in files:
            return "dcp"  # a metadata.json of someone else's beside a DCP checkpoint
    raise not_read(url, name)


def _deepspeed_read(name: str) -> str | None:
    """The format ckptctl reads a DeepSpeed layout ``recognise`` named as, or None (refused):
    ZeRO tag folders (``deepspeed``), universal checkpoints and save folders."""
    if not name.startswith("DeepSpeed"):
        return None
    if ", a save folder of " in name:
        return "deepspeed-save" if name.startswith(("DeepSpeed ZeRO", "DeepSpeed universal")) \
            else None
    if name == "DeepSpeed universal checkpoint":
        return "deepspeed-universal"
    return "deepspeed" if name.startswith("DeepSpeed ZeRO") else None


def refuse_megatron_plans(url: str, store, files: dict[str, int]) -> None:
    """After the DCP reader refused a ``.metadata``: when the pickle is Megatron-core's (it
    carries ``all_local_plans``) the folder lacks the ``metadata.json`` that commits a
    ``torch_dist`` save (the DCP reader gets none other): say that (``NOT_COMMITTED``), not
    that its pickle is unsafe. Reads ``.metadata`` again (the error path only).

    >>> try:                                                    # doctest: +SKIP
    ...     dcp.read_dcp(store, files)
    ... except FormatError:
    ...     refuse_megatron_plans("run/iter_0000010", store, files)  # not committed
    ...     raise
    """
    from .limits import MAX_METADATA_BYTES

    size = files.get(".metadata")
    if size is None or size > MAX_METADATA_BYTES:
        return
    try:
        raw = store.read(".metadata")
    except StorageError:
        raise
    except CkptError:
        return
    if b"all_local_plans" in raw:
        raise FormatError(url, f"a {MEGATRON_DIST} checkpoint without metadata.json: "
                          "Megatron writes it last, after every rank's data (the save did "
                          "not finish)", code="NOT_COMMITTED") from None


# ------------------------------------------------------------------ grouping a listing

def anchor(d: str, own: set[str]) -> str | None:
    """The folder (relative to the listing's root) of the foreign checkpoint that folder
    ``d``, holding the files ``own``, belongs to, or None (what
    :func:`~ckptctl.formats.detect.group_checkpoints` groups by).

    >>> anchor("run/global_step5", {"mp_rank_00_model_states.pt"}), anchor("a", {".metadata"})
    ('run/global_step5', None)
    """
    parent = posixpath.dirname(d)
    if _deepspeed(own):
        return d
    if posixpath.basename(parent) == "zero" and "fp32.pt" in own:
        return posixpath.dirname(parent)  # <ckpt>/zero/<param>/fp32.pt
    if posixpath.basename(d) == "zero" and "optimizer_state.pt" in own:
        return parent
    if own & _MEG_FILES:
        return parent if _MEG_RANK_DIR.match(posixpath.basename(d)) else d
    if "model_weights.ckpt" in own and _NEMO_RANK.match(f"{posixpath.basename(d)}/"
                                                         "model_weights.ckpt"):
        return parent  # NeMo 1's per-rank weights: the folder of rank folders
    if _MEG_CONFIG in own and (".metadata" in own or _MEG_COMMON in own
                               or any(f.endswith(".distcp") for f in own)):
        return d
    if _ORBAX_STEP in own or own & _ORBAX_ITEM:
        return d
    return None
