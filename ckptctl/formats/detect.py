"""Find out what is at a place and open it as a :class:`~ckptctl.model.Checkpoint`.

>>> detect_format({".metadata": 10, "__0_0.distcp": 100})
'dcp'
>>> detect_format({"model.safetensors": 10, "config.json": 2})
'safetensors'
>>> detect_format({"model.safetensors": 10, "optimizer.bin": 5, "random_states_0.pkl": 1})
'composite'
>>> detect_format({"zero_pp_rank_0_mp_rank_00_model_states.pt": 10})
'deepspeed'
>>> step_from_name("s3://b/run/global_step1200"), step_from_name("iter_0001200"), step_from_name("x")
(1200, 1200, None)
>>> step_from_name("ckpts/epoch=3-step=1200.ckpt"), step_from_name("m-epoch=0-step=7-v1.ckpt")
(1200, 7)
>>> step_from_name("run/30.orbax-checkpoint-tmp")
30
"""
from __future__ import annotations

import posixpath
import re

from ..errors import CkptError, FormatError, UnsupportedFormatError, UsageError
from ..model import Checkpoint, natural_key
from ..storage import Store
from . import (composite, dcp, deepspeed, foreign, megatron, megatron_legacy, orbax,
               safetensors, torchsave)
from .locate import file_format as _file_format
from .locate import latest_tag
from .locate import locate as locate_place
from .manifest import MANIFEST, WRITING_MARKER, read_manifest, sidecars, writer_unfinished
from .pack import PackStore, is_pack, pack_view
from .torchfile import read_torch_zip

_STEP_PATTERNS = [re.compile(p) for p in (
    r"^(?:step|global_step|checkpoint|ckpt|iter|iteration)[-_]?0*(\d+)$",
    r"^(?:step|global_step|checkpoint|ckpt|iter|iteration)[-_]?0*(\d+)\.\w+$",
)]
#: Lightning's ModelCheckpoint names: ``epoch=3-step=1200.ckpt``, ``m-step=7-v1.ckpt``.
_LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=(\d+)(?=[-_.]|$)")
#: An Orbax save in flight: ``30.orbax-checkpoint-tmp``, ``ckpt_30.orbax-checkpoint-tmp-1712``
#: (a finished step folder's bare ``30`` is read by formats/orbax.py, beside its metadata).
_ORBAX_TMP_STEP = re.compile(r"^(?:.*_)?0*(\d+)\.orbax-checkpoint-tmp(?:-\d+)?$")

#: Entries that hold the step, first found wins (torch.save, Lightning ``.ckpt``, folders).
STEP_ENTRIES = ("step", "global_step", "train_state.step", "trainer.step", "iteration")


def step_from_name(url: str) -> int | None:
    """The step a checkpoint's name carries (``step-1200``, ``global_step1200``,
    ``checkpoint-1200``, ``iter_0001200``, Lightning's ``epoch=3-step=1200.ckpt``), or None."""
    name = posixpath.basename(url.rstrip("/"))
    for pat in _STEP_PATTERNS:
        m = pat.match(name)
        if m:
            return int(m.group(1) or 0)
    m = _LIGHTNING_STEP.search(name) or _ORBAX_TMP_STEP.match(name)
    return int(m.group(1)) if m else None


def detect_format(files: dict[str, int]) -> str | None:
    """The format the files of a folder make up, or None."""
    if is_pack(files):  # its data-NNNNN.bin files are no torch.save files
        return "pack"
    if fw := foreign.format_of(files):  # DeepSpeed, Megatron, Orbax
        return fw
    if dcp.is_dcp(files):
        return "dcp"
    if composite.is_state_folder(files):
        return "composite"
    if safetensors.is_safetensors(files):
        return "safetensors"
    if any(torchsave.is_torch_file(f) for f in files):
        return "torch"
    return None


