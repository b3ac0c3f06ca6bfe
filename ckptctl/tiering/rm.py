"""``ckptctl rm URL``: delete one checkpoint, in the order that leaves nothing looking valid
(:mod:`ckptctl.writing.removal`), after the checks every deleter makes.
"""
from __future__ import annotations

from ..catalog.ls import group_checkpoints
from ..catalog.ownership import check_removable
from ..errors import CkptError, StorageError, UsageError
from ..formats.detect import locate
from ..formats.manifest import Manifest
from ..writing.removal import RemoveResult, remove_checkpoint


def remove(url: str, storage_options: dict | None = None, *, force: bool = False,
           orphan_dependants: bool = False) -> RemoveResult:
    """``ckptctl rm URL``: delete the one checkpoint at ``url`` (a folder ``ls`` would list,
    or a lone checkpoint file) with :func:`~ckptctl.writing.removal.remove_checkpoint`;
    anything else, such as a run's root, is refused (exit 2) before anything is deleted. So is (exit 1) a folder
    holding files that are not the checkpoint's (``FOREIGN_FILES``), and the base of delta
    packs that still need it (``HAS_DEPENDANTS``: packs beside it in its root, or
    elsewhere through the references they left) unless ``orphan_dependants``: the check
    every deleter makes (:func:`~ckptctl.catalog.ownership.check_removable`).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "step-1").mkdir()
    >>> _ = (d / "step-1" / ".metadata").write_bytes(b"m")
    >>> remove(str(d))                                          # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ckptctl.errors.UsageError: ... not a checkpoint folder (rm removes one checkpoint; ...)
    >>> remove(str(d / "step-1")).num_files, (d / "step-1").exists()
    (1, False)
    """
    store, files, single = locate(url, storage_options, follow_latest=False)
    if single is None and "" not in group_checkpoints(files):
        raise UsageError(f"{store.url}: not a checkpoint folder (rm removes one checkpoint; "
                         "`ckptctl ls` shows them, `ckptctl gc` removes many)")
    try:
        man = Manifest.read(store, files, single)  # a lone file's: its sidecar
    except StorageError:
        raise
    except CkptError:  # unreadable: no id, so nothing can depend on it
        man = None
    where = store.display(single) if single else store.url
    check_removable(where, store, files, man, single=single, storage_options=storage_options,
                    dependants=not orphan_dependants,
                    instead="remove those first, or pass --orphan-dependants")
    return remove_checkpoint(store, files, single=single, force_pinned=force)
