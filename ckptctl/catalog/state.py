"""What state a checkpoint is in, from ``verify --level quick``'s findings
(:class:`~ckptctl.catalog.checks.QuickCheck`):

* ``sealed``: a ckptctl manifest is present (a single file's: beside it,
  ``FILE.ckptctl.manifest.json``) and every file it lists is there at its size;
* ``complete``: the format's own commit marker is there and parses (DCP ``.metadata``,
  safetensors headers, HF index), every data file it names is present and long enough;
* ``incomplete``: the commit marker or a data file is missing (a write in progress, a crash),
  or a delta pack's base chain is not all there and committed (``MISSING_BASE``: it
  cannot be restored, whatever its own files say);
* ``corrupt``: something is there but wrong (unparsable metadata, wrong sizes);
* ``unknown``: it cannot be read here (a torch.save file without torch installed), or it
  is a layout ckptctl does not read (a DeepSpeed pipeline, another Megatron-core backend:
  refused by name).
"""
from __future__ import annotations

from dataclasses import dataclass

from .._deps import MissingDependencyError
from ..errors import UnsupportedFormatError
from ..formats.manifest import MANIFEST, control_name
from .checks import QuickCheck

SEALED, COMPLETE, INCOMPLETE, CORRUPT = "sealed", "complete", "incomplete", "corrupt"
UNKNOWN = "unknown"
_INCOMPLETE_CODES = {"NOT_COMMITTED", "MISSING_FILE", "MISSING_BASE"}


@dataclass
class StateReport:
    state: str
    reason: str
    format: str | None
    step: int | None


def checkpoint_state(url: str, storage_options: dict | None = None, *,
                     located: tuple | None = None, bases: dict | None = None) -> StateReport:
    """Classify the checkpoint at ``url`` from its metadata (no tensor data is read).

    ``located``: the checkpoint's files from a listing the caller already has (``ls``
    lists a whole root once), as :func:`~ckptctl.formats.detect.locate` returns them;
    then nothing is listed again. ``bases``: shared by one caller's classifications, so
    each delta pack's base chain is checked once (:class:`~ckptctl.catalog.checks.QuickCheck`).

    >>> checkpoint_state("ckpt/step-100").state             # doctest: +SKIP
    'complete'
    """
    name = control_name(MANIFEST, located[2]) if located is not None else MANIFEST
    if located is not None and name in located[1]:  # read by the check and the reader: once
        located[0].cache_small_files({name: located[1][name]})
    r = QuickCheck(url, storage_options, located=located, uploads=False, bases=bases)
    try:
        r.quick()
    except MissingDependencyError as e:  # not a verdict on the checkpoint: say what it needs
        return StateReport(UNKNOWN, e.message, None, None)
    except UnsupportedFormatError as e:  # another framework's layout: not ckptctl's to judge
        if not getattr(e, "framework", None):
            raise
        return StateReport(UNKNOWN, e.message, None, None)
    errors = [p for p in r.problems if p.severity == "error"]
    if not errors:
        return StateReport(SEALED if r.sealed else COMPLETE,
                           "manifest present, files match" if r.sealed else
                           "format metadata present and consistent", r.format, r.step)
    first = errors[0]
    reason = f"{first.code}: {first.path + ': ' if first.path else ''}{first.message}"
    state = INCOMPLETE if any(p.code in _INCOMPLETE_CODES for p in errors) else CORRUPT
    return StateReport(state, reason, r.format, r.step)