def not_a_checkpoint(store: Store, rel: str, size: int) -> str | None:
    """Why the torch-suffixed file ``rel`` is no checkpoint at all, from its first bytes
    (and a zip's directory), or None when it may be one (a damaged checkpoint stays one).

    A TorchScript archive (``torch.jit.save``: ``constants.pkl`` and ``code/`` records), a
    ``.pth`` text file (a Python path file). Anything else that fails to load may be a
    damaged checkpoint and is reported as such. One or two small reads; ``ls`` skips such
    files instead of calling them corrupt.
    """
    from .torchzip import TAIL_GUESS, central_directory

    if size == 0:
        return None
    head = store.read_range(rel, 0, min(size, 512))
    if head.startswith(torchsave.ZIP_MAGIC):
        try:
            tail = store.read_range(rel, max(0, size - TAIL_GUESS), size)
            entries, need = central_directory(tail, size)
            if need:
                entries, _ = central_directory(store.read_range(rel, size - need, size), size)
        except CkptError:  # a damaged zip: a damaged checkpoint
            return None
        records = {e.name.split("/", 1)[-1] for e in entries}
        if "constants.pkl" in records or any(r.startswith("code/") for r in records):
            return "a TorchScript archive (torch.jit.save), not a state dict"
        return None
    if not rel.endswith(".pth") or head[:1] == b"\x80":  # a pickle: a torch.save file
        return None
    text = None
    for cut in range(4):  # the 512 bytes may end inside a character
        try:
            text = head[:len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        return "a text file (a Python .pth path file), not a torch.save file"
    return None


def open_checkpoint(url: str, storage_options: dict | None = None, *, strict: bool = True,
                    read_step: bool = True, located: tuple | None = None,
                    allow_incomplete: bool = False, torch_free: bool = False) -> Checkpoint:
    """Open whatever checkpoint is at ``url``: format detection, metadata, manifest, step.

    ``torch_free``: a single torch.save zip is read without torch where it can be
    (:func:`~.torchfile.read_torch_zip`; ``verify`` asks for it), else with torch.

    Reads metadata only: a DCP checkpoint costs one listing and one or two GETs.
    ``located``: what :func:`locate` returned, to save listing again. A folder that a
    ckptctl writer or remover holds (``.ckptctl-writing``) is refused (``NOT_COMMITTED``)
    unless ``allow_incomplete`` (salvage: read what is there).
    """
    located = located or locate(url, storage_options)
    if writer_unfinished(located[1], located[2]) and not allow_incomplete:  # a file's: beside it
        raise FormatError(url, "a ckptctl writer or remover holds this folder "
                          f"({WRITING_MARKER}): wait for it, or rerun the writer with --force; "
                          "--allow-incomplete reads it anyway", code="NOT_COMMITTED")
    store, files, single = pack_view(located, storage_options)
    # another framework's layout is refused by name, never read in part (formats/foreign.py)
    fmt = foreign.refuse_if_foreign(url, files, store, single) \
        or (_file_format(single) if single else detect_format(files))
    if fmt == "safetensors" and not single:  # two exports side by side: name one, exit 2
        refuse_exports(url, files)
    if fmt == "deepspeed-save":  # DeepSpeed's save folder: the tag its `latest` names
        tag = latest_tag(store, files)
        if tag is None:
            tags = sorted({f.split("/", 1)[0] for f in files if "/" in f}, key=natural_key)
            raise several(url.rstrip("/") + "/", tags, None) from None
        ck = open_checkpoint(url.rstrip("/") + "/" + tag, storage_options, strict=strict,
                             read_step=read_step, allow_incomplete=allow_incomplete)
        ck.info["save_folder"] = url
        return ck
    if fmt == "deepspeed":
        ck = deepspeed.read_deepspeed(store, files)
    elif fmt == "deepspeed-universal":
        ck = deepspeed.read_universal(store, files)
    elif fmt == "megatron-dist":
        ck = megatron.read_dist(store, files, strict=strict)
    elif fmt == "megatron-legacy":
        ck = megatron_legacy.read_legacy(store, files)
    elif fmt == "orbax":
        ck = orbax.read_orbax(store, files)
    elif fmt == "dcp":
        try:
            ck = dcp.read_dcp(store, files, strict=strict)
        except FormatError:  # Megatron-core's .metadata: say what the folder is
            foreign.refuse_megatron_plans(url, store, files)
            raise
    elif fmt == "safetensors" and single:
        ck = safetensors.read_safetensors(store, files, single)
    elif fmt == "torch" and single:
        try:
            ck = (read_torch_zip(store, files, single) if torch_free else None) \
                or torchsave.read_torch(store, files, single)
        except FormatError:  # say so when it is not a checkpoint at all (TorchScript...)
            why = not_a_checkpoint(store, single, files[single])
            if why:
                raise UnsupportedFormatError(url, f"not a checkpoint: {why}") from None
            raise
    elif fmt == "pack":  # a committed pack opens through pack_view: this one is not
        raise FormatError(url, "pack is not committed (no manifest: a pack write did not "
                          "finish)", code="NOT_COMMITTED")
    elif fmt in ("composite", "safetensors", "torch"):
        try:
            ck = composite.read_folder(store, files)
        except UnsupportedFormatError as e:  # a file it cannot place: garbage says so
            raise unplaced_garbage(store, files, e) or e from None
    else:
        refuse_if_several(url, files)  # a run folder: "holds 3 checkpoints", exit 2
        shown = ", ".join(list(files)[:5])
        raise UnsupportedFormatError(url, "no checkpoint format recognised (expected DCP "
                                     ".metadata, *.safetensors or *.pt/*.bin files; found "
                                     f"{shown}{', ...' if len(files) > 5 else ''})")
    ck.root = getattr(located[0], "opened_as", None) or url  # a save folder: its latest tag
    ck.info["manifest"] = read_manifest(store, files, single)
    if isinstance(store, PackStore):  # inspect shows what the pack holds and its ratio
        ck.info["pack"] = store.info()
    resolve_step(ck, url, read_step=read_step)
    return ck


def unplaced_garbage(store: Store, files: dict[str, int],
                     e: UnsupportedFormatError) -> UnsupportedFormatError | None:
    """For the folder reader's refusal of a torch-suffixed file it cannot place (``x.bin``
    beside ``model.safetensors``): the same refusal saying what the bytes are not, when
    they are no torch.save file (:func:`~.torchsave.torch_bytes_problem`); else None.

    >>> import tempfile, pathlib
    >>> from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "x.bin").write_bytes(b"")
    >>> st = open_store(str(d)); e = UnsupportedFormatError(st.display("x.bin"), "cannot place")
    >>> unplaced_garbage(st, {"x.bin": 0}, e).message
    'not a torch.save file (the file is empty), beside the model files; refusing rather than leaving it out'
    """
    rel = next((f for f in files if torchsave.is_torch_file(f) and store.display(f) == e.path),
               None)
    if rel is None:
        return None
    why = torchsave.torch_bytes_problem(store, rel, files[rel])
    if why is None:
        return None
    return UnsupportedFormatError(e.path, f"{why}, beside the model files; refusing rather "
                                  "than leaving it out")


def resolve_step(ck: Checkpoint, url: str, *, read_step: bool = True) -> None:
    """Step from the manifest, else a ``step`` entry (:data:`STEP_ENTRIES`), else the name
    (:func:`step_from_name`)."""
    man = ck.info.get("manifest")
    if man is not None and man.step is not None:
        ck.step, ck.info["step_source"] = man.step, "manifest"
        return
    if read_step:
        ck.info["step_entry_read"] = True  # verify's quick level need not read it again
        if ck.format == "dcp":
            from .tensorio import read_object

            step = dcp.step_from_objects(ck, read_object)
        else:  # torch.save and Lightning give plain values without unpickling code
            values = [getattr(ck.objects.get(n), "value", None) for n in STEP_ENTRIES]
            step = next((v for v in values if isinstance(v, int) and not isinstance(v, bool)),
                        None)
        if step is not None:
            ck.step, ck.info["step_source"] = step, "entry"
            return
    step = step_from_name(url)
    if step is not None:
        ck.step, ck.info["step_source"] = step, "name"


# ------------------------------------------------------------------ grouping a listing

def group_checkpoints(files: dict[str, int]) -> dict[str, dict[str, int]]:
    """Group a recursive listing into checkpoints: folders that hold a format's files,
    folders of another framework's layout (one checkpoint each, as its framework sees
    it: a DeepSpeed tag folder, a universal checkpoint with its ``zero/`` tree, a
    Megatron ``iter_NNNNNNN`` folder, an Orbax step folder), standalone torch.save files
    and safetensors exports (:func:`~.safetensors.split_exports`: ``model.safetensors``
    beside ``model-bf16.safetensors`` are two). Key: the checkpoint's path relative to the
    root (``ls``, ``gc``, ``rm`` and ``--force`` all group with it).

    Each file is counted once: it belongs to the nearest checkpoint folder above it, and a
    sub-folder that is a checkpoint of its own keeps its files. Only a DCP, safetensors or
    HF ``.bin`` folder has such sub-folders; another framework's layout, a multi-file
    training state (which refuses a checkpoint inside it), a pack and an unfinished
    ckptctl write own all that is below them.

    >>> sorted(group_checkpoints({"a/.metadata": 1, "a/__0_0.distcp": 5, "b.pt": 3,
    ...        "ds/latest": 1, "ds/global_step5/mp_rank_00_model_states.pt": 4,
    ...        "u/mp_rank_00_model_states.pt": 4, "u/zero/w/fp32.pt": 4}))
    ['a', 'b.pt', 'ds/global_step5', 'u']
    >>> g = group_checkpoints({"model.safetensors": 8, "config.json": 1,
    ...                        "step-1/.metadata": 1, "step-1/__0_0.distcp": 5})
    >>> sorted(g), sorted(g[""])
    (['', 'step-1'], ['config.json', 'model.safetensors'])
    >>> sorted(group_checkpoints({"e/model.safetensors": 8, "e/model-bf16.safetensors": 4}))
    ['e/model-bf16.safetensors', 'e/model.safetensors']
    """
    by_dir: dict[str, dict[str, int]] = {}
    for rel, size in files.items():
        d, base = posixpath.split(rel)
        by_dir.setdefault(d, {})[base] = size
    anchors = {a for d, own in by_dir.items() if (a := foreign.anchor(d, set(own))) is not None}
    if "" in anchors:  # the root itself is one (a tag folder, a universal checkpoint)
        return {"": dict(files)}
    found: dict[str, dict[str, int]] = {}
    claimed: set[str] = set()  # the files of lone-file checkpoints
    folders: set[str] = set()  # checkpoint folders: files added below
    whole: set[str] = set()  # those that own everything below them

    def inside_whole(d: str) -> bool:  # below one found already (parents sort first)
        while d:
            d = posixpath.dirname(d)
            if d in whole:
                return True
        return False

    def take(d: str, owns_below: bool) -> None:
        found[d] = {}
        folders.add(d)
        if owns_below:
            whole.add(d)

    def lone(d: str, names) -> None:  # with its sidecars (manifest, pin): files it owns
        for f in sorted(names):
            mine = {f: by_dir[d][f], **sidecars(f, by_dir[d])}
            found[posixpath.join(d, f)] = {posixpath.join(d, k): v for k, v in mine.items()}
            claimed.update(posixpath.join(d, k) for k in mine)

    for d in sorted(set(by_dir) | anchors):
        if inside_whole(d):
            continue
        own = by_dir.get(d, {})
        if d in anchors:
            take(d, True)
            continue
        fmt = detect_format(own)
        if WRITING_MARKER in own or fmt in ("composite", "pack") \
                or (fmt is None and MANIFEST in own):  # unfinished: listed incomplete
            take(d, True)
        elif fmt == "safetensors":
            model, exports = safetensors_parts(own)
            lone(d, exports)
            if model:
                take(d, False)
        elif fmt == "dcp":
            take(d, False)
        elif fmt == "torch":
            if any(_HF_BIN.match(f) for f in own):
                take(d, False)
            else:
                lone(d, [f for f in own if torchsave.is_torch_file(f)])
    for rel, size in files.items():  # each file to the nearest checkpoint folder above it
        if rel in claimed:
            continue  # a lone file or export (or its sidecar): a checkpoint of its own
        p = rel
        while p:
            p = posixpath.dirname(p)
            if p in folders:
                found[p][rel] = size
                break
    return found


def own_files(located: tuple) -> tuple:
    """``located`` (:func:`locate`'s answer for a folder) with the listing cut to the files
    of the checkpoint the folder itself is, as :func:`group_checkpoints` groups them: no
    export beside its model, no sub-folder that is a checkpoint of its own. Unchanged for a
    lone file and for a folder that is no checkpoint itself (its reader says what it is).

    >>> own_files((None, {"model.safetensors": 8, "x/.metadata": 1}, None))[1]
    {'model.safetensors': 8}
    """
    store, files, single = located
    if single:
        return located
    mine = group_checkpoints(files).get("")
    if mine is None or len(mine) == len(files):
        return located
    return store, mine, single


def locate(url: str, storage_options: dict | None = None, *,
           follow_latest: bool = True) -> tuple:
    """:func:`~.locate.locate` (store, files, single file), the listing cut to the
    checkpoint the folder itself is (:func:`own_files`): every verb acts on the files
    ``ls`` counts in its row, never on an export beside it or a checkpoint below it. A
    folder of exports and no model is no checkpoint: the usage error names them
    (:func:`refuse_exports`).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "model.safetensors").write_bytes(b"x")
    >>> _ = (d / "model-bf16.safetensors").write_bytes(b"y")
    >>> locate(str(d / "model.safetensors"))[1:]
    ({'model.safetensors': 1}, 'model.safetensors')
    """
    located = locate_place(url, storage_options, follow_latest=follow_latest)
    if not located[2] and located[1]:
        refuse_exports(url, located[1])
    return own_files(located)


_HF_BIN = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")


def _one_model(own: dict[str, int]) -> bool:
    """Do a folder's safetensors (and torch.save) files make up one checkpoint, as the
    folder reader plans it (:func:`~ckptctl.formats.composite.plan_folder`)? A folder of
    ``model.safetensors`` and an unrelated ``x.pt`` does not: ``ls`` lists each file.

    >>> _one_model({"model.safetensors": 1, "config.json": 1}), _one_model({"model.safetensors": 1, "x.pt": 1})
    (True, False)
    """
    from .composite import plan_folder

    try:
        plan_folder({f: n for f, n in own.items() if "/" not in f})
    except UnsupportedFormatError:
        return False
    return True


def safetensors_parts(own: dict[str, int]) -> tuple[list[str], list[str]]:
    """(the files of the folder's one model, the files that are checkpoints of their own)
    of a folder whose top-level files ``own`` detect as ``safetensors``: the rule of
    :func:`~.safetensors.split_exports`; without a model, or beside a torch.save file
    the folder reader cannot place (:func:`_one_model`), each safetensors and torch.save
    file is its own.

    >>> safetensors_parts({"model.safetensors": 8, "model-bf16.safetensors": 4, "x.pt": 1})
    ([], ['model-bf16.safetensors', 'model.safetensors', 'x.pt'])
    """
    model, exports = safetensors.split_exports(own) if _one_model(own) else ([], [])
    if not model:  # files no loader reads as one: each its own
        exports = sorted(f for f in own if "/" not in f and (
            f.endswith(".safetensors") or torchsave.is_torch_file(f)))
    return model, exports


def refuse_exports(url: str, files: dict[str, int]) -> None:
    """For a folder of safetensors exports and no one model beside them
    (:func:`safetensors_parts`): the usage error that names them (exit 2), as for a run's
    root: each is a checkpoint, named by its file. Otherwise nothing (a folder whose
    files the reader cannot place at all is refused by the reader, by name).

    >>> refuse_exports("m", {"model.safetensors": 8, "model-bf16.safetensors": 4})
    Traceback (most recent call last):
    ckptctl.errors.UsageError: m/: holds 2 checkpoints (model.safetensors, model-bf16.safetensors), not one; name one (`ckptctl ls m/` lists them)
    """
    top = {f: n for f, n in files.items() if "/" not in f}
    if detect_format(top) != "safetensors" or WRITING_MARKER in top or not _one_model(top):
        return
    model, exports = safetensors_parts(top)
    if exports and not model:
        raise several(url.rstrip("/") + "/", sorted(exports, key=natural_key))


def refuse_if_several(url: str, files: dict[str, int]) -> None:
    """For a folder whose own files make no checkpoint: raise
    :class:`~ckptctl.errors.UsageError` (exit 2) when its sub-folders hold checkpoints,
    as ``ls`` groups them ("run1/: holds 3 checkpoints (step-10, step-20, step-30), not
    one; ..."; the error's ``checkpoints`` lists their names), or the refusal by name
    (exit 3) when every one of them is another framework's layout. Otherwise nothing.

    >>> refuse_if_several("run1", {"step-1/.metadata": 1, "step-2/.metadata": 1})
    Traceback (most recent call last):
    ckptctl.errors.UsageError: run1/: holds 2 checkpoints (step-1, step-2), not one; name one (`ckptctl ls run1/` lists them)
    """
    groups = group_checkpoints(files)
    if not groups or "" in groups:
        return
    names = sorted(groups, key=natural_key)
    kinds = set()
    for rel in names:
        g = groups[rel]
        listing = {posixpath.basename(rel): g[rel]} if rel in g else \
            {k[len(rel) + 1:]: v for k, v in g.items()}
        kind = foreign.recognise(listing)
        kinds.add(None if kind and kind.startswith("Orbax") else kind)  # Orbax steps: read
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    where = url.rstrip("/") + "/"
    if None not in kinds:  # a folder of another framework's checkpoints
        raise foreign.not_read(url, f"{' / '.join(sorted(kinds))} (a folder of {len(names)}: {shown})")
    raise several(where, names)


def several(where: str, names: list[str], also: str | None = None) -> UsageError:
    """The usage error of a folder ``where`` that holds the checkpoints ``names``, not one;
    ``also``: another command that takes the folder as it is (``verify --all``).

    >>> str(several("run1/", ["a", "b"], "ckptctl verify run1/ --all"))
    'run1/: holds 2 checkpoints (a, b), not one; name one, or `ckptctl verify run1/ --all`'
    """
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    hint = f", or `{also}`" if also else f" (`ckptctl ls {where}` lists them)"
    e = UsageError(f"holds {len(names)} checkpoint{'s' if len(names) != 1 else ''} ({shown}), "
                   f"not one; name one{hint}", where)
    e.checkpoints = list(names)
    return e
