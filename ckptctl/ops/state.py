"""What state a checkpoint is in: ``sealed``, ``complete``, ``incomplete`` or ``corrupt``.

* sealed: a ckptctl manifest is present and every file it lists is there at its size;
* complete: the format's own commit marker is there and parses (DCP ``.metadata``,
  safetensors headers, HF index), every data file it names is present;
* incomplete: the commit marker or a data file is missing (a write in progress, or a crash);
* corrupt: something is there but wrong (unparsable metadata, wrong sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CkptError, FormatError, NotFoundError
from ..formats import open_checkpoint
from ..model import Checkpoint

SEALED, COMPLETE, INCOMPLETE, CORRUPT = "sealed", "complete", "incomplete", "corrupt"


@dataclass
class StateReport:
    state: str
    reason: str
    checkpoint: Checkpoint | None


def manifest_problems(ck: Checkpoint) -> list[str]:
    """Files the manifest lists that are missing or of another size."""
    man = ck.info.get("manifest") or {}
    out = []
    for rel, rec in man.get("files", {}).items():
        size = rec.get("size") if isinstance(rec, dict) else None
        if rel not in ck.files:
            out.append(f"{rel}: missing")
        elif size is not None and ck.files[rel] != size:
            out.append(f"{rel}: {ck.files[rel]} bytes, manifest says {size}")
    return out


def checkpoint_state(url: str, storage_options: dict | None = None) -> StateReport:
    """Classify the checkpoint at ``url`` from its metadata (no tensor data is read).

    >>> checkpoint_state("/nonexistent/x").state        # doctest: +SKIP
    'incomplete'
    """
    try:
        ck = open_checkpoint(url, storage_options, read_step=False)
    except NotFoundError as e:
        return StateReport(INCOMPLETE, str(e), None)
    except FormatError as e:
        if "never committed" in e.message:
            return StateReport(INCOMPLETE, str(e), None)
        return StateReport(CORRUPT, str(e), None)
    except CkptError as e:
        return StateReport(CORRUPT, str(e), None)
    if ck.info.get("manifest") is not None:
        probs = manifest_problems(ck)
        if probs:
            return StateReport(CORRUPT, probs[0], ck)
        return StateReport(SEALED, "manifest present, files match", ck)
    return StateReport(COMPLETE, "format metadata present and consistent", ck)
