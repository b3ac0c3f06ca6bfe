"""A ckptctl writer at work on a folder: its ``.ckptctl-writing`` marker read as what it
says (:func:`unfinished_writer`: which command, by whom, since when, and the fix that keeps
the work done) and whether that writer still runs on this host (:func:`live_writer`).

A folder held by a writer is no checkpoint yet: the quick level calls it NOT_COMMITTED with
these words (:mod:`ckptctl.catalog.checks`); the writers refuse to replace, and gc and pack
to touch, a folder whose writer still runs.
"""
from __future__ import annotations

import json
import os
import socket

from ..errors import CkptError, StorageError
from ..formats.manifest import WRITING_MARKER, control_name
from ..storage import Store

#: The ckptctl writers a writing marker can name (its ``command``'s first word) whose fix
#: is not a rerun with --force: (how to name it, what to say). A promote resumes; a
#: removal is finished by rm; a pack's re-root by the gc (or watch) of its tier. The
#: others (reshard, consolidate, pack, unpack) start over, and only with --force, which
#: replaces nothing but such an unfinished write.
RESUME = {
    "promote": ("a promote", "did not finish: rerun the same promote to resume it (it "
                "sends only what is missing; removing the folder would discard what it "
                "sent)"),
    "rm": ("a `ckptctl rm`", "did not finish removing it: rerun the rm to finish"),
    "gc": ("a `ckptctl gc`", "did not finish removing it: `ckptctl rm` it to finish"),
    "reroot": ("a re-root of this pack (gc of a pack tier)", "did not finish: rerun the gc "
               "(or watch) of its tier, which finishes it"),
}
#: A marker's size past which it is not read (a writer's is a hundred bytes or so).
_MARKER_MAX = 64 << 10


def unfinished_writer(store, files: dict[str, int], single: str | None = None) -> str:
    """What verify says of a folder that a ckptctl writer holds (``.ckptctl-writing``):
    which command wrote it, by whom and since when, as its marker says (one small read),
    whether that writer still runs (this host only), and the fix that keeps the work done
    (:data:`RESUME`): a promote resumes, a reshard or consolidate starts over with
    --force. ``single``: the marker of that one file (``train.pt.ckptctl-writing``).

    >>> import json, tempfile
    >>> from ckptctl.storage import open_store
    >>> st = open_store(tempfile.mkdtemp())
    >>> st.write_atomic(".ckptctl-writing", json.dumps({"command": "promote", "pid": 1,
    ...     "host": "node7", "started": "2026-01-01T00:00:00Z"}).encode())
    >>> print(unfinished_writer(st, st.list_files()))
    a promote (pid 1 on node7, started 2026-01-01T00:00:00Z) did not finish: rerun the same \
promote to resume it (it sends only what is missing; removing the folder would discard what it sent)
    >>> st.write_atomic(".ckptctl-writing", json.dumps({"command": "reshard"}).encode())
    >>> print(unfinished_writer(st, st.list_files()))
    a `ckptctl reshard` did not finish: rerun with --force to start it over (it does not \
resume; --force replaces only such an unfinished write)
    >>> st.write_atomic(".ckptctl-writing", b"{}")
    >>> print(unfinished_writer(st, st.list_files()))
    a ckptctl writer did not finish: rerun with --force the command that wrote it, to start \
it over (a promote: rerun it as it was, it resumes)
    """
    doc = _marker_doc(store, files, single)
    command = doc.get("command") if isinstance(doc.get("command"), str) else None
    verb = command.split()[0] if command and command.split() else None
    pid = f"pid {doc['pid']}" + (f" on {doc['host']}" if doc.get("host") else "") \
        if doc.get("pid") else ""
    who = ", ".join(x for x in (pid, f"started {doc['started']}" if doc.get("started")
                                else "") if x)
    what = (RESUME[verb][0] if verb in RESUME else f"a `ckptctl {command}`" if verb
            else "a ckptctl writer") + (f" ({who})" if who else "")
    if _still_running(store, doc, single):
        return f"{what} is still at work on it: wait for it to finish"
    if verb in RESUME:
        return f"{what} {RESUME[verb][1]}"
    if verb:
        return (f"{what} did not finish: rerun with --force to start it over (it does not "
                "resume; --force replaces only such an unfinished write)")
    return (f"{what} did not finish: rerun with --force the command that wrote it, to start "
            "it over (a promote: rerun it as it was, it resumes)")


def _marker_doc(store, files: dict[str, int], single: str | None = None) -> dict:
    """The writing marker's JSON (``{}`` when it is too large, unreadable or not a JSON
    object: a torn write says nothing); an I/O failure raises (exit 3)."""
    name = control_name(WRITING_MARKER, single)
    if files.get(name, 0) > _MARKER_MAX:
        return {}
    try:
        doc = json.loads(store.read(name))
    except StorageError:
        raise
    except (CkptError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _still_running(store, doc: dict, single: str | None = None) -> bool:
    """Does the marker name a ckptctl process that still runs on this host (not this
    one: a writer that failed in this process has stopped)?"""
    if doc.get("host") != socket.gethostname() or doc.get("pid") == os.getpid():
        return False  # another host's cannot be checked from here; this process verifies
    return live_writer(store, single) is not None


def live_writer(store: Store, single: str | None = None) -> dict | None:
    """The ``.ckptctl-writing`` record of ``store`` when it names a ckptctl process still
    running on this host (this one included), else None: a leftover of a killed writer,
    another host's (which cannot be checked from here) or no marker at all. ``single``:
    the marker beside that one file (``train.pt.ckptctl-writing``).

    >>> import tempfile
    >>> from ckptctl.storage import open_store
    >>> live_writer(open_store(tempfile.mkdtemp())) is None
    True
    """
    try:
        doc = json.loads(store.read(control_name(WRITING_MARKER, single)))
        pid, host = int(doc["pid"]), doc["host"]
    except (CkptError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: a leftover
    if host != socket.gethostname() or not (pid == os.getpid() or _is_ckptctl(pid)):
        return None
    return doc


def _is_ckptctl(pid: int) -> bool:
    """Is ``pid`` a running ckptctl process (Linux: its command line says so)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ckptctl" in f.read()
    except OSError:
        return False
