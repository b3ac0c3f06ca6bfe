"""What a checkpoint folder owns and what it needs: one answer for every verb that lists,
removes, replaces or copies checkpoints (``ls``, ``latest``, ``verify``, ``gc``, ``rm``,
``watch``, ``promote`` and ``--force``).

* **Owned files** (:func:`split_owned`): what the checkpoint's format names (DCP
  ``.metadata`` and ``*.distcp``; safetensors files and their index; torch.save files; a
  pack's index and data files; below the top, what a framework's layout names:
  :func:`layout_files`), what its manifest lists, the JSON and tokenizer side
  files at the top of a model folder (one with safetensors or torch.save files), and
  ckptctl's own markers (manifest, writing marker, pin, references) with the temporary
  names of their writes. Anything else (``NOTES.md``, ``eval/results.json``)
  is the user's: a removal that would take it is refused (:func:`refuse_foreign`).
* **Dependencies**: a delta pack needs its base, recorded in its index by checkpoint id and
  URL; it is restorable only while that whole chain is there and committed
  (``verify``'s ``MISSING_BASE``, hence ``ls``/``latest``/``gc`` call it incomplete).
  :func:`packs_needing` finds the packs that need a given checkpoint (beside it, and
  elsewhere through the references :func:`record_dependant` leaves), so ``rm`` and
  ``--force`` refuse to take a base away.
* **Replacing** (:func:`why_not_replace`): what ``--force`` may overwrite.

>>> owned, foreign = split_owned({".metadata": 1, "__0_0.distcp": 9, "NOTES.md": 3,
...                               "eval/results.json": 2})
>>> sorted(owned), foreign
(['.metadata', '__0_0.distcp'], ['NOTES.md', 'eval/results.json'])
"""
from __future__ import annotations

import fnmatch
import json
import re

from ..errors import CkptError, Finding, StorageError
from ..formats.manifest import (CONTROL_FILES, MANIFEST, NEEDED_BY_PREFIX, SIDECAR_SUFFIXES,
                                WRITING_MARKER, Manifest, is_control_file, is_temp_name,
                                sidecars)
from ..storage import Store

#: Side files of a model folder (HF ``save_pretrained``, the Trainer, accelerate, PEFT):
#: part of the checkpoint when they sit at its top level beside weights.
SIDE_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*",
              "spiece.model", "sentencepiece.bpe.model")
#: Checkpoint data a folder's format names, by top-level file name.
_DATA = re.compile(r"^(?:.*\.distcp|\.metadata|.*\.safetensors|.*\.safetensors\.index\.json"
                   r"|.*\.(?:pt|pth|bin|ckpt)|.*\.bin\.index\.json|random_states_\d+\.pkl"
                   r"|custom_checkpoint_\d+\.pkl|ckptctl\.pack\.json|data-\d{5,9}\.bin)$")
#: Temporary names of ckptctl's own small writes of its markers (a write killed midway),
#: in a folder or beside a single-file checkpoint (``.train.pt.ckptctl-pinned.x1.tmp``).
_CONTROL_TEMP = re.compile(r"^\.(?:%s|[^/]+(?:%s))\.[^/]*\.tmp$" % (
    "|".join(re.escape(c) for c in CONTROL_FILES),
    "|".join(re.escape(s) for s in SIDECAR_SUFFIXES.values())))


def is_control_temp(rel: str) -> bool:
    """Is ``rel`` the temporary name of a write of one of ckptctl's markers (the
    manifest, the writing marker, a pin) that never finished? Harmless: never published.

    >>> is_control_temp("..ckptctl-writing.k2j3.tmp"), is_control_temp(".metadata.tmp")
    (True, False)
    >>> is_control_temp(".train.pt.ckptctl.manifest.json.k2j3.tmp")
    True
    """
    return _CONTROL_TEMP.match(rel) is not None


