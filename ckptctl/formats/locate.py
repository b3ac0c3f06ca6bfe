"""Where a checkpoint is: the folder (or the one file) a URL names, listed once. The
lowest step of opening anything; :mod:`.detect` (what format) and :mod:`.pack` (a delta
pack's base) both start here.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "model.safetensors").write_bytes(b"x")
>>> store, files, single = locate(str(d / "model.safetensors"))
>>> files, single
({'model.safetensors': 1}, 'model.safetensors')
"""
from __future__ import annotations

import posixpath
import re

from ..errors import (FormatError, NotFoundError, UnsafeInputError, UnsupportedFormatError,
                      UsageError)
from ..storage import Store, open_store
from .manifest import CONTROL_FILES, control_name, sidecars
from .torchsave import is_torch_file


def file_format(name: str) -> str | None:
    """The format a lone file's name says it holds, or None.

    >>> file_format("model.safetensors"), file_format("x.pt"), file_format("notes.md")
    ('safetensors', 'torch', None)
    """
    if name.endswith(".safetensors"):
        return "safetensors"
    if is_torch_file(name):
        return "torch"
    return None


#: What DeepSpeed puts at a save folder's top beside its tag folders.
LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
DEEPSPEED_SAVE_SIDE = {LATEST, LATEST_UNIVERSAL, "zero_to_fp32.py", "zero_to_torch.py"}
#: A ``latest`` file names a tag: a short single folder name, nothing more.
_TAG = re.compile(r"^[A-Za-z0-9_.=+-]{1,200}$")


def latest_tag(store: Store, files: dict[str, int], *, strict: bool = True) -> str | None:
    """The tag a DeepSpeed save folder's ``latest`` (else ``latest_universal``) names, when
    it names one of the folder's tag folders; None when there is neither. One small read.
    A file naming anything else (a path, a missing tag) is refused (:class:`FormatError`),
    or None when not ``strict``.

    >>> import tempfile, pathlib; from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "latest").write_text("../x")
    >>> latest_tag(open_store(str(d)), {"latest": 4}, strict=False) is None
    True
    """
    name = LATEST if LATEST in files else LATEST_UNIVERSAL if LATEST_UNIVERSAL in files else None
    if name is None:
        return None
    where = store.display(name)
    why = None
    if files[name] > 4096:
        why = "is no DeepSpeed tag file (too large)"
    else:
        try:
            tag = store.read(name).decode("utf-8").strip()
        except UnicodeDecodeError:
            why = "is no DeepSpeed tag file (not text)"
        except UnsafeInputError as e:  # a link leaving the folder: refused, never followed
            if strict:
                raise
            why = e.message
        else:
            if not _TAG.match(tag) or tag in (".", ".."):
                why = f"names {tag[:60]!r}, not a tag folder"
            elif not any(f.startswith(tag + "/") for f in files):
                why = f"names tag {tag}, which this folder does not hold"
    if why is None:
        return tag
    if strict:
        raise FormatError(where, why)
    return None


#: Megatron's tracker: the iteration its loader resumes from (``20`` or ``release``).
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
#: Files by which a framework names the checkpoint of a folder it resumes from.
POINTER_FILES = (LATEST, LATEST_UNIVERSAL, MEGATRON_TRACKER)


def pointer_target(file: str, text: str) -> str | None:
    """The folder a pointer file's text names (DeepSpeed's ``latest``: the tag itself;
    Megatron's tracker: ``iter_%07d`` of the iteration, or ``release``), or None for a
    text that names no folder.

    >>> pointer_target(MEGATRON_TRACKER, "20 "), pointer_target(LATEST, "global_step5")
    ('iter_0000020', 'global_step5')
    >>> pointer_target(MEGATRON_TRACKER, "../x") is None
    True
    """
    text = text.strip()
    if file == MEGATRON_TRACKER:
        if text == "release":
            return "release"
        return f"iter_{int(text):07d}" if text.isdigit() else None
    return text if _TAG.match(text) and text not in (".", "..") else None


