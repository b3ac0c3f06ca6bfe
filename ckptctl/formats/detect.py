"""Find out what is at a place and open it as a :class:`~ckptctl.model.Checkpoint`.

>>> detect_format({".metadata": 10, "__0_0.distcp": 100})
'dcp'
>>> detect_format({"model.safetensors": 10, "config.json": 2})
'safetensors'
>>> detect_format({"model.safetensors": 10, "optimizer.bin": 5, "random_states_0.pkl": 1})
'composite'
>>> step_from_name("s3://b/run/global_step1200"), step_from_name("iter_0001200"), step_from_name("x")
(1200, 1200, None)
>>> step_from_name("ckpts/epoch=3-step=1200.ckpt"), step_from_name("m-epoch=0-step=7-v1.ckpt")
(1200, 7)
"""
from __future__ import annotations

import posixpath
import re

from ..errors import CkptError, FormatError, UnsupportedFormatError
from ..model import Checkpoint
from ..storage import Store, open_store
from . import composite, dcp, safetensors, torchsave
from .manifest import read_manifest
from .pack import PackStore, is_pack, pack_view

_STEP_PATTERNS = [re.compile(p) for p in (
    r"^(?:step|global_step|checkpoint|ckpt|iter|iteration)[-_]?0*(\d+)$",
    r"^(?:step|global_step|checkpoint|ckpt|iter|iteration)[-_]?0*(\d+)\.\w+$",
)]
#: Lightning's ModelCheckpoint names: ``epoch=3-step=1200.ckpt``, ``m-step=7-v1.ckpt``.
_LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=(\d+)(?=[-_.]|$)")

#: Entries that hold the step, first found wins (torch.save, Lightning ``.ckpt``, folders).
STEP_ENTRIES = ("step", "global_step", "train_state.step", "trainer.step")


def step_from_name(url: str) -> int | None:
    """The step a checkpoint's name carries (``step-1200``, ``global_step1200``,
    ``checkpoint-1200``, ``iter_0001200``, Lightning's ``epoch=3-step=1200.ckpt``), or None."""
    name = posixpath.basename(url.rstrip("/"))
    for pat in _STEP_PATTERNS:
        m = pat.match(name)
        if m:
            return int(m.group(1) or 0)
    m = _LIGHTNING_STEP.search(name)
    return int(m.group(1)) if m else None


def detect_format(files: dict[str, int]) -> str | None:
    """The format the files of a folder make up, or None."""
    if is_pack(files):  # its data-NNNNN.bin files are no torch.save files
        return "pack"
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


def _file_format(name: str) -> str | None:
    if name.endswith(".safetensors"):
        return "safetensors"
    if torchsave.is_torch_file(name):
        return "torch"
    return None


def locate(url: str, storage_options: dict | None = None) -> tuple[Store, dict[str, int], str | None]:
    """(store of the folder, its files, the single file meant or None) for a URL that names
    a checkpoint folder or one checkpoint file. One listing request for a folder."""
    store = open_store(url, storage_options)
    files = store.list_files()
    if files:  # a pack's own files: readers open the checkpoint inside with pack_view
        return store, files, None
    parent_url, name = url.rstrip("/").rsplit("/", 1) if "/" in url.rstrip("/") else (".", url)
    parent = open_store(parent_url or "/", storage_options)
    if _file_format(name) and parent.exists(name):
        return parent, {name: parent.size(name)}, name
    if not store.exists():
        from ..errors import NotFoundError
        raise NotFoundError(url, "no such file or directory")
    if not store.isdir():  # a file, of no format ckptctl reads
        raise UnsupportedFormatError(url, "not a checkpoint")
    raise UnsupportedFormatError(url, "empty: no checkpoint files here")


def open_checkpoint(url: str, storage_options: dict | None = None, *, strict: bool = True,
                    read_step: bool = True, located: tuple | None = None) -> Checkpoint:
    """Open whatever checkpoint is at ``url``: format detection, metadata, manifest, step.

    Reads metadata only: a DCP checkpoint costs one listing and one or two GETs.
    ``located``: what :func:`locate` returned, to save listing again.
    """
    store, files, single = pack_view(located or locate(url, storage_options), storage_options)
    fmt = _file_format(single) if single else detect_format(files)
    if fmt == "dcp":
        ck = dcp.read_dcp(store, files, strict=strict)
    elif fmt == "safetensors" and single:
        ck = safetensors.read_safetensors(store, files, single)
    elif fmt == "torch" and single:
        try:
            ck = torchsave.read_torch(store, files, single)
        except FormatError:  # say so when it is not a checkpoint at all (TorchScript...)
            why = not_a_checkpoint(store, single, files[single])
            if why:
                raise UnsupportedFormatError(url, f"not a checkpoint: {why}") from None
            raise
    elif fmt == "pack":  # a committed pack opens through pack_view: this one is not
        raise FormatError(url, "an unfinished pack write (.ckptctl-writing is there); rerun "
                          "`ckptctl pack` with --force", code="NOT_COMMITTED")
    elif fmt in ("composite", "safetensors", "torch"):
        ck = composite.read_folder(store, files)
    else:
        shown = ", ".join(list(files)[:5])
        raise UnsupportedFormatError(url, "no checkpoint format recognised (expected DCP "
                                     ".metadata, *.safetensors or *.pt/*.bin files; found "
                                     f"{shown}{', ...' if len(files) > 5 else ''})")
    ck.root = url
    ck.info["manifest"] = read_manifest(store, files) if not single else None
    if isinstance(store, PackStore):  # inspect shows what the pack holds and its ratio
        ck.info["pack"] = store.info()
    resolve_step(ck, url, read_step=read_step)
    return ck


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
