"""Pins: ``ckptctl pin URL`` keeps a checkpoint from ``gc`` and ``rm`` until ``unpin``.

A pin is a small JSON file, ``.ckptctl-pinned`` (:data:`~ckptctl.formats.manifest.PIN_FILE`),
in the checkpoint's folder: ``{"pinned_at": iso, "by": user@host, "reason": str}``; a
single-file checkpoint's is beside it, ``train.pt.ckptctl-pinned``. It belongs to that
one place (``promote`` does not copy it) and is not the checkpoint's content (manifests
never list it, ``verify`` does not report it). ``gc`` sees it in the listing it already
has: no extra request.

>>> is_pinned({".ckptctl-pinned": 60, ".metadata": 10}), is_pinned({".metadata": 10})
(True, False)
>>> is_pinned({"a.pt": 9, "a.pt.ckptctl-pinned": 60}, "a.pt")
True
"""
from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import asdict, dataclass

from ..errors import CkptError, UsageError
from ..formats.manifest import PIN_FILE, control_name


@dataclass
class PinResult:
    url: str
    pinned: bool  # the state after the call
    changed: bool  # False: it already was (pin) or was not (unpin) pinned
    pinned_at: str | None = None
    by: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def is_pinned(files: dict[str, int], single: str | None = None) -> bool:
    """Is the checkpoint whose listing (relative to its folder) is ``files`` pinned?
    ``single``: the checkpoint is that one file, its pin the sidecar beside it."""
    return control_name(PIN_FILE, single) in files


def _place(url: str, storage_options: dict | None):
    """(store, files, pin's name, where) of the checkpoint at ``url``: a folder and its
    ``.ckptctl-pinned``, or a single file, the folder holding it and its sidecar pin."""
    from ..formats.detect import locate

    store, files, single = locate(url, storage_options, follow_latest=False)
    where = store.display(single) if single else store.url
    return store, files, control_name(PIN_FILE, single), where, single


def _read(store, pin: str = PIN_FILE) -> dict:
    try:
        doc = json.loads(store.read(pin))
        return doc if isinstance(doc, dict) else {}
    except (CkptError, ValueError):
        return {}


def pin(url: str, reason: str = "", storage_options: dict | None = None) -> PinResult:
    """Pin the checkpoint at ``url`` (again: the reason is replaced, the time kept).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / ".metadata").write_bytes(b"m")
    >>> r = pin(str(d), "release 1.0")
    >>> r.pinned, r.changed, r.reason, (d / ".ckptctl-pinned").exists()
    (True, True, 'release 1.0', True)
    >>> unpin(str(d)).changed, (d / ".ckptctl-pinned").exists()
    (True, False)
    """
    from ..catalog.ls import group_checkpoints

    store, files, pin_file, where, single = _place(url, storage_options)
    if not single and "" not in group_checkpoints(files):  # what ls would not list
        raise UsageError(f"{store.url}: not a checkpoint folder (nothing to pin; give the "
                         "URL of one checkpoint, as `ckptctl ls` shows it)")
    old = _read(store, pin_file) if pin_file in files else None
    doc = {"pinned_at": (old or {}).get("pinned_at")
           or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "by": f"{_user()}@{socket.gethostname()}", "reason": reason or ""}
    if old is not None and old.get("reason") == doc["reason"]:
        return PinResult(where, True, False, old.get("pinned_at"), old.get("by"),
                         old.get("reason"))
    store.write_atomic(pin_file, (json.dumps(doc, sort_keys=True) + "\n").encode())
    return PinResult(where, True, True, doc["pinned_at"], doc["by"], doc["reason"])


def unpin(url: str, storage_options: dict | None = None) -> PinResult:
    """Remove the pin of the checkpoint at ``url`` (not pinned: nothing to do, not an
    error). Example: see :func:`pin`."""
    store, files, pin_file, where, _ = _place(url, storage_options)
    if pin_file not in files:
        return PinResult(where, False, False)
    old = _read(store, pin_file)
    store.remove(pin_file)
    return PinResult(where, False, True, old.get("pinned_at"), old.get("by"),
                     old.get("reason"))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"