def layout_files(files: dict[str, int]) -> set[str]:
    """The files a checkpoint folder's format layout names beyond what every format owns
    (DCP's, safetensors, torch.save files), from its listing ``files``: a DeepSpeed
    universal checkpoint's ``zero/<param>/<state>.pt`` and ``zero/optimizer_state.pt``, a
    Megatron legacy iteration's ``mp_rank_TT[_PPP]/model_optim_rng.pt`` and the
    ``distrib_optim.pt`` beside each; a Megatron ``torch_dist`` folder's ``metadata.json``,
    ``common.pt`` and ``integrity.json`` (megatron-core 0.19 writes no ``common.pt``, so
    nothing made its JSON a model folder's side files); an Orbax step or item folder's
    metadata, OCDBT trees and array folders.

    >>> sorted(layout_files({"zero/w/fp32.pt": 8, "zero/w/notes.txt": 1,
    ...                      "mp_rank_00/model_optim_rng.pt": 9, "NOTES.md": 1}))
    ['mp_rank_00/model_optim_rng.pt', 'zero/w/fp32.pt']
    """
    from ..formats.deepspeed import universal_files
    from ..formats.megatron import dist_files
    from ..formats.megatron_legacy import legacy_files
    from ..formats.orbax import layout_files as orbax_files

    return universal_files(files) | legacy_files(files) | dist_files(files) | orbax_files(files)


def split_owned(files: dict[str, int], manifest: Manifest | None = None, *,
                single: str | None = None) -> tuple[dict[str, int], list[str]]:
    """``(owned, foreign)``: the files of one checkpoint folder (``files``, relative to it)
    that are the checkpoint's, and the sorted names of the others. ``manifest``: its
    parsed manifest, whose files are owned too; ``single``: a lone-file checkpoint, which
    owns that file and ckptctl's sidecars beside it (its manifest, writing marker, pin).

    >>> split_owned({"model.safetensors": 9, "config.json": 1, "tokenizer.json": 1,
    ...              ".ckptctl-pinned": 1, "README.md": 2})[1]
    ['README.md']
    >>> split_owned({"x.pt": 9, "y.pt": 9, "x.pt.ckptctl-pinned": 1}, single="x.pt")
    ({'x.pt': 9, 'x.pt.ckptctl-pinned': 1}, [])
    """
    if single is not None:
        return ({single: files[single], **sidecars(single, files)} if single in files
                else {}), []
    listed = set(manifest.files) if manifest is not None else set()
    listed |= layout_files(files)
    model_folder = any("/" not in rel and rel.endswith((".safetensors", ".pt", ".pth", ".bin",
                                                         ".ckpt")) for rel in files)
    owned, foreign = {}, []
    for rel, size in files.items():
        top = "/" not in rel
        if rel in listed or is_control_file(rel) or (top and (
                _DATA.match(rel) or is_temp_name(rel)
                or (model_folder and any(fnmatch.fnmatchcase(rel, p) for p in SIDE_FILES)))):
            owned[rel] = size
        else:
            foreign.append(rel)
    return owned, sorted(foreign)


def refuse_foreign(url: str, files: dict[str, int], manifest: Manifest | None = None, *,
                   single: str | None = None, doing: str = "remove",
                   advice: str | None = None) -> dict[str, int]:
    """The owned files of the checkpoint at ``url``, or :class:`~ckptctl.errors.Finding`
    (exit 1, ``FOREIGN_FILES``) naming the files that are not its own: a removal never
    takes what it cannot recognise, and a seal by watch never adopts it. ``advice``: what
    the message tells to do instead (default: move them away before you ``doing`` it).

    >>> refuse_foreign("run/step-10", {".metadata": 1, "NOTES.md": 3})
    Traceback (most recent call last):
    ckptctl.errors.Finding: run/step-10: holds files that are not the checkpoint's (NOTES.md); move them away before you remove it
    """
    owned, foreign = split_owned(files, manifest, single=single)
    if foreign:
        raise Finding(url, f"holds files that are not the checkpoint's ({foreign_list(foreign)})"
                      f"; {advice or f'move them away before you {doing} it'}",
                      code="FOREIGN_FILES")
    return owned