def pointers(store: Store, files: dict[str, int], folders=("",)) -> list[dict]:
    """The pointer files (:data:`POINTER_FILES`) of each of ``folders`` (relative to the
    store; ``""`` its top) that ``files`` (the store's listing) holds, and what each names:
    ``{"file", "names", "present"}`` (``file`` relative to the store; ``names`` None:
    unreadable; ``present``: the folder it names is in the listing), plus ``refused`` (why)
    for a link that leaves the store: never read. One small read each, nothing for a
    folder without one.

    >>> import tempfile, pathlib; from ckptctl.storage import open_store
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / MEGATRON_TRACKER).write_text("30")
    >>> pointers(open_store(str(d)), {MEGATRON_TRACKER: 2, "iter_0000020/common.pt": 9})
    [{'file': 'latest_checkpointed_iteration.txt', 'names': 'iter_0000030', 'present': False}]
    """
    out = []
    for folder in sorted(set(folders)):
        base = f"{folder}/" if folder else ""
        for name in POINTER_FILES:
            f = base + name
            if f not in files:
                continue
            target, refused = None, None
            if files[f] <= 4096:
                try:
                    target = pointer_target(name, store.read(f).decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    target = None
                except UnsafeInputError as e:  # a link out of the root: the rest is listed
                    refused = e.message
            out.append({"file": f, "names": target,
                        "present": target is not None and any(x.startswith(f"{base}{target}/")
                                                              for x in files)})
            if refused:
                out[-1]["refused"] = refused
    return out


#: What may sit at a Megatron run root's top beside its iteration folders.
MEGATRON_RUN_SIDE = {MEGATRON_TRACKER, "ckptctl.manifest.json", ".ckptctl-pinned"}
#: NeMo folders: (what marks one, the folder holding its Megatron ``torch_dist`` weights):
#: an extracted NeMo 1 ``.nemo`` (``model_config.yaml`` beside ``model_weights/``) and a
#: NeMo 2 checkpoint (``context/`` beside ``weights/``)
NEMO_LAYOUTS = (("model_config.yaml", "model_weights"), ("context/", "weights"))
NEMO_ARCHIVE = ".nemo"


def nemo_weights(files: dict[str, int]) -> tuple[str, str] | None:
    """(weights folder, marker) when ``files`` are a NeMo folder whose weights are a
    Megatron ``torch_dist`` checkpoint, else None.

    >>> nemo_weights({"model_config.yaml": 9, "model_weights/metadata.json": 9})
    ('model_weights', 'model_config.yaml')
    >>> nemo_weights({"context/io.json": 9, "weights/metadata.json": 9})
    ('weights', 'context/')
    """
    for marker, folder in NEMO_LAYOUTS:
        marked = any(f.startswith(marker) for f in files) if marker.endswith("/") \
            else marker in files
        if marked and f"{folder}/metadata.json" in files:
            return folder, marker
    return None


def followed(store: Store, files: dict[str, int]) -> tuple[str, str] | None:
    """(sub-folder, what names it) that a folder stands for: the tag of a DeepSpeed save
    folder (its top holds only ``latest`` and DeepSpeed's scripts) that its ``latest``
    names, the iteration of a Megatron run root (only the tracker at its top) that its
    tracker names, the weights of a NeMo folder (:func:`nemo_weights`); else None (the
    reader then says what is wrong)."""
    top = {f for f in files if "/" not in f}
    if MEGATRON_TRACKER in top and top <= MEGATRON_RUN_SIDE:
        p = pointers(store, files)
        return (p[0]["names"], MEGATRON_TRACKER) if p and p[0]["present"] else None
    if nemo := nemo_weights(files):
        return nemo
    if not top & {LATEST, LATEST_UNIVERSAL} or not top <= DEEPSPEED_SAVE_SIDE:
        return None
    tag = latest_tag(store, files, strict=False)
    return (tag, LATEST) if tag else None


def locate(url: str, storage_options: dict | None = None, *,
           follow_latest: bool = True) -> tuple[Store, dict[str, int], str | None]:
    """(store of the folder, its files, the single file meant or None) for a URL that names
    a checkpoint folder or one checkpoint file. One listing request for a folder.

    A DeepSpeed save folder stands for the tag its ``latest`` names (what DeepSpeed
    resumes), unless ``follow_latest`` is False (``rm``, ``pin``: the folder as it is)."""
    store = open_store(url, storage_options)
    files = store.list_files()
    if files and follow_latest and (to := followed(store, files)):
        found = locate(url.rstrip("/") + "/" + to[0], storage_options, follow_latest=False)
        found[0].opened_as = url.rstrip("/") + "/" + to[0]  # what readers call it
        found[0].opened_by = to[1]
        return found
    if files:  # a pack's own files: readers open the checkpoint inside with pack_view
        return store, files, None
    parent_url, name = split_file_url(url)
    parent = open_store(parent_url, storage_options)
    if file_format(name) and (one := single_files(parent, name)):
        return parent, one, name
    if name.endswith(NEMO_ARCHIVE) and parent.exists(name) and not parent.isdir(name):
        raise UnsupportedFormatError(url, "a NeMo archive (a tar of model_config.yaml and the "
                                     f"weights): extract it, `mkdir DIR && tar -xf {name} -C "
                                     "DIR`, and name DIR")
    if not store.exists():
        raise NotFoundError(url, "no such file or directory")
    if not store.isdir():  # a file, of no format ckptctl reads
        raise UnsupportedFormatError(url, "not a checkpoint")
    raise UnsupportedFormatError(url, "empty: no checkpoint files here")


def split_file_url(url: str) -> tuple[str, str]:
    """(URL of the folder holding it, name) of a URL that names one file.

    >>> split_file_url("s3://b/run/train.pt"), split_file_url("train.pt"), split_file_url("/x.pt")
    (('s3://b/run', 'train.pt'), ('.', 'train.pt'), ('/', 'x.pt'))
    """
    url = url.rstrip("/")
    if "/" not in url:
        return ".", url
    parent, name = url.rsplit("/", 1)
    return parent or "/", name


def single_files(parent: Store, name: str, *, require_file: bool = True) -> dict[str, int]:
    """The single-file checkpoint ``name`` in the folder ``parent`` and the sidecars
    beside it (its manifest, writing marker, pin: :func:`~.manifest.control_name`), name ->
    size; ``{}`` when the file is not there (``require_file`` False: its sidecars all the
    same, for a writer that finds what a killed one left). Locally a stat each; remotely
    one listing of the folder's top (no HEAD each).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.pt").write_bytes(b"x")
    >>> _ = (d / "a.pt.ckptctl-pinned").write_bytes(b"{}")
    >>> single_files(open_store(str(d)), "a.pt")
    {'a.pt': 1, 'a.pt.ckptctl-pinned': 2}
    """
    if parent.is_local:
        out = {}
        for rel in [name] + [control_name(c, name) for c in CONTROL_FILES]:
            if parent.exists(rel) and not parent.isdir(rel):
                out[rel] = parent.size(rel)
    else:
        try:
            top = parent.list_files(recursive=False)
        except NotFoundError:
            top = {}
        out = {name: top[name]} if name in top else {}
        out.update(sidecars(name, top))
    return out if name in out or not require_file else {}


def single_target(dst: str, name: str) -> tuple[str, str]:
    """(URL of the folder, file name) where a copy of the single-file checkpoint ``name``
    goes for the destination ``dst``, as ``cp`` reads it: ``dst`` is the file when its
    last part is a checkpoint file's name (``warm/train.pt``), else the folder the file
    goes into under its own name (``warm/``, ``s3://b/warm``). Another name is refused
    (exit 2): the manifest names the file, and a copy keeps the checkpoint's id.

    >>> single_target("warm/train.pt", "train.pt"), single_target("s3://b/warm/", "train.pt")
    (('warm', 'train.pt'), ('s3://b/warm', 'train.pt'))
    >>> single_target("warm/last.pt", "train.pt")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: warm/last.pt: a single-file checkpoint keeps its name (its manifest names train.pt): name warm/train.pt, or the folder warm/
    """
    if not dst.endswith("/") and file_format(dst.rsplit("/", 1)[-1]):
        folder, fname = split_file_url(dst)
        if fname != name:
            raise UsageError(f"a single-file checkpoint keeps its name (its manifest names "
                             f"{name}): name {folder.rstrip('/')}/{name}, or the folder "
                             f"{folder.rstrip('/')}/", dst)
        return folder, fname
    return dst.rstrip("/") or "/", name


def located_in(store, rel: str, group: dict[str, int]) -> tuple:
    """What :func:`~ckptctl.formats.detect.locate` would return for one candidate, cut
    from the root's listing: the checkpoint is classified without listing it again (and
    dated from the listing's modification times, no HEAD each). ``group``: its files as
    :func:`~ckptctl.formats.detect.group_checkpoints` groups the root's listing.

    >>> s = open_store("/tmp")
    >>> located_in(s, "run/step-1", {"run/step-1/a.safetensors": 8})[1:]
    ({'a.safetensors': 8}, None)
    """
    if rel in group:  # a lone torch.save file (and its sidecars: group_checkpoints)
        d, name = posixpath.split(rel)
        listed = {k: posixpath.basename(k) for k in group}
        return (store.child(d, listed=listed) if d else store), \
            {posixpath.basename(k): v for k, v in group.items()}, name
    if not rel:
        return store, dict(group), None
    return (store.child(rel, listed={k: k[len(rel) + 1:] for k in group}),
            {k[len(rel) + 1:]: v for k, v in group.items()}, None)


def refuse_save_folder(located: tuple, url: str, verb: str) -> None:
    """For a verb that writes beside a checkpoint or copies it whole (seal, verify, pack,
    promote): refuse a DeepSpeed save folder (exit 2) by naming the tag its ``latest``
    names, the checkpoint meant; reading verbs open that tag themselves.

    >>> class S: opened_as = "run/global_step3"
    >>> refuse_save_folder((S(), {}, None), "run", "seal")
    Traceback (most recent call last):
    ckptctl.errors.UsageError: run: a DeepSpeed save folder (its tags are checkpoints): name the tag, `ckptctl seal run/global_step3` (the one its latest names)
    """
    tag_url = getattr(located[0], "opened_as", None)
    if tag_url and tag_url.rstrip("/") != url.rstrip("/"):
        by = getattr(located[0], "opened_by", None)
        if by in {m for m, _ in NEMO_LAYOUTS}:
            raise UsageError(f"a NeMo checkpoint folder (its {tag_url.rsplit('/', 1)[-1]}/ "
                             f"holds the Megatron checkpoint): name it, `ckptctl {verb} "
                             f"{tag_url}`", url)
        if by == MEGATRON_TRACKER:
            raise UsageError("a Megatron run root (its iterations are checkpoints): name the "
                             f"iteration, `ckptctl {verb} {tag_url}` (the one "
                             f"{MEGATRON_TRACKER} names)", url)
        raise UsageError(f"a DeepSpeed save folder (its tags are checkpoints): name the tag, "
                         f"`ckptctl {verb} {tag_url}` (the one its latest names)", url)
