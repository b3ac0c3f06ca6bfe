"""What state a checkpoint is in, from ``verify --level quick``'s findings:

* ``sealed``: a ckptctl manifest is present and every file it lists is there at its size;
* ``complete``: the format's own commit marker is there and parses (DCP ``.metadata``,
  safetensors headers, HF index), every data file it names is present and long enough;
* ``incomplete``: the commit marker or a data file is missing (a write in progress, a crash);
* ``corrupt``: something is there but wrong (unparsable metadata, wrong sizes);
* ``unknown``: it cannot be read here (a torch.save file without torch installed).
"""
from __future__ import annotations

from dataclasses import dataclass

from .._deps import MissingDependencyError
from ..formats.manifest import MANIFEST
from .verify import verify

SEALED, COMPLETE, INCOMPLETE, CORRUPT = "sealed", "complete", "incomplete", "corrupt"
UNKNOWN = "unknown"
_INCOMPLETE_CODES = {"NOT_COMMITTED", "MISSING_FILE"}


@dataclass
class StateReport:
    state: str
    reason: str
    format: str | None
    step: int | None


def checkpoint_state(url: str, storage_options: dict | None = None, *,
                     located: tuple | None = None) -> StateReport:
    """Classify the checkpoint at ``url`` from its metadata (no tensor data is read).

    ``located``: the checkpoint's files from a listing the caller already has (``ls``
    lists a whole root once), as :func:`~ckptctl.formats.detect.locate` returns them;
    then nothing is listed again.

    >>> checkpoint_state("ckpt/step-100").state             # doctest: +SKIP
    'complete'
    """
    if located is not None and MANIFEST in located[1]:  # read by verify and the reader: once
        located[0].cache_small_files({MANIFEST: located[1][MANIFEST]})
    try:
        r = verify(url, storage_options, level="quick", located=located, uploads=False)
    except MissingDependencyError as e:  # not a verdict on the checkpoint: say what it needs
        return StateReport(UNKNOWN, e.message, None, None)
    errors = [p for p in r.problems if p.severity == "error"]
    if not errors:
        return StateReport(SEALED if r.sealed else COMPLETE,
                           "manifest present, files match" if r.sealed else
                           "format metadata present and consistent", r.format, r.step)
    first = errors[0]
    reason = f"{first.code}: {first.path + ': ' if first.path else ''}{first.message}"
    if r.sealed and located is not None and _only_its_base(errors, url, located[1]):
        # a delta pack whose own files match its manifest but whose base cannot be read
        # from here (moved, deleted, another tier): still sealed, not an unfinished write
        # (gc would remove it after the grace period); DCP packs read no base to tell
        return StateReport(SEALED, f"pack's files match its manifest; its base cannot be "
                           f"read here ({reason})", r.format, r.step)
    state = INCOMPLETE if any(p.code in _INCOMPLETE_CODES for p in errors) else CORRUPT
    return StateReport(state, reason, r.format, r.step)


def _only_its_base(errors, url: str, files: dict[str, int]) -> bool:
    """Are all of a pack folder's errors about another checkpoint (its base), none about
    its own files?"""
    from ..formats.pack import is_pack

    inside = url.rstrip("/") + "/"
    return is_pack(files) and all(
        p.path and p.path != url.rstrip("/") and not p.path.startswith(inside)
        for p in errors)