def foreign_list(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``: a short list of file names for a message.

    >>> foreign_list(["a", "b"]), foreign_list([str(i) for i in range(8)], 3)
    ('a, b', '0, 1, 2 and 5 more')
    """
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def needed_by_name(pack_url: str) -> str:
    """The name of the reference a delta pack at ``pack_url`` leaves in its base's folder.

    >>> needed_by_name("s3://b/cold/step-80")[:19]
    '.ckptctl-needed-by.'
    """
    from ..storage import digest_bytes

    return NEEDED_BY_PREFIX + digest_bytes(pack_url.rstrip("/").encode(), "xxh3-128")[:16]


def record_dependant(base_store, pack_url: str, base_id: str) -> None:
    """Leave a reference in the base's folder (``base_store``, its raw store) saying that
    the pack at ``pack_url`` is made against checkpoint ``base_id``: ``gc`` and ``rm`` of
    the base's root then keep the base while that pack lives, though they cannot list it.
    Written before the pack (a reference to a pack that never committed is ignored).

    >>> record_dependant(open_store("warm/step-60"), "s3://b/cold/step-80", "xxh3-128:9f")  # doctest: +SKIP
    """
    doc = {"pack": pack_url.rstrip("/"), "base": base_id}
    base_store.write_atomic(needed_by_name(pack_url),
                            (json.dumps(doc, sort_keys=True) + "\n").encode())


def external_dependants(store, files: dict[str, int], checkpoint_id: str | None,
                        storage_options: dict | None = None) -> list[str]:
    """URLs of the packs elsewhere that still need the checkpoint at ``store`` (its
    listing ``files``, its id ``checkpoint_id``), from the references
    :func:`record_dependant` left. A reference counts while its pack is there and names
    this base, or is still being written, or cannot be checked from here (unreachable,
    unreadable: kept rather than guessed away); one whose pack is gone or made against
    another base is stale.

    >>> external_dependants(open_store("warm/step-60"), files, "xxh3-128:9f")  # doctest: +SKIP
    ['s3://b/cold/step-80']
    """
    from ..storage import open_store

    out = []
    for rel in sorted(f for f in files if f.startswith(NEEDED_BY_PREFIX)):
        try:
            doc = json.loads(store.read(rel))
            url, base = str(doc["pack"]), doc.get("base")
        except StorageError:
            raise
        except (CkptError, ValueError, KeyError, TypeError):
            continue  # not a reference ckptctl wrote: nothing to honour
        if checkpoint_id and base != checkpoint_id:
            continue
        try:
            pstore = open_store(url, storage_options)
            pfiles = pstore.list_files()
            if not pfiles:
                continue  # the pack is gone
            man = Manifest.read(pstore, pfiles)
            if man is None:
                if WRITING_MARKER in pfiles:
                    out.append(url)  # being written
                continue
            if man.base == base:
                out.append(url)
        except CkptError:
            out.append(url)  # cannot be checked from here: keep the base
    return out


def packs_needing(url: str, store: Store, files: dict[str, int], checkpoint_id: str,
                  storage_options: dict | None = None, *,
                  single: str | None = None) -> list[str]:
    """The delta packs that need checkpoint ``checkpoint_id`` (at ``url``, ``store`` and
    its listing ``files``) as their base: those beside it under its parent folder (one
    listing, one small read per pack) and those elsewhere that left a reference.
    ``single``: the checkpoint is that one file in ``store``, whose packs are beside it
    in ``store`` itself (a lone file holds no references: packs elsewhere never name it,
    :func:`~ckptctl.packs.pack.pack` refuses that).

    >>> packs_needing("run/step-100", store, files, man.checkpoint_id)   # doctest: +SKIP
    ['run/step-200']
    """
    from ..formats.detect import group_checkpoints
    from ..formats.pack import PACK_INDEX

    out = [] if single else external_dependants(store, files, checkpoint_id, storage_options)
    parent = store if single else store.parent()
    me = store.display(single) if single else store.url.rstrip("/")
    for rel, group in sorted(group_checkpoints(parent.list_files()).items()):
        if not rel or f"{rel}/{PACK_INDEX}" not in group or f"{rel}/{MANIFEST}" not in group:
            continue
        where = parent.display(rel)
        if where.rstrip("/") == me:
            continue
        try:
            doc = Manifest.parse(parent.read(f"{rel}/{MANIFEST}"), where)
        except StorageError:
            raise
        except CkptError:
            continue
        if doc.base == checkpoint_id:
            out.append(where)
    return out


def why_not_replace(store, files: dict[str, int],
                    storage_options: dict | None = None) -> str | None:
    """Why ``--force`` may not replace the folder at ``store`` (its listing ``files``), or
    None when it may: it holds an unfinished ckptctl write (its writing marker), or one
    checkpoint that is not pinned, not the base of a delta pack, and holds nothing but
    its own files. Never a folder of several checkpoints or of someone else's files, and
    never a pinned one or a pack's base, even beside a writing marker (a stale one).

    >>> why_not_replace(None, {"step-1/.metadata": 1, "step-2/.metadata": 1})
    'it holds 2 checkpoints (step-1, step-2), not one'
    >>> why_not_replace(None, {".metadata": 1, "notes.txt": 1, "eval/r.json": 1})
    "it holds files that are not a checkpoint's (eval/r.json, notes.txt)"
    >>> why_not_replace(None, {".ckptctl-writing": 1, "__0_0.distcp": 8}) is None
    True
    >>> why_not_replace(None, {"..ckptctl-writing.x1y2.tmp": 0}) is None  # killed mid-marker
    True
    >>> why_not_replace(None, {".ckptctl-writing": 1, ".ckptctl-pinned": 1, ".metadata": 1})
    'it holds a pinned checkpoint (ckptctl unpin it first)'
    """
    from ..formats.detect import group_checkpoints
    from ..formats.manifest import PIN_FILE

    groups = group_checkpoints(files)
    if set(groups) - {""}:
        inner = sorted(g for g in groups if g)
        return (f"it holds {len(inner)} checkpoint{'s' if len(inner) > 1 else ''} "
                f"({foreign_list(inner, 3)}), not one")
    man = None
    if MANIFEST in files and store is not None:
        try:
            man = Manifest.read(store, files)
        except StorageError:
            raise
        except CkptError:
            man = None
    foreign = split_owned(files, man)[1]
    if foreign:
        return f"it holds files that are not a checkpoint's ({foreign_list(foreign, 3)})"
    # a pin, and packs on a manifest still there, count even beside a writing marker (a
    # stale one: a killed promote, rm or seal)
    if PIN_FILE in files:
        return "it holds a pinned checkpoint (ckptctl unpin it first)"
    if man is not None and store is not None:
        deps = packs_needing(store.url, store, files, man.checkpoint_id, storage_options)
        if deps:
            return (f"it holds the base of {len(deps)} delta pack(s) ({foreign_list(deps, 3)})")
    if WRITING_MARKER in files or all(is_temp_name(f) for f in files):
        return None  # an unfinished ckptctl write (or its marker's, killed): what --force is for
    if not groups:
        return "it holds no checkpoint"
    return None


#: What to do instead, by verb, when delta packs still need the checkpoint.
_INSTEAD = {"remove": "remove those first",
            "reseal": "seal --update would give it a new id, which they do not name; "
                      "restore them first (ckptctl promote --unpack), or seal a copy"}


def check_removable(url: str, store: Store | None, files: dict[str, int],
                    manifest: Manifest | None, *, doing: str = "remove",
                    single: str | None = None, storage_options: dict | None = None,
                    dependants: bool = True, algo: str | None = None,
                    instead: str | None = None) -> dict[str, int]:
    """The one check in front of every verb that deletes a checkpoint (``rm``, ``promote
    --delete-source``) or re-seals it (``seal --update``; ``doing="reseal"``): its owned
    files, or :class:`~ckptctl.errors.Finding` (exit 1) naming the files that are not its
    own (``FOREIGN_FILES``, :func:`refuse_foreign`) or the delta packs that need it as
    their base (``HAS_DEPENDANTS``, :func:`packs_needing`; not with ``dependants=False``,
    ``rm --orphan-dependants``). ``instead``: what the message says to do about the packs.

    A reseal adopts the files its manifest lacks (they are not refused), and strands
    packs only when it changes the files table (files added, or ``algo`` another
    hash than the manifest's): that is a new id, which the packs do not name.

    >>> check_removable("run/step-10", None, {".metadata": 1, "NOTES.md": 3}, None)
    Traceback (most recent call last):
    ckptctl.errors.Finding: run/step-10: holds files that are not the checkpoint's (NOTES.md); move them away before you remove it
    >>> check_removable("run/step-10", None, {".metadata": 1, "__0_0.distcp": 8}, None)
    {'.metadata': 1, '__0_0.distcp': 8}
    """
    if doing == "reseal":
        owned = split_owned(files, manifest, single=single)[0]
        added = manifest is not None and any(
            rel not in manifest.files and not is_control_file(rel) and not is_temp_name(rel)
            for rel in files)
        if not added and (manifest is None or algo in (None, manifest.hash)):
            return owned  # the same files table, the same id: no pack loses its base
    else:
        owned = refuse_foreign(url, files, manifest, single=single, doing=doing)
    if manifest is None or not dependants:
        return owned
    deps = packs_needing(url, store, files, manifest.checkpoint_id, storage_options,
                         single=single)
    if deps:
        raise Finding(url, f"the base of {len(deps)} delta pack(s) that could not be "
                      f"restored without it ({foreign_list(deps)}); "
                      f"{instead or _INSTEAD.get(doing, _INSTEAD['remove'])}",
                      code="HAS_DEPENDANTS")
    return owned


__all__ = ["SIDE_FILES", "layout_files", "split_owned", "refuse_foreign", "foreign_list", "is_control_temp",
           "needed_by_name", "record_dependant", "external_dependants", "packs_needing",
           "why_not_replace", "check_removable"]
