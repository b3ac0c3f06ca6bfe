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

from ..errors import NotFoundError, UnsupportedFormatError, UsageError
from ..storage import Store, open_store
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
DEEPSPEED_SAVE_SIDE = {"latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py"}


def deepspeed_tag(store: Store, files: dict[str, int]) -> str | None:
    """The tag folder a DeepSpeed save folder's ``latest`` names, when the folder is one
    (``latest`` and DeepSpeed's scripts at its top, nothing else) and holds that tag;
    else None. One small read."""
    top = {f for f in files if "/" not in f}
    name = "latest" if "latest" in top else "latest_universal" if "latest_universal" in top \
        else None
    if name is None or not top <= DEEPSPEED_SAVE_SIDE or files[name] > 4096:
        return None
    tag = store.read(name).decode("utf-8", "replace").strip()
    if not tag or "/" in tag or tag in (".", "..") \
            or not any(f.startswith(tag + "/") for f in files):
        return None  # the reader says what is wrong with it
    return tag


def locate(url: str, storage_options: dict | None = None, *,
           follow_latest: bool = True) -> tuple[Store, dict[str, int], str | None]:
    """(store of the folder, its files, the single file meant or None) for a URL that names
    a checkpoint folder or one checkpoint file. One listing request for a folder.

    A DeepSpeed save folder stands for the tag its ``latest`` names (what DeepSpeed
    resumes), unless ``follow_latest`` is False (``rm``, ``pin``: the folder as it is)."""
    store = open_store(url, storage_options)
    files = store.list_files()
    if files and follow_latest and (tag := deepspeed_tag(store, files)):
        found = locate(url.rstrip("/") + "/" + tag, storage_options, follow_latest=False)
        found[0].opened_as = url.rstrip("/") + "/" + tag  # what readers call it
        return found
    if files:  # a pack's own files: readers open the checkpoint inside with pack_view
        return store, files, None
    parent_url, name = url.rstrip("/").rsplit("/", 1) if "/" in url.rstrip("/") else (".", url)
    parent = open_store(parent_url or "/", storage_options)
    if file_format(name) and parent.exists(name):
        return parent, {name: parent.size(name)}, name
    if not store.exists():
        raise NotFoundError(url, "no such file or directory")
    if not store.isdir():  # a file, of no format ckptctl reads
        raise UnsupportedFormatError(url, "not a checkpoint")
    raise UnsupportedFormatError(url, "empty: no checkpoint files here")


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
        raise UsageError(f"a DeepSpeed save folder (its tags are checkpoints): name the tag, "
                         f"`ckptctl {verb} {tag_url}` (the one its latest names)", url)
