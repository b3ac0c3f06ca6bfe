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

from ..errors import NotFoundError, UnsupportedFormatError
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


def locate(url: str, storage_options: dict | None = None) -> tuple[Store, dict[str, int], str | None]:
    """(store of the folder, its files, the single file meant or None) for a URL that names
    a checkpoint folder or one checkpoint file. One listing request for a folder."""
    store = open_store(url, storage_options)
    files = store.list_files()
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
